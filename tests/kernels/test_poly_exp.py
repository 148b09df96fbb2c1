"""The polynomial exp and the kernels built on it, against mlx's own ops."""

import mlx.core as mx
import numpy as np
import pytest

from kernels import swiglu as swiglu_module
from kernels.cpu_extension import cpu_extension
from kernels.poly_exp import poly_exp
from kernels.swiglu import (
    gelu_tanh,
    gelu_tanh_halves,
    reference_gelu_tanh,
    reference_swiglu,
    swiglu,
)
from tests.kernels.test_quantized_matmul import run_with_isa_cap

needs_kernels = pytest.mark.skipif(cpu_extension() is None, reason="the C++ kernels were not built here")


def test_poly_exp_is_float32_accurate():
    x = np.concatenate([np.linspace(-87, 88, 100_001), [0.0, -1e-8, 1e-8, 0.5, -0.5]]).astype(np.float32)
    exact = np.exp(x.astype(np.float64))
    relative = np.abs(np.array(poly_exp(mx.array(x))) - exact) / exact
    assert relative.max() < 2e-7  # measured 7.6e-8; mlx's own CPU exp is off by up to 3.9e-6


def test_poly_exp_saturates_instead_of_wrapping():
    out = poly_exp(mx.array([-mx.inf, -1000.0, 1000.0]))
    assert out[0].item() < 1e-37 and out[1].item() < 1e-37
    assert out[2].item() > 1e38  # clamped at e^88, not a garbage bit pattern


@pytest.mark.parametrize("shape", [(16, 1, 2816), (1, 7, 64), (3,)])
def test_swiglu_matches_reference(shape):
    gate = mx.random.normal(shape) * 8
    up = mx.random.normal(shape)
    assert mx.allclose(swiglu(gate, up), reference_swiglu(gate, up), rtol=1e-5, atol=1e-6).item()
    extreme = mx.array([-200.0, -90.0, 0.0, 90.0, 200.0])
    assert mx.allclose(swiglu(extreme, mx.ones(5)), reference_swiglu(extreme, mx.ones(5))).item()



@pytest.mark.parametrize("up_shape", [(3, 8), (1, 8)], ids=["float16-up", "broadcast-up"])
def test_operands_the_kernels_do_not_take_go_to_mlx(up_shape):
    """The kernels take two float32 operands of one shape: a 16-bit or broadcast `up`
    beside a float32 gate is mlx's."""
    gate = mx.random.normal((3, 8), key=mx.random.key(1)) * 4
    up = mx.random.normal(up_shape, key=mx.random.key(2))
    up = up.astype(mx.float16) if up_shape == gate.shape else up
    for ours, reference in ((swiglu, reference_swiglu), (gelu_tanh, reference_gelu_tanh)):
        want = reference(gate, up)
        got = ours(gate, up)
        assert got.shape == want.shape and mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()

def test_swiglu_runs_the_cpu_kernel_when_it_is_loaded(monkeypatch):
    calls = []

    class Kernel:
        def silu_mul(self, gate, up):
            calls.append(gate.shape)
            return reference_swiglu(gate, up)

    monkeypatch.setattr(swiglu_module, "cpu_extension", Kernel)
    gate = mx.random.normal((3, 7))
    swiglu(gate, gate)
    assert calls == [(3, 7)]
    monkeypatch.setattr(swiglu_module, "cpu_extension", lambda: None)  # the mx-op fallback
    assert mx.allclose(swiglu(gate, gate), reference_swiglu(gate, gate), rtol=1e-5, atol=1e-6).item()
    assert calls == [(3, 7)]


@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (5, 2 * 64), (2, 300, 2 * 40)])
def test_swiglu_of_stacked_halves_matches_reference(shape):
    """A stacked gate/up projection's output: gate and up are each row's two halves."""
    gate_up = mx.random.normal(shape, key=mx.random.key(shape[0])) * 4
    gate, up = mx.split(gate_up, 2, axis=-1)
    want = reference_swiglu(gate, up)
    got = swiglu_module.swiglu_halves(gate_up)
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    strided = mx.random.normal((shape[-1], 3)).T  # not dense rows
    want = reference_swiglu(*mx.split(mx.contiguous(strided), 2, axis=-1))
    assert mx.allclose(swiglu_module.swiglu_halves(strided), want, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("shape", [(16, 1, 6912), (1, 7, 64), (3,)])
def test_gemmas_gelu_tanh_matches_nn_gelu_approx(shape):
    gate = mx.random.normal(shape, key=mx.random.key(len(shape))) * 4
    up = mx.random.normal(shape)
    assert mx.allclose(gelu_tanh(gate, up), reference_gelu_tanh(gate, up), rtol=1e-5, atol=1e-6).item()
    extreme = mx.array([-200.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 20.0, 200.0])
    got, want = gelu_tanh(extreme, mx.ones(9)), reference_gelu_tanh(extreme, mx.ones(9))
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item(), (got, want)


@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (5, 2 * 64), (2, 300, 2 * 40)])
def test_gelu_tanh_of_stacked_halves_matches_reference(shape):
    gate_up = mx.random.normal(shape, key=mx.random.key(shape[0])) * 4
    want = reference_gelu_tanh(*mx.split(gate_up, 2, axis=-1))
    got = gelu_tanh_halves(gate_up)
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


