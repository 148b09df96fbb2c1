"""Embed cadence in an asyncio program: the Trio actors run on a thread of their own.

    python examples/embed_asyncio.py [--model PATH_OR_REPO]

Streams two generations at once (asyncio tasks; the GPU actor batches them), then
leaves a long one early: leaving is an abort, and its row is freed within a step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

import structlog

import actors
from actors.asyncio_bridge import AsyncioLLM


async def stream(llm: AsyncioLLM, tag: str, prompt: str) -> str:
    text = ""
    async with llm.generate(prompt, max_tokens=24) as generation:
        async for delta in generation:
            print(f"[{tag}] {delta.text!r}", flush=True)
            text += delta.text
    return text


async def main(model: str | None) -> None:
    async with actors.open_llm_asyncio(model, max_batch=4) as llm:
        print(f"model: {llm.name}\n")
        texts = await asyncio.gather(stream(llm, "a", "def "), stream(llm, "b", "The "))
        print(f"\n'def ' -> {texts[0]!r}\n'The ' -> {texts[1]!r}")

        async def long() -> None:
            async for _ in llm.generate("Once upon a time", max_tokens=900, ignore_eos=True):
                pass

        with contextlib.suppress(TimeoutError):  # a cancelled consumer becomes an Abort
            await asyncio.wait_for(long(), timeout=0.2)
        async with asyncio.timeout(5):
            while (await llm.engine_stats()).num_open:
                await asyncio.sleep(0.01)
        print("\nleft a long generation after 0.2 s: its row is already free")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in demo checkpoint")
    # cadence logs through structlog and leaves its configuration to the program.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main(parser.parse_args().model))
