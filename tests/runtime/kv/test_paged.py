"""The paged storage's own checks, block-table cache and sizing (runtime/kv/paged.py)."""

from runtime.kv import paged
from runtime.kv.base import RowSpan, attend_stacked_by_parts
from runtime.kv.paged import PagedKV
from runtime.models.layers import RoPE

import mlx.core as mx
import numpy as np
import pytest

from kernels.cpu_extension import cpu_extension
from kernels.dense_matmul import pack_panels
from kernels.fused_blocks import NormedLayers


def windowed_kv():
    """2 layers: layer 0 full (group 0), layer 1 with a window of 4 (group 1)."""
    return PagedKV(2, 2, 16, 2, num_blocks=16, block_size=4, layer_windows=(None, 4), max_rows=1)


def test_a_row_whose_tables_cannot_hold_its_positions_is_refused():
    kv = PagedKV(2, 1, 8, 1, num_blocks=8, block_size=4)
    kv.forward([RowSpan(0, 3, 5, (0, 1))], 0)  # 8 positions in 2 blocks: exactly full
    with pytest.raises(ValueError, match="cannot hold 9 positions"):
        kv.forward([RowSpan(0, 3, 6, (0, 1))], 0)
    with pytest.raises(ValueError, match="block tables for 1 layer groups"):
        kv.forward([RowSpan(0, 0, 1, (0,), ((1,),))], 0)
    windowed = windowed_kv()
    windowed.forward([RowSpan(0, 0, 8, (0, 1), ((0, 1),))], 0)
    with pytest.raises(ValueError, match="block tables for 2 layer groups"):
        windowed.forward([RowSpan(0, 0, 8, (0, 1))], 0)  # the windowed group's table is missing
    with pytest.raises(ValueError, match="cannot hold 8 positions"):
        windowed.forward([RowSpan(0, 0, 8, (0, 1), ((0,),))], 0)  # its table is one block short


def test_block_tables_are_rebuilt_only_when_a_row_gains_a_block_or_the_pool_moves():
    kv = PagedKV(2, 1, 8, 1, num_blocks=8, block_size=4)
    rows = [RowSpan(0, 4, 1, (2, 3)), RowSpan(1, 0, 3, (5,))]
    first = kv.forward(rows, 0).step.tables
    assert kv.num_table_builds == 1 and first.tolist() == [[2, 3], [5, 5]]  # pads: its own last
    decoded = [RowSpan(0, 5, 1, (2, 3)), RowSpan(1, 3, 1, (5,))]  # same blocks, later positions
    assert kv.forward(decoded, 0).step.tables is first and kv.num_table_builds == 1
    grown = [RowSpan(0, 6, 1, (2, 3)), RowSpan(1, 4, 1, (5, 7))]
    assert kv.forward(grown, 0).step.tables.tolist() == [[2, 3], [5, 7]]
    assert kv.num_table_builds == 2
    # The pool moved row 0's blocks (same count, new ids): a new epoch, a new table.
    moved = [RowSpan(0, 7, 1, (6, 1)), RowSpan(1, 5, 1, (5, 7))]
    assert kv.forward(moved, 1).step.tables.tolist() == [[6, 1], [5, 7]]
    assert kv.num_table_builds == 3


def test_a_steps_shape_has_the_query_heads_per_kv_head():
    """The attention path is chosen on it (the native kernel takes at most 64)."""
    kv = PagedKV(2, 2, 8, 3, num_blocks=8, block_size=4)  # 6 query heads over 2 KV heads
    step = kv.forward([RowSpan(0, 0, 3, (1,))], 0).step
    assert (step.num_kv_heads, step.num_queries_per_kv) == (2, 3)


