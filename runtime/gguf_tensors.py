"""GGUF tensors as mlx arrays: float types as they are, the block types whose weights are
affine in groups of 32 as mlx quantized weights, the others expanded by the `gguf` package.

mlx's affine layout (`group_size=32`) is `w = scale * code + bias`, one scale and bias per
32 weights. Q4_0, Q4_1 and Q8_0 (one scale, and offset, per 32-weight block), Q5_0 and
Q5_1 (the same, 5-bit codes) and the K-quants Q4_K and Q5_K (a 256-weight superblock of
eight 32-weight groups, each with a 6-bit scale and minimum times the superblock's
float16 ones) are all of that form, so their blocks are repacked, not requantized:
`mx.dequantize` gives exactly the values the `gguf` package decodes. 4-bit codes stay 4
bits; 5-bit ones go to 8 (cadence's kernels run 4 and 8 bits). The K-quants' group
scales are products (d x sc) that float16 cannot hold exactly, so theirs are float32.
MXFP4 (gpt-oss's experts) is mlx's own `mxfp4` mode, its nibbles reordered. Q2_K, Q3_K
and Q6_K (16-weight groups, which mlx's affine layout does not have) and the rest are
expanded to float16. The result matches what `mx.load` itself makes of a Q4_0,
Q4_1 or Q8_0 GGUF, but `mx.load` refuses a whole file when any tensor is of another type
(a Q4_K_M file mixes Q4_K and Q6_K), so the blocks are read here instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.errors import CheckpointError

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

GROUP_SIZE = 32  # weights per affine group in every repacked type
NATIVE_BITS = {
    GGMLType.Q4_0: 4,
    GGMLType.Q4_1: 4,
    GGMLType.Q8_0: 8,
    GGMLType.Q5_0: 8,
    GGMLType.Q5_1: 8,
    GGMLType.Q4_K: 4,
    GGMLType.Q5_K: 8,
    GGMLType.MXFP4: 4,  # mlx's own mxfp4 (gpt-oss's experts), not affine
}
MODES = {GGMLType.MXFP4: "mxfp4"}  # the types kept in a mode other than affine
# Expanded to float16, the precision of their own scales (Q6_K: float16 d times 8-bit
# sub-scales and 6-bit codes), by the gguf package's decoders.
DEQUANTIZED = (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q6_K)
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
    """[..., rows, bytes] of GGUF blocks -> mlx's packed uint32 weight, scales and biases
    (group 32), of the same leading shape.

    mlx stores weight i of a row in word i // (32 // bits) at bit (i % per-word) * bits,
    little-endian, and dequantizes `code * scale + bias`.
    """
    leading = blocks.shape[:-1]
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    if kind == GGMLType.MXFP4:
        words, exponents = _mxfp4(blocks.reshape(-1, block_bytes))
        return {
            hf_name: words.reshape(*leading, -1).view(np.uint32),
            f"{hf_name.removesuffix('.weight')}.scales": exponents.reshape(*leading, -1),
        }
    codes, scales, biases = _AFFINE_GROUPS[kind](blocks.reshape(-1, block_bytes))
    if NATIVE_BITS[kind] == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    prefix = hf_name.removesuffix(".weight")
    return {
        hf_name: np.ascontiguousarray(codes, dtype=np.uint8).reshape(*leading, -1).view(np.uint32),
        f"{prefix}.scales": np.ascontiguousarray(scales).reshape(*leading, -1),
        f"{prefix}.biases": np.ascontiguousarray(biases).reshape(*leading, -1),
    }


# Each returns ([groups, 32] uint8 codes, [groups] scales, [groups] biases) for a type's
# [blocks, bytes]: weight j of a group is `codes[j] * scale + bias`, as the type decodes it.
AffineGroups = tuple[np.ndarray, np.ndarray, np.ndarray]


def _halves(nibbles: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: byte j holds weight j (low nibble) and j + 16."""
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes -> [n, 32]: bit i of the little-endian word, weight i's fifth bit."""
    return (np.unpackbits(qh, axis=1, bitorder="little") << 4).astype(np.uint8)


