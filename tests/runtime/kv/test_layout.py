"""Layer groups by attention kind, and a row's tables over their pools."""

from runtime.kv.blocks import BlockPool
from runtime.kv.layout import NULL_BLOCK, SIZING_CHUNK, KVLayout
from runtime.scheduler import DEFAULT_SOLO_PREFILL_TOKENS

import attrs

GEMMA_1B = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))


def test_layers_group_by_kind_full_first():
    layout = KVLayout.for_layers(26, GEMMA_1B)
    assert layout.group_windows == (None, 512)
    assert layout.group_layers[0] == (5, 11, 17, 23) and len(layout.group_layers[1]) == 22
    assert layout.describe() == "4 full layers + 22 sliding-window (512) layers"
    plain = KVLayout.for_layers(3)
    assert plain.group_windows == (None,) and plain.group_of_layer == (0, 0, 0)
    assert not plain.is_windowed and layout.is_windowed


def test_a_windowed_group_holds_the_window_and_a_chunk_at_most():
    layout = KVLayout.for_layers(26, GEMMA_1B)
    assert layout.row_blocks(0, 8000, 16) == 500
    assert layout.row_blocks(1, 8000, 16, max_chunk=256) == -(-(511 + 256) // 16) + 1 == 49
    assert layout.row_blocks(1, 100, 16) == 7  # a short row: just its blocks
    assert SIZING_CHUNK == DEFAULT_SOLO_PREFILL_TOKENS  # pools sized for the policy's chunks
    # A query at position 600 reads keys 89..600: block 5 (80-95) on.
    assert layout.first_needed_block(1, 600, 16) == 5 and layout.first_needed_block(0, 600, 16) == 0
    assert layout.max_row_tokens(10, 16) == 160
    every_layer_slides = KVLayout.for_layers(2, (4, 4))
    assert every_layer_slides.max_row_tokens(2, 16) > 10**9  # rows stop growing
    # A query reads 4 keys, in 2 blocks when they straddle a block's edge: a pool of one
    # block cannot hold a row past 16 tokens.
    assert every_layer_slides.max_row_tokens(1, 16) == 16
    # A window of 4 in blocks of 4: a decoding query's 4 keys span 2 blocks at most, so a
    # pool of 2 holds a row however long it grows.
    assert every_layer_slides.max_row_tokens(2, 4) > 10**9
    # Two windows: group 0's (the narrower) decides; the wider group's pool never binds.
    assert KVLayout.for_layers(2, (8, 4)).max_row_tokens(2, 4) > 10**9


def test_a_rows_windowed_blocks_go_back_to_their_own_pool():
    layout = attrs.evolve(KVLayout.for_layers(4, (8, None, 8, None)), group_num_blocks=(20, 6))
    pool = BlockPool(20, 4, layout=layout)
    assert [p.num_blocks for p in pool.group_pools] == [20, 6]
    tables = pool.new_tables()
    pool.grow_tables(tables, 5)  # 20 positions
    assert pool.num_free_blocks == 15 and pool.group_pools[1].num_free_blocks == 1
    assert pool.num_growable(tables, 20) == 1 + 3  # the window from 20 on frees blocks 0-2
    pool.release_out_of_window(tables, 20)  # the next query, at 20, reads 13..20
    assert tables[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in tables[0]
    assert pool.group_pools[1].num_free_blocks == 4 and pool.num_free_blocks == 15
    pool.check()
    pool.release_tables(tables)
    assert pool.num_free_blocks == 20 and pool.group_pools[1].num_free_blocks == 6
    pool.check()


def test_a_windowed_row_holds_exactly_the_blocks_its_worst_placed_chunk_spans():
    """A chunk of 8 at position s reads keys s - 8 .. s + 7 with a window of 9: 16
    positions, which span 5 blocks of 4 at worst (s = 9: keys 1-16), never 6."""
    layout = KVLayout.for_layers(1, (9,))
    spans = [
        (s + 7) // 4 - layout.first_needed_block(0, s, 4) + 1 for s in range(0, 64)
    ]
    assert max(spans) == layout.row_blocks(0, 10**6, 4, max_chunk=8) == 5
    assert layout.first_needed_block(0, 0, 4) == 0 and layout.first_needed_block(0, 12, 4) == 1


def test_a_query_inside_the_first_window_still_needs_block_0_at_block_size_1():
    """Every block before the window's first key goes back; block 0 holds key 0, which a
    query at 5 with a window of 9 still reads."""
    layout = KVLayout.for_layers(1, (9,))
    assert [layout.first_needed_block(0, q, 1) for q in (0, 5, 8, 9, 12)] == [0, 0, 0, 1, 4]


def test_blocks_a_row_gave_back_from_its_window_no_longer_count_as_held():
    """With every layer windowed, group 0's own table gets NULL_BLOCK entries: admission
    and growth must count only the blocks still held, or they promise blocks there are not."""
    layout = attrs.evolve(KVLayout.for_layers(2, (8, 8)), group_num_blocks=(10,))
    pool = BlockPool(10, 4, layout=layout)
    tables = pool.new_tables()
    pool.grow_tables(tables, 6)  # 24 positions
    pool.release_out_of_window(tables, 24)  # the next query, at 24, reads 17..24
    assert tables[0][:4] == [NULL_BLOCK] * 4
    assert pool.num_held(tables) == 2 == pool.num_used_blocks
