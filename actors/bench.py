"""`cadence bench ...`: measurements that print figures (never timed tests).

    cadence bench paged-attention   fast vs gather paths of kernels/paged_attention.py
    cadence bench soak              rude and faulty clients against the server; count leaks
    cadence bench serve             load any OpenAI-compatible server; cadence beside mlx_lm.server
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)

import mlx.core as mx
import numpy as np

from actors import bench_ladder, bench_serve, soak
from kernels import paged_attention as pa


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="print measured figures")
    which = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench))
    paged = which.add_parser(
        "paged-attention", help="fast vs gather paged attention per decode step"
    )
    paged.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    paged.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    paged.add_argument("--layers", type=int, default=16, help="layers per step (scales the figure)")
    paged.add_argument("--heads", type=int, default=16)
    paged.add_argument("--kv-heads", type=int, default=4)
    paged.add_argument("--head-dim", type=int, default=64)
    paged.add_argument("--block-size", type=int, default=16)
    paged.add_argument("--repeats", type=int, default=5)
    paged.set_defaults(run=paged_attention)
    soak.add_parser(which)
    bench_serve.add_parser(which)
    bench_ladder.add_parser(which)


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


def paged_attention(args: argparse.Namespace) -> int:
    forced = os.environ.get("CADENCE_PAGED_ATTENTION")
    rng = np.random.default_rng(0)
    print(f"device {mx.default_device()}, {args.heads} heads / {args.kv_heads} KV heads, "
          f"D={args.head_dim}, block {args.block_size}; ms per decode step of {args.layers} layers")
    print("| B | context | fast ms | gather ms | gather / fast |")
    print("|---|---|---|---|---|")
    counts: dict[str, dict[str, int]] = {}
    for batch in args.batches:
        for context in args.contexts:
            step, pools, q, k, v = _decode_step(batch, context, args, rng)
            arm_ms = {}
            for path in ("fast", "gather"):
                before = dict(pa.dispatch_counts)
                arm_ms[path] = _time_arm(path, step, pools, q, k, v, args.repeats) * 1e3 * args.layers
                ran = {p: pa.dispatch_counts[p] - before.get(p, 0) for p in ("fast", "gather")}
                counts.setdefault(path, {"fast": 0, "gather": 0})
                for p, n in ran.items():
                    counts[path][p] += n
            ratio = arm_ms["gather"] / arm_ms["fast"]
            print(f"| {batch} | {context} | {arm_ms['fast']:.1f} | {arm_ms['gather']:.1f} | {ratio:.2f}x |")
            sys.stdout.flush()
    if forced is None:
        os.environ.pop("CADENCE_PAGED_ATTENTION", None)
    else:
        os.environ["CADENCE_PAGED_ATTENTION"] = forced
    if counts["fast"]["fast"] == 0 or counts["fast"]["gather"] != 0:
        print(f"error: the fast arm did not run the fast path only: {counts['fast']}", file=sys.stderr)
        return 1
    if counts["gather"]["gather"] == 0 or counts["gather"]["fast"] != 0:
        print(f"error: the gather arm did not run the gather path only: {counts['gather']}", file=sys.stderr)
        return 1
    return 0
