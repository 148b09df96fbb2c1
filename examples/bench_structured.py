"""What structured output costs the batch: decode tok/s of 16 rows, 8 of them constrained
by a JSON schema, beside 16 free rows, with the host time spent on token masks.

    python examples/bench_structured.py [--batch 16] [--constrained 8] [--new-tokens 64] [--repeats 3]

Uses the serving benchmark's checkpoint (actors/bench_model.py: ~200M params, fp32,
the demo tokenizer's 2,048 tokens; built once under .bench/). Each arm prefills its
rows untimed, then times the decode steps through the real policy and engine with one
step of lookahead, until the first row finishes. A constrained row skips lookahead's
speculative step (see runtime/grammar.py), so it decodes every other step while the
free rows decode every step. Steps are timed collect to collect and the median is
kept: other jobs on a shared box skew means far more than medians.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time
from pathlib import Path

import runtime  # noqa: F401  (loads the fast BLAS before mlx)
import runtime.engine
from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from runtime.kv.blocks import BlockPool
from runtime.runner import PlanRunner, step_results
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SamplingParams, SequenceParams

import attrs

from actors.bench_model import bench_checkpoint

# A list of short notes that must be long: it cannot close within the run.
SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 400,
        }
    },
    "required": ["notes"],
}


class MaskClock:
    """Wraps the engine's token_masks: how many steps computed masks, and for how long."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._masks = runtime.engine.token_masks

    def __call__(self, states, vocab_size):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        masks = self._masks(states, vocab_size)
        if masks is not None:
            self.seconds += time.perf_counter() - start
            self.calls += 1
        return masks


@attrs.frozen
class Decoded:
    tok_per_s: float  # every row's tokens over the time both groups decode
    step_ms: float  # the median step, collect to collect, while both groups decode
    free_per_step: float  # tokens per step, of the free rows and of the constrained
    constrained_per_step: float


def decode(
    engine: Engine, batch: int, num_constrained: int, grammar: CompiledGrammar, new_tokens: int
) -> Decoded:
    """Decode `batch` rows, the first `num_constrained` under `grammar`, through the policy
    and the engine with one step of lookahead; measured until the first row finishes
    (from then on the batch is no longer the mix being measured)."""
    rng = random.Random(0)
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size, is_caching=False)
    policy = FcfsScheduler(batch, pool, engine.max_context, 64 * batch, 64 * batch + batch)
    for i in range(batch):
        policy.add(
            str(i),
            SequenceParams(
                prompt_tokens=tuple(rng.randrange(3, 2000) for _ in range(64)),
                max_tokens=new_tokens,
                ignore_eos=True,
                grammar=grammar if i < num_constrained else None,
                sampling=SamplingParams(temperature=0.7, seed=i),
            ),
        )
    runner = PlanRunner(engine)
    plan = policy.schedule()  # every prompt, each sampling its first token: not timed
    assert plan is not None
    policy.on_step_done(plan.step, step_results(runner.collect(runner.launch(plan))))
    pending: collections.deque = collections.deque()
    produced = collections.Counter[bool]()
    steps: list[float] = []
    start = last = time.perf_counter()
    while len(policy.running) == batch:
        plan = policy.schedule() if len(pending) <= 1 else None
        if plan is not None:
            pending.append(runner.launch(plan))
            continue
        launched = pending.popleft()
        results = runner.collect(launched)
        runner.start()  # the step launched behind it (held back on the CPU)
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        for result in results:
            if result.token is not None:
                produced[int(result.request_id) < num_constrained] += 1
        policy.on_step_done(launched.plan.step, step_results(results))
    for launched in pending:  # drain what is queued; the rest is not measured
        runner.collect(launched)
    runner.close_all()
    return Decoded(
        (produced[True] + produced[False]) / (last - start),
        1e3 * statistics.median(steps),
        produced[False] / len(steps),
        produced[True] / len(steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--constrained", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(bench_checkpoint(Path(".bench")))
    engine = Engine(loaded, max_batch=args.batch, max_context=1024)
    compiler = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, engine.eos_ids)
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA), "bench"))
    clock = MaskClock()
    runtime.engine.token_masks = clock  # type: ignore[assignment]
    decode(engine, args.batch, args.constrained, grammar, 4)  # warm up
    best: dict[str, Decoded] = {}
    mask_ms = 0.0
    for _ in range(args.repeats):  # interleaved, best of each: the box is shared
        for name, num_constrained in (("free", 0), ("mixed", args.constrained)):
            clock.seconds, clock.calls = 0.0, 0
            got = decode(engine, args.batch, num_constrained, grammar, args.new_tokens)
            if name not in best or got.step_ms < best[name].step_ms:
                best[name] = got
                if name == "mixed":
                    mask_ms = 1e3 * clock.seconds / max(clock.calls, 1)
    print(f"B={args.batch}, {args.new_tokens} new tokens a row, best of {args.repeats}")
    print(
        "| batch | tok/s at the median step | median step | tokens/step free + constrained "
        "| mask/step | tok/s over the whole run |"
    )
    print("|---|---|---|---|---|---|")
    for name, label in (
        ("free", f"{args.batch} free"),
        ("mixed", f"{args.batch - args.constrained} free + {args.constrained} JSON schema"),
    ):
        got = best[name]
        mask = f"{mask_ms:.2f} ms" if name == "mixed" else "-"
        per_step = got.free_per_step + got.constrained_per_step
        print(
            f"| {label} | {1e3 * per_step / got.step_ms:.0f} | {got.step_ms:.0f} ms | "
            f"{got.free_per_step:.1f} + {got.constrained_per_step:.1f} | {mask} | "
            f"{got.tok_per_s:.0f} |"
        )


if __name__ == "__main__":
    main()
