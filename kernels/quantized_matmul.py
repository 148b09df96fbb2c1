"""x @ W.T for a weight W stored in mlx's affine quantized layout: one entry for every layer.

On the CPU it runs cadence's C++ kernels (kernels/cpu/, loaded by cpu_extension.py);
elsewhere, or without them, mlx's own `quantized_matmul` (Metal and CUDA keep theirs).
Why, measured on a 2-core x86-64 box shared with other work (4096x4096 layer, 4-bit,
group 64, ms; see the README for more):

| M | mlx's CPU quantized_matmul | fp32 matmul (OpenBLAS) | cadence kernel |
|---|---|---|---|
| 1 | 10.6 ms | 4.2 ms | 0.85 ms |
| 16 | 183 ms | 22 ms | 8.1 ms |

Up to 7 rows (decode) stream the packed weights once through a vectorized fp32 dot
product. From 8 rows each 32-column panel of the weight is dequantized, 2,048 k at a
time, into a tile the panel kernel multiplies (kernels/cpu/row_kernels.h,
QuantizedPanelJob): each weight decoded once, no fp32 copy of the layer. It replaced
dequantizing the whole layer for OpenBLAS's sgemm from 32 rows (ms, group 64, 4 bits):

| rows | layer [K -> N] | panels | dequantize + sgemm |
|---|---|---|---|
| 64 | 576 -> 3072 | 2.35 | 3.23 |
| 176 | 1024 -> 5632 | 10.2 | 13.5 |
| 512 | 1024 -> 5632 | 29.2 | 32.2 |
| 176 | 4096 -> 4096 | 29.6 | 58.2 |
"""

from __future__ import annotations

import mlx.core as mx

from kernels.cpu_extension import cpu_extension

KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)


def is_kernel_layout(group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether cadence's CPU kernels handle this quantization: affine at 4 or 8 bits, or
    mxfp4 (its E2M1 codes looked up, its exponents as float32 scales: `exponent_scales`)."""
    if mode == "mxfp4":
        return (group_size, bits) == (32, 4)
    return mode == "affine" and bits in KERNEL_BITS and group_size in KERNEL_GROUP_SIZES


def exponent_scales(exponents: mx.array) -> mx.array:
    """mxfp4's uint8 exponents e -> the float32 scales 2^(e - 127) the kernels multiply
    by, exactly (e = 0, 2^-127, is a denormal: its bits built apart)."""
    e = exponents.astype(mx.uint32)
    bits = mx.where(e == 0, mx.array(1 << 22, dtype=mx.uint32), e << 23)
    return mx.contiguous(bits.view(mx.float32))


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
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """x: [..., K]; w: [N, K * bits / 32] uint32; scales, biases: [N, K / group_size]
    (mxfp4: no biases, and on the kernel float32 scales from `exponent_scales`).

    Returns x @ dequantize(w).T, [..., N], in x's dtype, accumulated in float32.
    """
    ext = cpu_extension() if uses_cpu_kernel(group_size, bits, mode) else None
    if ext is None:
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode
        )
    # Every mx op costs its dispatch (~2-3 us on the CPU): the kernel takes x [..., K] as
    # it is, so no reshape goes in or out.
    y = ext.matmul(x, w, scales, biases, group_size, bits)
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
