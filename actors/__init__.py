"""cadence's Trio actors (admission, scheduler, GPU, streamer), the embedding API and HTTP.

import actors
async with actors.open_llm() as llm:          # the built-in demo model
    async for delta in llm.generate(prompt="def "):
        print(delta.text, end="")

The names below load on first use, so importing one submodule (the `cadence` command's
entry point) does not import the rest: see actors/entry.py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import runtime  # noqa: F401  (an optimized BLAS must load before mlx.core)

if TYPE_CHECKING:
    from actors.asyncio_bridge import open_llm_asyncio
    from actors.generation import Generation
    from actors.llm import LLM, EngineStats
    from actors.requests import (
        Delta,
        GenerateRequest,
        GenerationError,
        OverloadedError,
        ServiceClosedError,
        Usage,
    )
    from actors.service import open_llm

_HOMES = {
    "LLM": "actors.llm",
    "Delta": "actors.requests",
    "EngineStats": "actors.llm",
    "GenerateRequest": "actors.requests",
    "Generation": "actors.generation",
    "GenerationError": "actors.requests",
    "OverloadedError": "actors.requests",
    "ServiceClosedError": "actors.requests",
    "Usage": "actors.requests",
    "open_llm": "actors.service",
    "open_llm_asyncio": "actors.asyncio_bridge",
}
__all__ = [
    "Delta",
    "EngineStats",
    "GenerateRequest",
    "Generation",
    "GenerationError",
    "LLM",
    "OverloadedError",
    "ServiceClosedError",
    "Usage",
    "open_llm",
    "open_llm_asyncio",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value
