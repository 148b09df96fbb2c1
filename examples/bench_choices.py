"""n choices over one long prompt: peak KV blocks and wall time, shared prompt vs not.

    python examples/bench_choices.py [--model PATH] [--n 4] [--prompt-tokens 1000] [--max-tokens 16]

Runs the same request (seeded sampling, `ignore_eos`) three ways on one model: n=1,
then n choices with prefix caching (the choices share the prompt's blocks), then n
choices without it (each computes and holds its own copy). The choices go through
the same path as the HTTP API's `n` (actors/choices.py). Prints the wall time until
every choice finished, the peak of the KV pool's used blocks, and each choice's
prompt tokens taken from the cache.
"""

from __future__ import annotations

import argparse
import logging
import time

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
from runtime.sequence import SamplingParams

import structlog
import trio

import actors
from actors.choices import choice_requests, interleaved, start_together
from actors.generation import Generation
from actors.requests import GenerateRequest, Usage


async def run_once(args: argparse.Namespace, n: int, prefix_cache: bool) -> None:
    prompt = tuple((i * 37 + 11) % 2000 + 3 for i in range(args.prompt_tokens))
    async with actors.open_llm(args.model, max_batch=8, prefix_cache=prefix_cache) as llm:
        async for _ in llm.generate([5, 6, 7], max_tokens=2):  # warm up outside the timing
            pass
        pool = llm._policy.pool
        request = GenerateRequest(
            prompt=prompt,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            sampling=SamplingParams(temperature=1.0, seed=1),
        )
        generations = [
            Generation(llm, choice, request_id=f"bench-{i}")
            for i, choice in enumerate(choice_requests(request, n))
        ]
        peak, usages = 0, list[Usage]()

        async def watch_the_pool() -> None:
            nonlocal peak
            while True:
                peak = max(peak, pool.num_used_blocks)
                await trio.sleep(0.001)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_the_pool)
            await start_together(llm, generations)
            async with interleaved(generations) as events:
                async for _, event in events:
                    if isinstance(event, Exception):
                        raise event
                    if event.usage is not None:
                        usages.append(event.usage)
            nursery.cancel_scope.cancel()
        wall = time.perf_counter() - start
    cached = sorted(u.cached_tokens for u in usages)
    print(
        f"n={n} prefix cache {'on ' if prefix_cache else 'off'}: {wall:5.2f} s, "
        f"peak {peak} KV blocks of {pool.block_size} tokens, cached prompt tokens {cached}"
    )


async def main(args: argparse.Namespace) -> None:
    await run_once(args, 1, True)
    await run_once(args, args.n, True)
    await run_once(args, args.n, False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    # cadence leaves structlog's configuration to the program, and structlog's own
    # prints every event, a debug line per engine step included, between the figures.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    trio.run(main, parser.parse_args())
