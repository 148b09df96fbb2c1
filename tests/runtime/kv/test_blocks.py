"""The block pool's invariants under random allocate / share / publish / release / evict."""

from runtime.errors import CapacityError
from runtime.kv.blocks import BlockPool, chain_hashes
from runtime.kv.layout import NULL_BLOCK, KVLayout

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule


class PoolMachine(RuleBasedStateMachine):
    """Holders own block lists, as requests do; the model is their refcounts."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=8, block_size=2, salt=b"test")
        self.holders: list[list[int]] = []
        self.next_hash = 0

    def _held(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for blocks in self.holders:
            for b in blocks:
                counts[b] = counts.get(b, 0) + 1
        return counts

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        blocks = []
        for _ in range(n):
            before = self.pool.epoch
            had_free = bool(self.pool.free)
            try:
                blocks.append(self.pool.allocate())
            except CapacityError:
                assert self.pool.num_free_blocks == 0
                break
            if not had_free:  # an eviction reuses a cached block: that is a move
                assert self.pool.epoch > before
        self.holders.append(blocks)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def publish(self, data):
        blocks = data.draw(st.sampled_from(self.holders))
        if blocks:
            block = data.draw(st.sampled_from(blocks))
            self.next_hash += 1
            self.pool.publish(block, self.next_hash.to_bytes(8, "big"))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def share_a_cached_prefix(self, data):
        """What admission does with a prefix hit."""
        hashes = list(self.pool.by_hash)
        if hashes:
            picked = data.draw(
                st.lists(st.sampled_from(hashes), min_size=1, max_size=3, unique=True)
            )
            hits = self.pool.match_prefix(picked)
            self.pool.take_cached_tables([hits], len(picked))
            self.holders.append(hits)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release(self, data):
        index = data.draw(st.integers(0, len(self.holders) - 1))
        before = self.pool.epoch
        self.pool.release(self.holders.pop(index))
        assert self.pool.epoch > before

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def rewind(self, data):
        """Drop a holder's tail blocks (a speculative append undone, or a preemption)."""
        blocks = data.draw(st.sampled_from(self.holders))
        keep = data.draw(st.integers(0, len(blocks)))
        before = self.pool.epoch
        self.pool.release(blocks[keep:])
        del blocks[keep:]
        assert self.pool.epoch > before

    @invariant()
    def refcounts_match_the_holders(self):
        self.pool.check()
        held = self._held()
        for block in range(self.pool.num_blocks):
            assert self.pool.refcount[block] == held.get(block, 0)
        # No leak: every block is held, free, or cached-free.
        assert self.pool.num_used_blocks == len(held)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_block_released_more_often_than_held_is_refused():
    pool = BlockPool(2, 4)
    block = pool.allocate()
    pool.release([block])
    with pytest.raises(ValueError):
        pool.release([block])


def test_eviction_is_least_recently_released_first_and_forgets_the_hash():
    pool = BlockPool(3, 2)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for block, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.publish(block, h)
    pool.release([b])
    pool.release([a])
    pool.release([c])
    assert pool.allocate() == b and pool.match_prefix([b"b"]) == []
    assert pool.match_prefix([b"a"]) == [a]


def test_chain_hashes_depend_on_every_earlier_token_and_the_salt():
    base = chain_hashes([1, 2, 3, 4, 5, 6, 7], 2, b"s")
    assert len(base) == 3  # full blocks only
    assert chain_hashes([9, 2, 3, 4, 5, 6], 2, b"s")[1] != base[1]  # an earlier token differs
    assert chain_hashes([1, 2, 3, 4, 5, 6], 2, b"other")[0] != base[0]
    # Extending a chain from its last hash gives the same hashes as hashing it whole.
    tail = chain_hashes([1, 2, 3, 4, 5, 6], 2, b"s", parent=base[0], start=2)
    assert tail == base[1:]