@needs_kernels
def test_gelu_tanh_runs_the_cpu_kernel_when_it_is_loaded(monkeypatch):
    ext = cpu_extension()
    gate = mx.random.normal((4, 96))
    before = ext.num_gated_calls()
    mx.eval(gelu_tanh(gate, gate), gelu_tanh_halves(gate))
    assert ext.num_gated_calls() == before + 2
    monkeypatch.setattr(swiglu_module, "cpu_extension", lambda: None)  # the mx-op fallback
    mx.eval(gelu_tanh(gate, gate), gelu_tanh_halves(gate))
    assert ext.num_gated_calls() == before + 2


GATED_SCRIPT = """
import mlx.core as mx
from kernels.cpu_extension import cpu_extension
from kernels.swiglu import gelu_tanh, gelu_tanh_halves, reference_gelu_tanh, reference_swiglu, swiglu
# Fixed draws: at gate ~ -4.9, gelu ~ 1e-6 carries an error near float32's step for values
# of ~1 (7e-8), which an `up` of ~19 multiplies past atol: 9 unseeded draws in 3,000 failed.
gate = mx.random.normal((3, 1037), key=mx.random.key(0)) * 4  # a ragged tail
up = mx.random.normal((3, 1037), key=mx.random.key(1))
for got, want in ((gelu_tanh(gate, up), reference_gelu_tanh(gate, up)), (swiglu(gate, up), reference_swiglu(gate, up)),
                  (gelu_tanh_halves(gate[:, :1036]), reference_gelu_tanh(gate[:, :518], gate[:, 518:1036]))):
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
print(cpu_extension().attention_isa())
"""


@needs_kernels
@pytest.mark.parametrize("cap", ["baseline", "avx2"])
def test_every_instruction_set_of_the_gated_activations_matches_the_reference(cap):
    assert run_with_isa_cap(GATED_SCRIPT, cap) == cap


def test_poly_exp_stays_finite_at_its_upper_clamp():
    out = poly_exp(mx.array([88.0, 88.7, 89.0, 1000.0, mx.inf]))
    assert mx.isfinite(out).all().item()  # e^88 ~ 1.65e38, below float32's max
    assert mx.allclose(out, mx.full((5,), np.exp(np.float64(88.0)).astype(np.float32)), rtol=1e-6).item()


def test_16_bit_halves_go_through_mlxs_ops():
    """The extension takes float32 alone; other dtypes are mlx's, and stay in their dtype."""
    gate_up = (mx.random.normal((3, 16), key=mx.random.key(3)) * 4).astype(mx.float16)
    halves = mx.split(gate_up, 2, axis=-1)
    for got, want in ((swiglu_module.swiglu_halves(gate_up), reference_swiglu(*halves)),
                      (gelu_tanh_halves(gate_up), reference_gelu_tanh(*halves))):
        assert got.dtype == mx.float16 and mx.allclose(got, want, rtol=1e-2, atol=1e-2).item()


def test_without_the_extension_split_rows_and_halves_compute_the_reference(monkeypatch):
    monkeypatch.setattr(swiglu_module, "cpu_extension", lambda: None)
    gate_up = mx.random.normal((2, 33, 2 * 4096), key=mx.random.key(4)) * 4
    gate, up = mx.split(gate_up, 2, axis=-1)
    assert gate.size >= swiglu_module.SPLIT_MIN_ELEMENTS  # the rows' halves on two CPU streams
    split = swiglu(gate, up)
    assert split.shape == gate.shape
    for got, want in ((split, reference_swiglu(gate, up)),
                      (swiglu_module.swiglu_halves(gate_up), reference_swiglu(gate, up)),
                      (gelu_tanh_halves(gate_up), reference_gelu_tanh(gate, up))):
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


@needs_kernels
def test_off_the_cpu_the_activations_are_mlxs(monkeypatch):
    ext = cpu_extension()
    gate = mx.random.normal((4, 96))
    monkeypatch.setattr(swiglu_module.mx, "default_device", lambda: mx.Device(mx.gpu))
    before = ext.num_gated_calls()
    halves = swiglu_module.swiglu_halves(gate), gelu_tanh_halves(gate)
    mx.eval(swiglu(gate, gate), gelu_tanh(gate, gate), *halves)
    assert ext.num_gated_calls() == before
