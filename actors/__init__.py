"""cadence's Trio actors (admission, scheduler, GPU, streamer), the embedding API and HTTP.

import actors
async with actors.open_llm() as llm:          # the built-in demo model
    async for delta in llm.generate(prompt="def "):
        print(delta.text, end="")
"""

import runtime  # noqa: F401  (an optimized BLAS must load before mlx.core)

from actors.asyncio_bridge import open_llm_asyncio
from actors.generation import Generation
from actors.requests import (
    Delta,
    GenerateRequest,
    GenerationError,
    OverloadedError,
    ServiceClosedError,
    Usage,
)
from actors.service import LLM, EngineStats, open_llm

__all__ = [
    "LLM",
    "Delta",
    "EngineStats",
    "GenerateRequest",
    "Generation",
    "GenerationError",
    "OverloadedError",
    "ServiceClosedError",
    "Usage",
    "open_llm",
    "open_llm_asyncio",
]