def test_every_token_of_a_block_is_in_its_hash():
    """Prompts that differ in any one token of a block never share its cached K/V."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    base = chain_hashes(tokens, 4, b"s")
    for position in range(len(tokens)):
        changed = tokens.copy()
        changed[position] = 99
        hashes = chain_hashes(changed, 4, b"s")
        block = position // 4
        assert hashes[:block] == base[:block] and hashes[block] != base[block], position


def test_a_cached_prefix_outlives_allocations_while_never_used_blocks_remain():
    pool = BlockPool(4, 2)
    a = pool.allocate()
    pool.publish(a, b"a")
    pool.release([a])
    fresh = [pool.allocate() for _ in range(3)]  # the three never used
    assert a not in fresh and pool.match_prefix([b"a"]) == [a]
    assert pool.allocate() == a and pool.match_prefix([b"a"]) == []  # only then evicted


def test_the_hit_rate_is_the_share_of_looked_up_blocks_found_cached():
    pool = BlockPool(4, 2)
    assert pool.hit_rate == 0.0  # nothing looked up yet
    a = pool.allocate()
    pool.publish(a, b"a")
    pool.release([a])
    hits = pool.match_prefix([b"a", b"b", b"c", b"d"])
    pool.take_cached_tables([hits], 4)
    assert hits == [a] and pool.hit_rate == 0.25


def test_publishing_skips_a_windowed_block_already_given_back():
    """With lookahead a window can move past a block before the step that computed it is
    reported done; its table entry is NULL_BLOCK then, which is no block to cache."""
    full_and_windowed = KVLayout.for_layers(2, (None, 4))
    layout = attrs.evolve(full_and_windowed, group_num_blocks=(8, 8))
    pool = BlockPool(8, 4, layout=layout)
    tables = pool.new_tables()
    pool.grow_tables(tables, 3)  # positions 0..11 in both groups
    pool.release_out_of_window(tables, 12)  # a query at 12 reads 9..12: block 2 only
    assert tables[1][:2] == [NULL_BLOCK, NULL_BLOCK] and tables[1][2] != NULL_BLOCK
    for index, block_hash in enumerate((b"h0", b"h1", b"h2")):
        pool.publish_tables(tables, index, block_hash)
    assert pool.by_hash == {b"h0": tables[0][0], b"h1": tables[0][1], b"h2": tables[0][2]}
    assert pool.group_pools[1].by_hash == {b"h2": tables[1][2]}
    pool.check()  # every group's pool


def cached_and_released(pool: BlockPool, hashes: list[bytes]) -> list[list[int]]:
    """The tables of a row of len(hashes) full blocks that published them all and left."""
    tables = pool.new_tables()
    pool.grow_tables(tables, len(hashes))
    for index, block_hash in enumerate(hashes):
        pool.publish_tables(tables, index, block_hash)
    pool.release_tables(tables)
    return tables


def test_a_prefix_is_a_hit_only_where_every_group_still_caches_its_window():
    full_and_windowed = KVLayout.for_layers(2, (None, 4))
    layout = attrs.evolve(full_and_windowed, group_num_blocks=(8, 2))
    pool = BlockPool(8, 4, layout=layout)
    hashes = chain_hashes(list(range(8)), 4, b"")
    tables = cached_and_released(pool, hashes)
    assert pool.match_tables(hashes[:1]) == [[tables[0][0]], [tables[1][0]]]
    windowed = pool.group_pools[1]
    windowed.allocate()  # evicts the windowed copy of block 0, the least recently released
    assert pool.match_tables(hashes[:1]) == [[], []]  # group 0 alone cannot serve it
    # Two blocks: a query at 8 reads 5..8, block 1 only, which the windowed pool still has.
    assert pool.match_tables(hashes) == [tables[0][:2], [NULL_BLOCK, tables[1][1]]]


def test_a_hit_in_a_pool_whose_every_layer_slides_holds_only_the_windows_blocks():
    """With no full group, group 0's own table starts with NULL_BLOCK entries."""
    pool = BlockPool(8, 4, layout=KVLayout.for_layers(1, (4,)))
    hashes = chain_hashes(list(range(12)), 4, b"")
    tables = cached_and_released(pool, hashes)
    hits = pool.match_tables(hashes)
    assert hits == [[NULL_BLOCK, NULL_BLOCK, tables[0][2]]]  # a query at 12 reads 9..12
    pool.take_cached_tables(hits, 3)
    pool.check()
    assert pool.refcount[tables[0][2]] == 1 and pool.num_used_blocks == 1
    assert pool.hit_rate == 1.0  # the whole prefix is skipped, window or not
    pool.release_tables(hits)
    pool.check()
    assert pool.num_used_blocks == 0


def test_each_windowed_group_is_matched_in_its_own_pool():
    """Two window sizes: two windowed groups, each with its own pool and block ids."""
    layout = attrs.evolve(KVLayout.for_layers(3, (None, 4, 8)), group_num_blocks=(8, 2, 8))
    pool = BlockPool(8, 4, layout=layout)
    hashes = chain_hashes(list(range(8)), 4, b"")
    tables = cached_and_released(pool, hashes)
    assert pool.match_tables(hashes[:1]) == [[tables[0][0]], [tables[1][0]], [tables[2][0]]]
    pool.group_pools[1].allocate()  # evicts window 4's copy of block 0; window 8's keeps it
    assert pool.match_tables(hashes[:1]) == [[], [], []]
    pool.check()


def test_a_windowed_pool_short_of_the_blocks_to_keep_free_lets_a_row_grow_by_none():
    """A prompt chunk leaves a windowed block free per running row: with fewer free than
    that, its row grows by no block (never by a negative count)."""
    layout = attrs.evolve(KVLayout.for_layers(2, (None, 4)), group_num_blocks=(8, 2))
    pool = BlockPool(8, 4, layout=layout)
    tables = pool.new_tables()
    pool.grow_tables(tables, 1)
    assert pool.num_growable(tables, 1) == 1  # the windowed pool's one free block
    assert pool.num_growable(tables, 1, keep_windowed_free=3) == 0


def test_only_a_windowed_group_0_has_blocks_out_of_the_window():
    """The policy counts group 0's blocks: a full group 0 keeps every one, whatever the
    windowed groups give back."""
    layout = attrs.evolve(KVLayout.for_layers(2, (None, 4)), group_num_blocks=(8, 8))
    pool = BlockPool(8, 4, layout=layout)
    tables = pool.new_tables()
    pool.grow_tables(tables, 3)
    assert pool.num_out_of_window(tables, 12) == 0  # the windowed group reads block 2 only
    sliding = BlockPool(8, 4, layout=KVLayout.for_layers(1, (4,)))
    tables = sliding.new_tables()
    sliding.grow_tables(tables, 3)
    assert sliding.num_out_of_window(tables, 12) == 2
    # Every layer slides, in two windows: group 0's own table counts, not the wider one's.
    two_windows = attrs.evolve(KVLayout.for_layers(2, (4, 8)), group_num_blocks=(8, 8))
    pool = BlockPool(8, 4, layout=two_windows)
    tables = pool.new_tables()
    pool.grow_tables(tables, 3)
    pool.release_out_of_window(tables, 12)  # window 4 reads block 2, window 8 blocks 1-2
    assert pool.num_out_of_window(tables, 12) == 0 and tables[1][1] != NULL_BLOCK
