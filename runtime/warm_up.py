"""Run the step shapes a server will meet once, before its first request.

mlx's CUDA backend compiles a kernel the first time a step needs it (NVRTC; the PTX is
then cached on disk, under /tmp/mlx/<version>/ptx by default). On an H200, a 4-bit
Llama-3.2-1B-shaped model's first 256-token prompt took 43.4 s, the same prompt's
second run 0.02 s, and a bench's first 16-client run waited 32 s for its first token:
the first clients of a server would pay that. `warm_up_steps` runs, on dummy prompts in a
block pool of its own (nothing stays cached or held), a prompt of the most tokens a
step takes alone, then `max_batch` rows prefilling and decoding beside one another.

The server calls it at start-up on a GPU (`--warm-up` forces it anywhere, `--no-warm-up`
skips it); on the CPU mlx compiles nothing per shape worth a start-up's time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams
from runtime.step_plan import StepPlan

import attrs
import mlx.core as mx

DECODE_STEPS = 4  # rows decoding together for a few steps: the decode shapes, not one


@attrs.frozen
class WarmUp:
    seconds: float
    steps: int
    most_tokens: int  # in one step
    most_rows: int  # in one step
    device: str


def warm_up_steps(
    engine: Engine,
    policy: FcfsScheduler,
    wanted: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> WarmUp | None:
    """Run `policy`'s step shapes through `engine` on dummy prompts where `wanted` (None:
    on a GPU only); None where not. Call it on the MLX thread. `progress` hears one line
    as it begins: a first start on a GPU can take a minute, and says why.

    `policy` is the server's (read for its limits only): the warm-up's own pool and
    policy leave the server's blocks, prefix cache and queue as they were."""
    if not (mx.default_device() != mx.cpu if wanted is None else wanted):
        return None
    if progress is not None:
        progress(f"warming up on {mx.default_device()}: each step shape once, on dummy prompts")
    start = time.perf_counter()
    kv = engine.kv
    pool = BlockPool(kv.num_blocks, kv.block_size, is_caching=False, layout=kv.layout)
    own = FcfsScheduler(
        policy.max_batch,
        pool,
        engine.max_context,
        policy.prefill_chunk,
        policy.max_num_batched_tokens,
        policy.solo_prefill_tokens,
    )
    plans: list[StepPlan] = []
    vocab = engine.config.vocab_size
    longest = max(min(policy.solo_prefill_tokens, engine.max_context - DECODE_STEPS), 1)
    alone = {"warm-up": _dummy(longest, 0, vocab)}
    run_offline(engine, own, alone, on_step=plans.append)
    prompt = max(min(policy.prefill_chunk // policy.max_batch, engine.max_context // 2), 1)
    beside = {f"warm-up-{i}": _dummy(prompt, i + 1, vocab) for i in range(policy.max_batch)}
    run_offline(engine, own, beside, on_step=plans.append)
    return WarmUp(
        round(time.perf_counter() - start, 2),
        len(plans),
        max((plan.num_tokens for plan in plans), default=0),
        max((len(plan.spans) for plan in plans), default=0),
        str(mx.default_device()),
    )


def _dummy(length: int, seed: int, vocab: int) -> SequenceParams:
    tokens = tuple((seed * 7919 + i * 104729) % vocab for i in range(length))
    return SequenceParams(prompt_tokens=tokens, max_tokens=DECODE_STEPS, ignore_eos=True)
