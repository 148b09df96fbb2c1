"""`cadence bench ...`: measurements that print figures (never timed tests).

    cadence bench paged-attention   native vs fast vs gather paths of kernels/paged_attention.py
    cadence bench soak              rude and faulty clients against the server; count leaks
    cadence bench serve             load any OpenAI-compatible server; cadence beside mlx_lm.server
    cadence bench ladder            the batch ladder's table, and whether padding pays
    cadence bench load              seconds and peak memory of loading; beside mlx-lm's load
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
from runtime.kv.budget import DEFAULT_BLOCK_SIZE, available_memory

import mlx.core as mx
import numpy as np

from actors import arg_types, bench_ladder, bench_load, bench_serve, soak
from kernels import paged_attention as pa


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="print measured figures")
    which = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench))
    paged = which.add_parser(
        "paged-attention", help="native vs fast vs gather paged attention per decode step"
    )
    count = arg_types.positive_int
    paged.add_argument("--batches", type=count, nargs="+", default=[1, 4, 16])
    paged.add_argument("--contexts", type=count, nargs="+", default=[128, 512, 2048, 8192])
    paged.add_argument(
        "--layers", type=count, default=16, help="layers per step (scales the figure)"
    )
    paged.add_argument("--heads", type=count, default=16)
    paged.add_argument("--kv-heads", type=count, default=4)
    paged.add_argument("--head-dim", type=count, default=64)
    paged.add_argument("--block-size", type=count, default=DEFAULT_BLOCK_SIZE)
    paged.add_argument("--repeats", type=count, default=5)
    paged.set_defaults(run=functools.partial(_checked_paged_attention, paged))
    soak.add_parser(which)
    bench_serve.add_parser(which)
    bench_ladder.add_parser(which)
    bench_load.add_parser(which)


def _decode_step(batch: int, context: int, args: argparse.Namespace, rng: np.random.Generator):
    """A pool holding `batch` rows of `context - 1` tokens in shuffled blocks, plus one new token each."""
    size = args.block_size
    blocks_per_row = -(-context // size)
    num_blocks = batch * blocks_per_row
    order = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_row)
    step = pa.PagedStep(
        tables=mx.array(order),
        starts=(context - 1,) * batch,
        num_new=(1,) * batch,
        block_size=size,
        num_slots=num_blocks * size,
        num_kv_heads=args.kv_heads,
        num_queries_per_kv=args.heads // args.kv_heads,
    )
    shape = (args.kv_heads * num_blocks * size, args.head_dim)
    pools = ([mx.random.normal(shape)], [mx.random.normal(shape)])
    q = mx.random.normal((batch, args.heads, args.head_dim))
    k = mx.random.normal((batch, args.kv_heads, args.head_dim))
    v = mx.random.normal((batch, args.kv_heads, args.head_dim))
    mx.eval(pools, q, k, v)
    return step, pools, q, k, v


def _time_arm(path: str, step, pools, q, k, v, repeats: int) -> float:
    """Median seconds for one layer of the step on `path`, chosen through `dispatch`."""
    os.environ["CADENCE_PAGED_ATTENTION"] = path
    times = []
    for _ in range(repeats + 1):  # the first run warms the kernels up
        chosen = pa.dispatch(step)
        start = time.perf_counter()
        out = pa.paged_attention(pools, 0, q, k, v, 0.125, step, chosen)
        mx.eval(out, pools)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def _checked_paged_attention(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    # Each KV head serves a whole group of query heads; the kernels assume equal groups.
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    # The largest step's pools, and what the gather arm copies out of them (K and V for
    # every query head): a step past the memory there is would be killed, not measured.
    tokens = max(args.batches) * -(-max(args.contexts) // args.block_size) * args.block_size
    needed = 4 * tokens * args.head_dim * 2 * (args.kv_heads + args.heads)
    if (available := available_memory()) is not None and needed > available:
        parser.error(
            f"the largest step ({max(args.batches)} rows of {max(args.contexts)} tokens) needs "
            f"~{needed / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB available"
        )
    return paged_attention(args)


def paged_attention(args: argparse.Namespace) -> int:
    forced = os.environ.get("CADENCE_PAGED_ATTENTION")
    rng = np.random.default_rng(0)
    os.environ.pop("CADENCE_PAGED_ATTENTION", None)
    shape = pa.StepShape(1, 1, 1, 0, args.kv_heads, args.heads // args.kv_heads)
    why_not_native = pa.native_kernel_reason(shape)
    arms = ("fast", "gather") if why_not_native else ("native", "fast", "gather")
    print(f"device {mx.default_device()}, {args.heads} heads / {args.kv_heads} KV heads, "
          f"D={args.head_dim}, block {args.block_size}; ms per decode step of {args.layers} layers")
    if why_not_native:
        print(f"(no native arm: {why_not_native})")
    print("| B | context | " + " | ".join(f"{arm} ms" for arm in arms) + " | gather / fast |"
          + (" gather / native |" if "native" in arms else ""))
    print("|---|---|" + "---|" * (len(arms) + 1 + ("native" in arms)))
    counts = {arm: {path: 0 for path in arms} for arm in arms}
    for batch in args.batches:
        for context in args.contexts:
            step, pools, q, k, v = _decode_step(batch, context, args, rng)
            arm_ms = {}
            for arm in arms:
                before = dict(pa.dispatch_counts)
                arm_ms[arm] = _time_arm(arm, step, pools, q, k, v, args.repeats) * 1e3 * args.layers
                for path in arms:
                    counts[arm][path] += pa.dispatch_counts[path] - before.get(path, 0)
            row = f"| {batch} | {context} | " + " | ".join(f"{arm_ms[a]:.1f}" for a in arms)
            row += f" | {arm_ms['gather'] / arm_ms['fast']:.2f}x |"
            if "native" in arms:
                row += f" {arm_ms['gather'] / arm_ms['native']:.1f}x |"
            print(row)
            sys.stdout.flush()
    if forced is None:
        os.environ.pop("CADENCE_PAGED_ATTENTION", None)
    else:
        os.environ["CADENCE_PAGED_ATTENTION"] = forced
    for arm in arms:
        if counts[arm][arm] == 0 or any(n for path, n in counts[arm].items() if path != arm):
            print(f"error: the {arm} arm did not run the {arm} path only: {counts[arm]}", file=sys.stderr)
            return 1
    return 0
