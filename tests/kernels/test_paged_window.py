"""Sliding-window layers in paged attention: both paths against plain masked attention,
with the blocks that fell out of the window pointing at a block of NaNs (never read)."""

import attrs
import mlx.core as mx
import numpy as np
import pytest

from kernels import paged_attention as pa
from kernels import paged_attention_mx
from tests.kernels.test_paged_attention import ATTENTION_PATHS

BLOCK, D, HKV, NUM_BLOCKS = 4, 16, 2, 64
POISON = NUM_BLOCKS - 1  # dead entries point here; its K/V are NaN


def reference(q, k, v, query_pos, window):
    """q [H, D] at `query_pos`, k/v [Hkv, L, D] for positions 0..L-1 -> [H, D]."""
    group = q.shape[0] // k.shape[0]
    k, v = mx.repeat(k, group, axis=0), mx.repeat(v, group, axis=0)
    scores = (q[:, None, :] * 0.25 @ k.swapaxes(-1, -2))[:, 0]  # [H, L]
    key_pos = mx.arange(k.shape[1])
    seen = (key_pos <= query_pos) & (key_pos > query_pos - window)
    scores = mx.where(seen[None], scores, -mx.inf)
    return (mx.softmax(scores, axis=-1, precise=True)[:, None, :] @ v)[:, 0]


def windowed_step(starts, num_new, window, group, seed=0):
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(NUM_BLOCKS - 1))
    tables = []
    for s, n in zip(starts, num_new, strict=True):
        first_needed = max(0, s - window + 1) // BLOCK
        blocks = [int(free.pop()) for _ in range(-(-(s + n) // BLOCK))]
        tables.append([POISON if j < first_needed else b for j, b in enumerate(blocks)])
    table = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    step = pa.PagedStep(
        tables=mx.array(table), starts=tuple(starts), num_new=tuple(num_new), block_size=BLOCK,
        num_slots=NUM_BLOCKS * BLOCK, num_kv_heads=HKV, num_queries_per_kv=group, window=window,
    )
    shape = (HKV, NUM_BLOCKS, BLOCK, D)
    keys = rng.standard_normal(shape).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    keys[:, POISON] = values[:, POISON] = np.nan
    N = sum(num_new)
    q = mx.array(rng.standard_normal((N, HKV * group, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((N, HKV, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((N, HKV, D)).astype(np.float32))
    return step, tables, mx.array(keys.reshape(-1, D)), mx.array(values.reshape(-1, D)), q, k, v


SHAPES = {
    "decode past the window": ([5, 17, 0, 30], [1, 1, 1, 1]),
    "chunks straddling the window edge": ([3, 6, 13], [9, 5, 7]),
    "mixed": ([21, 0, 11], [1, 19, 1]),
    "a chunk longer than the window": ([2], [23]),
}


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_windowed_attention_matches_masked_attention_and_never_reads_dead_blocks(shape, group, path):
    window = 8
    starts, num_new = SHAPES[shape]
    step, tables, keys, values, q, k, v = windowed_step(starts, num_new, window, group)
    pools = ([keys], [values])
    out = pa.paged_attention(pools, 0, q, k, v, 0.25, step, path)
    pool_k = pools[0][0].reshape(HKV, NUM_BLOCKS * BLOCK, D)
    pool_v = pools[1][0].reshape(HKV, NUM_BLOCKS * BLOCK, D)
    assert mx.all(mx.isfinite(out)).item()
    lo = 0
    for table, s, n in zip(tables, starts, num_new, strict=True):
        slots = mx.array([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(s + n)], dtype=mx.int32)
        row_k = mx.nan_to_num(pool_k[:, slots], nan=1e4)  # dead positions: masked either way
        row_v = mx.nan_to_num(pool_v[:, slots], nan=1e4)
        for t in range(n):
            want = reference(q[lo + t], row_k, row_v, s + t, window)
            assert mx.allclose(out[lo + t], want, atol=1e-5).item(), (s, t)
        lo += n


def test_without_the_window_the_same_step_differs():
    step, _, keys, values, q, k, v = windowed_step([30], [1], 64, 1)  # window wider than the row
    full = pa.paged_attention(([keys], [values]), 0, q, k, v, 0.25, step, "fast")
    narrow = attrs.evolve(step, window=8)
    windowed = pa.paged_attention(([keys], [values]), 0, q, k, v, 0.25, narrow, "fast")
    assert not mx.allclose(full, windowed, atol=1e-3).item()


def test_block_columns_past_a_rows_table_stay_inside_it():
    """A windowed row starts its block columns late, so the batch's widest span runs past
    the table's width. mlx's gather does not check bounds: those columns must read the
    row's own last entry, never the next row's or memory past the table."""
    step, tables, *_ = windowed_step([21, 0, 11], [1, 19, 1], window=8, group=1)
    width = max(map(len, tables))
    group = paged_attention_mx._Group(step, rows=[0, 1, 2], token_lo=[0, 1, 20])
    first_block = [max(0, s - 8 + 1) // BLOCK for s in (21, 0, 11)]
    assert first_block[0] + group.num_blocks > width  # the case in question
    padded = np.array(step.tables)
    for r, first in enumerate(first_block):
        columns = np.minimum(first + np.arange(group.num_blocks), width - 1)
        assert np.array(group.table)[r].tolist() == padded[r, columns].tolist()
