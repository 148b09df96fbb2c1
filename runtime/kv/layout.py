"""Which layers share a block table: full-attention layers, and sliding-window ones.

A model whose layers all attend to the whole row (llama, qwen) has one group: a
block holds `block_size` positions of every layer, as before windows existed.

A model that mixes sliding-window (local) layers with full (global) ones, like
Gemma 3's five local to one global, gets several groups of equally many layers,
each with its own block table per row, all drawing on one pool of equal blocks
(vLLM's hybrid KV manager does the same):

    Gemma 3 1B: 26 layers, 4 global (5, 11, 17, 23), 22 local, window 512
    group size 4: group 0 = the 4 global layers; groups 1-6 = the local ones, 4 a
    group (the last has 2, its other 2 slots unused); a block = 16 positions x 4 layers

    row of 2,000 tokens, block size 16: group 0 holds all 125 of its blocks; each
    local group holds the ~33 covering the last 512 positions, and the blocks that
    fell out of the window went back to the pool while the row went on.

A local group's table keeps its length (position p stays in entry p // block_size),
with `NULL_BLOCK` in the entries whose blocks went back: attention never reads
them unmasked, because a query at position q sees only keys (q - window, q].
Groups are ordered full first, so a row's first table is its full-attention one.
"""

from __future__ import annotations

import attrs

NULL_BLOCK = -1  # a table entry whose block fell out of the window and went back
# Sizing without the scheduler at hand (the engine's pool and context bound): the
# longest span a row computes at once; the scheduler's solo prefill is 256 by default.
SIZING_CHUNK = 512


@attrs.frozen
class KVLayout:
    group_windows: tuple[int | None, ...]  # per group: its layers' window, None for full
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]  # which of the group's `group_size` storage slots
    group_size: int  # layers per group: storage per block is this many layers' K/V

    @classmethod
    def for_layers(cls, num_layers: int, windows: tuple[int | None, ...] = ()) -> KVLayout:
        """`windows[layer]` (empty: all full) -> groups of equally many layers."""
        windows = windows or (None,) * num_layers
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        # Full layers first; the smallest kind sets the group size (Gemma: its globals).
        ordered = sorted(kinds.items(), key=lambda kind: (kind[0] is not None, kind[0] or 0))
        size = min(len(layers) for _, layers in ordered)
        group_windows: list[int | None] = []
        group_of, slot_of = [0] * num_layers, [0] * num_layers
        for window, layers in ordered:
            for lo in range(0, len(layers), size):
                for slot, layer in enumerate(layers[lo : lo + size]):
                    group_of[layer], slot_of[layer] = len(group_windows), slot
                group_windows.append(window)
        return cls(tuple(group_windows), tuple(group_of), tuple(slot_of), size)

    def describe(self) -> str:
        """e.g. "1 full + 6 sliding-window (512) groups of 4 layers"."""
        kinds: dict[int | None, int] = {}
        for window in self.group_windows:
            kinds[window] = kinds.get(window, 0) + 1
        parts = [f"{n} full" if w is None else f"{n} sliding-window ({w})" for w, n in kinds.items()]
        return f"{' + '.join(parts)} groups of {self.group_size} layers"

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def is_windowed(self) -> bool:
        return any(w is not None for w in self.group_windows)

    def blocks_per_row(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks a row of `num_tokens` holds at once, computed in chunks of
        at most `max_chunk`: all of its blocks in full groups, in local groups those
        covering the window before a chunk and the chunk itself."""
        full = -(-num_tokens // block_size)
        total = 0
        for window in self.group_windows:
            held = full if window is None else min(full, -(-(window - 1 + max_chunk) // block_size) + 1)
            total += held
        return total

    def max_row_tokens(self, num_blocks: int, block_size: int, max_chunk: int = SIZING_CHUNK) -> int:
        """The longest row `num_blocks` blocks hold (a multiple of `block_size`)."""
        lo, hi = 0, num_blocks  # in blocks of positions; blocks_per_row grows with it
        if not any(w is None for w in self.group_windows):
            hi = 1 << 40  # every layer windowed: a row's blocks stop growing
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_per_row(mid * block_size, block_size, max_chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo * block_size

    def first_needed_block(self, group: int, next_position: int, block_size: int) -> int:
        """Entries of `group`'s table before this are never read by a query at
        `next_position` or later (0 for full groups)."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, next_position - window + 1) // block_size