def test_row_bytes_counts_what_a_row_holds_in_each_group():
    layer_block = PagedKV.bytes_per_block(1, 2, 16, 4, mx.float32)
    assert layer_block == 2 * 2 * 4 * 16 * 4
    assert PagedKV.bytes_per_block(3, 2, 16, 4, mx.float32) == 3 * layer_block  # a group's block
    plain = PagedKV(3, 2, 16, 2, num_blocks=16, block_size=4)
    assert plain.row_bytes(9) == (3 * 3 * layer_block,) * 2  # 3 blocks (one partial) x 3 layers
    windowed = PagedKV(3, 2, 16, 2, num_blocks=16, block_size=4, layer_windows=(4, None, 4))
    full = -(-2000 // 4) * 3 * layer_block
    window_blocks = windowed.layout.row_blocks(1, 2000, 4)
    assert window_blocks < 500
    assert windowed.row_bytes(2000) == ((500 * 1 + window_blocks * 2) * layer_block, full)


def test_attend_stacked_in_a_windowed_layer_attends_over_its_window():
    """The one-op path (rotation, write, attention) of a windowed layer equals the parts,
    and differs from the same layer's full attention."""
    rows = [RowSpan(0, 0, 12, (0, 1, 2), ((0, 1, 2),))]
    qkv = mx.array(np.random.default_rng(0).standard_normal((12, (4 + 2 * 2) * 16)).astype(np.float32))
    rope = RoPE(16, 10000.0, None)
    outs = []
    for layer in (1, 0):
        one_op = windowed_kv().forward(rows, 0)
        by_parts = windowed_kv().forward(rows, 0)
        out = one_op.attend_stacked(layer, qkv, rope, 4, 2, 0.25)
        want = attend_stacked_by_parts(by_parts, layer, qkv, rope, 4, 2, 0.25)
        assert mx.allclose(out, want, atol=1e-5).item(), layer
        outs.append(out)
    assert not mx.allclose(outs[0], outs[1], atol=1e-3).item()  # the window made a difference


def test_a_row_with_fewer_blocks_than_the_widest_is_padded_with_its_own_last_block():
    kv = PagedKV(2, 1, 8, 1, num_blocks=8, block_size=4)
    rows = [RowSpan(0, 9, 1, (4, 1, 6)), RowSpan(1, 5, 1, (2, 7)), RowSpan(2, 0, 1, (3,))]
    assert kv.forward(rows, 0).step.tables.tolist() == [[4, 1, 6], [2, 7, 7], [3, 3, 3]]


def test_block_tables_follow_the_rows_when_the_same_rows_come_in_another_order():
    """A prompt that finishes its prefill moves among the decoding rows: no block moved
    (same epoch, same counts), yet each row must still read its own blocks."""
    kv = PagedKV(2, 1, 8, 1, num_blocks=8, block_size=4)
    a, b = (2, 3), (5, 6)
    kv.forward([RowSpan(0, 5, 1, a), RowSpan(1, 4, 3, b)], 0)
    swapped = kv.forward([RowSpan(1, 7, 1, b), RowSpan(0, 6, 1, a)], 0).step.tables
    assert swapped.tolist() == [[5, 6], [2, 3]]


@pytest.mark.parametrize(("forced", "runs_native"), [("", True), ("gather", False), ("fast", False)])
def test_attend_stacked_runs_the_native_op_only_where_the_step_took_the_native_path(
    monkeypatch, forced, runs_native
):
    """The one-op path is the native kernel's: a step dispatched elsewhere (forced here;
    on Metal or CUDA always) must go by parts, which the CPU tests could not tell apart;
    the native path must not (by parts it runs the native attention too, only slower)."""
    ext = cpu_extension()
    if ext is None:
        pytest.skip("the C++ kernels were not built here")
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", forced)
    by_parts = []

    def spy(*args):
        by_parts.append(args)
        return attend_stacked_by_parts(*args)

    monkeypatch.setattr(paged, "attend_stacked_by_parts", spy)
    qkv = mx.array(np.random.default_rng(1).standard_normal((5, (4 + 2 * 2) * 16)).astype(np.float32))
    view = PagedKV(1, 2, 16, 2, num_blocks=8, block_size=4).forward([RowSpan(0, 0, 5, (0, 1))], 0)
    before = ext.num_attention_calls()
    mx.eval(view.attend_stacked(0, qkv, RoPE(16, 10000.0, None), 4, 2, 0.25))
    assert view.path == (forced or "native")
    assert (ext.num_attention_calls() > before) == runs_native
    assert bool(by_parts) != runs_native


@pytest.mark.parametrize(("forced", "runs_native"), [("", True), ("gather", False), ("fast", False)])
def test_a_residual_attention_block_is_one_op_only_where_the_step_took_the_native_path(
    monkeypatch, forced, runs_native
):
    """Elsewhere (forced here; on Metal or CUDA always) it is None, and the model runs the
    block by parts on the step's own path."""
    ext = cpu_extension()
    if ext is None:
        pytest.skip("the C++ kernels were not built here")
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", forced)
    rng = np.random.default_rng(2)

    def layer(n, k):
        weight = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.2)
        return (pack_panels(weight), mx.zeros((0,)), n)

    block = NormedLayers(mx.ones((64,)), 1e-6, layer((4 + 2 * 2) * 16, 64), layer(64, 4 * 16))
    x = mx.array(rng.standard_normal((1, 5, 64)).astype(np.float32))
    view = PagedKV(1, 2, 16, 2, num_blocks=8, block_size=4).forward([RowSpan(0, 0, 5, (0, 1))], 0)
    before = ext.num_block_calls()
    out = view.residual_attention(0, x, block, RoPE(16, 10000.0, None), 4, 2, 0.25)
    assert view.path == (forced or "native")
    assert (out is not None) == runs_native
    if out is not None:
        mx.eval(out)
        assert out.shape == x.shape
    assert (ext.num_block_calls() > before) == runs_native


@pytest.mark.parametrize("path", ["gather", "fast"])
def test_attend_shared_reads_the_layer_it_names_and_stores_nothing(monkeypatch, path):
    """Gemma 4's KV-shared layers: the mx paths read the source layer's pool as it stands
    (what was stored this step included) and write none; the native op, which cannot
    attend without writing, is handed the same K/V again."""
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    kv = PagedKV(2, 1, 8, 2, num_blocks=8, block_size=4)
    step = kv.forward([RowSpan(0, 0, 6, (0, 1))], 0)
    q, k, v = (mx.random.normal((6, n, 8), key=mx.random.key(n)) for n in (2, 1, 1))
    want = step.attend(0, q, k, v, 0.5)
    pools = [mx.array(p) for p in (*kv.keys, *kv.values)]
    got = step.attend_shared(0, q, mx.zeros_like(k), mx.zeros_like(v), 0.5)  # not what was stored
    assert mx.allclose(got, want, atol=1e-6).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(pools, (*kv.keys, *kv.values), strict=True))
