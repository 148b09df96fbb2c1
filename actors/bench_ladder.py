"""`cadence bench ladder`: the batch ladder's table, and whether padding pays.

For each step size N (N decoding rows, one token each, at a given context), it
prints the dense layers' measured time (what the ladder decides on), the size the
ladder pads N to, and the whole forward, attention included, unpadded and padded:
the figure that says whether `cadence serve --batch-ladder` is worth turning on.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.errors import CadenceError
from runtime.kv.base import RowSpan
from runtime.kv.layout import NULL_BLOCK
from runtime.kv.recurrent import zero_states
from runtime.ladder import BatchLadder, measure_ladder, pad_step

import mlx.core as mx

from actors import arg_types
from actors.bench_model import bench_checkpoint


def add_parser(which: argparse._SubParsersAction) -> None:
    ladder = which.add_parser("ladder", help="the batch ladder's table and padded step times")
    ladder.add_argument(
        "--model", default=None, help="a checkpoint (default: the 200M bench model)"
    )
    ladder.add_argument("--cache-dir", type=Path, default=Path(".bench"))
    count = arg_types.positive_int
    ladder.add_argument("--max-tokens", type=count, default=32, help="sizes 1..N")
    ladder.add_argument("--context", type=count, default=200, help="each row's tokens so far")
    ladder.add_argument("--repeats", type=count, default=7)
    ladder.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except CadenceError as error:  # a bad checkpoint, or a context the model cannot hold
        print(f"cadence bench ladder: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    loaded = load_model(args.model or bench_checkpoint(args.cache_dir))
    # Each row holds its context, the token it decodes, and one spare.
    max_context = args.context + 2
    if max_context > (limit := loaded.config.max_position_embeddings):
        raise CadenceError(
            f"--context {args.context} needs {max_context} positions; "
            f"{loaded.name} has {limit} (--context {limit - 2} at most)"
        )
    engine = Engine(loaded, max_batch=args.max_tokens, max_context=max_context)
    start = time.perf_counter()
    ladder = measure_ladder(engine.model, loaded.config.num_hidden_layers, args.max_tokens)
    print(
        f"ladder measured in {time.perf_counter() - start:.1f} s; {loaded.name}, {mx.default_device()}"
    )
    print("| N | dense ms | padded to | step ms | padded step ms | padded / plain |")
    print("|---|---|---|---|---|---|")
    total_plain = total_padded = 0.0
    for n in range(1, args.max_tokens + 1):
        spans = _decode_rows(engine, n, args.context)
        tokens = mx.zeros((n,), dtype=mx.int32)
        plain = functools.partial(_step, engine, None, tokens, spans)
        padded = functools.partial(_step, engine, ladder, tokens, spans)
        a, b = _fastest(plain, args.repeats), _fastest(padded, args.repeats)
        total_plain, total_padded = total_plain + a, total_padded + b
        rung = ladder.padded(n)
        print(
            f"| {n} | {ladder.ms[n - 1]:.1f} | {rung if rung != n else '-'} | {a:.1f} | "
            f"{b:.1f} | {b / a:.2f}x |"
        )
    print(
        f"all sizes once: {total_plain:.0f} ms plain, {total_padded:.0f} ms padded "
        f"({total_padded / total_plain:.2f}x)"
    )
    return 0


def _step(
    engine: Engine, ladder: BatchLadder | None, tokens: mx.array, spans: list[RowSpan]
) -> mx.array:
    recurrent = None if engine.states is None else zero_states(spans)  # a hybrid model's
    t, view = pad_step(ladder, tokens, engine.kv.forward(spans, 0, recurrent))
    return engine.model.hidden(t[None], view)


def _decode_rows(engine: Engine, rows: int, context: int) -> list[RowSpan]:
    """`rows` rows decoding at position `context`, each with blocks of its own in every
    layer group: a windowed group's (sliding layers) only those its window reads, as a
    served row holds them (runtime/kv/blocks.py), the entries before them NULL_BLOCK."""
    size, layout = engine.kv.block_size, engine.kv.layout
    per_row = -(-(context + 1) // size)
    spans = []
    for i in range(rows):
        tables = []
        for group in range(layout.num_groups):
            skipped = layout.first_needed_block(group, context, size)
            held = per_row - skipped
            tables.append((NULL_BLOCK,) * skipped + tuple(range(i * held, (i + 1) * held)))
        spans.append(RowSpan(i, context, 1, tables[0], tuple(tables[1:])))
    return spans


def _fastest(forward: Callable[[], mx.array], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(forward())
        best = min(best, time.perf_counter() - start)
    return best * 1e3
