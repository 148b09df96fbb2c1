"""Paged attention: one entry per layer serves a whole ragged step over block pools.

    pool (per layer, K and V alike): [n_kv_heads * num_slots, head_dim], flat
    slot of position p of a row:     table[p // block_size] * block_size + p % block_size
    row of head h at that slot:      h * num_slots + slot

A step is R rows, row r bringing `num_new[r]` query tokens at positions
`[start[r], start[r] + num_new[r])`, concatenated into `[N]` tokens. Each token's
K/V is scattered into the pool once, then every query attends causally over its
row's positions `[0, its own]`. Two paths compute the same thing:

- `gather` (the reference): per row, copy its K/V out of the pool, then
  `mx.fast.scaled_dot_product_attention`. A Python loop per row and per layer.
- `fast` (vectorized): one gather for all rows, grouped-query matmuls with the
  polynomial-exp softmax (kernels/fast_softmax.py); rows bringing one token and
  rows bringing several form two padded groups, so a 512-token chunk does not
  pad every decoding row to 512 queries.

`select_path` picks one per step, before anything is written: a path either owns
the step or was declined, and the pool is written exactly once either way. Its
floor is the measured table in the README (`cadence bench paged-attention`);
`CADENCE_PAGED_ATTENTION=gather|fast` forces a path, and
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

from kernels.fast_softmax import softmax_last_axis

log = structlog.get_logger("cadence.paged_attention")

# Rows x visible keys at or above which the vectorized path wins. Measured on the
# 2-core x86 CPU (README, `cadence bench paged-attention`): at B=1 the per-row path
# is one take plus mx.fast (fewer ops); from B=4 up the vectorized path wins.
FAST_MIN_KEYS = 1024
# Above this many bytes of fp32 scores per layer the vectorized path declines: the
# per-row path materialises one row's scores at a time.
FAST_MAX_SCORE_BYTES = 1 << 29

dispatch_counts: collections.Counter[str] = collections.Counter()  # "fast", "gather", per step
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


@attrs.frozen
class Decision:
    path: str  # "fast" or "gather"
    reason: str  # "forced", "at_or_above_floor", "below_floor", "scores_over_cap"
    detail: str


def select_path(shape: StepShape) -> Decision:
    """Pure: which path runs a step of this shape. The environment can force either."""
    forced = os.environ.get("CADENCE_PAGED_ATTENTION", "").strip().lower()
    if forced in ("gather", "fast"):
        return Decision(forced, "forced", f"CADENCE_PAGED_ATTENTION={forced}")
    floor = int(os.environ.get("CADENCE_PAGED_FAST_MIN_KEYS", FAST_MIN_KEYS))
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

    @functools.cached_property
    def shape(self) -> StepShape:
        return StepShape(
            num_rows=len(self.starts),
            max_new=max(self.num_new),
            max_visible=max(s + n for s, n in zip(self.starts, self.num_new, strict=True)),
            num_multi_rows=sum(n > 1 for n in self.num_new),
            num_kv_heads=self.num_kv_heads,
            num_queries_per_kv=self.num_queries_per_kv,
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
        return self._head_rows(self._slots(self._row_of_token, self.positions))

    @functools.cached_property
    def _row_of_token(self) -> mx.array:
        return mx.array(np.repeat(np.arange(len(self.starts)), self.num_new), dtype=mx.int32)

    def _slots(self, row_index: mx.array, positions: mx.array) -> mx.array:
        """Pool slots of `positions` of table rows `row_index` (broadcast together)."""
        blocks = self.tables[row_index, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _head_rows(self, slots: mx.array) -> mx.array:
        """Slots [...] -> flat pool rows [Hkv * ...] of every KV head, head-major."""
        heads = mx.arange(self.num_kv_heads, dtype=mx.int32).reshape(-1, *([1] * slots.ndim))
        return (heads * self.num_slots + slots[None]).reshape(-1)

    def visible_rows(self, rows: list[int], length: int) -> mx.array:
        """Flat pool rows [Hkv * len(rows) * length] of positions [0, length) of `rows`."""
        index = mx.array(rows, dtype=mx.int32)[:, None]
        positions = mx.arange(length, dtype=mx.int32)[None, :]
        return self._head_rows(self._slots(index, positions))

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
    plan = step.fast if path == "fast" else step.gather
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


class _GatherPlan:
    """The reference: each row's K/V copied out of the pool, then mx.fast attention."""

    def __init__(self, step: PagedStep):
        self.spans = []  # (first token, one past last, pool rows, mask or None)
        lo = 0
        for r, (start, n) in enumerate(zip(step.starts, step.num_new, strict=True)):
            length = start + n
            mask = None
            if n > 1:
                query_pos = mx.arange(start, length)[:, None]
                mask = mx.arange(length)[None, :] <= query_pos  # [n, length]
            self.spans.append((lo, lo + n, step.visible_rows([r], length), mask))
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
    """Rows padded to `num_queries` tokens and `length` keys: one batched attention."""

    def __init__(self, step: PagedStep, rows: list[int], token_lo: list[int]):
        starts = [step.starts[r] for r in rows]
        num_new = [step.num_new[r] for r in rows]
        self.num_rows, self.num_queries = len(rows), max(num_new)
        self.length = max(s + n for s, n in zip(starts, num_new, strict=True))
        T = self.num_queries
        # Query token of (row, t); pads repeat the row's last token and are dropped.
        t = np.minimum(np.arange(T)[None, :], np.array(num_new)[:, None] - 1)  # [R, T]
        self.query_tokens = np.array(token_lo)[:, None] + t
        self.is_real = np.arange(T)[None, :] < np.array(num_new)[:, None]
        query_pos = mx.array(np.array(starts)[:, None] + t, dtype=mx.int32)  # [R, T]
        key_pos = mx.arange(self.length, dtype=mx.int32)
        if T == 1 and all(s + n == self.length for s, n in zip(starts, num_new, strict=True)):
            self.mask = None
        else:
            self.mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [R, T, L]
        self.kv_rows = step.visible_rows(rows, self.length)

    def attend(
        self, keys: mx.array, values: mx.array, q: mx.array, scale: float, num_kv_heads: int
    ) -> mx.array:
        """q [R * T, H, D] in (row, t) order -> [R * T, H, D]."""
        R, T, L = self.num_rows, self.num_queries, self.length
        H, D = q.shape[1:]
        G = H // num_kv_heads
        k = keys[self.kv_rows].reshape(num_kv_heads, R, L, D)
        v = values[self.kv_rows].reshape(num_kv_heads, R, L, D)
        # Query heads sharing a KV head become rows of one matmul: [Hkv, R, T * G, D].
        grouped = q.reshape(R, T, num_kv_heads, G, D).transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, R, T * G, D)
        scores = ((grouped * scale) @ k.swapaxes(-1, -2)).astype(mx.float32)  # [Hkv, R, T*G, L]
        mask = None if self.mask is None else self.mask[None, :, :, None, :]  # [1, R, T, 1, L]
        probs = softmax_last_axis(scores.reshape(num_kv_heads, R, T, G, L), mask)
        out = probs.reshape(num_kv_heads, R, T * G, L).astype(v.dtype) @ v  # [Hkv, R, T*G, D]
        return out.reshape(num_kv_heads, R, T, G, D).transpose(1, 2, 0, 3, 4).reshape(R * T, H, D)


