"""The one KV-cache interface the models see, whatever the storage behind it.

A storage backend keeps the keys and values of many sequences ("rows"), each in
its own slot. For every forward the engine asks it for a `ForwardKV`: a view of
the rows taking part, with where each row's new tokens go. The model calls
`kv.attend(layer, q, k, v, scale)` in every layer and never branches on storage,
so a paged backend can replace the dense one without touching a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import mlx.core as mx


@attrs.frozen
class RowSpan:
    """One row's part in a forward: `num_new` tokens appended after `start` cached ones."""

    slot: int
    start: int
    num_new: int


@attrs.frozen
class KVState:
    """A row's keys and values copied out of storage, for snapshot/restore.

    `layers[i]` is `(keys, values)`, each `[num_kv_heads, length, head_dim]`.
    """

    length: int
    layers: tuple[tuple[mx.array, mx.array], ...]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class ForwardKV(Protocol):
    """The KV view for one forward over rows `[B]` with `T` new tokens each."""

    @property
    def offsets(self) -> mx.array | int:
        """Position of each row's first new token: an int, or `[B]` int32."""
        ...

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Store `k`, `v` and attend `q` over the row's whole history.

        q: [B, n_heads, T, head_dim]; k, v: [B, n_kv_heads, T, head_dim].
        Returns [B, n_heads, T, head_dim].
        """
        ...


class KVStorage(Protocol):
    num_slots: int

    def allocate(self) -> int: ...

    def free(self, slot: int) -> None: ...

    def forward(self, rows: Sequence[RowSpan]) -> ForwardKV: ...

    def export(self, slot: int, length: int) -> KVState: ...

    def load(self, slot: int, state: KVState) -> None: ...

    @property
    def num_free_slots(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class CausalNoCache:
    """`ForwardKV` for a plain causal forward with no cache (training, scoring)."""

    offsets = 0

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        mask = "causal" if q.shape[2] > 1 else None
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
