"""Paged attention: one entry per layer serves a whole ragged step over block pools.

    pool (per layer, K and V alike): [n_kv_heads * num_slots, head_dim], flat
    slot of position p of a row:     table[p // block_size] * block_size + p % block_size
    row of head h at that slot:      h * num_slots + slot

A step is R rows, row r bringing `num_new[r]` query tokens at positions
`[start[r], start[r] + num_new[r])`, concatenated into `[N]` tokens. Each token's
K/V is scattered into the pool once, then every query attends causally over its
row's positions `[0, its own]`, or in a sliding-window layer over its last `window`
positions `(own - window, own]` (as mlx-lm's and transformers' masks: the key at
`own - window` is the first one out). Three paths compute the same thing:

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

from kernels.cpu_extension import cpu_extension
from kernels.poly_exp import poly_exp
from kernels.streams import is_worth_splitting, side_stream

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


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """`x.astype(dtype)`, but no copy when it already is (a copy costs ~35 us on the CPU)."""
    return x if x.dtype == dtype else x.astype(dtype)


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
    def write_rows(self) -> mx.array:
        """[Hkv * N] flat pool rows of the new tokens' K/V, head-major."""
        return self._head_rows(self._slots(self.row_of_token, self.positions))

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
    def fast(self) -> _FastPlan:
        return _FastPlan(self)

    @functools.cached_property
    def gather(self) -> _GatherPlan:
        return _GatherPlan(self)


def paged_attention(
    pools: tuple[list[mx.array], list[mx.array]],
    layer: int,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    step: PagedStep,
    path: str,
) -> mx.array:
    """Write k, v [N, Hkv, D] into layer `layer` of (keys, values) pools, then attend.

    q [N, H, D] -> [N, H, D]. `path` is what `dispatch` chose for this step.
    """
    keys, values = pools
    D = k.shape[-1]
    keys[layer][step.write_rows] = k.transpose(1, 0, 2).reshape(-1, D)  # [Hkv * N, D]
    values[layer][step.write_rows] = v.transpose(1, 0, 2).reshape(-1, D)
    plan: _NativePlan | _FastPlan | _GatherPlan
    if path == "native":
        plan = step.native
    elif path == "fast":
        plan = step.fast
    else:
        plan = step.gather
    return plan.attend(keys[layer], values[layer], q, scale)


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
    """The CPU extension's kernel: the whole step in one call per layer."""

    def __init__(self, step: PagedStep):
        self.step = step

    def attend(self, keys: mx.array, values: mx.array, q: mx.array, scale: float) -> mx.array:
        step = self.step
        ext = cpu_extension()
        assert ext is not None, "select_path chose the native kernel without the extension"
        return ext.paged_attention(
            q, keys, values, step.tables, step.row_of_token, step.positions,
            step.num_kv_heads, step.block_size, step.window or 0, scale,
        )


class _GatherPlan:
    """The reference: each row's K/V copied out of the pool, then mx.fast attention."""

    def __init__(self, step: PagedStep):
        self.spans = []  # (first token, one past last, pool rows, mask or None)
        lo = 0
        for r, (start, n) in enumerate(zip(step.starts, step.num_new, strict=True)):
            key_pos = np.arange(step.first_key(r), start + n)[None, :]  # [1, L]
            mask = None
            if n > 1:  # a single query sees every key from first_key on
                mask = mx.array(step.visible(np.arange(start, start + n)[:, None], key_pos))
            self.spans.append((lo, lo + n, step.key_rows([r], key_pos), mask))
            lo += n
        self.num_kv_heads = step.num_kv_heads

    def attend(self, keys: mx.array, values: mx.array, q: mx.array, scale: float) -> mx.array:
        outs = []
        D = q.shape[-1]
        for lo, hi, rows, mask in self.spans:
            k = keys[rows].reshape(1, self.num_kv_heads, -1, D)  # [1, Hkv, L, D]
            v = values[rows].reshape(1, self.num_kv_heads, -1, D)
            q_row = q[lo:hi].transpose(1, 0, 2)[None]  # [1, H, n, D]
            out = mx.fast.scaled_dot_product_attention(q_row, k, v, scale=scale, mask=mask)
            outs.append(out[0].transpose(1, 0, 2))  # [n, H, D]
        return mx.concatenate(outs) if len(outs) > 1 else outs[0]


