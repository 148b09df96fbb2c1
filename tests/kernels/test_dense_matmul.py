"""kernels/dense_matmul.py and the C++ kernel under it, against mlx's own matmul."""

from runtime.checkpoint import load_model

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kernels import dense_matmul as dm
from kernels.cpu_extension import cpu_extension
from tests.kernels.fresh_python import last_line
from tests.kernels.test_quantized_matmul import needs_kernels, run_with_isa_cap
from tests.kernels.test_quantized_models import FAMILIES, SHAPE, greedy, kernels_off, mlx_lm_greedy

__all__ = ["kernels_off"]  # a fixture, imported for the test below


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "n"), [(64, 8), (37, 7), (1000, 33), (2816, 5)])
def test_the_kernel_matches_matmul_and_really_runs(rows, k, n):
    x = mx.random.normal((rows, k), key=mx.random.key(rows))
    w = mx.random.normal((n, k), key=mx.random.key(k))
    ext = cpu_extension()
    before = ext.num_dense_calls()
    got = dm.dense_matmul(x, w)
    mx.eval(got)
    assert ext.num_dense_calls() == before + 1
    assert got.shape == (rows, n)
    assert mx.allclose(got, x @ w.T, rtol=1e-4, atol=1e-4).item()


@needs_kernels
def test_more_rows_than_the_kernel_takes_go_to_the_sgemm():
    ext = cpu_extension()
    w = mx.random.normal((16, 32))
    x = mx.random.normal((dm.MOST_ROWS + 1, 32))
    before = ext.num_dense_calls()
    mx.eval(dm.dense_matmul(x, w))
    assert ext.num_dense_calls() == before
    batched = mx.random.normal((1, 3, 32))  # [B, T, K] as the models call it: 3 rows
    assert mx.allclose(dm.dense_matmul(batched, w), batched @ w.T, rtol=1e-4, atol=1e-4).item()
    assert ext.num_dense_calls() == before + 1
    mx.eval(dm.dense_matmul(x[None], w))  # [1, T, K]: T rows, not one
    assert ext.num_dense_calls() == before + 1
    half = x.astype(mx.float16)  # another dtype: mlx's matmul
    assert dm.dense_matmul(half[:2], w.astype(mx.float16)).dtype == mx.float16
    assert ext.num_dense_calls() == before + 1


