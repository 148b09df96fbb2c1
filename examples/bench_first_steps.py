"""Time each load's first run against its second: what a GPU's kernel compiles cost.

    .venv/bin/python examples/make_llama_checkpoint.py /tmp/llama-1b-q4 --bits 4 --layers 4
    .venv/bin/python examples/bench_first_steps.py /tmp/llama-1b-q4 [--warm-up]

mlx's CUDA backend compiles a kernel the first time a step needs it (the PTX is then
cached on disk, under /tmp/mlx/<version>/ptx). For 1, 16 and 64 rows of 256-token
prompts and 16 tokens each, this runs the load twice on fresh prompts through the real
policy and engine, and prints each run's seconds, its longest wait between two steps
and the PTX files the cache gained. With `--warm-up` the server's start-up warm-up
(runtime/warm_up.py) runs first, so the first runs show what it leaves uncompiled.
On the H200 (2026-12-04; 4-bit, hidden 2048, 4 layers, before the warm-up existed;
this loop in a scratch script): 1 row 43.51 s then 0.02 s, 6 PTX files the first time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams
from runtime.warm_up import warm_up_steps

import mlx.core as mx

from actors.tracing import configure_logging


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--warm-up", action="store_true", help="run the server's warm-up first")
    args = parser.parse_args()
    configure_logging(level="warning")  # the figures alone on stdout
    most = max(args.rows)
    engine = Engine(load_model(args.checkpoint), max_batch=most)
    ptx = Path("/tmp/mlx") / mx.__version__ / "ptx"

    def policy() -> FcfsScheduler:
        pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size, is_caching=False)
        return FcfsScheduler(most, pool, engine.max_context)

    def ptx_files() -> int:
        return len(list(ptx.glob("*"))) if ptx.exists() else 0

    print(f"{args.checkpoint}, {mx.default_device()}, mlx {mx.__version__}")
    if args.warm_up:
        warm = warm_up_steps(engine, policy(), wanted=True)
        assert warm is not None
        print(f"warm-up: {warm.seconds:.2f} s, {warm.steps} steps")
    serial = 0
    for rows in args.rows:
        for attempt in ("first", "second"):
            serial += 1
            prompts = {
                f"{serial}-{i}": SequenceParams(
                    tuple((serial * 1009 + i * 131 + j * 7) % 2000 + 3 for j in range(256)),
                    16,
                    ignore_eos=True,
                )
                for i in range(rows)
            }
            stamps: list[float] = []
            before = ptx_files()
            start = time.perf_counter()
            run_offline(
                engine,
                policy(),
                prompts,
                on_step=lambda _, at=stamps: at.append(time.perf_counter()),
            )
            seconds = time.perf_counter() - start
            gaps = [b - a for a, b in zip([start, *stamps], stamps, strict=False)]
            print(
                f"{rows} rows, {attempt} run: {seconds:.2f} s, {len(stamps)} steps, "
                f"longest wait {max(gaps):.2f} s, PTX files {before} -> {ptx_files()}"
            )


if __name__ == "__main__":
    main()
