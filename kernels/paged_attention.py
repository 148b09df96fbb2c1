"""Paged attention: one entry per layer serves a whole ragged step over block pools.

    pool (per layer, K and V alike): [n_kv_heads * num_slots, head_dim], flat
    slot of position p of a row:     table[p // block_size] * block_size + p % block_size
    row of head h at that slot:      h * num_slots + slot

A step is R rows, row r bringing `num_new[r]` query tokens at positions
`[start[r], start[r] + num_new[r])`, concatenated into `[N]` tokens. Each token's
K/V is scattered into the pool once, then every query attends causally over its
row's positions `[0, its own]`, or in a sliding-window layer over its last `window`
positions `(own - window, own]` (as mlx-lm's and transformers' masks: the key at
`own - window` is the first one out). Three paths compute the same thing (the
first two, made of mlx ops, in kernels/paged_attention_mx.py):

- `gather` (the reference): per row, copy its K/V out of the pool, then
  `mx.fast.scaled_dot_product_attention`. A Python loop per row and per layer.
- `fast` (vectorized): reads K/V in place, block by block, with `mx.gather_mm`:
  no copy of the history, no loop per row. Grouped-query scores, a softmax over a
  row's blocks with the polynomial exp (kernels/poly_exp.py). Rows bringing one
  token and rows bringing several form two padded groups, so a 512-token chunk
  does not pad every decoding row to 512 queries.
- `native` (the CPU's): one C++ primitive of the CPU extension (kernels/cpu/) for
  the whole step. It reads every row's blocks in place with an online softmax and a
  vectorized exp, threaded: a decoding token's query heads go key by key; a prefill
  chunk's tokens form tiles whose query heads are vector lanes (32 with AVX-512), so each
  key is loaded once for the tile and no dot product needs a horizontal sum. It runs
  whenever the extension is loaded, the default device is the CPU and the pool is
  float32, since it measured faster than either other path at every size tried
  (`cadence bench paged-attention`; a 256-token chunk over 6,000 keys: 34 ms a
  layer against 1.03 s for `fast`).

All three read a windowed layer's rows from the first key its window sees, so a
local layer's cost follows the window, not the row's length; the blocks before it
may already be back in the pool (their table entries point at block 0, unread).

`select_path` picks one per step, before anything is written: a path either owns
the step or was declined, and the pool is written exactly once either way. Without
the native kernel, its floor between the other two is the measured table in the
README (`cadence bench paged-attention`); `CADENCE_PAGED_ATTENTION=gather|fast|native`
forces a path (native only where it can run), and
`CADENCE_PAGED_FAST_MIN_KEYS` moves the floor. The first occurrence of each
outcome is logged at info, so a run shows which path it used.
"""

from __future__ import annotations

import collections
import functools
import os

import attrs
import mlx.core as mx
import numpy as np
import structlog

from kernels import fused_blocks
from kernels.cpu_extension import cpu_extension
from kernels.fused_blocks import NormedLayers
from kernels.paged_attention_mx import FastPlan, GatherPlan

log = structlog.get_logger("cadence.paged_attention")

# Rows x visible keys at or above which the vectorized path wins, from the table in
# the README (`cadence bench paged-attention`, 2-core x86 CPU, 16 layers of 16 query
# and 4 KV heads, D=64): at B=1 the per-row path wins up to 256 keys (3.4 vs 5.6 ms
# at 128, 5.3 vs 5.7 at 256) and loses from 512 on (7.0 vs 6.6); at B=4 the
# vectorized path already wins at 128 keys a row (6.9 vs 9.5 ms).
FAST_MIN_KEYS = 512
# Above this many bytes of fp32 scores per layer the vectorized path declines: the
# per-row path materialises one row's scores at a time.
FAST_MAX_SCORE_BYTES = 1 << 29

dispatch_counts: collections.Counter[str] = collections.Counter()  # "native", "fast", "gather", per step
_logged: set[tuple[str, str]] = set()


@attrs.frozen
class StepShape:
    """What the selector sees of a step."""

    num_rows: int
    max_new: int  # query tokens of the row bringing the most
    max_visible: int  # keys of the row seeing the most
    num_multi_rows: int  # rows bringing more than one token
    num_kv_heads: int
    num_queries_per_kv: int
    is_float32: bool = True  # the pool's dtype, the only one the native kernel reads


