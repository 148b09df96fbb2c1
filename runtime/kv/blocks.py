"""The block pool: which KV blocks exist, who holds them, and which prefixes they cache.

Pure Python, owned by the scheduling policy (as nano-vllm's block manager is), so
admission and preemption see memory directly. The engine only ever receives block
tables: it never allocates.

    block ids   0   1   2   3   4   5   6   7
    refcount    2   1   0   0   1   0   0   0
    hash        h0  h1  h2  -   -   -   -   -
                ^shared  ^cached: free, still hit-able (LRU)  ^free

A block is "full" once `block_size` tokens whose ids are known have their K/V
computed. A full block gets a hash chained over every token id before it plus a
salt for whatever else changes the K/V (the model), so equal hashes mean equal
K/V. Released full blocks stay cached until evicted, least recently used first;
a prefix lookup takes them back without recomputing. Blocks are shared only once
full, and full blocks are never written again, so sharing needs no copy.

`epoch` counts every mutation that can change what a block id holds (release,
eviction, preemption): a plan cached from block tables is keyed on it, so a
missed invalidation can never read a block that moved.

With sliding-window layers a row holds one table per layer group (runtime/kv/layout.py).
This pool is group 0's, the one the policy reasons about; each windowed group has a
pool of its own (`group_pools`), sized so it never binds. The `*_tables` methods
keep a row's tables together:

    row of 41 positions (next query at 41), block size 4, window 8: it reads 34-41
    group 0 (full)    [ 7  2  9 11  3  5  8 12 14 15  1]   every block
    group 1 (window)  [ -  -  -  -  -  -  -  -  4  6 10]   blocks 8-10 (positions 32-43);
                                                       the rest went back as the row grew

A full block of a windowed group is cached in its group's pool under the prefix
hash, so a prefix hit is a hit only if every group has what the next query reads:
all the prefix's blocks in full groups, the window's last blocks in windowed ones.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Iterable, Sequence

from runtime.errors import CapacityError
from runtime.kv.layout import NULL_BLOCK, KVLayout


def chain_hashes(
    tokens: Sequence[int], block_size: int, salt: bytes, *, parent: bytes = b"", start: int = 0
) -> list[bytes]:
    """Hashes of the full blocks of `tokens[start:]`, each chained on the one before.

    `parent` is the hash of the block ending at `start` (b"" at 0). blake2b rather
    than Python's `hash`, whose int and tuple hashes are not keyed: a client could
    craft a collision and read another request's cached K/V.
    """
    hashes = []
    for lo in range(start, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16, key=salt[:64])
        digest.update(array("q", tokens[lo : lo + block_size]).tobytes())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        salt: bytes = b"",
        is_caching: bool = True,
        layout: KVLayout | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.layout = layout or KVLayout.for_layers(1)  # one group: every layer full
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.salt = salt
        self.is_caching = is_caching
        sizes = self.layout.group_num_blocks or (num_blocks,) * self.layout.num_groups
        self.group_pools = [self] + [
            BlockPool(n, block_size, salt=salt, is_caching=is_caching) for n in sizes[1:]
        ]
        self.refcount = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.epoch = 0
        self.num_lookup_blocks = 0  # full prompt blocks looked up
        self.num_hit_blocks = 0  # ... and found cached
        self.num_query_tokens = 0  # prompt tokens looked up, vLLM's prefix-cache "queries"

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used, or cached and evictable."""
        return len(self.free) + len(self.cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_lookup_blocks if self.num_lookup_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks holding the longest prefix of `hashes`; takes nothing."""
        blocks = []
        if self.is_caching:
            for h in hashes:
                if (block := self.by_hash.get(h)) is None:
                    break
                blocks.append(block)
        return blocks

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are cached-free (taking them lowers `num_free_blocks`)."""
        return sum(1 for b in blocks if b in self.cached)

    def _hold(self, blocks: Iterable[int]) -> None:
        """Take a hold on each of `blocks`, which may be cached-free (a prefix hit)."""
        for block in blocks:
            if self.refcount[block] == 0:
                del self.cached[block]
            self.refcount[block] += 1

    def allocate(self) -> int:
        """A fresh block for one holder: never used first, else evict the LRU cached one."""
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            old_hash = self.block_hash[block]
            assert old_hash is not None  # only full, hashed blocks are kept cached
            del self.by_hash[old_hash]
            self.block_hash[block] = None
            self.epoch += 1  # its old contents are gone
        else:
            raise CapacityError(f"all {self.num_blocks} KV blocks are in use")
        self.refcount[block] = 1
        return block

    def publish(self, block: int, block_hash: bytes) -> None:
        """Mark a held, full block as caching the prefix `block_hash`."""
        if not self.is_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.by_hash:
            return  # the same prefix is cached in another block already: keep that one
        self.block_hash[block] = block_hash
        self.by_hash[block_hash] = block

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one hold on each block; the last hold frees it (cached ones stay hit-able)."""
        for block in blocks:
            if self.refcount[block] <= 0:
                raise ValueError(f"block {block} released more often than held")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if self.block_hash[block] is None:
                    self.free.append(block)
                else:
                    self.cached[block] = None  # most recently used last
        self.epoch += 1

    def check(self) -> None:
        """Assert the pool's invariants (tests and debugging)."""
        assert all(r >= 0 for r in self.refcount)
        free, cached = set(self.free), set(self.cached)
        assert not free & cached and len(free) == len(self.free)
        for block in range(self.num_blocks):
            held = self.refcount[block] > 0
            assert held != (block in free or block in cached), block
            assert (block in cached) <= (self.block_hash[block] is not None), block
        assert {b: h for h, b in self.by_hash.items()} == {
            b: h for b, h in enumerate(self.block_hash) if h is not None
        }
        for pool in self.group_pools[1:]:
            pool.check()


    # -- a row's tables, one per layer group ---------------------------------------

    def new_tables(self) -> list[list[int]]:
        return [[] for _ in self.group_pools]

    def blocks_for_row(self, num_tokens: int, max_chunk: int) -> int:
        """The most of this pool's blocks a row of `num_tokens` holds at once
        (computed in chunks of at most `max_chunk`)."""
        return self.layout.row_blocks(0, num_tokens, self.block_size, max_chunk)

    @staticmethod
    def num_held(tables: Sequence[Sequence[int]]) -> int:
        """Blocks of this pool (group 0's) the tables hold."""
        return sum(1 for block in tables[0] if block != NULL_BLOCK)

    def match_tables(self, hashes: Sequence[bytes]) -> list[list[int]]:
        """Per group, the cached blocks of the longest prefix of `hashes` that every group
        can serve (a windowed group: the blocks the next query's window reads, NULL_BLOCK
        before them); takes nothing. Every table has the hit's length."""
        num_hit = len(hashes)
        for pool, window in zip(self.group_pools, self.layout.group_windows, strict=True):
            if window is None:  # a full group needs every block of the prefix
                num_hit = min(num_hit, len(pool.match_prefix(hashes)))
        size = self.block_size

        def window_blocks(group: int, num_blocks: int) -> list[int | None]:
            pool = self.group_pools[group]
            lo = self.layout.first_needed_block(group, num_blocks * size, size)
            if not pool.is_caching:
                return [None] * (num_blocks - lo)
            return [pool.by_hash.get(h) for h in hashes[lo:num_blocks]]

        windowed = [g for g, w in enumerate(self.layout.group_windows) if w is not None]
        while num_hit > 0 and any(None in window_blocks(g, num_hit) for g in windowed):
            num_hit -= 1
        tables = []
        for group, pool in enumerate(self.group_pools):
            if group in windowed:
                lo = self.layout.first_needed_block(group, num_hit * size, size)
                found = [b for b in window_blocks(group, num_hit) if b is not None]
                tables.append([NULL_BLOCK] * lo + found)
            else:
                tables.append(pool.match_prefix(hashes[:num_hit]))
        return tables

    def num_evictable_tables(self, tables: Sequence[Sequence[int]]) -> int:
        """Of this pool's blocks in `tables`, how many are cached-free."""
        return self.num_evictable(tables[0])

    def take_cached_tables(
        self, tables: Sequence[Sequence[int]], num_looked_up: int, num_prompt_tokens: int | None = 0
    ) -> None:
        """Hold what `match_tables` found; the hit rate counts prompt blocks, not groups.
        A prompt's lookup queries each of its `num_prompt_tokens`, as vLLM counts them,
        though only full blocks before the last token can hit; None: a preempted row's
        resumption, which is not counted at all.

        Any group's table may start with NULL_BLOCK entries, group 0's too when every
        layer slides: those prompt blocks count as hits (their tokens are not computed
        again), but there is no block to hold."""
        if num_prompt_tokens is not None:
            self.num_lookup_blocks += num_looked_up
            self.num_query_tokens += num_prompt_tokens
            self.num_hit_blocks += len(tables[0])
        for pool, table in zip(self.group_pools, tables, strict=True):
            pool._hold(b for b in table if b != NULL_BLOCK)

    def num_growable(
        self, tables: Sequence[Sequence[int]], next_position: int, keep_windowed_free: int = 0
    ) -> int:
        """Blocks of positions every group can add to `tables` now (after giving back
        what fell out of its windows at `next_position`), leaving `keep_windowed_free`
        blocks free in each windowed group's pool."""
        growable = min(
            pool.num_free_blocks
            - (keep_windowed_free if group else 0)
            + self._num_out_of_window(group, tables[group], next_position)
            for group, pool in enumerate(self.group_pools)
        )
        return max(growable, 0)

    def grow_tables(self, tables: list[list[int]], num_blocks: int) -> None:
        """Append `num_blocks` fresh blocks to every group's table."""
        for pool, table in zip(self.group_pools, tables, strict=True):
            table.extend(pool.allocate() for _ in range(num_blocks))

    def num_out_of_window(self, tables: Sequence[Sequence[int]], next_position: int) -> int:
        """This pool's held blocks no query at `next_position` or later reads."""
        return self._num_out_of_window(0, tables[0], next_position)

    def _num_out_of_window(self, group: int, table: Sequence[int], next_position: int) -> int:
        first = self.layout.first_needed_block(group, next_position, self.block_size)
        return sum(1 for block in table[:first] if block != NULL_BLOCK)

    def release_out_of_window(self, tables: list[list[int]], next_position: int) -> None:
        """Give back the windowed groups' blocks that no query at `next_position` or later
        reads; their entries become NULL_BLOCK. Steps already queued may still read
        them: they run before any step that could write the blocks' next holder."""
        for group, (pool, table) in enumerate(zip(self.group_pools, tables, strict=True)):
            first = self.layout.first_needed_block(group, next_position, self.block_size)
            dropped = [b for b in table[:first] if b != NULL_BLOCK]
            if dropped:
                pool.release(dropped)
                table[:first] = [NULL_BLOCK] * first

    def publish_tables(self, tables: Sequence[Sequence[int]], index: int, block_hash: bytes) -> None:
        """Cache block `index` of every group that still holds it under `block_hash`."""
        for pool, table in zip(self.group_pools, tables, strict=True):
            if table[index] != NULL_BLOCK:
                pool.publish(table[index], block_hash)

    def release_tables(self, tables: Sequence[Sequence[int]]) -> None:
        for pool, table in zip(self.group_pools, tables, strict=True):
            pool.release([b for b in table if b != NULL_BLOCK])
