"""A decoder layer's two residual blocks, each one op on the CPU (kernels/cpu/block_ops.h).

    h = x + o(attention(qkv(norm(x))))          # residual_attention
    out = h + down(act(gate_up(norm(h))))       # residual_mlp

On the CPU, for a step of fewer than `MAX_ROWS` rows over weights that cadence's
kernels run (quantized, or float32 / 16-bit packed in panels), each block is one
primitive: the same kernels, in the same order, as its parts (so the same bits),
without the ~8 ops a layer between them.
A single-stream decode step of a 30-layer model was ~370 ops, and each op costs its
build here in Python, its dispatch in mlx and an output buffer: ~2.5 ms of a ~10 ms
token on a 2-core x86-64 box. More rows go by parts: the ops' overhead is small beside
their matmuls.

A layer's `plan_blocks` decides once, at load, whether its weights allow it;
`kernel_for` decides per step (device, dtype, rows). CADENCE_CPU_BLOCKS=off runs every
block by parts (to measure what the blocks save, or to rule them out).
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from kernels.cpu_extension import cpu_extension
from kernels.dense_matmul import PanelLinear
from kernels.quantized_linear import KernelQuantizedLinear
from kernels.quantized_matmul import is_kernel_layout

# Where the ops between the matmuls are a large share of a step; beyond, by parts (the
# same kernels, so the same results, whichever way a step goes).
MAX_ROWS = 32
IS_ON = os.environ.get("CADENCE_CPU_BLOCKS", "").lower() not in ("off", "0", "no")
ACTIVATIONS = ("silu", "gelu_tanh")

# A layer as the extension takes it, its bias empty when it has none: quantized,
# (w, scales, biases, bias, group_size, bits); or packed in panels, (w_panels, bias, N).
KernelLayer = (
    tuple[mx.array, mx.array, mx.array, mx.array, int, int] | tuple[mx.array, mx.array, int]
)


def kernel_layer(linear: nn.Module) -> KernelLayer | None:
    """`linear`'s operands if cadence's quantized or panel kernel runs it, else None."""
    bias = linear["bias"] if "bias" in linear else mx.zeros((0,), mx.float32)
    if bias.dtype != mx.float32:
        return None
    if isinstance(linear, PanelLinear):
        return (linear.weight, bias, linear.out_features)
    if not isinstance(linear, KernelQuantizedLinear):
        return None
    if linear.mode != "affine" or not is_kernel_layout(linear.group_size, linear.bits, linear.mode):
        return None  # the one-op blocks run affine layers (mxfp4 goes by parts)
    if linear.scales.dtype != mx.float32 or linear["biases"].dtype != mx.float32:
        return None
    return (linear.weight, linear.scales, linear["biases"], bias, linear.group_size, linear.bits)


@attrs.frozen
class NormedLayers:
    """One block's norm (weight and eps) and its two layers, in order; an attention
    block may norm each query and key head too, (q_norm [D], k_norm [D], eps); either
    block may norm its output before the residual add (`post_norm` [K], same eps)."""

    norm_weight: mx.array
    eps: float
    first: KernelLayer
    second: KernelLayer
    qk_norm: tuple[mx.array, mx.array, float] | None = None
    post_norm: mx.array | None = None


def normed_layers(
    norm_weight: mx.array,
    eps: float,
    first: nn.Module,
    second: nn.Module,
    qk_norm: tuple[mx.array, mx.array, float] | None = None,
    post_norm: mx.array | None = None,
) -> NormedLayers | None:
    """The operands of a block whose norms are RMSNorms, x * rsqrt(mean(x^2) + eps) *
    weight (float32 weights), and whose layers both run on cadence's kernels; else None."""
    weights = [norm_weight] + ([] if qk_norm is None else list(qk_norm[:2]))
    weights += [] if post_norm is None else [post_norm]
    if any(w.dtype != mx.float32 or w.ndim != 1 for w in weights):
        return None
    layers = kernel_layer(first), kernel_layer(second)
    if layers[0] is None or layers[1] is None:
        return None
    return NormedLayers(norm_weight, float(eps), layers[0], layers[1], qk_norm, post_norm)


def kernel_for(x: mx.array) -> Any:  # noqa: ANN401  (the extension module, untyped)
    """The extension when a block over `x` [..., K] runs as one op here and now."""
    if not IS_ON or mx.default_device() != mx.cpu or x.dtype != mx.float32 or x.ndim < 1:
        return None
    if x.shape[-1] == 0 or x.size // x.shape[-1] >= MAX_ROWS:
        return None
    return cpu_extension()


def mlp_block(x: mx.array, block: NormedLayers, activation: str) -> mx.array | None:
    """x + down(act(gate_up(norm(x)))) as one op, or None where it cannot run so."""
    ext = kernel_for(x)
    if ext is None:
        return None
    return ext.residual_mlp(
        x, block.norm_weight, block.eps, block.first, block.second, activation, block.post_norm
    )


def reference_mlp_block(x: mx.array, block: NormedLayers, activation: str) -> mx.array:
    """The same as mx ops, for the tests: the definition `mlp_block` must equal."""
    normed = mx.fast.rms_norm(x, block.norm_weight, block.eps)
    gate, up = mx.split(_linear(normed, block.first), 2, axis=-1)
    act = nn.silu(gate) if activation == "silu" else nn.gelu_approx(gate)
    y = _linear(act * up, block.second)
    return x + (y if block.post_norm is None else mx.fast.rms_norm(y, block.post_norm, block.eps))


def _linear(x: mx.array, layer: KernelLayer) -> mx.array:
    if len(layer) == 3:  # panels [ceil(N / 32), K, 32] back to the weight's rows [N, K]
        panels, bias, n = layer
        weight = panels.astype(mx.float32).transpose(0, 2, 1).reshape(-1, panels.shape[1])[:n]
    else:
        w, scales, biases, bias, group_size, bits = layer
        weight = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    y = x @ weight.T
    return y + bias if bias.size else y
