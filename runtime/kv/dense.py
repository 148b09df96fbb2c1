"""Dense KV storage: every row owns one slot of a preallocated per-layer pool.

    keys[layer], values[layer]: [num_slots * n_kv_heads * capacity, head_dim]
    viewed for attention as     [num_slots, n_kv_heads, capacity, head_dim]

    slot 0 | row a: t0 t1 t2 t3 t4 .  .  . |
    slot 1 | (free)                        |
    slot 2 | row b: t0 t1 .  .  .  .  .  . |

A row joining takes a free slot and a row leaving gives it back: no other row's
keys or values move (mlx-lm's BatchKVCache re-copies the whole batch on every
join and leave). A batched decode attends over the slot span `[lo, hi)` with a
per-row length mask; only `capacity` growth, in `grow_by` steps, copies the pool.

The pools are stored flat so a step's writes are one single-index scatter of
head_dim-wide rows: 4x faster on CPU than scattering with (slot, head, position)
index arrays (0.025 vs 0.108 ms a layer at B=16), and still in place.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from runtime.errors import CapacityError
from runtime.kv.base import KVState, RowSpan

import mlx.core as mx

from kernels.decode_attention import decode_attention


class DenseKV:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_length: int,
        dtype: mx.Dtype = mx.float32,
        grow_by: int = 256,
    ):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_slots = num_slots
        self.max_length = max_length
        self.dtype = dtype
        self.grow_by = grow_by
        self.capacity = 0
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self._free_slots = list(range(num_slots))  # a heap: the lowest slot first keeps spans dense

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def allocate(self) -> int:
        if not self._free_slots:
            raise CapacityError(f"all {self.num_slots} KV slots are in use")
        return heapq.heappop(self._free_slots)

    def free(self, slot: int) -> None:
        # Stale keys stay behind: every read is masked by the row's length.
        heapq.heappush(self._free_slots, slot)

    def forward(self, rows: Sequence[RowSpan]):
        self._ensure_capacity(max(r.start + r.num_new for r in rows))
        if all(r.num_new == 1 for r in rows):
            return _DecodeView(self, rows)
        if len(rows) == 1:
            return _PieceView(self, rows[0])
        raise ValueError("dense KV runs multi-token pieces one row at a time")

    def view(self, pool: mx.array) -> mx.array:
        """A flat pool as [num_slots, n_kv_heads, capacity, head_dim], without a copy."""
        return pool.reshape(self.num_slots, self.num_kv_heads, self.capacity, self.head_dim)

    def rows(self, slots: mx.array, positions: mx.array) -> mx.array:
        """Flat pool rows of every head at `positions` of each slot, in [N, Hkv, T] order.

        slots [N], positions [N, T] -> [N * Hkv * T]: the order of `k.reshape(-1, D)`
        for keys shaped [N, Hkv, T, D].
        """
        heads = mx.arange(self.num_kv_heads)[None, :, None]
        slot_heads = slots[:, None, None] * self.num_kv_heads + heads  # [N, Hkv, 1]
        return (slot_heads * self.capacity + positions[:, None, :]).reshape(-1)

    def export(self, slot: int, length: int) -> KVState:
        layers = tuple(
            (
                mx.contiguous(self.view(k)[slot, :, :length]),
                mx.contiguous(self.view(v)[slot, :, :length]),
            )
            for k, v in zip(self.keys, self.values, strict=True)
        )
        mx.eval(layers)
        return KVState(length=length, layers=layers)

    def load(self, slot: int, state: KVState) -> None:
        self._ensure_capacity(state.length)
        rows = self.rows(mx.array([slot]), mx.arange(state.length)[None, :])
        for layer, (k, v) in enumerate(state.layers):
            self.keys[layer][rows] = k.reshape(-1, self.head_dim)
            self.values[layer][rows] = v.reshape(-1, self.head_dim)

    def _ensure_capacity(self, length: int) -> None:
        if length <= self.capacity:
            return
        if length > self.max_length:
            raise CapacityError(f"{length} tokens exceed the KV limit of {self.max_length}")
        new_capacity = min(self.max_length, -(-length // self.grow_by) * self.grow_by)
        shape = (self.num_slots, self.num_kv_heads, new_capacity, self.head_dim)
        for pools in (self.keys, self.values):
            for layer in range(self.num_layers):
                grown = mx.zeros(shape, dtype=self.dtype)
                if self.capacity:
                    grown[:, :, : self.capacity] = self.view(pools[layer])
                    pools[layer] = grown.reshape(-1, self.head_dim)
                else:
                    pools.append(grown.reshape(-1, self.head_dim))
        # Materialise now so the copy is not re-run inside every later step's graph.
        mx.eval(self.keys, self.values)
        self.capacity = new_capacity


class _DecodeView:
    """One new token for each of B rows, in any slots."""

    def __init__(self, storage: DenseKV, rows: Sequence[RowSpan]):
        self._storage = storage
        slots = [r.slot for r in rows]
        starts = [r.start for r in rows]
        self.offsets = mx.array(starts, dtype=mx.int32)  # [B]
        self._lo, hi = min(slots), max(slots) + 1
        self._length = max(starts) + 1
        self._is_dense = slots == list(range(self._lo, hi))
        self._write_rows = storage.rows(mx.array(slots), self.offsets[:, None])
        # Lengths over the whole span; a gap slot sees one stale key and its output is dropped.
        span_lengths = [1] * (hi - self._lo)
        for slot, start in zip(slots, starts, strict=True):
            span_lengths[slot - self._lo] = start + 1
        if self._is_dense and len(set(span_lengths)) == 1:
            self._mask = None
        else:
            lengths = mx.array(span_lengths, dtype=mx.int32)
            self._mask = (mx.arange(self._length)[None, :] < lengths[:, None])[:, None, None, :]
        self._rows_in_span = None if self._is_dense else mx.array([s - self._lo for s in slots])
        self._span = hi - self._lo

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        s = self._storage
        s.keys[layer][self._write_rows] = k.reshape(-1, s.head_dim)  # [B * Hkv, D] rows
        s.values[layer][self._write_rows] = v.reshape(-1, s.head_dim)
        hi = self._lo + self._span
        keys = s.view(s.keys[layer])[self._lo : hi, :, : self._length]  # [S, Hkv, L, D]
        values = s.view(s.values[layer])[self._lo : hi, :, : self._length]
        if self._rows_in_span is None:
            return decode_attention(q, keys, values, scale, self._mask)
        q_span = mx.zeros((self._span, *q.shape[1:]), dtype=q.dtype)  # [S, H, 1, D]
        q_span[self._rows_in_span] = q
        return decode_attention(q_span, keys, values, scale, self._mask)[self._rows_in_span]


class _PieceView:
    """T new tokens of one row: a prefill chunk."""

    def __init__(self, storage: DenseKV, row: RowSpan):
        self._storage = storage
        self._row = row
        self.offsets = row.start
        end = row.start + row.num_new
        self._write_rows = storage.rows(mx.array([row.slot]), mx.arange(row.start, end)[None, :])
        if row.start == 0:
            self._mask: mx.array | str = "causal"
        else:
            query_pos = mx.arange(row.start, end)[:, None]  # [T, 1]
            self._mask = mx.arange(end)[None, :] <= query_pos  # [T, start+T]

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        s, r = self._storage, self._row
        end = r.start + r.num_new
        s.keys[layer][self._write_rows] = k.reshape(-1, s.head_dim)  # [Hkv * T, D] rows
        s.values[layer][self._write_rows] = v.reshape(-1, s.head_dim)
        keys = s.view(s.keys[layer])[r.slot : r.slot + 1, :, :end]  # [1, Hkv, start+T, D]
        values = s.view(s.values[layer])[r.slot : r.slot + 1, :, :end]
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=self._mask)
