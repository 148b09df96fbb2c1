"""kernels/norm_rope.py: the CPU primitives against mlx's own rms_norm and rope."""

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import norm_rope
from kernels.cpu_extension import cpu_extension
from tests.kernels.test_quantized_matmul import needs_kernels, run_with_isa_cap


def mlx_rope(x, positions, dims, base, scale, freqs=None):
    """mlx's rope (its CPU fallback), each token a batch row at its own offset."""
    out = mx.fast.rope(x[:, :, None, :], dims, traditional=False, base=base, scale=scale,
                       offset=positions, freqs=freqs)
    return out[:, :, 0, :]


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 5, 64), (3, 576), (7, 4, 67), (1, 1, 8)])
def test_rms_norm_matches_mlx_and_really_runs(shape):
    x = mx.random.normal(shape, key=mx.random.key(1)) * 3
    w = mx.random.normal(shape[-1:], key=mx.random.key(2))
    ext = cpu_extension()
    before = ext.num_rms_norm_calls()
    got = norm_rope.rms_norm(x, w, 1e-5)
    mx.eval(got)
    assert ext.num_rms_norm_calls() == before + 1
    assert got.shape == x.shape
    assert mx.allclose(got, mx.fast.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6).item()


@needs_kernels
def test_rms_norm_reads_views_as_they_lie():
    """Inputs that are not dense rows (a transpose, a slice, a broadcast) are read right."""
    base = mx.random.normal((64, 6), key=mx.random.key(3))
    x = base.T  # [6, 64], column-major
    w = mx.broadcast_to(mx.array(1.5), (64,))
    got = norm_rope.rms_norm(x, w, 1e-6)
    assert mx.allclose(got, mx.fast.rms_norm(mx.contiguous(x), mx.full((64,), 1.5), 1e-6),
                       rtol=1e-5, atol=1e-6).item()
    sliced = mx.random.normal((4, 3, 40), key=mx.random.key(4))[:, 1, 8:]
    w32 = mx.random.normal((32,), key=mx.random.key(5))
    assert mx.allclose(norm_rope.rms_norm(sliced, w32, 1e-6), mx.fast.rms_norm(sliced, w32, 1e-6),
                       rtol=1e-5, atol=1e-6).item()


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "head_dim", "dims", "base", "scale"),
    [(4, 64, 64, 10000.0, 1.0), (3, 128, 128, 1e6, 0.25), (2, 80, 48, 500000.0, 1.0)],
)
def test_rope_is_mlx_rope_bit_for_bit(heads, head_dim, dims, base, scale):
    """Same angles, same cos and sin, same products: the same bits as mlx's CPU rope."""
    x = mx.random.normal((9, heads, head_dim), key=mx.random.key(heads))
    positions = mx.array([0, 1, 2, 17, 300, 4095, 5, 5, 70000], dtype=mx.int32)
    inv = norm_rope.inverse_frequencies(dims, base, None)
    ext = cpu_extension()
    before = ext.num_rope_calls()
    got = norm_rope.rope(x, positions, dims=dims, base=base, scale=scale, freqs=None, inv_freqs=inv)
    mx.eval(got)
    assert ext.num_rope_calls() == before + 1
    want = mlx_rope(x, positions, dims, base, scale)
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(got[..., dims:], x[..., dims:]).item()  # past `dims`: unrotated


@needs_kernels
def test_rope_with_given_frequencies_and_a_strided_x():
    """llama3-style frequencies given as an array; x a column slice of a wider matrix."""
    freqs = mx.array([1.0 * 1.7**i for i in range(16)])
    wide = mx.random.normal((5, 3 * 32 + 8), key=mx.random.key(7))
    x = wide[:, 8:].reshape(5, 3, 32)  # not dense rows: each token's row is 104 apart
    positions = mx.array([3, 9, 27, 81, 243], dtype=mx.int32)
    inv = norm_rope.inverse_frequencies(32, None, freqs)
    got = norm_rope.rope(x, positions, dims=32, base=None, scale=1.0, freqs=freqs, inv_freqs=inv)
    want = mlx_rope(mx.contiguous(x), positions, 32, None, 1.0, freqs=freqs)
    assert mx.allclose(got, want, rtol=1e-6, atol=1e-6).item()


@needs_kernels
def test_rope_rotates_by_position():
    """A plain check that needs no mlx: position p turns pair (i, i + half) by p * inv[i]."""
    x = mx.zeros((2, 1, 4)) + mx.array([1.0, 0.0, 0.0, 0.0])
    positions = mx.array([0, 3], dtype=mx.int32)
    inv = norm_rope.inverse_frequencies(4, 100.0, None)  # [1, 0.1]
    got = norm_rope.rope(x, positions, dims=4, base=100.0, scale=1.0, freqs=None, inv_freqs=inv)
    assert mx.allclose(got[0, 0], mx.array([1.0, 0.0, 0.0, 0.0])).item()
    assert mx.allclose(got[1, 0], mx.array([math.cos(3.0), 0.0, math.sin(3.0), 0.0]), atol=1e-6).item()


