"""The two paths of kernels/paged_attention.py made of mlx ops, for where the native
CPU kernel cannot run (Metal, CUDA, a half-precision pool, no extension):

- `GatherPlan` (the reference): per row, copy its K/V out of the pool, then
  `mx.fast.scaled_dot_product_attention`. A Python loop per row and per layer.
- `FastPlan` (vectorized): decoding rows read K/V in place, block by block, with
  `mx.gather_mm`; rows bringing a chunk copy their K/V once and run dense matmuls.

The layout they read is described in kernels/paged_attention.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from kernels.poly_exp import poly_exp
from kernels.streams import is_worth_splitting, side_stream

if TYPE_CHECKING:
    from kernels.paged_attention import PagedStep


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """`x.astype(dtype)`, but no copy when it already is (a copy costs ~35 us on the CPU)."""
    return x if x.dtype == dtype else x.astype(dtype)


def soft_capped(scores: mx.array, cap: float) -> mx.array:
    """Gemma 2's attention-score cap: cap * tanh(scores / cap)."""
    return mx.tanh(scores / cap) * cap


def sink_weights(top: mx.array, sinks: mx.array | None) -> tuple[mx.array, mx.array | float]:
    """(the max to subtract from scores, e^(sink - it)) for a softmax whose sum takes
    each head's sink logit too (gpt-oss): `top` the scores' max, `sinks` broadcast
    against it (or None: `top` and 0)."""
    if sinks is None:
        return top, 0.0
    sinks = _as(sinks, mx.float32)
    top = mx.maximum(top, sinks)
    return top, mx.exp(sinks - top)


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None,
    softcap: float = 0.0,
    sinks: mx.array | None = None,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`, with each score soft-capped (Gemma 2),
    which it cannot do, or sinks [H] in each head's softmax (gpt-oss), which it does:
    q [B, H, T, D], k and v [B, Hkv, L, D]; `mask` None, "causal" (the last T of L
    positions) or bool [T, L]."""
    if not softcap:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    num_groups = q.shape[1] // k.shape[1]
    if num_groups > 1:
        k, v = mx.repeat(k, num_groups, axis=1), mx.repeat(v, num_groups, axis=1)
    scores = soft_capped(_as((q * scale) @ k.swapaxes(-1, -2), mx.float32), softcap)
    T, L = q.shape[2], k.shape[2]
    if isinstance(mask, str):
        mask = mx.arange(L)[None, :] <= mx.arange(T)[:, None] + (L - T)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    top, sink = sink_weights(
        scores.max(axis=-1, keepdims=True), None if sinks is None else sinks[:, None, None]
    )
    weights = mx.exp(scores - top)
    probs = weights / (weights.sum(axis=-1, keepdims=True) + sink)
    return _as(probs, v.dtype) @ v


class GatherPlan:
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

    def attend(
        self,
        keys: mx.array,
        values: mx.array,
        q: mx.array,
        scale: float,
        softcap: float = 0.0,
        sinks: mx.array | None = None,
    ) -> mx.array:
        outs = []
        D = q.shape[-1]
        for lo, hi, rows, mask in self.spans:
            k = keys[rows].reshape(1, self.num_kv_heads, -1, D)  # [1, Hkv, L, D]
            v = values[rows].reshape(1, self.num_kv_heads, -1, D)
            q_row = q[lo:hi].transpose(1, 0, 2)[None]  # [1, H, n, D]
            out = attention(q_row, k, v, scale, mask, softcap, sinks)
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
        self,
        keys: mx.array,
        values: mx.array,
        q: mx.array,
        scale: float,
        num_kv_heads: int,
        softcap: float,
        sinks: mx.array | None,
    ) -> mx.array:
        R, T, nb, bs = self.num_rows, self.num_queries, self.num_blocks, self.block_size
        Hkv, D = num_kv_heads, q.shape[-1]
        G = q.shape[1] // Hkv
        k_blocks = keys.reshape(Hkv * self.pool_blocks, bs, D)
        v_blocks = values.reshape(Hkv * self.pool_blocks, bs, D)
        grouped = self.grouped(q * scale, Hkv).reshape(Hkv * R, T * G, D)
        scores = mx.gather_mm(grouped, k_blocks.swapaxes(-1, -2), self.query_blocks, self.kv_blocks)
        scores = _as(scores, mx.float32).reshape(Hkv, R, nb, T, G, bs)
        if softcap:
            scores = soft_capped(scores, softcap)
        scores = scores + self.bias
        # The max over a row's keys, in two cheap steps: within blocks, then across them.
        top = mx.max(mx.max(scores, axis=5, keepdims=True), axis=2, keepdims=True)
        top, sink = sink_weights(top, None if sinks is None else sinks.reshape(Hkv, 1, 1, 1, G, 1))
        weights = poly_exp(scores - top)  # unnormalised probabilities
        total = mx.sum(mx.sum(weights, axis=5), axis=2)[..., None]  # [Hkv, R, T, G, 1]
        if isinstance(sink, mx.array):  # its weight, of top's shape, beside the keys'
            total = total + mx.squeeze(sink, axis=2)
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
        self,
        keys: mx.array,
        values: mx.array,
        q: mx.array,
        scale: float,
        num_kv_heads: int,
        softcap: float,
        sinks: mx.array | None,
    ) -> mx.array:
        R, L, D = self.num_rows, self.length, q.shape[-1]
        k = keys[self.kv_rows].reshape(num_kv_heads, R, L, D)
        v = values[self.kv_rows].reshape(num_kv_heads, R, L, D)
        grouped = self.grouped(q * scale, num_kv_heads)  # [Hkv, R, T * G, D]
        head_sinks = None if sinks is None else sinks.reshape(num_kv_heads, 1, 1, -1, 1)
        if not self.is_split:
            out = self._heads(grouped, k, v, softcap, head_sinks)
        else:
            half = num_kv_heads // 2
            first_sinks, second_sinks = (None, None) if head_sinks is None else (head_sinks[:half], head_sinks[half:])
            first = self._heads(grouped[:half], k[:half], v[:half], softcap, first_sinks)
            with mx.stream(side_stream()):
                second = self._heads(grouped[half:], k[half:], v[half:], softcap, second_sinks)
            out = mx.concatenate([first, second])
        return _as(self.ungrouped(out), q.dtype)

    def _heads(
        self, grouped: mx.array, k: mx.array, v: mx.array, softcap: float, sinks: mx.array | None
    ) -> mx.array:
        """grouped [h, R, T * G, D]; k, v [h, R, L, D]; sinks [h, 1, 1, G, 1] or None
        -> [h, R, T, G, D]."""
        h, R, TG, D = grouped.shape
        T, L = self.num_queries, self.length
        scores = _as(grouped @ k.swapaxes(-1, -2), mx.float32)  # [h, R, T * G, L]
        if softcap:
            scores = soft_capped(scores, softcap)
        scores = scores.reshape(h, R, T, TG // T, L) + self.bias
        if sinks is None:
            probs = mx.softmax(scores, axis=-1)
        else:  # the sink as one more column of the softmax, dropped after it
            column = mx.broadcast_to(_as(sinks, mx.float32), (*scores.shape[:-1], 1))
            probs = mx.softmax(mx.concatenate([scores, column], axis=-1), axis=-1)[..., :L]
        out = _as(probs.reshape(h, R, TG, L), v.dtype) @ v
        return out.reshape(h, R, T, TG // T, D)


class FastPlan:
    """All rows in at most two batched attentions: one-token rows, and multi-token rows."""

    def __init__(self, step: PagedStep):
        token_lo = np.concatenate([[0], np.cumsum(step.num_new)[:-1]]).tolist()
        singles = [r for r, n in enumerate(step.num_new) if n == 1]
        multis = [r for r, n in enumerate(step.num_new) if n > 1]
        self.groups: list[_BlockGroup | _CopyGroup] = []
        # mlx's CPU gather_mm takes float32 only: a half-precision pool's decode rows
        # are copied out instead (every step of theirs failed at 512 rows x keys).
        in_place = _BlockGroup if step.is_float32 or mx.default_device() != mx.cpu else _CopyGroup
        if singles:
            self.groups.append(in_place(step, singles, [token_lo[r] for r in singles]))
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

    def attend(
        self,
        keys: mx.array,
        values: mx.array,
        q: mx.array,
        scale: float,
        softcap: float = 0.0,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if self.is_identity:
            return self.groups[0].attend(keys, values, q, scale, self.num_kv_heads, softcap, sinks)
        outs = [
            g.attend(keys, values, q[index], scale, self.num_kv_heads, softcap, sinks)
            for g, index in zip(self.groups, self.query_index, strict=True)
        ]
        out = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        return out[self.inverse]