def _mxfp4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 17] MXFP4 blocks -> ([n, 16] bytes in mlx's order, [n] uint8 exponents).

    A block is its shared exponent e (E8M0), then 16 bytes of 4-bit E2M1 codes, weight j
    in byte j's low nibble and weight j + 16 in its high one; ggml decodes it as twice
    the E2M1 value times 2^(e - 128), which is mlx's mxfp4 (the E2M1 value times
    2^(e - 127)) with the same code and exponent: only the nibbles move, to weight i in
    byte i // 2 (low nibble first)."""
    codes = _halves(blocks[:, 1:])
    return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)), np.ascontiguousarray(blocks[:, 0])


def _q8_0(blocks: np.ndarray) -> AffineGroups:
    d = blocks[:, 0:2].view(np.float16)[:, 0]
    # int8 q * d == (q + 128) * d - 128 * d: shift to the unsigned codes mlx expects.
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, (d * np.float16(-128)).astype(np.float16)


def _q4_0(blocks: np.ndarray) -> AffineGroups:  # (q - 8) * d
    d = blocks[:, 0:2].view(np.float16)[:, 0]
    return _halves(blocks[:, 2:]), d, (d * np.float16(-8)).astype(np.float16)


def _q4_1(blocks: np.ndarray) -> AffineGroups:  # q * d + m
    d, m = blocks[:, 0:2].view(np.float16)[:, 0], blocks[:, 2:4].view(np.float16)[:, 0]
    return _halves(blocks[:, 4:]), d, m


def _q5_0(blocks: np.ndarray) -> AffineGroups:  # (q - 16) * d, exactly q * d - 16 * d
    d = blocks[:, 0:2].view(np.float16)[:, 0].astype(np.float32)
    codes = _halves(blocks[:, 6:]) | _high_bits(blocks[:, 2:6])
    return codes, d, d * np.float32(-16)


def _q5_1(blocks: np.ndarray) -> AffineGroups:  # q * d + m
    d, m = blocks[:, 0:2].view(np.float16)[:, 0], blocks[:, 2:4].view(np.float16)[:, 0]
    return _halves(blocks[:, 8:]) | _high_bits(blocks[:, 4:8]), d, m


def _k_quant_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K/Q5_K superblock's eight group scales d * sc and biases -(dmin * m), float32
    (as the gguf package computes them), and what follows its 16-byte head."""
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] 6-bit each
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32)), blocks[:, 16:]


def _q4_k_codes(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n * 8, 32]: 32 bytes a pair of groups, the low nibbles the
    first group's codes, the high nibbles the second's."""
    pairs = qs.reshape(-1, 4, 32)
    return np.stack([pairs & 0x0F, pairs >> 4], axis=2).reshape(-1, 32)


def _q4_k(blocks: np.ndarray) -> AffineGroups:
    scales, biases, qs = _k_quant_groups(blocks)
    return _q4_k_codes(qs), scales.reshape(-1), biases.reshape(-1)


def _q5_k(blocks: np.ndarray) -> AffineGroups:
    scales, biases, rest = _k_quant_groups(blocks)
    qh, qs = rest[:, :32], rest[:, 32:]
    # Bit g of qh's byte j is the fifth bit of weight j of group g.
    fifth = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    codes = _q4_k_codes(qs) | (fifth.reshape(-1, 32) << 4).astype(np.uint8)
    return codes, scales.reshape(-1), biases.reshape(-1)


_AFFINE_GROUPS: dict[GGMLType, Callable[[np.ndarray], AffineGroups]] = {
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
}


def quantization_config(packing_by_layer: dict[str, tuple[int, str]]) -> dict[str, Any] | None:
    """config.json's `quantization` for the repacked layers ({module path: (bits, mode)}):
    group 32, 4-bit affine by default (else the first layer's packing), per-layer entries
    for the others; None when there are none."""
    if not packing_by_layer:
        return None
    packings = list(packing_by_layer.values())
    default = (4, "affine") if (4, "affine") in packings else packings[0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default[0], "mode": default[1]}
    for layer, (bits, mode) in packing_by_layer.items():
        if (bits, mode) != default:
            config[layer] = {"group_size": GROUP_SIZE, "bits": bits, "mode": mode}
    return config
