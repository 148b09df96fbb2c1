"""Decode throughput of cadence's Engine beside mlx-lm's, same checkpoint, same run.

    python examples/bench_engine.py [--batches 1 4 8 16] [--new-tokens 64] [--prompt-tokens 128]

Builds (once, cached under .bench/) a ~200M-param fp32 Llama-shaped checkpoint with
random weights: hidden 1024, 16 layers, 16 heads, 4 KV heads, FFN 2816, 32k vocab.
For each batch size B it prefills B prompts, then times only the decode steps:

    ours:   the FCFS policy and the Engine (runtime.runner.PlanRunner), one step of lookahead
    mlx-lm: generate_step (B=1) and BatchGenerator (B > 1)

and prints the best tok/s of each arm over interleaved repeats, with the ratio. mlx-lm is imported here as the
peer, never by cadence itself.
"""

from __future__ import annotations

import argparse
import collections
import random
import time
from pathlib import Path

import runtime  # noqa: F401  (loads the fast BLAS before mlx)
from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import PlanRunner, step_results
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

import mlx.core as mx
from mlx.utils import tree_flatten

from actors.bench_model import BENCH_CONFIG
from actors.bench_model import bench_checkpoint as build_bench_checkpoint


def bench_checkpoint(root: Path, vocab_size: int = BENCH_CONFIG["vocab_size"]) -> Path:
    """The benchmark checkpoint, with its 32k vocabulary unless told otherwise."""
    return build_bench_checkpoint(root, vocab_size)


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


def ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tok/s through the policy and the engine, one step of lookahead."""
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size, is_caching=False, layout=engine.kv.layout)
    whole_prompts = sum(len(p) for p in prompts)
    policy = FcfsScheduler(len(prompts), pool, engine.max_context, whole_prompts, whole_prompts)
    for i, prompt in enumerate(prompts):
        policy.add(str(i), SequenceParams(prompt_tokens=tuple(prompt), max_tokens=new_tokens, ignore_eos=True))
    runner = PlanRunner(engine)
    plan = policy.schedule()  # every prompt, each sampling its first token: not timed
    assert plan is not None
    policy.on_step_done(plan.step, step_results(runner.collect(runner.launch(plan))))
    pending: collections.deque = collections.deque()
    start, produced = time.perf_counter(), 0
    while True:
        plan = policy.schedule() if len(pending) <= 1 else None
        if plan is not None:
            pending.append(runner.launch(plan))  # N+1 queued before N is read
            continue
        if not pending:
            break
        launched = pending.popleft()
        results = runner.collect(launched)
        runner.start()  # the step launched behind it (held back on the CPU)
        produced += sum(r.token is not None for r in results)
        policy.on_step_done(launched.plan.step, step_results(results))
    return produced / (time.perf_counter() - start)


def mlx_lm_single(model, prompt: list[int], new_tokens: int) -> float:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=new_tokens)
    next(steps)
    start = time.perf_counter()
    count = sum(1 for _ in steps)
    return count / (time.perf_counter() - start)


def mlx_lm_batch(model, prompts: list[list[int]], new_tokens: int) -> float:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=new_tokens, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    gen.insert(prompts, [new_tokens] * len(prompts))
    started: set[int] = set()
    start, produced = None, 0
    while True:
        _, responses = gen.next()
        if not responses and start is not None:
            break
        for r in responses:
            if r.uid in started:
                produced += 1
            started.add(r.uid)
        if start is None and len(started) == len(prompts):
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    gen.close()
    return produced / elapsed


def mlx_lm_decode(model, prompts: list[list[int]], new_tokens: int) -> float:
    if len(prompts) == 1:
        return mlx_lm_single(model, prompts[0], new_tokens)
    return mlx_lm_batch(model, prompts, new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench"))
    parser.add_argument("--repeats", type=int, default=3, help="best of N per cell, arms interleaved")
    args = parser.parse_args()

    import mlx_lm

    path = bench_checkpoint(args.cache_dir)
    loaded = load_model(path)
    engine = Engine(loaded, max_batch=max(args.batches), max_context=args.prompt_tokens + args.new_tokens + 8)
    peer, _ = mlx_lm.load(str(path))
    print(f"checkpoint: {path} ({sum(v.size for _, v in tree_flatten(loaded.model.parameters())) / 1e6:.0f}M params, fp32)")
    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, decode tok/s, "
          f"best of {args.repeats} interleaved runs")
    print(f"{'B':>3} | {'cadence':>8} | {'mlx-lm':>8} | {'peer arm':<15} | ratio")
    for batch in args.batches:
        prompts = prompts_for(batch, args.prompt_tokens, BENCH_CONFIG["vocab_size"])
        arm = "generate_step" if batch == 1 else "BatchGenerator"
        ours_runs, peer_runs = [], []
        for _ in range(args.repeats):  # interleaved, so both arms see the same machine
            ours_runs.append(ours(engine, prompts, args.new_tokens))
            peer_runs.append(mlx_lm_decode(peer, prompts, args.new_tokens))
        ours_tps, peer_tps = max(ours_runs), max(peer_runs)
        print(f"{batch:>3} | {ours_tps:8.1f} | {peer_tps:8.1f} | {arm:<15} | {ours_tps / peer_tps:.2f}x", flush=True)

if __name__ == "__main__":
    main()
