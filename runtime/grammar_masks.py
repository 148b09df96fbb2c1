"""A step's token masks: every constrained row's allowed tokens, as the batched sampler
takes them (runtime/engine.py), from the rows' grammar states (runtime/grammar.py)."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.grammar import GrammarState, bar_eos, unpack_mask

import mlx.core as mx
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask


def token_masks(
    states: Sequence[GrammarState | None],
    vocab_size: int,
    queued: Sequence[mx.array | None] = (),
) -> mx.array | None:
    """[B, V] bool: the tokens each row's grammar allows next (all, for a None row).

    `queued`: each row's input token (lazy, [1]) where it is its sample still in
    flight, else None (or left off). Only a thinking row is fed one (`is_thinking`): its
    mask is the thought's, or where that token is `</think>`, the one past it
    (`past_thought`), picked on the device.

    None when no row has a grammar. Computed on the host, row by row: llguidance's
    parallel executor took 2.3 ms for 8 rows of the demo vocabulary on the loaded
    2-core box, one call per row 0.07 ms in all (its thread pool's wake-ups cost more
    than the masks). Unpacked from bits by numpy: 0.7 ms for 16 rows of 151,936
    tokens, 3.8 ms with mlx's ops on the CPU.
    """
    constrained = [(i, s) for i, s in enumerate(states) if s is not None]
    if not constrained:
        return None
    fed = _fed(states, queued)
    # Each row's own mask, then for each fed row the one past its thought's end.
    past = [(len(states) + j, state.past_thought()) for j, (_, state, _) in enumerate(fed)]
    # [B, ceil(W / 32)] int32, all set; W covers every id a grammar's tokenizer holds,
    # the mask is cut to the model's V below.
    mask_vocab = max(vocab_size, *(state.mask_vocab for _, state in constrained))
    bitmask = allocate_token_bitmask(len(states) + len(past), mask_vocab)
    for i, state in constrained + past:
        if state.phase != "thought":  # (a thought's mask is not the grammar's)
            fill_next_token_bitmask(state.matcher, bitmask, i)
    allowed = unpack_mask(bitmask, vocab_size)
    for i, state in constrained + past:
        state.fill_mask(allowed[i])
        if state.barred_eos_ids:
            bar_eos(allowed[i], [t for t in sorted(state.barred_eos_ids) if t < vocab_size])
    if not fed:
        return mx.array(allowed)
    # Each row takes its own mask, a fed row the one past its thought where it is fed `</think>`.
    rows = mx.array([i for i, _, _ in fed])
    is_close = mx.concatenate([token for _, _, token in fed]) == mx.array(
        [state.close_id for _, state, _ in fed]
    )
    pick = mx.arange(len(states))
    pick[rows] = mx.where(is_close, mx.array([i for i, _ in past]), rows)
    return mx.take(mx.array(allowed), pick, axis=0)


def _fed(
    states: Sequence[GrammarState | None], queued: Sequence[mx.array | None]
) -> list[tuple[int, GrammarState, mx.array]]:
    """The constrained rows fed their queued token, and it; only a thinking row may be."""
    fed = []
    for i, token in enumerate(queued):
        if token is not None and (state := states[i]) is not None:
            if not state.is_thinking:
                raise ValueError("only a row inside its thought may be fed its queued sample")
            fed.append((i, state, token))
    return fed