class _Group:
    """Rows padded to `num_queries` tokens each: one batched attention for all of them."""

    def __init__(self, step: PagedStep, rows: list[int], token_lo: list[int]):
        starts = np.array([step.starts[r] for r in rows])
        num_new = np.array([step.num_new[r] for r in rows])
        self.step = step
        self.num_rows, self.num_queries = len(rows), int(num_new.max())
        size = step.block_size
        # Each row's blocks from the first its window touches (0 without a window).
        first_block = np.array([step.first_key(r) // size for r in rows])
        self.num_blocks = int((-(-(starts + num_new) // size) - first_block).max())
        self.block_size = size
        self.pool_blocks = step.num_slots // size  # blocks per KV head in the pool
        # Query token of (row, t); pads repeat the row's last token and are dropped.
        t = np.minimum(np.arange(self.num_queries)[None, :], num_new[:, None] - 1)
        self.query_tokens = np.array(token_lo)[:, None] + t  # [R, T]
        self.is_real = np.arange(self.num_queries)[None, :] < num_new[:, None]
        self.query_pos = starts[:, None] + t  # [R, T]
        columns = first_block[:, None] + np.arange(self.num_blocks)[None, :]  # [R, nb]
        # Key position of each (row, block column, offset), laid out block-major: [R, nb * bs].
        self.key_pos = (columns[:, :, None] * size + np.arange(size)).reshape(self.num_rows, -1)
        columns = np.minimum(columns, step.tables.shape[1] - 1)  # past the table: masked
        index = mx.array(rows, dtype=mx.int32)[:, None]
        self.table = step.tables[index, mx.array(columns, dtype=mx.int32)]  # [R, nb]

    def visible_bias(self) -> np.ndarray:
        """[R, T, nb * bs] float32: 0 where a query sees the key position, -inf elsewhere."""
        visible = self.step.visible(self.query_pos[:, :, None], self.key_pos[:, None, :])
        return np.where(visible, 0.0, -np.inf).astype(np.float32)

    def grouped(self, q: mx.array, num_kv_heads: int) -> mx.array:
        """q [R * T, H, D] -> [Hkv, R, T * G, D]: query heads sharing a KV head as rows."""
        R, T = self.num_rows, self.num_queries
        H, D = q.shape[1:]
        G = H // num_kv_heads
        return q.reshape(R, T, num_kv_heads, G, D).transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, R, T * G, D)

    def ungrouped(self, out: mx.array) -> mx.array:
        """[Hkv, R, T, G, D] -> [R * T, H, D]."""
        Hkv, R, T, G, D = out.shape
        return out.transpose(1, 2, 0, 3, 4).reshape(R * T, Hkv * G, D)


class _BlockGroup(_Group):
    """Reads K/V in place, block by block, with `mx.gather_mm`: no copy of the history.
    Decode rows (one query token each) use it: they touch every key once.

    For KV head h, row r, block j of its table the scores are
    q[h, r] [G, D] @ pool_block[h, table[r, j]].T [D, block_size]; the softmax runs
    over all of a row's blocks at once, and the output sums weights @ V over the
    blocks, normalised once at the end (on [G, D] per row, not on every score).
    """

    def __init__(self, step: PagedStep, rows: list[int], token_lo: list[int]):
        super().__init__(step, rows, token_lo)
        R, T, nb, bs, Hkv = (
            self.num_rows, self.num_queries, self.num_blocks, self.block_size, step.num_kv_heads
        )
        self.bias = mx.array(self.visible_bias().reshape(R, T, nb, bs).transpose(0, 2, 1, 3)[None, :, :, :, None, :])
        heads = mx.arange(Hkv, dtype=mx.int32)[:, None, None]
        self.kv_blocks = (heads * self.pool_blocks + self.table[None]).reshape(-1).astype(mx.uint32)
        query_rows = heads * R + mx.arange(R, dtype=mx.int32)[None, :, None]  # [Hkv, R, 1]
        self.query_blocks = mx.broadcast_to(query_rows, (Hkv, R, nb)).reshape(-1).astype(mx.uint32)

    def attend(
        self, keys: mx.array, values: mx.array, q: mx.array, scale: float, num_kv_heads: int
    ) -> mx.array:
        R, T, nb, bs = self.num_rows, self.num_queries, self.num_blocks, self.block_size
        Hkv, D = num_kv_heads, q.shape[-1]
        G = q.shape[1] // Hkv
        k_blocks = keys.reshape(Hkv * self.pool_blocks, bs, D)
        v_blocks = values.reshape(Hkv * self.pool_blocks, bs, D)
        grouped = self.grouped(q * scale, Hkv).reshape(Hkv * R, T * G, D)
        scores = mx.gather_mm(grouped, k_blocks.swapaxes(-1, -2), self.query_blocks, self.kv_blocks)
        scores = _as(scores, mx.float32).reshape(Hkv, R, nb, T, G, bs) + self.bias
        # The max over a row's keys, in two cheap steps: within blocks, then across them.
        top = mx.max(mx.max(scores, axis=5, keepdims=True), axis=2, keepdims=True)
        weights = poly_exp(scores - top)  # unnormalised probabilities
        total = mx.sum(mx.sum(weights, axis=5), axis=2)[..., None]  # [Hkv, R, T, G, 1]
        out = mx.gather_mm(
            _as(weights.reshape(Hkv * R * nb, T * G, bs), v_blocks.dtype), v_blocks, None, self.kv_blocks
        )  # [Hkv * R * nb, T * G, D]
        out = out.reshape(Hkv, R, nb, T, G, D).sum(axis=2) / total
        return _as(self.ungrouped(out), q.dtype)


class _CopyGroup(_Group):
    """Copies each row's K/V out once, then two dense matmuls. Rows bringing a chunk of
    many tokens use it: the copy is paid once for all of the chunk's queries, and the
    matmuls are large enough for the BLAS to run at speed.

    A long chunk's cost is its softmax: T x H x L exps (a 256-token chunk at 6,000
    keys: 24.6M a layer). mlx's fused softmax takes 0.37 s for those on this CPU
    against 0.61 s for the polynomial exp's separate passes, and mlx's CPU
    elementwise ops run on one thread: so above `SPLIT_MIN_SCORES` the KV heads are
    split over a second CPU stream (0.43 -> 0.31 s for that layer on 2 cores).
    """

    SPLIT_MIN_SCORES = 1 << 20

    def __init__(self, step: PagedStep, rows: list[int], token_lo: list[int]):
        super().__init__(step, rows, token_lo)
        self.length = self.num_blocks * self.block_size
        self.bias = mx.array(self.visible_bias()[None, :, :, None, :])  # [1, R, T, 1, L]
        self.kv_rows = step.key_rows(rows, self.key_pos)  # [Hkv * R * L]
        num_scores = step.num_kv_heads * step.num_queries_per_kv * self.num_rows * self.num_queries * self.length
        self.is_split = step.num_kv_heads >= 2 and is_worth_splitting(
            num_scores, self.SPLIT_MIN_SCORES
        )

    def attend(
        self, keys: mx.array, values: mx.array, q: mx.array, scale: float, num_kv_heads: int
    ) -> mx.array:
        R, L, D = self.num_rows, self.length, q.shape[-1]
        k = keys[self.kv_rows].reshape(num_kv_heads, R, L, D)
        v = values[self.kv_rows].reshape(num_kv_heads, R, L, D)
        grouped = self.grouped(q * scale, num_kv_heads)  # [Hkv, R, T * G, D]
        if not self.is_split:
            out = self._heads(grouped, k, v)
        else:
            half = num_kv_heads // 2
            first = self._heads(grouped[:half], k[:half], v[:half])
            with mx.stream(side_stream()):
                second = self._heads(grouped[half:], k[half:], v[half:])
            out = mx.concatenate([first, second])
        return _as(self.ungrouped(out), q.dtype)

    def _heads(self, grouped: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """grouped [h, R, T * G, D]; k, v [h, R, L, D] -> [h, R, T, G, D]."""
        h, R, TG, D = grouped.shape
        T, L = self.num_queries, self.length
        scores = _as(grouped @ k.swapaxes(-1, -2), mx.float32)  # [h, R, T * G, L]
        probs = mx.softmax(scores.reshape(h, R, T, TG // T, L) + self.bias, axis=-1)
        out = _as(probs.reshape(h, R, TG, L), v.dtype) @ v
        return out.reshape(h, R, T, TG // T, D)


class _FastPlan:
    """All rows in at most two batched attentions: one-token rows, and multi-token rows."""

    def __init__(self, step: PagedStep):
        token_lo = np.concatenate([[0], np.cumsum(step.num_new)[:-1]]).tolist()
        singles = [r for r, n in enumerate(step.num_new) if n == 1]
        multis = [r for r, n in enumerate(step.num_new) if n > 1]
        self.groups: list[_BlockGroup | _CopyGroup] = []
        if singles:
            self.groups.append(_BlockGroup(step, singles, [token_lo[r] for r in singles]))
        if multis:
            self.groups.append(_CopyGroup(step, multis, [token_lo[r] for r in multis]))
        # Where each token's output sits in the groups' outputs laid end to end.
        order = np.concatenate([g.query_tokens[g.is_real] for g in self.groups])
        flat_real = np.concatenate([g.is_real.reshape(-1) for g in self.groups])
        padded_position = np.flatnonzero(flat_real)  # of each real output, in `order`
        inverse = np.empty(len(order), dtype=np.int64)
        inverse[order] = padded_position
        # A decode-only step is already in token order: no gathers around the attention.
        self.is_identity = len(self.groups) == 1 and bool(flat_real.all()) and bool(
            (self.groups[0].query_tokens.reshape(-1) == np.arange(len(order))).all()
        )
        self.query_index = [mx.array(g.query_tokens.reshape(-1), dtype=mx.int32) for g in self.groups]
        self.inverse = mx.array(inverse, dtype=mx.int32)
        self.num_kv_heads = step.num_kv_heads

    def attend(self, keys: mx.array, values: mx.array, q: mx.array, scale: float) -> mx.array:
        if self.is_identity:
            return self.groups[0].attend(keys, values, q, scale, self.num_kv_heads)
        outs = [
            g.attend(keys, values, q[index], scale, self.num_kv_heads)
            for g, index in zip(self.groups, self.query_index, strict=True)
        ]
        out = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        return out[self.inverse]
