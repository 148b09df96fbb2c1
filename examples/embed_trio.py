"""Embed cadence in your own Trio program: no HTTP, no signal handlers, no global config.

    python examples/embed_trio.py [--model PATH_OR_REPO]

Streams one chat answer, runs four prompts at once (the GPU actor batches them),
then leaves a long generation early: leaving is an abort, and the row's KV is
freed within one engine step.
"""

from __future__ import annotations

import argparse
import logging

import structlog
import trio

import actors


async def main(model: str | None) -> None:
    async with actors.open_llm(model, max_batch=4) as llm:
        print(f"model: {llm.name} (context {llm.max_context} tokens)\n")

        messages = [{"role": "user", "content": "What does a for loop do?"}]
        async with llm.generate(messages=messages, max_tokens=48) as stream:
            async for delta in stream:
                print(delta.text, end="", flush=True)
        print(f"\n[finish_reason={stream.finish_reason}, usage={stream.usage}]\n")

        prompts = ["def ", "import ", "class ", "The "]
        texts: dict[str, str] = {}

        async def complete(prompt: str) -> None:
            texts[prompt] = "".join([d.text async for d in llm.generate(prompt, max_tokens=24)])

        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(complete, prompt)
        for prompt in prompts:
            print(f"{prompt!r} -> {texts[prompt]!r}")

        with trio.move_on_after(0.2):  # a consumer that goes away becomes an Abort
            async with llm.generate("Once upon a time", max_tokens=900, ignore_eos=True) as gen:
                async for _ in gen:
                    pass
        with trio.fail_after(5):
            while (await llm.engine_stats()).num_open:
                await trio.sleep(0.01)
        print("\nleft a long generation after 0.2 s: its row is already free")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in demo checkpoint")
    # cadence logs through structlog and leaves its configuration to the program:
    # this one shows warnings only (`actors.tracing.configure_logging` is the CLI's setup).
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    trio.run(main, parser.parse_args().model)