def test_other_dtypes_and_devices_use_mlx():
    x = mx.random.normal((3, 2, 16)).astype(mx.float16)
    positions = mx.array([1, 2, 3], dtype=mx.int32)
    inv = norm_rope.inverse_frequencies(16, 10000.0, None)
    ext = cpu_extension()
    before = (ext.num_rope_calls(), ext.num_rms_norm_calls()) if ext else None
    got = norm_rope.rope(x, positions, dims=16, base=10000.0, scale=1.0, freqs=None, inv_freqs=inv)
    assert got.dtype == mx.float16
    assert mx.array_equal(got, mlx_rope(x, positions, 16, 10000.0, 1.0)).item()
    normed = norm_rope.rms_norm(x, mx.ones((16,), dtype=mx.float16), 1e-5)
    assert normed.dtype == mx.float16
    mx.eval(normed)
    if ext is not None:
        assert (ext.num_rope_calls(), ext.num_rms_norm_calls()) == before



def test_mlxs_rope_takes_the_position_scale_too():
    """Linear RoPE scaling in float16 (mlx's op) scales positions as the kernel does."""
    x = mx.random.normal((3, 2, 16), key=mx.random.key(3)).astype(mx.float16)
    positions = mx.array([1, 20, 300], dtype=mx.int32)
    inv = norm_rope.inverse_frequencies(16, 10000.0, None)
    got = norm_rope.rope(x, positions, dims=16, base=10000.0, scale=0.25, freqs=None, inv_freqs=inv)
    assert mx.array_equal(got, mlx_rope(x, positions, 16, 10000.0, 0.25)).item()
    assert not mx.allclose(got, mlx_rope(x, positions, 16, 10000.0, 1.0), atol=1e-2).item()

def test_a_16_bit_weight_or_int64_positions_beside_float32_x_use_mlx():
    """The primitives take float32 operands and int32 positions; other operands are mlx's."""
    x = mx.random.normal((3, 2, 16), key=mx.random.key(8))
    w = mx.random.normal((16,), key=mx.random.key(9)).astype(mx.bfloat16)
    want = mx.fast.rms_norm(x, w, 1e-5)
    assert mx.allclose(norm_rope.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6).item()
    positions = mx.array(np.array([1, 2, 300]))  # numpy's int64
    inv = norm_rope.inverse_frequencies(16, 10000.0, None)
    got = norm_rope.rope(x, positions, dims=16, base=10000.0, scale=1.0, freqs=None, inv_freqs=inv)
    assert mx.array_equal(got, mlx_rope(x, positions, 16, 10000.0, 1.0)).item()


@needs_kernels
def test_off_the_cpu_mlxs_own_ops_run(monkeypatch):
    ext = cpu_extension()
    x = mx.random.normal((3, 2, 16))
    positions = mx.array([1, 2, 3], dtype=mx.int32)
    inv = norm_rope.inverse_frequencies(16, 10000.0, None)
    before = (ext.num_rope_calls(), ext.num_rms_norm_calls())
    monkeypatch.setattr(norm_rope.mx, "default_device", lambda: mx.Device(mx.gpu))
    got = norm_rope.rope(x, positions, dims=16, base=10000.0, scale=1.0, freqs=None, inv_freqs=inv)
    mx.eval(got, norm_rope.rms_norm(x, mx.ones((16,)), 1e-5))
    assert (ext.num_rope_calls(), ext.num_rms_norm_calls()) == before


@needs_kernels
@pytest.mark.parametrize("op", ["silu_mul", "dense", "quantized"])
def test_primitives_read_strided_and_deeper_inputs(op):
    """The kernels take [..., K] as it lies: a transposed or sliced x needs no copy op."""
    ext = cpu_extension()
    x = mx.random.normal((64, 2, 3), key=mx.random.key(11)).transpose(1, 2, 0)  # [2, 3, 64], strided
    dense = mx.contiguous(x)
    if op == "silu_mul":
        up = mx.random.normal((2, 3, 64), key=mx.random.key(12))[:, ::-1]
        got, want = ext.silu_mul(x, up), dense / (1 + mx.exp(-dense)) * mx.contiguous(up)
    elif op == "dense":
        w = mx.random.normal((10, 64), key=mx.random.key(13))
        got, want = ext.dense_matmul(x, w), dense @ w.T
    else:
        w, scales, biases = mx.quantize(mx.random.normal((10, 64), key=mx.random.key(14)), 32, 4)
        got = ext.matmul(x, w, scales, biases, 32, 4)
        want = dense @ mx.dequantize(w, scales, biases, 32, 4).T
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()


ROPE_SCRIPT = """
import runtime
import mlx.core as mx
from kernels import norm_rope
from kernels.cpu_extension import cpu_extension
from tests.kernels.test_norm_rope import mlx_rope
x = mx.random.normal((6, 3, 64), key=mx.random.key(0))
positions = mx.array([0, 7, 100, 2047, 9, 1 << 20], dtype=mx.int32)
inv = norm_rope.inverse_frequencies(64, 10000.0, None)
got = norm_rope.rope(x, positions, dims=64, base=10000.0, scale=1.0, freqs=None, inv_freqs=inv)
assert mx.array_equal(got, mlx_rope(x, positions, 64, 10000.0, 1.0)).item()
w = mx.random.normal((64,))
assert mx.allclose(norm_rope.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6).item()
print(cpu_extension().isa())
"""


@needs_kernels
@pytest.mark.parametrize("cap", ["baseline", "avx2"])
def test_every_instruction_set_rotates_as_mlx(cap):
    assert "avx512" not in run_with_isa_cap(ROPE_SCRIPT, cap)