@attrs.frozen
class Decision:
    path: str  # "native", "fast" or "gather"
    reason: str  # "forced", "native_kernel", "at_or_above_floor", "below_floor", "scores_over_cap"
    detail: str


MAX_NATIVE_QUERIES_PER_KV = 64  # the C++ kernel's limit


def native_kernel_reason(shape: StepShape) -> str | None:
    """Why the native kernel cannot run a step of this shape (None: it can)."""
    if mx.default_device() != mx.cpu:
        return f"default device is {mx.default_device()}"
    if not shape.is_float32:
        return "the KV pool is not float32"
    if shape.num_queries_per_kv > MAX_NATIVE_QUERIES_PER_KV:
        return f"{shape.num_queries_per_kv} query heads per KV head"
    if cpu_extension() is None:
        return "the CPU extension is not loaded"
    return None


def select_path(shape: StepShape) -> Decision:
    """Which path runs a step of this shape: the native kernel wherever it can run,
    else by the measured floor. The environment can force any path."""
    forced = os.environ.get("CADENCE_PAGED_ATTENTION", "").strip().lower()
    if forced in ("gather", "fast"):
        return Decision(forced, "forced", f"CADENCE_PAGED_ATTENTION={forced}")
    why_not_native = native_kernel_reason(shape)
    if why_not_native is None:
        reason = "forced" if forced == "native" else "native_kernel"
        return Decision("native", reason, f"cadence CPU kernel ({cpu_extension().attention_isa()})")  # type: ignore[union-attr]
    floor = _env_int("CADENCE_PAGED_FAST_MIN_KEYS", FAST_MIN_KEYS)
    keys = shape.num_rows * shape.max_visible
    if keys < floor:
        return Decision("gather", "below_floor", f"{keys} rows x keys < floor {floor}")
    score_bytes = (
        4 * shape.num_kv_heads * shape.num_queries_per_kv * shape.num_multi_rows
        * shape.max_new * shape.max_visible
    )
    if score_bytes > FAST_MAX_SCORE_BYTES:
        return Decision("gather", "scores_over_cap", f"{score_bytes >> 20} MiB of scores per layer")
    return Decision("fast", "at_or_above_floor", f"{keys} rows x keys >= floor {floor}")


