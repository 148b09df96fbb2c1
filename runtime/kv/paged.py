"""Paged KV storage: fixed-size blocks in one preallocated pool per layer.

    keys[layer], values[layer]: [n_kv_heads * num_blocks * block_size, head_dim]

Layers are grouped by attention kind (runtime/kv/layout.py), each group with its
own block ids and its own table per row; a layer's pool has as many blocks as its
group. Without windowed layers there is one group of all layers.

    row a, table (3, 0, 5):  positions 0-15 in block 3, 16-31 in block 0, 32-  in block 5

A row holds exactly the blocks its tokens need (the policy's `BlockPool` decides
which), so a 6,000-token request costs 6,000 tokens of KV, not a slot per row at
the longest row's length, and a prefix cached by one request is read in place by
the next. Writes are one single-index scatter of head_dim-wide rows per layer.

`forward` turns a step's row spans into a `PagedForward`, the `ForwardKV` the
model sees. The block-table array is cached across steps while no row gained a
block and `epoch` (the pool's move counter) is unchanged; per-row lengths and
positions are recomputed every step.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.kv.base import Rotary, RowSpan, attend_stacked_by_parts
from runtime.kv.layout import NULL_BLOCK, SIZING_CHUNK, KVLayout
from runtime.kv.recurrent import RecurrentStep

import attrs
import mlx.core as mx
import numpy as np

from kernels.fused_blocks import NormedLayers
from kernels.paged_attention import PagedStep, dispatch, paged_attention

# The pools are this storage's own: only the attention ops read and write them, each
# layer's in one stream's order, and nothing keeps an old version to read later. So the
# native ops write a step's K/V into the pools' buffers even when mlx still holds them
# for an op queued before (see take_pool, kernels/cpu/attention_ops.h): a step queued
# while the one before it runs would otherwise copy every pool it writes.
POOLS_IN_PLACE = True


class PagedKV:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_queries_per_kv: int,
        num_blocks: int,
        block_size: int,
        dtype: mx.Dtype = mx.float32,
        layer_windows: tuple[int | None, ...] = (),
        max_rows: int = 1,
        layer_shapes: tuple[tuple[int, int], ...] = (),
    ):
        """`num_blocks` is group 0's (every layer's without windows); a windowed
        group gets enough for `max_rows` rows (runtime/kv/layout.py). `layer_shapes`:
        each layer's (KV heads, head dim) where they differ by group (Gemma 4's full
        layers have wider heads than its sliding ones); empty: `num_kv_heads`, `head_dim`."""
        layout = KVLayout.for_layers(num_layers, layer_windows)
        sizes = [num_blocks, *layout.windowed_pool_blocks(block_size, max_rows)]
        self.layout = attrs.evolve(layout, group_num_blocks=tuple(sizes))
        self.group_shapes = group_shapes(self.layout, layer_shapes, (num_kv_heads, head_dim))
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_heads = num_queries_per_kv * num_kv_heads
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.num_slots = num_blocks * block_size  # group 0's
        shapes = [
            (self.group_shapes[g][0] * sizes[g] * block_size, self.group_shapes[g][1])
            for g in self.layout.group_of_layer
        ]
        self.keys = [mx.zeros(shape, dtype=dtype) for shape in shapes]
        self.values = [mx.zeros(shape, dtype=dtype) for shape in shapes]
        mx.eval(self.keys, self.values)
        self.num_table_builds = 0  # block-table arrays built (the rest were reused)
        self._tables: tuple[tuple, list[mx.array]] | None = None

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: mx.Dtype
    ) -> int:
        """A block's bytes when it holds `num_layers` layers (a group's)."""
        return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.size

    @staticmethod
    def sizing(
        layout: KVLayout,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: mx.Dtype,
        max_rows: int,
        layer_shapes: tuple[tuple[int, int], ...] = (),
    ) -> tuple[int, int]:
        """(bytes of one group-0 block, bytes the windowed groups' pools take for `max_rows`)."""
        shapes = group_shapes(layout, layer_shapes, (num_kv_heads, head_dim))
        blocks = _group_block_bytes(layout, shapes, block_size, dtype)
        pool_blocks = layout.windowed_pool_blocks(block_size, max_rows)
        windowed = sum(n * b for n, b in zip(pool_blocks, blocks[1:], strict=True))
        return blocks[0], windowed

    def row_bytes(self, num_tokens: int) -> tuple[int, int]:
        """Peak KV bytes one row of `num_tokens` holds: with this layout, and were every
        layer full (the same with no windowed layers)."""
        group_bytes = _group_block_bytes(self.layout, self.group_shapes, self.block_size, self.dtype)
        held = sum(
            self.layout.row_blocks(g, num_tokens, self.block_size, SIZING_CHUNK) * b
            for g, b in enumerate(group_bytes)
        )
        return held, -(-num_tokens // self.block_size) * sum(group_bytes)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def forward(
        self, rows: Sequence[RowSpan], epoch: int, recurrent: RecurrentStep | None = None
    ) -> PagedForward:
        """`recurrent`: the rows' linear-attention states, for a hybrid model."""
        for row in rows:
            if len(row.tables) != self.layout.num_groups:
                raise ValueError(
                    f"row {row.seq_id}: {len(row.tables)} block tables for {self.layout.num_groups} layer groups"
                )
            if any(len(table) * self.block_size < row.end for table in row.tables):
                raise ValueError(f"row {row.seq_id}: {len(row.blocks)} blocks cannot hold {row.end} positions")
        steps = [
            PagedStep(
                tables=table,
                starts=tuple(r.start for r in rows),
                num_new=tuple(r.num_new for r in rows),
                block_size=self.block_size,
                num_slots=num_blocks * self.block_size,
                num_kv_heads=kv_heads,
                num_queries_per_kv=self.num_heads // kv_heads,
                window=window,
                is_float32=self.keys[0].dtype == mx.float32,
            )
            for table, window, num_blocks, (kv_heads, _) in zip(
                self._block_tables(rows, epoch),
                self.layout.group_windows,
                self.layout.group_num_blocks,
                self.group_shapes,
                strict=True,
            )
        ]
        return PagedForward(self, steps, recurrent)

    def _block_tables(self, rows: Sequence[RowSpan], epoch: int) -> list[mx.array]:
        """Per layer group [R, max_blocks] int32, reused while the same rows hold the same blocks."""
        key = (epoch, tuple((r.seq_id, len(r.blocks)) for r in rows))
        if self._tables is not None and self._tables[0] == key:
            return self._tables[1]
        width = max(len(r.blocks) for r in rows)
        arrays = []
        for group in range(self.layout.num_groups):
            # A pad, masked, repeats the row's last block: the fast path reads whole
            # blocks, and a block of another row's (block 0 was) may hold its overflow's
            # NaN, which a masked score times does not drop.
            table = np.empty((len(rows), width), dtype=np.int32)
            for i, row in enumerate(rows):
                blocks = row.tables[group]
                table[i, : len(blocks)] = blocks
                table[i, len(blocks) :] = blocks[-1]
            last = table[:, -1:]  # out of the window, unread: any block held will do
            arrays.append(mx.array(np.where(table == NULL_BLOCK, last, table)))
        self.num_table_builds += 1
        self._tables = (key, arrays)
        return arrays


def group_shapes(
    layout: KVLayout, layer_shapes: tuple[tuple[int, int], ...], every_layer: tuple[int, int]
) -> tuple[tuple[int, int], ...]:
    """Each group's (KV heads, head dim), from each layer's (`layer_shapes`; empty: all
    `every_layer`): one per group, since its layers share block ids."""
    layer_shapes = layer_shapes or (every_layer,) * len(layout.group_of_layer)
    if len(layer_shapes) != len(layout.group_of_layer):
        raise ValueError(f"{len(layer_shapes)} layer shapes for {len(layout.group_of_layer)} layers")
    shapes = []
    for layers in layout.group_layers:
        kinds = {layer_shapes[layer] for layer in layers}
        if len(kinds) != 1:
            raise ValueError(f"layers {layers} share block ids but differ in KV shape: {sorted(kinds)}")
        shapes.append(kinds.pop())
    return tuple(shapes)


def _group_block_bytes(
    layout: KVLayout, shapes: tuple[tuple[int, int], ...], block_size: int, dtype: mx.Dtype
) -> list[int]:
    """A block's bytes in each group: its layers' K and V at the group's shape."""
    return [
        PagedKV.bytes_per_block(len(layers), *shape, block_size, dtype)
        for layers, shape in zip(layout.group_layers, shapes, strict=True)
    ]


class PagedForward:
    """The `ForwardKV` of one ragged step; the attention path is chosen once, here.
    `steps[g]` is layer group g's view of the step (its tables and window)."""

    def __init__(self, storage: PagedKV, steps: list[PagedStep], recurrent: RecurrentStep | None = None):
        self._storage = storage
        self.recurrent = recurrent
        self.steps = steps
        self.step = steps[0]
        self.path = dispatch(self.step)

    @property
    def positions(self) -> mx.array:
        return self.step.positions

    def attend(
        self,
        layer: int,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        softcap: float = 0.0,
        sinks: mx.array | None = None,
    ) -> mx.array:
        s = self._storage
        step = self.steps[s.layout.group_of_layer[layer]]
        return paged_attention(
            (s.keys, s.values), layer, q, k, v, scale, step, self.path, POOLS_IN_PLACE, softcap, sinks
        )

    def attend_shared(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float = 0.0
    ) -> mx.array:
        """See ForwardKV.attend_shared. The native op writes as it attends: it writes `k`, `v`
        again, in place and unchanged; the other paths only read."""
        s = self._storage
        step = self.steps[s.layout.group_of_layer[layer]]
        if self.path == "native":
            return self.attend(layer, q, k, v, scale, softcap)
        plan = step.fast if self.path == "fast" else step.gather
        return plan.attend(s.keys[layer], s.values[layer], q, scale, softcap, None)

    def attend_stacked(
        self, layer: int, qkv: mx.array, rope: Rotary, num_heads: int, num_kv_heads: int, scale: float
    ) -> mx.array:
        """On the native path with a rotary table (`RoPE`), one op: the rotation, the K/V
        write and attention (kernels/cpu/attention_ops.h); otherwise by parts."""
        inv_freqs = getattr(rope, "inv_freqs", None)
        if self.path != "native" or inv_freqs is None or qkv.dtype != mx.float32:
            return attend_stacked_by_parts(self, layer, qkv, rope, num_heads, num_kv_heads, scale)
        s = self._storage
        step = self.steps[s.layout.group_of_layer[layer]]
        keys, values = s.keys, s.values
        out, keys[layer], values[layer] = step.native.rotate_write_and_attend(
            keys[layer], values[layer], qkv, num_heads, inv_freqs, rope.scale, scale, POOLS_IN_PLACE  # type: ignore[attr-defined]
        )
        return out

    def residual_attention(
        self,
        layer: int,
        x: mx.array,
        block: NormedLayers,
        rope: Rotary,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
    ) -> mx.array | None:
        """One op on the native path for few rows (kernels/fused_blocks.py), else None."""
        inv_freqs = getattr(rope, "inv_freqs", None)
        if self.path != "native" or inv_freqs is None:
            return None
        s = self._storage
        step = self.steps[s.layout.group_of_layer[layer]]
        keys, values = s.keys, s.values
        written = step.native.residual_attention(
            x, block, keys[layer], values[layer], num_heads, inv_freqs, rope.scale, scale,  # type: ignore[attr-defined]
            POOLS_IN_PLACE,
        )
        if written is None:
            return None
        out, keys[layer], values[layer] = written
        return out

    def convolve(self, layer: int, x: mx.array, weight: mx.array) -> mx.array:
        return self._recurrent.convolve(layer, x, weight)

    def delta_rule(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array
    ) -> mx.array:
        return self._recurrent.delta_rule(layer, q, k, v, log_decay, beta)

    def ssm_scan(
        self, layer: int, x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array
    ) -> mx.array:
        return self._recurrent.ssm_scan(layer, x, dt, B, C, log_decay)

    @property
    def _recurrent(self) -> RecurrentStep:
        if self.recurrent is None:
            raise ValueError("a linear-attention layer in a forward without recurrent state")
        return self.recurrent
