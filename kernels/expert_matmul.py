"""Routed experts' matmuls: each (row, expert) pair's x row times that expert's weight.

    x [R, K], experts [R, k] (uint32 ids), W [E, N, K]  ->  [R, k, N]

On the CPU with cadence's kernels (kernels/cpu/expert_ops.cpp) the pairs are grouped by
expert when the op runs, and each expert's rows go through the quantized or dense row
kernels, its weights streamed once. Elsewhere, or without them, mlx's `gather_mm` and
`gather_qmm`, the pairs sorted by expert first when there are many (a prompt chunk), so
that each expert's weights are read once for its rows rather than once a row.

mlx's CPU gathers run far from memory speed: one Qwen3-30B-A3B-shaped projection (128
experts of 768 x 2048, 8 a token, 4-bit group 64) took 14.4 ms for one row against the
kernel's 0.53, and 3.6 s for 256 rows against 63 ms (README, "Routed experts on the CPU").
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from kernels.cpu_extension import cpu_extension
from kernels.quantized_matmul import uses_cpu_kernel

# From this many (row, expert) pairs mlx's gathers get their pairs sorted by expert.
SORT_FROM_PAIRS = 64


def dense_expert_matmul(x: mx.array, experts: mx.array, w: mx.array) -> mx.array:
    """x [R, K] @ w[experts].T -> [R, k, N], in x's dtype; w [E, N, K] float."""
    ext = cpu_extension() if mx.default_device() == mx.cpu else None
    if ext is not None and x.dtype == mx.float32:
        return ext.dense_expert_matmul(x, experts, w)
    return _gathered(
        x,
        experts,
        lambda a, ids, is_sorted: mx.gather_mm(
            a, w.swapaxes(-1, -2), rhs_indices=ids, sorted_indices=is_sorted
        ),
    )


def quantized_expert_matmul(
    x: mx.array,
    experts: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """x [R, K] @ dequantize(w[experts]).T -> [R, k, N], in x's dtype; w [E, N, K * bits / 32]."""
    # The kernel's operands: float32 rows, and scales and biases as the CPU load leaves
    # them (float32); kept as stored (`--keep-dtype`), mlx's gather runs them.
    ext = cpu_extension() if uses_cpu_kernel(group_size, bits, mode) else None
    float_operands = x.dtype == scales.dtype == mx.float32 and (biases is None or biases.dtype == mx.float32)
    if ext is not None and float_operands and (biases is not None) == (mode == "affine"):
        # mxfp4's scales as runtime/cpu_weights.py leaves them on the CPU: exponent_scales'
        return ext.expert_matmul(x, experts, w, scales, biases, group_size, bits)
    return _gathered(
        x,
        experts,
        lambda a, ids, is_sorted: mx.gather_qmm(
            a,
            w,
            scales,
            biases,
            rhs_indices=ids,
            transpose=True,
            group_size=group_size,
            bits=bits,
            mode=mode,
            sorted_indices=is_sorted,
        ),
    )


Gather = Callable[[mx.array, mx.array, bool], mx.array]  # (x rows, expert ids, is_sorted)


def _gathered(x: mx.array, experts: mx.array, gather: Gather) -> mx.array:
    """mlx's gathered matmul over the pairs, sorted by expert from SORT_FROM_PAIRS."""
    num_rows, k = experts.shape
    if experts.size < SORT_FROM_PAIRS:
        return gather(x[:, None, None, :], experts, False).squeeze(-2)  # [R, k, 1, N] -> [R, k, N]
    flat = experts.flatten()
    order = mx.argsort(flat)
    out = gather(x[order // k][:, None, :], flat[order], True)  # [P, 1, N], grouped by expert
    return out[mx.argsort(order)].reshape(num_rows, k, -1)
