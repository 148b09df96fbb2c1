"""The one KV-cache interface the models see, whatever the storage behind it.

A step is a ragged batch: the new tokens of every row in it, concatenated into
one flat batch `[N]`. For every forward the engine asks the storage for a
`ForwardKV`: each token's position and where the rows' keys and values live.
The model calls `kv.attend(layer, q, k, v, scale)` in every layer and never
branches on storage or on prefill versus decode.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import mlx.core as mx


@attrs.frozen
class RowSpan:
    """One row's part in a step: K/V for positions `[start, start + num_new)` is
    computed and stored in `blocks` (the row's block table, covering at least
    `start + num_new` positions); the row attends over positions `[0, start + num_new)`,
    or the last `window` of them in a sliding-window layer. A model with windowed layers
    has several layer groups, each with its own table (runtime/kv/layout.py): `blocks`
    is the first's, `group_tables` the others'."""

    seq_id: int
    start: int
    num_new: int
    blocks: tuple[int, ...]
    group_tables: tuple[tuple[int, ...], ...] = ()

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        return (self.blocks, *self.group_tables)

    @property
    def end(self) -> int:
        return self.start + self.num_new


class ForwardKV(Protocol):
    """The KV view for one forward over `N` new tokens."""

    @property
    def positions(self) -> mx.array:
        """Each new token's position in its row: `[N]` int32 (RoPE offsets)."""
        ...

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Store `k`, `v` and attend each query over its row's history up to its own position.

        q: [N, n_heads, head_dim]; k, v: [N, n_kv_heads, head_dim]. Returns [N, n_heads, head_dim].
        """
        ...


class CausalNoCache:
    """`ForwardKV` for a plain causal forward over `[B, T]` tokens with no cache (training,
    scoring). `windows[layer]`: that layer's sliding window, or None (see ModelConfig)."""

    def __init__(self, batch: int, length: int, windows: tuple[int | None, ...] = ()):
        self.batch, self.length, self.windows = batch, length, windows
        self.positions = mx.tile(mx.arange(length, dtype=mx.int32), batch)  # [B * T]

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        B, T = self.batch, self.length

        def heads_first(x: mx.array) -> mx.array:  # [B*T, H, D] -> [B, H, T, D]
            return x.reshape(B, T, *x.shape[1:]).transpose(0, 2, 1, 3)

        window = self.windows[layer] if self.windows else None
        mask: mx.array | str | None = "causal" if T > 1 else None
        if window is not None and window < T:
            query, key = mx.arange(T)[:, None], mx.arange(T)[None, :]
            mask = (key <= query) & (key > query - window)  # [T, T]
        out = mx.fast.scaled_dot_product_attention(
            heads_first(q), heads_first(k), heads_first(v), scale=scale, mask=mask
        )
        return out.transpose(0, 2, 1, 3).reshape(B * T, *q.shape[1:])
