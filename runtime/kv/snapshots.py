"""Which recurrent-state snapshots exist, for a hybrid model's prefix cache: the policy's
side, pure Python (the engine holds the arrays, runtime/engine.py).

A cached prefix is K/V only; a hybrid model's linear-attention layers also need their
state at its end (runtime/kv/recurrent.py). So a prefix is usable only up to a block
whose snapshot exists: the state of every recurrent layer after exactly the tokens
through that block, kept under the block's hash.

    book = SnapshotBook(capacity=16)
    sid = book.plan_save(step, "req", position=64, is_decode=False)  # span ends at 64
    ... the step runs; the engine keeps the row's state then as snapshot `sid` ...
    book.on_step_done(step, resolve)   # named by block 3's hash, or dropped
    book.longest_usable(hashes)        # -> 4 blocks, restore from `book.snapshot_id(...)`
    plan.snapshot_drops = book.take_drops(is_cached)

Every snapshot planned is named or dropped, and every dropped id reaches the engine in
a plan, so the engine holds only what this book counts: at most `capacity` named ones
(least recently used dropped first), a block's snapshot dropped when its block leaves
the cache, plus the saves of steps in flight (a row's own, one per span at most).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Container, Sequence

import attrs


@attrs.frozen
class PlannedSave:
    request_id: str
    position: int  # the block boundary the span ends at
    snapshot_id: int
    is_decode: bool  # a decoding row's boundary: only its newest is worth keeping


@attrs.define
class SnapshotBook:
    capacity: int  # named snapshots kept at most
    named: collections.OrderedDict[bytes, int] = attrs.Factory(collections.OrderedDict)  # LRU first
    in_flight: dict[int, list[PlannedSave]] = attrs.Factory(dict)  # step -> its saves
    newest_decoded: dict[str, bytes] = attrs.Factory(dict)  # request -> its decode boundary's hash
    drops: list[int] = attrs.Factory(list)  # for the next plan
    ids: itertools.count[int] = attrs.Factory(itertools.count)

    def plan_save(self, step: int, request_id: str, position: int, is_decode: bool) -> int:
        """A snapshot id for the row's state after step `step`'s span ends at `position`."""
        save = PlannedSave(request_id, position, next(self.ids), is_decode)
        self.in_flight.setdefault(step, []).append(save)
        return save.snapshot_id

    def on_step_done(self, step: int, block_hash: Callable[[PlannedSave], bytes | None]) -> None:
        """Name step `step`'s saves by `block_hash` (the hash of the block ending at the
        save's position, None if its row failed, left, or the block is not cached)."""
        for save in self.in_flight.pop(step, []):
            named = block_hash(save)
            if named is None or named in self.named:  # a snapshot of this prefix exists already
                self.drops.append(save.snapshot_id)
                continue
            self.named[named] = save.snapshot_id
            if save.is_decode:  # a row's older decode boundary is a prefix no one else sent
                older = self.newest_decoded.get(save.request_id)
                self.newest_decoded[save.request_id] = named
                if older is not None:
                    self._drop(older)
        while len(self.named) > self.capacity:
            _, snapshot_id = self.named.popitem(last=False)
            self.drops.append(snapshot_id)

    def longest_usable(self, hashes: Sequence[bytes]) -> int:
        """How many of the leading blocks `hashes` (all cached) a row can start after:
        the most whose last has a snapshot (0: none)."""
        for num_blocks in range(len(hashes), 0, -1):
            if hashes[num_blocks - 1] in self.named:
                return num_blocks
        return 0

    def take(self, block_hash: bytes) -> int:
        """The snapshot under `block_hash`, now the most recently used."""
        self.named.move_to_end(block_hash)
        return self.named[block_hash]

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.named

    def forget(self, request_id: str) -> None:
        """The request left: its newest decode boundary stays, as any other snapshot."""
        self.newest_decoded.pop(request_id, None)

    def take_drops(self, is_cached: Container[bytes]) -> tuple[int, ...]:
        """The snapshot ids the engine may free now, those whose block left the cache
        (evicted: its prefix can no longer hit) included."""
        for block_hash in [h for h in self.named if h not in is_cached]:
            self._drop(block_hash)
        drops, self.drops = tuple(self.drops), []
        return drops

    def _drop(self, block_hash: bytes) -> None:
        if (snapshot_id := self.named.pop(block_hash, None)) is not None:
            self.drops.append(snapshot_id)
