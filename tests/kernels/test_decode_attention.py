"""Decode attention kernels against the plain-attention reference."""

import mlx.core as mx
import pytest

from kernels.decode_attention import decode_attention, grouped_decode_attention, reference_attention


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("L", [17, 100])  # 3 x 100 keys takes the grouped path
def test_grouped_matches_reference(heads, kv_heads, masked, L):
    B, D = 3, 16
    mx.random.seed(heads * 10 + kv_heads)
    q = mx.random.normal((B, heads, 1, D))
    k, v = mx.random.normal((B, kv_heads, L, D)), mx.random.normal((B, kv_heads, L, D))
    mask = None
    if masked:
        lengths = mx.array([L, 5, 1])
        mask = (mx.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
    want = reference_attention(q, k, v, 0.25, mask)
    for kernel in (grouped_decode_attention, decode_attention):
        assert mx.allclose(kernel(q, k, v, 0.25, mask), want, atol=1e-5).item()
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert mx.allclose(fused, want, atol=1e-5).item()


def test_masked_keys_have_no_influence():
    q = mx.random.normal((1, 4, 1, 8))
    k, v = mx.random.normal((1, 2, 6, 8)), mx.random.normal((1, 2, 6, 8))
    mask = (mx.arange(6) < 3)[None, None, None, :]
    garbage_k = mx.concatenate([k[:, :, :3], 1e4 * mx.ones((1, 2, 3, 8))], axis=2)
    garbage_v = mx.concatenate([v[:, :, :3], 1e4 * mx.ones((1, 2, 3, 8))], axis=2)
    a = grouped_decode_attention(q, k, v, 0.3, mask)
    b = grouped_decode_attention(q, garbage_k, garbage_v, 0.3, mask)
    assert mx.allclose(a, b, atol=1e-5).item()
