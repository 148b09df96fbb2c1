"""The policy's part in a hybrid model's prefix cache (runtime/kv/snapshots.py): where a
row's spans keep its recurrent state, and which cached prefix a row can resume from.
Mixed into the policy (runtime/scheduler.py), whose pool, book and rows it reads.

A row keeps its state (its span ends there, a prompt chunk cut short if need be):
  - after its prompt's last full block before the newest token, the prefix a repeat
    of the prompt (n choices, a retry) looks up;
  - after its prompt, if that ends on a block;
  - after the cached blocks it shared with another prompt but had no snapshot for
    (two prompts with one system prompt): it computes them again, and the next
    prompt like them resumes there, as SGLang keeps a state where a radix node splits;
  - at each block boundary it decodes past: only the newest is kept, the end of a
    reply, which the next turn of a chat sends again.
"""

from __future__ import annotations

from runtime.kv.blocks import BlockPool
from runtime.kv.snapshots import PlannedSave, SnapshotBook
from runtime.scheduled_request import ScheduledRequest


class SnapshotPlanning:
    pool: BlockPool
    snapshots: SnapshotBook | None  # None: no recurrent state, or no prefix caching
    running: dict[str, ScheduledRequest]
    num_steps: int

    def _usable_hits(self, request: ScheduledRequest, hits: list[list[int]]) -> list[list[int]]:
        """`hits` cut to the longest prefix a hybrid model's row can resume after: one
        whose last block has a snapshot of the recurrent state there. Notes where the
        cached blocks it cannot use end (`shared_end`), to keep the state there."""
        if self.snapshots is None:
            return hits
        num_cached = len(hits[0])
        num_usable = self.snapshots.longest_usable(request.block_hashes[:num_cached])
        request.shared_end = num_cached * self.pool.block_size if num_usable < num_cached else 0
        if num_usable == num_cached:
            return hits
        return self.pool.match_tables(request.block_hashes[:num_usable])

    def _next_save_point(self, request: ScheduledRequest) -> int | None:
        """The nearest position past what a prefilling row computed where it keeps its state."""
        if self.snapshots is None:  # a model without recurrent state: every prefill step
            return None
        points = [p for p in self._save_points(request) if self._needs_save(request, p)]
        return min(points, default=None)

    def _save_points(self, request: ScheduledRequest) -> tuple[int, ...]:
        size = self.pool.block_size
        return (request.shared_end, (request.frontier - 1) // size * size)

    def _needs_save(self, request: ScheduledRequest, position: int) -> bool:
        """A span ending at block boundary `position`, past what the row computed, should
        save its state there: no snapshot of that prefix exists (or its hash is unknown)."""
        if self.snapshots is None or position <= request.num_computed:
            return False
        index = position // self.pool.block_size - 1
        return not (index < len(request.block_hashes) and self.snapshots.has(request.block_hashes[index]))

    def _planned_save(self, request: ScheduledRequest, end: int, is_prefill: bool) -> int | None:
        """The snapshot id the row's next span, ending at `end`, saves its state as, if any."""
        if self.snapshots is None or end % self.pool.block_size:
            return None
        if is_prefill and end not in (*self._save_points(request), request.frontier):
            return None
        if not self._needs_save(request, end):
            return None
        return self.snapshots.plan_save(self.num_steps + 1, request.request_id, end, not is_prefill)

    def _snapshot_hash(self, save: PlannedSave) -> bytes | None:
        """The hash a save is named by: its block's, once cached; None if its row left, or
        the block is not cached: a failed row's never is (the snapshot is then dropped)."""
        request = self.running.get(save.request_id)
        index = save.position // self.pool.block_size - 1
        if request is None or index >= request.num_published:
            return None
        block_hash = request.block_hashes[index]
        return block_hash if block_hash in self.pool.by_hash else None
