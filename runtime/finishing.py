"""Whether a row is done after a token: one function for every site that decides it.

The engine calls `finish_step` for each sampled token (all but STOP_SEQUENCE); the
streamer, which matches stop strings on the text, merges its STOP_SEQUENCE with the
engine's cause through `first_cause`. Both follow one order, `FinishCause`'s, and
the first that applies wins:

    1. ERROR              the row failed (the error message travels beside it)
    2. EOS                the token is an end-of-sequence id (unless ignore_eos)
    3. STOP_SEQUENCE      a stop string matched the generated text
    4. LENGTH             max_tokens tokens have been generated
    5. CONTEXT_EXHAUSTED  the row's KV has reached the context limit
    6. REPETITION_LOOP    the recent tokens are one short pattern, repeated
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.sequence import FinishCause


def finish_step(
    *,
    token: int | None,
    num_generated: int,
    tokens: Sequence[int],
    max_tokens: int | None,
    context_length: int,
    max_context: int,
    eos_ids: frozenset[int],
    repetition_window: int | None = None,
) -> FinishCause | None:
    """`tokens` is the sequence so far, `token` last (only its tail is read, and only
    for the loop check); `num_generated` counts `token`; `context_length` is prompt +
    generated."""
    if token is None:
        return FinishCause.ERROR
    if token in eos_ids:
        return FinishCause.EOS
    if max_tokens is not None and num_generated >= max_tokens:
        return FinishCause.LENGTH
    if context_length >= max_context:
        return FinishCause.CONTEXT_EXHAUSTED
    if (
        repetition_window
        and num_generated >= repetition_window + repetition_window // 4  # a tail of new tokens
        and is_repetition_loop(tokens, repetition_window)
    ):
        return FinishCause.REPETITION_LOOP
    return None


def is_repetition_loop(tokens: Sequence[int], window: int) -> bool:
    """True when the last `window` tokens repeat a pattern of period <= window // 4."""
    max_period = window // 4
    if max_period < 1 or len(tokens) < window + max_period:
        return False
    tail = list(tokens[-window - max_period :])
    recent = tail[-window:]
    return any(recent == tail[-window - p : -p] for p in range(1, max_period + 1))


_RANK = {cause: rank for rank, cause in enumerate(FinishCause)}  # declaration order


def first_cause(*causes: FinishCause | None) -> FinishCause | None:
    """Of several causes that apply at once (None: does not apply), the one that wins."""
    present = [cause for cause in causes if cause is not None]
    return min(present, key=_RANK.__getitem__) if present else None