class _FastPlan:
    """All rows in at most two batched attentions: one-token rows, and multi-token rows."""

    def __init__(self, step: PagedStep):
        token_lo = np.concatenate([[0], np.cumsum(step.num_new)[:-1]]).tolist()
        singles = [r for r, n in enumerate(step.num_new) if n == 1]
        multis = [r for r, n in enumerate(step.num_new) if n > 1]
        self.groups = [
            _Group(step, rows, [token_lo[r] for r in rows]) for rows in (singles, multis) if rows
        ]
        # Where each token's output sits in the groups' outputs laid end to end.
        order = np.concatenate([g.query_tokens[g.is_real] for g in self.groups])
        self.query_index = [mx.array(g.query_tokens.reshape(-1), dtype=mx.int32) for g in self.groups]
        flat_real = np.concatenate([g.is_real.reshape(-1) for g in self.groups])
        padded_position = np.flatnonzero(flat_real)  # of each real output, in `order`
        inverse = np.empty(len(order), dtype=np.int64)
        inverse[order] = padded_position
        self.inverse = mx.array(inverse, dtype=mx.int32)
        self.num_kv_heads = step.num_kv_heads

    def attend(self, keys: mx.array, values: mx.array, q: mx.array, scale: float) -> mx.array:
        outs = [
            g.attend(keys, values, q[index], scale, self.num_kv_heads)
            for g, index in zip(self.groups, self.query_index, strict=True)
        ]
        out = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        return out[self.inverse]
