"""x @ W.T for a weight W stored in mlx's affine quantized layout: one entry for every layer.

On the CPU it runs cadence's C++ kernels (kernels/cpu/, loaded by cpu_extension.py);
elsewhere, or without them, mlx's own `quantized_matmul` (Metal and CUDA keep theirs).
Why, measured on a 2-core x86-64 box shared with other work (4096x4096 layer, 4-bit,
group 64, ms; see the README for more):

| M | mlx's CPU quantized_matmul | fp32 matmul (OpenBLAS) | cadence kernel |
|---|---|---|---|
| 1 | 10.6 ms | 4.2 ms | 0.85 ms |
| 16 | 183 ms | 22 ms | 8.1 ms |

Few rows (decode) stream the packed weights once through a vectorized fp32 dot product;
many rows (prefill) dequantize the weight to fp32 in one threaded pass and hand it to
the sgemm (OpenBLAS, kernels/blas.py), whose blocking beats a hand-written loop there.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.cpu_extension import cpu_extension

# From this many rows of x on, dequantize + sgemm: on a 1536x576 layer it overtook the
# row kernel between 24 and 32 rows (2.1 vs 2.4 ms at 24); on a loaded box a 4096x4096
# layer favoured the row kernel up to 64 rows, so this is a compromise, not an optimum.
SGEMM_MIN_ROWS = 32
KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)


def is_kernel_layout(group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether cadence's CPU kernels handle this quantization."""
    return mode == "affine" and bits in KERNEL_BITS and group_size in KERNEL_GROUP_SIZES


def uses_cpu_kernel(group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether `quantized_matmul` will run cadence's kernel for this layout here and now."""
    return (
        mx.default_device() == mx.cpu
        and is_kernel_layout(group_size, bits, mode)
        and cpu_extension() is not None
    )


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
) -> mx.array:
    """x: [..., K]; w: [N, K * bits / 32] uint32; scales, biases: [N, K / group_size].

    Returns x @ dequantize(w).T, [..., N], in x's dtype, accumulated in float32.
    """
    ext = cpu_extension() if uses_cpu_kernel(group_size, bits) else None
    if ext is None:
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=True, group_size=group_size, bits=bits
        )
    # Every mx op costs its dispatch (~2-3 us on the CPU): the kernel takes x [..., K] as
    # it is, so no reshape goes in or out.
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows < SGEMM_MIN_ROWS:
        y = ext.matmul(x, w, scales, biases, group_size, bits)
    else:
        y = x.astype(mx.float32) @ ext.dequantize(w, scales, biases, group_size, bits).T
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


def reference_quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
) -> mx.array:
    """The pure-mx definition `quantized_matmul` is tested against."""
    weight = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    return (x.astype(mx.float32) @ weight.astype(mx.float32).T).astype(x.dtype)
