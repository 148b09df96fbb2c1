"""What the scheduling policy (runtime/scheduler.py) hands the engine each step, in
request ids: the rows it opens and closes, and each row's span of tokens to compute.
The runner (runtime/runner.py) turns it into the engine's StepBatch; the GPU actor
logs its shape as the `step` event."""

from __future__ import annotations

from runtime.sequence import SequenceParams

import attrs


@attrs.frozen
class PlannedSpan:
    request_id: str
    start: int
    num_new: int
    blocks: tuple[int, ...]
    samples: bool  # the span reaches the newest token: its last position is sampled
    group_tables: tuple[tuple[int, ...], ...] = ()  # the other layer groups' tables
    # Prompt tokens (a resumed row's generated ones too), however few: a 1-token prompt,
    # or the one a prefix hit leaves, is prefill, not a decoding row.
    is_prefill: bool = True
    # A hybrid model's row keeps its recurrent state after the span as this snapshot
    # (runtime/kv/snapshots.py): the span ends at a block boundary.
    save_as: int | None = None


@attrs.frozen
class StepPlan:
    """One step for the GPU actor, in request ids.

    `closes` lists every request that left since the last plan by abort, whether or
    not it ever had a row: the GPU frees the rows it has and reports all of them back
    as released, so the streamer can forget them. `opens` carries each new row's
    prompt tokens taken from the prefix cache.
    """

    step: int
    opens: tuple[tuple[str, SequenceParams, int], ...] = ()
    closes: tuple[str, ...] = ()
    rejects: tuple[tuple[str, str], ...] = ()  # (request id, why): can never fit the pool
    spans: tuple[PlannedSpan, ...] = ()
    epoch: int = 0
    num_free_blocks: int = 0
    hit_rate: float = 0.0
    preempted: tuple[str, ...] = ()  # requeued by recompute while planning this step
    # A hybrid model's prefix hits: (request id, snapshot id) its recurrent state starts
    # from, before its first span; and the snapshots the engine may free, after those.
    restores: tuple[tuple[str, int], ...] = ()
    snapshot_drops: tuple[int, ...] = ()
    # (cause, stage) of each of `closes`, for the log: the scheduler actor fills them in
    close_causes: tuple[tuple[str, str], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(span.num_new for span in self.spans)

    @property
    def num_prefill_rows(self) -> int:
        return sum(span.is_prefill for span in self.spans)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(span.num_new for span in self.spans if span.is_prefill)
