"""What the scheduling policy (runtime/scheduler.py) knows of one request."""

from __future__ import annotations

from runtime.sequence import SequenceParams

import attrs


@attrs.define
class ScheduledRequest:
    """Everything the policy knows of one request: its tokens, blocks and progress."""

    request_id: str
    params: SequenceParams
    tokens: list[int]  # prompt, then every collected token
    block_hashes: list[bytes]  # of its full blocks of known tokens, chained
    tables: list[list[int]] = attrs.Factory(lambda: [[]])  # its block table per layer group
    num_computed: int = 0  # positions whose K/V is computed or queued
    num_kv_done: int = 0  # ... of those, by a step already reported done
    num_published: int = 0  # leading blocks offered to the prefix cache
    num_samples: int = 0  # tokens sampled, counting queued steps
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the cache
    # A hybrid model's: where cached blocks it could not resume after end (another
    # prompt's, with no state snapshot there): it keeps its state there (0: none).
    shared_end: int = 0
    is_open: bool = False  # the engine has a row for it (kept across preemption)
    # A constrained row inside the thought before its grammar, as of its collected
    # tokens (the engine says so): it may have one sample in flight (`_awaits_its_sample`).
    is_thinking: bool = False
    arrival: int = 0  # order of `add` calls

    @property
    def blocks(self) -> list[int]:
        """Its first group's table: every position's block (runtime/kv/layout.py)."""
        return self.tables[0]

    @property
    def rank(self) -> tuple[int, int]:
        """Lower runs first: the priority, then the arrival."""
        return (self.params.priority, self.arrival)

    @property
    def frontier(self) -> int:
        """Tokens known or queued; a span ending here samples the next one."""
        return len(self.params.prompt_tokens) + self.num_samples

    @property
    def is_prefilling(self) -> bool:
        """Known tokens are still missing K/V (not just the newest sample's)."""
        return self.num_computed < self.frontier - 1 or self.num_samples == 0