@needs_kernels
def test_kernel_layers_keep_nn_layers_parameters_and_results():
    linear = nn.Linear(40, 24, bias=True)
    adopted = dm.KernelLinear.adopt(linear)
    assert set(adopted.parameters()) == {"weight", "bias"}
    x = mx.random.normal((2, 40))
    assert mx.allclose(adopted(x), linear(x), rtol=1e-5, atol=1e-5).item()
    embedding = nn.Embedding(50, 40)
    head = dm.KernelEmbedding.adopt(embedding)
    assert mx.allclose(head.as_linear(x), embedding.as_linear(x), rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(head(mx.array([3, 7])), embedding(mx.array([3, 7]))).item()


@needs_kernels
def test_odd_shapes_and_an_empty_batch_do_not_crash():
    ext = cpu_extension()
    assert ext.dense_matmul(mx.zeros((0, 8)), mx.ones((3, 8))).shape == (0, 3)
    with pytest.raises(ValueError):
        ext.dense_matmul(mx.zeros((2, 8)), mx.ones((3, 9)))


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_checkpoints_run_through_the_panel_kernel_with_mlx_lm_parity(make_checkpoint, family):
    path = make_checkpoint(family, **SHAPE, **FAMILIES[family])
    lines = []
    loaded = load_model(path, on_progress=lines.append)
    leaves = [m for _, m in nn.utils.tree_flatten(loaded.model.leaf_modules(), is_leaf=nn.Module.is_module)]
    assert any(isinstance(m, dm.PanelLinear) for m in leaves)
    assert not any(isinstance(m, dm.KernelLinear) for m in leaves)  # every one packed
    assert "linear float32 (cadence panel kernel)" in next(x for x in lines if x.startswith("weights:"))
    before = cpu_extension().num_panel_calls()
    assert greedy(loaded) == mlx_lm_greedy(path)
    assert cpu_extension().num_panel_calls() > before  # prefill and decode steps ran it


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 16, 33, 200])
@pytest.mark.parametrize(("k", "n"), [(64, 32), (37, 7), (300, 33), (1000, 65)])
def test_the_panel_kernel_matches_matmul_and_really_runs(rows, k, n):
    """Every tile height (12 rows a tile with AVX-512), a partial last panel, K past one
    256-deep pass, as the models call it ([1, T, K])."""
    x = mx.random.normal((1, rows, k), key=mx.random.key(rows))
    linear = nn.Linear(k, n, bias=True)
    panel = dm.PanelLinear.adopt(dm.KernelLinear.adopt(linear))
    assert panel.weight.shape == (-(-n // 32), k, 32)
    ext = cpu_extension()
    before = ext.num_panel_calls()
    got = panel(x)
    mx.eval(got)
    assert ext.num_panel_calls() == before + 1
    assert got.shape == (1, rows, n)
    assert mx.allclose(got, linear(x), rtol=1e-4, atol=1e-4).item()


@needs_kernels
def test_the_panel_kernel_refuses_a_weight_that_is_not_its_panels():
    ext = cpu_extension()
    packed = dm.pack_panels(mx.ones((40, 8)))  # 2 panels
    assert ext.panel_matmul(mx.zeros((0, 8)), packed, 40).shape == (0, 40)
    empty_sum = ext.panel_matmul(mx.ones((3, 0)), dm.pack_panels(mx.ones((40, 0))), 40)
    assert mx.array_equal(empty_sum, mx.zeros((3, 40))).item()  # K = 0: zeros, not garbage
    for bad in ((mx.zeros((2, 9)), packed, 40), (mx.zeros((2, 8)), packed, 65), (mx.zeros((2, 8)), packed, 31),
                (mx.zeros((2, 8)), mx.ones((2, 8, 16)), 40)):
        with pytest.raises(ValueError):
            ext.panel_matmul(*bad)


def panels_by_numpy(w: mx.array) -> np.ndarray:
    """The panel layout, spelled out: column n at panel n // 32, lane n % 32, zeros past N."""
    rows = np.asarray(w.astype(mx.float32))
    n, k = rows.shape
    num_panels = -(-n // 32)
    padded = np.pad(rows, [(0, num_panels * 32 - n), (0, 0)])
    return padded.reshape(num_panels, 32, k).transpose(0, 2, 1)


@needs_kernels
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "shape", [(40, 8), (33, 200), (64, 129), (1, 3), (32, 1), (0, 5), (40, 0), (300, 70)]
)
def test_the_extension_packs_the_panels_the_kernel_reads(dtype, shape):
    """Ragged last panels and a K that is no whole number of the packing's 64-k blocks;
    each panel's lanes hold the values as stored (16 bits kept, not widened)."""
    w = (mx.random.normal(shape, key=mx.random.key(sum(shape))) * 100).astype(dtype)
    packed = dm.pack_panels(w)
    assert packed.dtype == dtype
    assert np.array_equal(np.asarray(packed.astype(mx.float32)), panels_by_numpy(w))


@needs_kernels
def test_packing_reads_a_view_as_its_values_and_refuses_what_is_no_weight():
    ext = cpu_extension()
    whole = mx.random.normal((100, 64))
    for view in (whole.T, whole[3:90:2], whole[:, 5:50]):
        assert np.array_equal(np.asarray(ext.pack_panels(view)), panels_by_numpy(view))
    for bad in (mx.zeros((2, 3, 4)), mx.zeros((8,)), mx.zeros((8, 8), dtype=mx.int32)):
        with pytest.raises(ValueError, match="pack_panels"):
            ext.pack_panels(bad)


PANEL_SCRIPT = """
import mlx.core as mx
import mlx.nn as nn
from kernels import dense_matmul as dm
from kernels.cpu_extension import cpu_extension
for n in (70, 90):  # a last panel of 6 columns (one partial tile), of 26 (a whole and a partial)
    for rows in (1, 2, 3, 5, 6, 7, 12, 40):
        linear = nn.Linear(300, n)
        x = mx.random.normal((rows, 300))
        got = dm.PanelLinear.adopt(dm.KernelLinear.adopt(linear))(x)
        assert mx.allclose(got, linear(x), rtol=1e-4, atol=1e-4).item(), (n, rows)
print(cpu_extension().isa())
"""


@needs_kernels
@pytest.mark.parametrize("cap", ["baseline", "avx2"])
def test_every_instruction_set_of_the_panel_kernel_matches_matmul(cap):
    """Tiles of 2 rows x 4 vectors of 8 lanes (the whole panel) up to 3 rows there, and of 6 x
    2 (half a panel) past them, against 12 x 2 of 16 with AVX-512 (the whole panel)."""
    assert cap in run_with_isa_cap(PANEL_SCRIPT, cap)


ROWS_APART_SCRIPT = """
import mlx.core as mx
from kernels import dense_matmul as dm
from kernels.cpu_extension import cpu_extension
ext = cpu_extension()
for dtype in (mx.float32, mx.bfloat16):
    for k in (300, 600):  # K in one deep pass; in passes of 256 with a partial last one
        w = mx.random.normal((70, k)).astype(dtype)  # a partial last panel
        packed = dm.pack_panels(w)
        x = mx.random.normal((200, k))
        whole = ext.panel_matmul(x, packed, 70)
        assert mx.allclose(whole, x @ w.astype(mx.float32).T, rtol=1e-4, atol=1e-4).item()
        for rows in (1, 2, 3, 5, 6, 16, 32, 33, 48, 199):  # decode tiles, prefill tiles, both sides
            part = ext.panel_matmul(x[-rows:], packed, 70)
            assert mx.array_equal(part, whole[-rows:]).item(), (dtype, k, rows)
print(ext.isa())
"""


@needs_kernels
@pytest.mark.parametrize("cap", [None, "baseline", "avx2"])
def test_a_rows_panel_result_is_the_same_bits_whatever_rows_run_beside_it(cap):
    """Batch invariance: a request's logits must not depend on the step it rode in, or
    greedy tokens alone and in a batch part. Up to 3 rows and past them (AVX2, baseline)
    use different register tiles, so both must sum each output over k in the same passes."""
    env = {} if cap is None else {"CADENCE_CPU_ISA": cap}
    isa = last_line(ROWS_APART_SCRIPT, env, timeout=600)
    assert cap is None or cap in isa


ROW_SCRIPT = """
import mlx.core as mx
from kernels import dense_matmul as dm
from kernels.cpu_extension import cpu_extension
before = cpu_extension().num_dense_calls()
for dtype in (mx.float32, mx.bfloat16):
    w = mx.random.normal((70, 301)).astype(dtype)  # 4-row blocks and 2 more; K past 8-lane vectors
    for rows in range(1, dm.MOST_ROWS + 1):
        x = mx.random.normal((rows, 301))
        got = dm.dense_matmul(x, w)
        assert mx.allclose(got, x @ w.astype(mx.float32).T, rtol=1e-4, atol=1e-4).item(), (dtype, rows)
assert cpu_extension().num_dense_calls() == before + 2 * dm.MOST_ROWS
print(cpu_extension().isa())
"""


@needs_kernels
@pytest.mark.parametrize("cap", ["baseline", "avx2"])
def test_every_instruction_set_of_the_row_kernel_matches_matmul(cap):
    """Blocks of 4 weight rows x 3 rows of x there, against 4 x 4 with AVX-512: every
    count of rows, so every last block's height."""
    assert cap in run_with_isa_cap(ROW_SCRIPT, cap)


def test_without_the_extension_float32_layers_stay_mlx_layers(make_checkpoint, kernels_off):
    loaded = load_model(make_checkpoint("llama", **SHAPE))
    leaves = [m for _, m in nn.utils.tree_flatten(loaded.model.leaf_modules(), is_leaf=nn.Module.is_module)]
    assert not any(isinstance(m, (dm.KernelLinear, dm.KernelEmbedding)) for m in leaves)


@needs_kernels
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_kernel_takes_up_to_most_rows_and_16_bit_weights_as_stored(dtype):
    ext = cpu_extension()
    w = mx.random.normal((24, 40), key=mx.random.key(1)).astype(dtype)
    x = mx.random.normal((1, dm.MOST_ROWS, 40), key=mx.random.key(2))  # [B, T, K], T at the limit
    before = ext.num_dense_calls()
    got = dm.dense_matmul(x, w)
    mx.eval(got)
    assert ext.num_dense_calls() == before + 1
    assert got.dtype == mx.float32
    assert mx.allclose(got, x @ w.astype(mx.float32).T, rtol=1e-4, atol=1e-4).item()


@needs_kernels
def test_off_the_cpu_the_kernel_is_not_used(monkeypatch):
    assert dm.uses_dense_kernel(1) and not dm.uses_dense_kernel(0)
    monkeypatch.setattr(dm.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not dm.uses_dense_kernel(1)


@needs_kernels
def test_16_bit_layers_compute_in_float32_with_a_float32_bias():
    linear = nn.Linear(40, 24, bias=True)
    linear.update({"weight": linear.weight.astype(mx.float16), "bias": linear.bias.astype(mx.float16)})
    adopted = dm.KernelLinear.adopt(linear)
    assert adopted.weight.dtype == mx.float16 and adopted.bias.dtype == mx.float32
    x = mx.random.normal((2, 40))
    assert adopted(x).dtype == mx.float32
    embedding = nn.Embedding(50, 40)
    embedding.weight = embedding.weight.astype(mx.bfloat16)
    rows = dm.KernelEmbedding.adopt(embedding)(mx.array([3, 7]))
    assert rows.dtype == mx.float32
    assert mx.array_equal(rows, embedding.weight[mx.array([3, 7])].astype(mx.float32)).item()
