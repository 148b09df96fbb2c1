"""Long-prompt prefill rates, and prefix reuse through HTTP, on the bench checkpoint.

    python examples/bench_prefill.py [--lengths 512 2048 6000] [--shared 1000] [--repeats 3]

1. Prefill tok/s: one prompt of each length alone through the policy (serving
   defaults) and the Engine, timed to its first token.
2. Prefix reuse: `cadence serve` in a subprocess; chat completions that share a
   --shared-token system prompt, each with its own user question. The first is
   cold; later ones hit the prefix cache. Time to first token is read from the
   stream, with `usage.prompt_tokens_details.cached_tokens` from the usage chunk.
   The same requests against `cadence serve --no-prefix-cache` give the cold figure
   for every request, in the same run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import runtime  # noqa: F401  (loads the fast BLAS before mlx)
from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import DEFAULT_SOLO_PREFILL_TOKENS, FcfsScheduler
from runtime.sequence import SequenceParams

import openai
from bench_engine import bench_checkpoint
from bench_http import start_server

WORDS = ["the", "for", "while", "class", "def", "return", "import", "yield", "lambda", "module", "object", "value", "list"]


def prefill_rate(engine: Engine, length: int, seed: int) -> float:
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(3, 2000) for _ in range(length))
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size, is_caching=False)
    policy = FcfsScheduler(1, pool, engine.max_context)  # the serving defaults
    start = time.perf_counter()
    run_offline(engine, policy, {"p": SequenceParams(prompt_tokens=prompt, max_tokens=1)})
    return length / (time.perf_counter() - start)


def first_token(client: openai.OpenAI, model: str, system: str, question: str) -> tuple[float, int]:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft, cached = None, 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details else 0
    return (ttft if ttft is not None else time.perf_counter() - start), cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 6000])
    parser.add_argument("--shared", type=int, default=1000, help="system prompt tokens (about)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench"))
    parser.add_argument("--skip-http", action="store_true")
    args = parser.parse_args()

    path = bench_checkpoint(args.cache_dir, vocab_size=2048)
    max_context = max(max(args.lengths) + 8, 2048)
    engine = Engine(load_model(path), max_batch=1, max_context=max_context)
    print(f"checkpoint: {path}; a prompt alone is computed {DEFAULT_SOLO_PREFILL_TOKENS} tokens "
          f"a step (the serving default); best of {args.repeats}")
    print("| prompt tokens | prefill tok/s | vs the shortest |")
    print("|---|---|---|")
    first = None
    for length in args.lengths:
        rate = max(prefill_rate(engine, length, seed) for seed in range(args.repeats))
        first = first or rate
        print(f"| {length} | {rate:.0f} | {rate / first:.2f}x |", flush=True)
    if args.skip_http:
        return

    rng = random.Random(0)
    system = " ".join(rng.choice(WORDS) for _ in range(args.shared))
    questions = [f"Question {i}: what does {rng.choice(WORDS)} do?" for i in range(args.requests)]
    rows = {}
    for label, extra in (("prefix cache", []), ("--no-prefix-cache", ["--no-prefix-cache"])):
        server, url, model = start_server(path, 4096, extra=extra)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            rows[label] = [first_token(client, model, system, q) for q in questions]
        finally:
            server.terminate()
            server.wait(timeout=60)
    cold = statistics.median(t for t, _ in rows["--no-prefix-cache"])
    print(f"\nshared system prompt of {args.shared} words; {args.requests} requests in turn")
    print("| server | request | TTFT s | cached tokens | vs cold (median, no cache) |")
    print("|---|---|---|---|---|")
    for label, results in rows.items():
        for i, (ttft, cached) in enumerate(results):
            print(f"| {label} | {i + 1} | {ttft:.3f} | {cached} | {ttft / cold:.0%} |")


if __name__ == "__main__":
    main()
