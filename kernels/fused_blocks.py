"""A decoder layer's two residual blocks, each one op on the CPU (kernels/cpu/block_ops.h).

    h = x + o(attention(qkv(norm(x))))          # residual_attention
    out = h + down(act(gate_up(norm(h))))       # residual_mlp

On the CPU, for a step of fewer than `MAX_ROWS` rows over quantized weights that
cadence's kernels run, each block is one primitive: the same kernels, in the same
order, as its parts (so the same bits), without the ~8 ops a layer between them.
A single-stream decode step of a 30-layer model was ~370 ops, and each op costs its
build here in Python, its dispatch in mlx and an output buffer: ~2.5 ms of a ~10 ms
token on a 2-core x86-64 box. More rows go by parts: their matmuls dequantize for the
sgemm (kernels/quantized_matmul.py), and the ops' overhead is small beside them.

`plan_blocks` decides once, at load, whether a layer's weights allow it;
`mlp_block` and `attention_operands` decide per step (device, dtype, rows).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from kernels.cpu_extension import cpu_extension
from kernels.quantized_linear import KernelQuantizedLinear
from kernels.quantized_matmul import SGEMM_MIN_ROWS, is_kernel_layout

MAX_ROWS = SGEMM_MIN_ROWS  # below it the parts' matmuls run the row kernel too
ACTIVATIONS = ("silu", "gelu_tanh")

# A quantized layer as the extension takes it: (w, scales, biases, bias, group_size,
# bits), bias empty when the layer has none.
QuantizedLayer = tuple[mx.array, mx.array, mx.array, mx.array, int, int]


def quantized_layer(linear: nn.Module) -> QuantizedLayer | None:
    """`linear`'s operands if cadence's quantized kernels run it, else None."""
    if not isinstance(linear, KernelQuantizedLinear):
        return None
    if not is_kernel_layout(linear.group_size, linear.bits, linear.mode):
        return None
    bias = linear["bias"] if "bias" in linear else mx.zeros((0,), mx.float32)
    arrays = (linear.weight, linear.scales, linear["biases"], bias)
    if any(a.dtype != mx.float32 for a in arrays[1:]):
        return None
    return (*arrays, linear.group_size, linear.bits)


@attrs.frozen
class NormedLayers:
    """One block's norm (weight and eps) and its two quantized layers, in order."""

    norm_weight: mx.array
    eps: float
    first: QuantizedLayer
    second: QuantizedLayer


def normed_layers(
    norm_weight: mx.array, eps: float, first: nn.Module, second: nn.Module
) -> NormedLayers | None:
    """The operands of a block whose norm is RMSNorm, x * rsqrt(mean(x^2) + eps) *
    norm_weight (float32), and whose layers both run on the quantized kernels; else None."""
    if norm_weight.dtype != mx.float32 or norm_weight.ndim != 1:
        return None
    layers = quantized_layer(first), quantized_layer(second)
    if layers[0] is None or layers[1] is None:
        return None
    return NormedLayers(norm_weight, float(eps), layers[0], layers[1])


def kernel_for(x: mx.array) -> Any:  # noqa: ANN401  (the extension module, untyped)
    """The extension when a block over `x` [..., K] runs as one op here and now."""
    if mx.default_device() != mx.cpu or x.dtype != mx.float32 or x.ndim < 1:
        return None
    if x.shape[-1] == 0 or x.size // x.shape[-1] >= MAX_ROWS:
        return None
    return cpu_extension()


def mlp_block(x: mx.array, block: NormedLayers, activation: str) -> mx.array | None:
    """x + down(act(gate_up(norm(x)))) as one op, or None where it cannot run so."""
    ext = kernel_for(x)
    if ext is None:
        return None
    return ext.residual_mlp(x, block.norm_weight, block.eps, block.first, block.second, activation)


def reference_mlp_block(x: mx.array, block: NormedLayers, activation: str) -> mx.array:
    """The same as mx ops, for the tests: the definition `mlp_block` must equal."""
    normed = mx.fast.rms_norm(x, block.norm_weight, block.eps)
    gate, up = mx.split(_linear(normed, block.first), 2, axis=-1)
    act = nn.silu(gate) if activation == "silu" else nn.gelu_approx(gate)
    return x + _linear(act * up, block.second)


def _linear(x: mx.array, layer: QuantizedLayer) -> mx.array:
    w, scales, biases, bias, group_size, bits = layer
    y = x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).T
    return y + bias if bias.size else y
