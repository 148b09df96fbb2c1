"""kernels/expert_matmul.py and its C++ op (kernels/cpu/expert_ops.cpp): each (row,
expert) pair's product, against a per-pair reference, through the kernel and mlx's gathers."""

import mlx.core as mx
import numpy as np
import pytest

from kernels import cpu_extension as loader
from kernels import expert_matmul
from kernels.expert_matmul import SORT_FROM_PAIRS, dense_expert_matmul, quantized_expert_matmul
from tests.kernels.test_quantized_matmul import needs_kernels

E, N, K = 6, 40, 128


def pairs(num_rows, k, seed=0):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((num_rows, K)).astype(np.float32))
    experts = rng.integers(0, E, (num_rows, k)).astype(np.uint32)
    experts[0] = 2  # one row choosing the same expert k times
    return x, mx.array(experts)


def reference(x, experts, weight):
    """out[r, j] = x[r] @ weight[experts[r, j]].T, pair by pair in float64."""
    x, ids, w = np.array(x, np.float64), np.array(experts), np.array(weight.astype(mx.float32), np.float64)
    return np.stack([[w[e] @ x[r] for e in ids[r]] for r in range(len(ids))])


@pytest.mark.parametrize("path", ["cadence-kernel", "mlx-gather"])
@pytest.mark.parametrize("num_rows", [1, 5, 40])  # 40 x 2 pairs: mlx's sorted path
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_dense_experts_match_each_pairs_product(monkeypatch, path, num_rows, dtype):
    if path == "mlx-gather":
        monkeypatch.setitem(loader._state, "module", None)
    elif loader.cpu_extension() is None:
        pytest.skip("the C++ kernels were not built here")
    x, experts = pairs(num_rows, 2)
    assert (experts.size >= SORT_FROM_PAIRS) == (num_rows == 40)
    weight = (mx.random.normal((E, N, K), key=mx.random.key(1)) * 0.1).astype(dtype)
    got = dense_expert_matmul(x, experts, weight)
    assert got.shape == (num_rows, 2, N) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), reference(x, experts, weight), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["cadence-kernel", "mlx-gather"])
@pytest.mark.parametrize("num_rows", [1, 3, 9, 40])  # 9 x 3 pairs: experts with 8+ rows (panel tiles)
@pytest.mark.parametrize(("bits", "group_size"), [(4, 64), (8, 32), (4, 128)])
def test_quantized_experts_match_each_pairs_product(monkeypatch, path, num_rows, bits, group_size):
    if path == "mlx-gather":
        monkeypatch.setitem(loader._state, "module", None)
    elif loader.cpu_extension() is None:
        pytest.skip("the C++ kernels were not built here")
    x, experts = pairs(num_rows, 3, seed=num_rows)
    weight = mx.random.normal((E, N, K), key=mx.random.key(2)) * 0.1
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    before = loader.cpu_extension().num_expert_calls() if path == "cadence-kernel" else 0
    got = quantized_expert_matmul(x, experts, w, scales, biases, group_size, bits)
    dequantized = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    np.testing.assert_allclose(np.array(got), reference(x, experts, dequantized), rtol=1e-3, atol=1e-3)
    if path == "cadence-kernel":
        assert loader.cpu_extension().num_expert_calls() == before + 1


@needs_kernels
def test_a_pair_whose_id_is_no_expert_gets_zeros_and_the_others_their_products():
    ext = loader.cpu_extension()
    x, experts = pairs(4, 2)
    ids = np.array(experts)
    ids[1, 1] = E  # one past the last expert
    weight = mx.random.normal((E, N, K), key=mx.random.key(3))
    got = np.array(ext.dense_expert_matmul(x, mx.array(ids), weight))
    assert not got[1, 1].any()
    ids[1, 1] = ids[1, 0]
    np.testing.assert_allclose(got[[0, 2, 3]], reference(x, mx.array(ids), weight)[[0, 2, 3]], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(got[1, 0], reference(x, mx.array(ids), weight)[1, 0], rtol=1e-4, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ext, x, ids, w: ext.dense_expert_matmul(x.astype(mx.float16), ids, w), "x must be a 2-D float32"),
        (lambda ext, x, ids, w: ext.dense_expert_matmul(x, ids.astype(mx.int32), w), "experts must be a 2-D uint32"),
        (lambda ext, x, ids, w: ext.dense_expert_matmul(x, ids[:2], w), "with x's rows"),
        (lambda ext, x, ids, w: ext.dense_expert_matmul(x, ids, w[0]), "w must be 3-D"),
        (lambda ext, x, ids, w: ext.dense_expert_matmul(x, ids, w[..., :64]), "for x's K"),
        (lambda ext, x, ids, w: ext.expert_matmul(x, ids, *mx.quantize(w, 64, 4), 64, 3), "bits must be 4 or 8"),
        (lambda ext, x, ids, w: ext.expert_matmul(x, ids, *mx.quantize(w, 64, 4), 16, 4), "group_size must be"),
        (lambda ext, x, ids, w: ext.expert_matmul(x, ids, *mx.quantize(w, 64, 4), 64, 8), "w must be uint32"),
        (lambda ext, x, ids, w: ext.expert_matmul(x, ids, *mx.quantize(w, 64, 4), 32, 4), "scales and biases"),
    ],
    ids=["x-dtype", "ids-dtype", "ids-rows", "w-2d", "w-k", "bits", "group", "w-words", "scales"],
)
def test_operands_that_do_not_fit_are_refused_when_the_op_is_built(call, message):
    x, experts = pairs(4, 2)
    with pytest.raises(ValueError, match=message):
        call(loader.cpu_extension(), x, experts, mx.random.normal((E, N, K)))


@needs_kernels
def test_16_bit_scales_as_stored_run_through_mlxs_gather():
    """`--keep-dtype` leaves a checkpoint's bfloat16 scales: the kernel reads float32 ones."""
    x, experts = pairs(5, 2)
    weight = mx.random.normal((E, N, K), key=mx.random.key(4)) * 0.1
    w, scales, biases = mx.quantize(weight.astype(mx.bfloat16), group_size=64, bits=4)
    assert scales.dtype == mx.bfloat16
    before = loader.cpu_extension().num_expert_calls()
    got = quantized_expert_matmul(x, experts, w, scales, biases, 64, 4)
    assert loader.cpu_extension().num_expert_calls() == before
    dequantized = mx.dequantize(w, scales, biases, group_size=64, bits=4)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), reference(x, experts, dequantized), rtol=2e-2, atol=2e-2)


def test_off_the_cpu_device_mlxs_gathers_run_and_the_kernel_is_not_asked_for(monkeypatch):
    """On a GPU (Metal) the arrays are not the CPU kernel's: both ops take mlx's gathers."""
    x, experts = pairs(5, 2)
    weight = mx.random.normal((E, N, K), key=mx.random.key(7)) * 0.1
    w, scales, biases = mx.quantize(weight, group_size=64, bits=4)
    dequantized = mx.dequantize(w, scales, biases, group_size=64, bits=4)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(
        expert_matmul, "cpu_extension", lambda: pytest.fail("the CPU kernel was asked for")
    )
    got = dense_expert_matmul(x, experts, weight)
    np.testing.assert_allclose(np.array(got), reference(x, experts, weight), rtol=1e-4, atol=1e-4)
    got = quantized_expert_matmul(x, experts, w, scales, biases, 64, 4)
    np.testing.assert_allclose(np.array(got), reference(x, experts, dequantized), rtol=1e-3, atol=1e-3)