def _env_int(name: str, default: int) -> int:
    """A malformed value is ignored: a typo must not fail every engine step."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@attrs.frozen
class PagedStep:
    """One step's layout, built once and shared by every layer.

    `tables` is `[R, max_blocks]` int32 (padded with block 0, never read unmasked);
    `starts` and `num_new` are host ints in the rows' token order.
    """

    tables: mx.array
    starts: tuple[int, ...]
    num_new: tuple[int, ...]
    block_size: int
    num_slots: int  # slots per KV head in the pool: num_blocks * block_size
    num_kv_heads: int
    num_queries_per_kv: int
    window: int | None = None  # a sliding-window layer's: the keys a query sees, itself included
    is_float32: bool = True  # the pool's dtype

    def first_key(self, row: int) -> int:
        """The first position any of `row`'s queries sees (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, self.starts[row] - self.window + 1)

    def visible(self, query_pos: np.ndarray, key_pos: np.ndarray) -> np.ndarray:
        """Broadcast bool: the query at `query_pos` sees the key at `key_pos`."""
        seen = key_pos <= query_pos
        if self.window is not None:
            seen &= key_pos > query_pos - self.window
        return seen

    @functools.cached_property
    def shape(self) -> StepShape:
        return StepShape(
            num_rows=len(self.starts),
            max_new=max(self.num_new),
            max_visible=max(s + n for s, n in zip(self.starts, self.num_new, strict=True)),
            num_multi_rows=sum(n > 1 for n in self.num_new),
            num_kv_heads=self.num_kv_heads,
            num_queries_per_kv=self.num_queries_per_kv,
            is_float32=self.is_float32,
        )

    @functools.cached_property
    def positions(self) -> mx.array:
        """[N] int32: each new token's position in its row."""
        return mx.array(
            np.concatenate([np.arange(s, s + n) for s, n in zip(self.starts, self.num_new, strict=True)]),
            dtype=mx.int32,
        )

    @functools.cached_property
    def write_rows_and_tails(self) -> tuple[mx.array, int]:
        """(flat pool rows [Hkv * (N + M)], M), head-major: per KV head, the new tokens'
        slots, then the M slots past each row's end in a block it first writes in this step.

        A freed block keeps its last owner's K/V. The mlx paths read the masked slots
        of a row's last block (the fast one reads whole blocks), and a score of -inf
        times a stale NaN or inf is NaN: one request's overflow failed the next ones to
        get its blocks. Zeroed as the block is opened, they hold nothing stale.
        """
        rows, positions = [], []
        for r, (start, n) in enumerate(zip(self.starts, self.num_new, strict=True)):
            end = start + n
            opened = (end - 1) // self.block_size * self.block_size  # its last block's first slot
            if end % self.block_size and opened >= start:
                tail = np.arange(end, opened + self.block_size)
                rows.append(np.full(len(tail), r))
                positions.append(tail)
        written = self._slots(self.row_of_token, self.positions)
        if not rows:
            return self._head_rows(written), 0
        row_index = mx.array(np.concatenate(rows), dtype=mx.int32)
        tails = self._slots(row_index, mx.array(np.concatenate(positions), dtype=mx.int32))
        return self._head_rows(mx.concatenate([written, tails])), len(row_index)

    @functools.cached_property
    def row_of_token(self) -> mx.array:
        """[N] int32: each new token's row (its index into `tables`)."""
        return mx.array(np.repeat(np.arange(len(self.starts)), self.num_new), dtype=mx.int32)

    def _slots(self, row_index: mx.array, positions: mx.array) -> mx.array:
        """Pool slots of `positions` of table rows `row_index` (broadcast together)."""
        blocks = self.tables[row_index, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _head_rows(self, slots: mx.array) -> mx.array:
        """Slots [...] -> flat pool rows [Hkv * ...] of every KV head, head-major."""
        heads = mx.arange(self.num_kv_heads, dtype=mx.int32).reshape(-1, *([1] * slots.ndim))
        return (heads * self.num_slots + slots[None]).reshape(-1)

    def key_rows(self, rows: list[int], positions: np.ndarray) -> mx.array:
        """Flat pool rows [Hkv * len(rows) * L] of key `positions` [len(rows), L] of `rows`;
        positions past a row's table read its last entry (callers mask them)."""
        index = mx.array(rows, dtype=mx.int32)[:, None]
        columns = np.minimum(positions // self.block_size, self.tables.shape[1] - 1)
        blocks = self.tables[index, mx.array(columns, dtype=mx.int32)]
        slots = blocks * self.block_size + mx.array(positions % self.block_size, dtype=mx.int32)
        return self._head_rows(slots)

    @functools.cached_property
    def native(self) -> _NativePlan:
        return _NativePlan(self)

    @functools.cached_property
    def fast(self) -> FastPlan:
        return FastPlan(self)

    @functools.cached_property
    def gather(self) -> GatherPlan:
        return GatherPlan(self)


def paged_attention(
    pools: tuple[list[mx.array], list[mx.array]],
    layer: int,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    step: PagedStep,
    path: str,
    pools_in_place: bool = False,
    softcap: float = 0.0,
    sinks: mx.array | None = None,
) -> mx.array:
    """Write k, v [N, Hkv, D] into layer `layer` of (keys, values) pools, then attend.

    q [N, H, D] -> [N, H, D]. `path` is what `dispatch` chose for this step. `softcap`
    > 0 caps each score s at softcap * tanh(s / softcap) (Gemma 2), and `sinks` [H]
    adds e^(sink) to each head's softmax sum (gpt-oss), on every path.
    `pools_in_place`: the pools are a storage's own, which only these ops read and
    write; the native op then writes into their buffers even while mlx still holds them
    for an op queued before it (see take_pool in kernels/cpu/attention_ops.h).
    """
    keys, values = pools
    if path == "native":  # one op writes and attends
        out, keys[layer], values[layer] = step.native.write_and_attend(
            keys[layer], values[layer], q, k, v, scale, pools_in_place, softcap, sinks
        )
        return out
    D = k.shape[-1]
    rows, num_tails = step.write_rows_and_tails  # the tails take zeros: see there
    k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [Hkv, N, D]
    if num_tails:
        zeros = mx.zeros((k.shape[0], num_tails, D), dtype=k.dtype)
        k, v = mx.concatenate([k, zeros], axis=1), mx.concatenate([v, zeros], axis=1)
    keys[layer][rows] = k.reshape(-1, D)  # head-major, as `rows`
    values[layer][rows] = v.reshape(-1, D)
    plan = step.fast if path == "fast" else step.gather
    return plan.attend(keys[layer], values[layer], q, scale, softcap, sinks)


def dispatch(step: PagedStep) -> str:
    """Choose the step's path once, count it, and log the first step of each outcome."""
    decision = select_path(step.shape)
    dispatch_counts[decision.path] += 1
    if (decision.path, decision.reason) not in _logged:
        _logged.add((decision.path, decision.reason))
        shape = step.shape
        log.info(
            "paged_attention",
            path=decision.path,
            reason=decision.reason,
            detail=decision.detail,
            rows=shape.num_rows,
            max_new=shape.max_new,
            max_visible=shape.max_visible,
            device=str(mx.default_device()),
        )
    return decision.path


class _NativePlan:
    """The CPU extension's kernel: the whole step in one call per layer, the K/V write too."""

    def __init__(self, step: PagedStep):
        self.step = step

    def write_and_attend(
        self,
        keys: mx.array,
        values: mx.array,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        pools_in_place: bool = False,
        softcap: float = 0.0,
        sinks: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """(out [N, H, D], keys, values): the pools as written, which replace the old ones."""
        step = self.step
        ext = cpu_extension()
        assert ext is not None, "select_path chose the native kernel without the extension"
        out, keys, values = ext.paged_attention_write(
            q, k, v, keys, values, step.tables, step.row_of_token, step.positions,
            step.num_kv_heads, step.block_size, step.window or 0, scale, pools_in_place, softcap=softcap,
            # A float32 model's are float32 already: no cast op a layer a step.
            sinks=sinks if sinks is None or sinks.dtype == mx.float32 else sinks.astype(mx.float32),
        )
        return out, keys, values

    def rotate_write_and_attend(
        self,
        keys: mx.array,
        values: mx.array,
        qkv: mx.array,
        num_heads: int,
        inv_freqs: mx.array,
        rope_scale: float,
        scale: float,
        pools_in_place: bool = False,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The same from a stacked qkv [..., (H + 2 Hkv) * D], q and k rotated in the op
        (at the step's positions): (out [..., H * D], keys, values)."""
        step = self.step
        ext = cpu_extension()
        assert ext is not None, "select_path chose the native kernel without the extension"
        out, keys, values = ext.paged_attention_rotary(
            qkv, keys, values, step.tables, step.row_of_token, step.positions, inv_freqs,
            num_heads, step.num_kv_heads, step.block_size, step.window or 0, scale, rope_scale,
            pools_in_place,
        )
        return out, keys, values

    def residual_attention(
        self,
        x: mx.array,
        block: NormedLayers,
        keys: mx.array,
        values: mx.array,
        num_heads: int,
        inv_freqs: mx.array,
        rope_scale: float,
        scale: float,
        pools_in_place: bool = False,
    ) -> tuple[mx.array, mx.array, mx.array] | None:
        """x + o(`rotate_write_and_attend`(qkv(norm(x)))) as one op for a step of few rows
        (kernels/fused_blocks.py): (out, keys, values), or None where it cannot run so."""
        ext = fused_blocks.kernel_for(x)
        if ext is None:
            return None
        step = self.step
        out, keys, values = ext.residual_attention(
            x, block.norm_weight, block.eps, block.first, block.second, keys, values,
            step.tables, step.row_of_token, step.positions, inv_freqs, num_heads,
            step.num_kv_heads, step.block_size, step.window or 0, scale, rope_scale,
            block.qk_norm, block.post_norm, pools_in_place,
        )
        return out, keys, values
