"""Which layers share a block table: full-attention layers, and sliding-window ones.

A model whose layers all attend to the whole row (llama, qwen) has one group: a
block holds `block_size` positions of every layer.

A model that mixes sliding-window (local) layers with full (global) ones, like
Gemma 3's five local to one global, gets one group per kind, full first. Each
group has its own block pool and its own block table per row, and each layer its
own storage array (runtime/kv/paged.py):

    Gemma 3 1B: 26 layers, 4 global (5, 11, 17, 23), 22 local, window 512
    group 0 (full):   the 4 global layers; a block = 16 positions x 4 layers
    group 1 (window): the 22 local layers; a block = 16 positions x 22 layers

    row of 2,000 tokens, block size 16: group 0 holds all 125 of its blocks; group 1
    holds the ~33 covering the last 512 positions: the blocks that fell out of the
    window went back to its pool while the row went on.

A local group's table keeps its length (position p stays in entry p // block_size),
with `NULL_BLOCK` in the entries whose blocks went back: attention never reads
them, because a query at position q sees only keys (q - window, q].

Group 0's pool is the one the scheduling policy reasons about (admission,
growth, preemption) and the KV budget sizes. A windowed group's pool is sized for
`max_rows` rows at their largest (the window before a chunk, and the chunk), so
it never binds. Why not one pool shared by all groups, as vLLM's hybrid manager
does? That needs one storage array shared by several layers, and mlx copies an
array that is written after another layer of the same step read it: measured, six
layers sharing one 64 MB array took 533 ms a step against 0.5 ms with one array each.
"""

from __future__ import annotations

import attrs

NULL_BLOCK = -1  # a table entry whose block fell out of the window and went back
# The longest span a row computes at once, for sizing windowed pools: the scheduler's
# default solo prefill (DEFAULT_SOLO_PREFILL_TOKENS). A longer chunk is shrunk to the
# windowed blocks free beyond one per row (BlockPool.num_growable), never refused.
SIZING_CHUNK = 512


@attrs.frozen
class KVLayout:
    group_windows: tuple[int | None, ...]  # per group: its layers' window, None for full
    group_layers: tuple[tuple[int, ...], ...]
    group_of_layer: tuple[int, ...]
    # Blocks in each group's pool, once storage is sized (empty before).
    group_num_blocks: tuple[int, ...] = ()

    @classmethod
    def for_layers(cls, num_layers: int, windows: tuple[int | None, ...] = ()) -> KVLayout:
        """`windows[layer]` (empty: all full) -> one group per kind, full first."""
        windows = windows or (None,) * num_layers
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        layers = tuple(tuple(i for i, w in enumerate(windows) if w == kind) for kind in kinds)
        group_of = tuple(kinds.index(w) for w in windows)
        return cls(tuple(kinds), layers, group_of)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def is_windowed(self) -> bool:
        return any(w is not None for w in self.group_windows)

    def describe(self) -> str:
        """e.g. "4 full layers + 22 sliding-window (512) layers"."""
        return " + ".join(
            f"{len(layers)} full layers" if w is None else f"{len(layers)} sliding-window ({w}) layers"
            for w, layers in zip(self.group_windows, self.group_layers, strict=True)
        )

    def row_blocks(self, group: int, num_tokens: int, block_size: int, max_chunk: int = SIZING_CHUNK) -> int:
        """The most blocks of `group` a row of `num_tokens` holds at once, computed in
        chunks of at most `max_chunk`: all of them in a full group; in a windowed one
        those covering the window before a chunk and the chunk itself."""
        full = -(-num_tokens // block_size)
        window = self.group_windows[group]
        if window is None:
            return full
        return min(full, -(-(window - 1 + max_chunk) // block_size) + 1)

    def windowed_pool_blocks(self, block_size: int, max_rows: int) -> tuple[int, ...]:
        """Blocks of each windowed group's pool (groups 1..): `max_rows` rows at their largest."""
        return tuple(
            max_rows * self.row_blocks(g, 1 << 40, block_size) for g in range(1, self.num_groups)
        )

    def first_needed_block(self, group: int, next_position: int, block_size: int) -> int:
        """Entries of `group`'s table before this are never read by a query at
        `next_position` or later (0 for full groups)."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, next_position - window + 1) // block_size

    def max_row_tokens(self, num_blocks: int, block_size: int) -> int:
        """The longest row group 0's `num_blocks` blocks hold."""
        # Every layer windowed: a row stops growing once it holds its window and the next
        # token, unless the pool is smaller than that (a tiny --kv-budget); it would stall
        # there, so it ends when it fills the pool, as a full group's row does.
        if self.group_windows[0] is not None and num_blocks >= self.row_blocks(0, 1 << 40, block_size, 1):
            return 1 << 40
        return num_blocks * block_size
