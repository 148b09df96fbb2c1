"""GGUF tensors as mlx arrays: float types as they are, Q4_0/Q4_1/Q8_0 as mlx quantized
weights, the K-quants and the other block types expanded by the `gguf` package.

Q4_0, Q4_1 and Q8_0 are affine quantizations with one scale (and offset) per 32 weights,
which is exactly mlx's `group_size=32` layout: their blocks are repacked, not requantized,
so `mx.dequantize` gives the file's values. The result matches what `mx.load` itself
makes of such a GGUF, but `mx.load` refuses a whole file when any tensor is of another
type (a Q4_K_M file mixes Q4_K and Q6_K), so the blocks are read here instead.
"""

from __future__ import annotations

from typing import Any

from runtime.errors import CheckpointError

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

GROUP_SIZE = 32  # weights per block in Q4_0, Q4_1 and Q8_0
NATIVE_BITS = {GGMLType.Q4_0: 4, GGMLType.Q4_1: 4, GGMLType.Q8_0: 8}
# Expanded to float16, the precision of their own scales (Q4_K: float16 d and dmin
# times 6-bit sub-scales and 4-bit codes), by the gguf package's decoders.
DEQUANTIZED = (
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q2_K,
    GGMLType.Q3_K,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
)
SUPPORTED = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, *NATIVE_BITS, *DEQUANTIZED)


def convert_tensor(
    tensor: Any, hf_name: str, rows: list[int] | None, shift: float, source: str
) -> dict[str, mx.array]:
    """One `gguf.ReaderTensor` as {hf_name: array}, or, for Q4_0/Q4_1/Q8_0, the packed
    weight plus `.scales` and `.biases` beside it (mlx-community's names).

    `rows` reorders the first axis (undoing a converter permutation); `shift` is
    subtracted from every value (Gemma's norms were stored as 1 + w).
    """
    return to_mlx(tensor, decode_tensor(tensor, hf_name, rows, shift, source))


def to_mlx(tensor: Any, arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """`decode_tensor`'s numpy arrays as mlx arrays (BF16 tensors back in bfloat16)."""
    converted = {name: mx.array(values) for name, values in arrays.items()}
    if tensor.tensor_type == GGMLType.BF16:
        converted = {name: values.astype(mx.bfloat16) for name, values in converted.items()}
    return converted


def decode_tensor(
    tensor: Any, hf_name: str, rows: list[int] | None, shift: float, source: str
) -> dict[str, np.ndarray]:
    """`convert_tensor`'s work in numpy only (BF16 as float32), so that it can run on a
    worker thread: numpy releases the GIL in the dequantizers' array operations, and
    mlx arrays are made only on the caller's thread."""
    kind = tensor.tensor_type
    if kind not in SUPPORTED:
        supported = ", ".join(t.name for t in SUPPORTED)
        raise CheckpointError(
            f"{source}: tensor '{tensor.name}' has unsupported GGUF type {kind.name} "
            f"(supported: {supported})"
        )
    data = np.asarray(tensor.data)
    expected_rows = int(np.prod(tensor.shape[1:])) if len(tensor.shape) > 1 else 1
    if len(tensor.shape) > 1 and int(np.prod(data.shape[:-1])) != expected_rows:
        raise CheckpointError(f"{source}: tensor '{tensor.name}' is truncated")
    if rows is not None:
        if len(rows) != data.shape[0]:
            raise CheckpointError(
                f"{source}: tensor '{tensor.name}' has {data.shape[0]} rows, expected {len(rows)}"
            )
        data = data[rows]
    if kind in NATIVE_BITS and shift == 0.0 and len(tensor.shape) in (2, 3):
        # A matrix, or stacked experts' [E, out, in]; a quantized vector is expanded.
        return _repacked(data, kind, hf_name)
    values = _float_values(data, kind, tensor.name, source)
    if shift:
        values = values.astype(np.float32) - np.float32(shift)
    return {hf_name: values}


def _float_values(data: np.ndarray, kind: GGMLType, name: str, source: str) -> np.ndarray:
    if kind in (GGMLType.F32, GGMLType.F16):
        return data
    try:
        values = gguf.quants.dequantize(data, kind)
    except (ValueError, NotImplementedError) as exc:
        raise CheckpointError(
            f"{source}: tensor '{name}' does not decode as {kind.name} ({exc})"
        ) from None
    return values if kind == GGMLType.BF16 else values.astype(np.float16)


def _repacked(blocks: np.ndarray, kind: GGMLType, hf_name: str) -> dict[str, np.ndarray]:
    """[..., rows, bytes] of GGUF blocks -> mlx's packed uint32 weight, float16 scales
    and biases, of the same leading shape.

    mlx stores weight i of a row in word i // (32 // bits) at bit (i % per-word) * bits,
    little-endian, and dequantizes `q * scale + bias`.
    """
    leading = blocks.shape[:-1]
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    blocks = blocks.reshape(-1, block_bytes)  # [rows * blocks per row, bytes per block]
    scales = blocks[:, 0:2].view(np.float16)
    if kind == GGMLType.Q8_0:
        # int8 q * d == (q + 128) * d - 128 * d: shift to the unsigned codes mlx expects.
        codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        biases = (scales * np.float16(-128)).astype(np.float16)
    else:
        if kind == GGMLType.Q4_1:
            biases, nibbles = blocks[:, 2:4].view(np.float16), blocks[:, 4:]  # q * d + m
        else:
            biases, nibbles = (
                (scales * np.float16(-8)).astype(np.float16),
                blocks[:, 2:],
            )  # (q - 8) * d
        # A block's byte j holds weight j in its low nibble and weight j + 16 in its high one.
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # [blocks, 32] in weight order
        codes = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    prefix = hf_name.removesuffix(".weight")
    return {
        hf_name: np.ascontiguousarray(codes).reshape(*leading, -1).view(np.uint32),
        f"{prefix}.scales": np.ascontiguousarray(scales).reshape(*leading, -1),
        f"{prefix}.biases": np.ascontiguousarray(biases).reshape(*leading, -1),
    }


def quantization_config(bits_by_layer: dict[str, int]) -> dict[str, Any] | None:
    """config.json's `quantization` for the repacked layers ({module path: bits}): group
    32, 4 bits by default, per-layer entries for the 8-bit ones; None when there are none."""
    if not bits_by_layer:
        return None
    default_bits = 4 if 4 in bits_by_layer.values() else 8
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits}
    for layer, bits in bits_by_layer.items():
        if bits != default_bits:
            config[layer] = {"group_size": GROUP_SIZE, "bits": bits}
    return config
