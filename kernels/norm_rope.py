"""RMSNorm and rotary embedding: one entry each for the models, one primitive each on the CPU.

mlx's `mx.fast.rms_norm` and `mx.fast.rope` have Metal and CUDA kernels but none for
the CPU, where each call becomes its fallback graph of ~10 (norm) and ~25 (rope) small
ops. A 30-layer model's single-row decode step was ~3,900 ops; every op costs its
dispatch, and the step's graph had to be built op by op in Python first. On the CPU
in float32 these run as cadence primitives (kernels/cpu/norm_rope_ops.cpp) computing
what the fallbacks compute, in the same order where it matters: the position scaled
in float32, the angle as position x inverse frequency, std::cos/std::sin of it.
Elsewhere, or without the extension, mlx's own `fast` ops run.
"""

from __future__ import annotations

import math

import mlx.core as mx

from kernels.cpu_extension import cpu_extension


def _kernel_for(x: mx.array):  # noqa: ANN202  (the extension module, untyped)
    if mx.default_device() != mx.cpu or x.dtype != mx.float32:
        return None
    return cpu_extension()


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x [..., D] -> x * rsqrt(mean(x^2, -1) + eps) * weight."""
    ext = _kernel_for(x)
    if ext is None or weight.dtype != mx.float32:
        return mx.fast.rms_norm(x, weight, eps)
    return ext.rms_norm(x, weight, eps)


def inverse_frequencies(dims: int, base: float | None, freqs: mx.array | None) -> mx.array:
    """[dims / 2] float32, made by the same mx ops as mlx's rope fallback makes them."""
    if freqs is not None:
        return mx.reciprocal(freqs.astype(mx.float32))
    assert base is not None
    half = dims // 2
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))


def rope(
    x: mx.array,
    positions: mx.array,
    *,
    dims: int,
    base: float | None,
    scale: float,
    freqs: mx.array | None,
    inv_freqs: mx.array,
) -> mx.array:
    """x [N, H, D], token n at positions[n] (int32 [N]) -> the rotated x, the half-split
    (non-traditional) layout. `inv_freqs` is `inverse_frequencies(dims, base, freqs)`."""
    ext = _kernel_for(x)
    if ext is None or positions.dtype != mx.int32 or positions.ndim != 1:
        # Each token is a batch row of length 1 at its own offset.
        out = mx.fast.rope(
            x[:, :, None, :], dims, traditional=False, base=base, scale=scale, offset=positions, freqs=freqs
        )
        return out[:, :, 0, :]
    return ext.rope(x, positions, inv_freqs, scale)
