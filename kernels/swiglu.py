"""The gated MLP activations: SwiGLU, silu(gate) * up (llama, qwen), and Gemma's
GELU-tanh, gelu_approx(gate) * up.

On the CPU, float32, it is one primitive of the CPU extension (kernels/cpu/): a
vectorized exp, threaded. Without the extension the sigmoid goes through the
polynomial exp made of mx ops: at B=16 with a 2816-wide MLP, 0.94 ms per layer
with `nn.silu`, 0.15 ms that way, ~13 ms of a 97 ms decode step for a 16-layer
model. Elsewhere mlx's own ops are used.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from kernels.cpu_extension import cpu_extension
from kernels.poly_exp import exp_parts, scale_of
from kernels.streams import is_worth_splitting, side_stream

SPLIT_MIN_ELEMENTS = 1 << 18  # a prefill chunk's, not a decode step's (16 x 2816)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """gate, up: [..., intermediate] -> silu(gate) * up, same shape."""
    if mx.default_device() != mx.cpu or gate.dtype != mx.float32:
        return reference_swiglu(gate, up)
    ext = cpu_extension()
    if ext is not None and up.dtype == mx.float32 and gate.shape == up.shape:
        return ext.silu_mul(gate, up)
    rows = gate.reshape(-1, gate.shape[-1])
    if rows.shape[0] < 2 or not is_worth_splitting(gate.size, SPLIT_MIN_ELEMENTS):
        return _swiglu(gate, up)
    # Two halves of the rows on two CPU streams: the exp runs on both cores.
    half = rows.shape[0] // 2
    up_rows = up.reshape(rows.shape)
    first = _swiglu(rows[:half], up_rows[:half])
    with mx.stream(side_stream()):
        second = _swiglu(rows[half:], up_rows[half:])
    return mx.concatenate([first, second]).reshape(gate.shape)


def swiglu_halves(gate_up: mx.array) -> mx.array:
    """gate_up: [..., 2 * intermediate], gate then up (a stacked projection) -> [..., intermediate]."""
    ext = _kernel_for(gate_up)
    return ext.silu_mul_halves(gate_up) if ext is not None else swiglu(*_halves(gate_up))


def gelu_tanh(gate: mx.array, up: mx.array) -> mx.array:
    """gate, up: [..., intermediate] -> nn.gelu_approx(gate) * up, same shape.

    On the CPU in float32, one primitive of the extension: mlx's own gelu_approx there is
    a fused but single-threaded, unvectorized tanh (16 x 6912: 3.0 ms against 0.05;
    512 x 6912: 95 ms against 0.8, as SwiGLU's kernel, with which it shares its exp)."""
    ext = _kernel_for(gate)
    if ext is None or up.dtype != mx.float32 or gate.shape != up.shape:
        return reference_gelu_tanh(gate, up)
    return ext.gelu_tanh_mul(gate, up)


def gelu_tanh_halves(gate_up: mx.array) -> mx.array:
    """gate_up: [..., 2 * intermediate], gate then up (a stacked projection) -> [..., intermediate]."""
    ext = _kernel_for(gate_up)
    return ext.gelu_tanh_mul_halves(gate_up) if ext is not None else reference_gelu_tanh(*_halves(gate_up))


def _kernel_for(x: mx.array):  # noqa: ANN202  (the extension module, untyped)
    """The extension when `x` is float32 on the CPU and it is loaded, else None."""
    return cpu_extension() if mx.default_device() == mx.cpu and x.dtype == mx.float32 else None


def _halves(gate_up: mx.array) -> tuple[mx.array, mx.array]:
    gate, up = mx.split(gate_up, 2, axis=-1)
    return gate, up


def reference_gelu_tanh(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    e_r, bits = exp_parts(-gate)
    return _combine(gate, up, e_r, scale_of(bits))


@partial(mx.compile, shapeless=True)  # all four inputs share one shape: no broadcasting
def _combine(gate: mx.array, up: mx.array, e_r: mx.array, scale: mx.array) -> mx.array:
    return gate / (1.0 + e_r * scale) * up


def reference_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up
