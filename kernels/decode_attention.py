"""Decode attention (one new query token per row) with a measured choice of kernel.

On the CPU, mlx's `scaled_dot_product_attention` has no fused kernel: its fallback
expands grouped K/V heads and runs mlx's slow exp. The grouped kernel folds the
query heads that share a KV head into the rows of one matmul and uses the
polynomial exp (kernels/poly_exp.py), but costs a dozen ops. Measured on a 2-core
x86 box, 16 layers of 16 query / 4 KV heads, D=64, ms per step:

    B x L      1x64  2x64  4x64  1x192  2x192  16x192  1x1024  16x1024
    grouped    2.2   2.7   3.1   2.7    3.4    11.1    4.8     70
    mx.fast    0.9   1.8   3.0   2.3    4.3    29.3    10.1    163

so below ~256 keys per step in all the op count dominates and mx.fast wins.
GPUs always use mx.fast's fused kernels.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.fast_softmax import softmax_last_axis

SMALL_ATTENTION_KEYS = 256  # B * L at or below which mx.fast's fewer ops win on CPU


def decode_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None
) -> mx.array:
    """q [B, H, 1, D]; k, v [B, Hkv, L, D]; mask [B, 1, 1, L] bool or None -> [B, H, 1, D]."""
    if mx.default_device() == mx.cpu and k.shape[0] * k.shape[2] > SMALL_ATTENTION_KEYS:
        return grouped_decode_attention(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def grouped_decode_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None
) -> mx.array:
    B, H, _, D = q.shape
    num_kv_heads = k.shape[1]
    grouped = q.reshape(B, num_kv_heads, H // num_kv_heads, D)  # query heads sharing a KV head
    scores = (grouped * scale) @ k.swapaxes(-1, -2)  # [B, Hkv, H/Hkv, L]
    return (softmax_last_axis(scores, mask) @ v).reshape(B, H, 1, D)


def reference_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None
) -> mx.array:
    """Plain attention with K/V heads repeated: the definition the kernels must match."""
    repeat = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)  # [B, H, 1, L]
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1, precise=True) @ v
