"""Per-row recurrent state for linear-attention layers (Qwen3.5's Gated DeltaNet, Granite
4.0's Mamba2).

A hybrid model's linear-attention layer keeps no K/V: each row carries, per such
layer, a causal convolution's last K - 1 inputs `[K-1, C]` and a delta-rule state
`[Hv, Dv, Dk]` (float32; a Mamba2 layer's SSM state `[H, Dh, Ds]` in its place),
advanced by each of its spans (runtime/kv/delta_rule.py, runtime/kv/ssm_scan.py:
decoding rows one batched step, a prompt chunk by chunks). The storage interface holds them
beside the paged K/V: a layer calls `kv.convolve(...)` and `kv.delta_rule(...)` (or
`kv.ssm_scan(...)`), as an attention layer calls `kv.attend(...)`, and never branches on
prefill or decode.

    store = RecurrentStore()
    step = store.step(spans)   # each row's state: zeros where its span starts at 0
    ... the forward calls step.convolve / step.delta_rule once per layer ...
    store.commit(step)         # only once the whole forward is built

A forward that raises is never committed, so its retry (the engine's halves) reads
the states it read. The states stay lazy: step N+1 reads step N's before either
runs. A row's state knows the position it reached, and a span must start there or
at 0 (a recompute after preemption starts over): a span starting anywhere else fails
its row rather than run on a wrong state. A cached prefix resumes from a snapshot:
`snapshot` copies a row's state out after a span, `restore` starts a row from one
(the policy picks which, runtime/kv/snapshots.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from runtime.kv.delta_rule import delta_step, span_delta_rule
from runtime.kv.ssm_scan import span_ssm_scan, ssm_step

import attrs
import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from runtime.kv.base import RowSpan

STATE_BYTES = 4  # float32: what the CPU computes in, and the matrix states everywhere
# (inputs [N, ...] per token..., state) -> (y, the new state): a layer's matrix recurrence.
Recurrence = Callable[..., tuple[mx.array, mx.array]]


@attrs.frozen
class Held:
    """A row's state of one layer: entry `index` of `batch` [R, ...], the array its last
    step computed for all its rows. Held so, a decode step of the same rows as the last
    reads `batch` whole instead of stacking R slices (16 rows x 6 layers: ~200 ops fewer)."""

    batch: mx.array
    index: int

    @property
    def array(self) -> mx.array:
        return self.batch[self.index]


@attrs.frozen
class RowState:
    position: int  # the tokens it has seen
    conv: tuple[Held, ...]  # per layer [K-1, C]
    delta: tuple[Held, ...]  # per layer its matrix state: the delta rule's [Hv, Dv, Dk], Mamba2's [H, Dh, Ds]


class RecurrentStore:
    """Every open row's state, keyed by its seq_id."""

    def __init__(self) -> None:
        self._rows: dict[int, RowState] = {}

    def step(self, spans: Sequence[RowSpan]) -> RecurrentStep:
        """The states `spans` start from; raises ValueError for a span that starts
        neither at 0 nor where its row's state is."""
        states: list[RowState | None] = []
        for span in spans:
            state = None if span.start == 0 else self._rows.get(span.seq_id)
            if span.start != 0 and (state is None or state.position != span.start):
                reached = 0 if state is None else state.position
                raise ValueError(
                    f"row {span.seq_id}: its recurrent state is at position {reached}, "
                    f"the span starts at {span.start} (a recurrent model computes a row from 0)"
                )
            states.append(state)
        return RecurrentStep([(s.seq_id, s.start, s.num_new) for s in spans], states)

    def commit(self, step: RecurrentStep) -> None:
        """Keep the states `step` computed, for its rows' next spans."""
        for i, (seq_id, start, num_new) in enumerate(step.rows):
            self._rows[seq_id] = RowState(
                start + num_new,
                tuple(layer[i] for layer in step.new_conv),
                tuple(layer[i] for layer in step.new_delta),
            )
        # A row left out of the step (a constrained row awaiting its sample, a prompt
        # waiting for budget) would pin its last batch, every row's state in it, after
        # the others moved on: it gets a copy of its own, so the rows' states stay
        # `max_batch` rows' worth, as the budget counts them.
        stepped = {seq_id for seq_id, _, _ in step.rows}
        for seq_id, row in self._rows.items():
            if seq_id not in stepped and any(h.batch.shape[0] > 1 for h in (*row.conv, *row.delta)):
                self._rows[seq_id] = attrs.evolve(row, conv=_own(row.conv), delta=_own(row.delta))

    def release(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)

    def snapshot(self, seq_id: int, position: int) -> RowState | None:
        """A copy of the row's state if it is at `position` (its span ran), else None;
        a copy of its own, so that keeping it never pins the batch of every row (a row
        alone in its batch is its own already; a step never writes a state in place)."""
        row = self._rows.get(seq_id)
        if row is None or row.position != position:
            return None
        return RowState(position, _own(row.conv), _own(row.delta))

    def restore(self, seq_id: int, snapshot: RowState) -> None:
        """Start the row from `snapshot` (a cached prefix's state): its next span starts
        at `snapshot.position`. Steps only read a state, so the snapshot stays as it is."""
        self._rows[seq_id] = snapshot

    def arrays(self) -> list[mx.array]:
        """Every state held (to evaluate with the K/V pools)."""
        held = {id(h.batch): h.batch for row in self._rows.values() for h in (*row.conv, *row.delta)}
        return list(held.values())

    def __len__(self) -> int:
        return len(self._rows)


def _own(held: tuple[Held, ...]) -> tuple[Held, ...]:
    """Each state copied out of its batch (stacked alone: a new buffer)."""
    return tuple(h if h.batch.shape[0] == 1 else Held(mx.stack([h.array]), 0) for h in held)


def zero_states(spans: Sequence[RowSpan]) -> RecurrentStep:
    """A step of `spans` from zero states wherever they start, kept by no one (timings)."""
    return RecurrentStep([(s.seq_id, s.start, s.num_new) for s in spans], [None] * len(spans))


class RecurrentStep:
    """One forward's recurrent state: `rows[i]` = (seq_id, start, num_new), its tokens
    at `[offset_i, offset_i + num_new)` of the flat batch, as `RowSpan`s lay them out."""

    def __init__(self, rows: list[tuple[int, int, int]], states: list[RowState | None]):
        self.rows = rows
        self._states = states
        self.new_conv: list[list[Held]] = []  # per layer, per row
        self.new_delta: list[list[Held]] = []
        sizes = np.array([n for _, _, n in rows], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(sizes)])
        self._num_tokens = int(self._offsets[-1])

    def _layer_states(self, kind: str, layer: int, rows: Sequence[int], zeros: mx.array) -> mx.array:
        """`rows`' input states of `layer`, stacked [len(rows), ...]: each its own, or
        `zeros` where its span starts at 0; the last step's batch as it is where these
        rows were all of it, in order."""
        held = [None if (s := self._states[i]) is None else getattr(s, kind)[layer] for i in rows]
        first = held[0]
        if first is not None and first.batch.shape[0] == len(held) and all(
            h is not None and h.batch is first.batch and h.index == j for j, h in enumerate(held)
        ):
            return first.batch
        return mx.stack([zeros if h is None else h.array for h in held])

    def convolve(self, layer: int, x: mx.array, weight: mx.array) -> mx.array:
        """Causal depthwise convolution over each row: x [N, C], weight [C, K] -> [N, C].
        Token n sees its row's K - 1 inputs before it: earlier tokens of its span,
        then the row's stored inputs (zeros before position 0). Keeps each row's last
        K - 1 inputs."""
        if layer != len(self.new_conv):
            raise ValueError(f"recurrent layer {layer} convolved out of order")
        K = weight.shape[1]
        R, N = len(self.rows), self._num_tokens
        zeros = mx.zeros((K - 1, x.shape[-1]), dtype=x.dtype)
        stored = self._layer_states("conv", layer, range(R), zeros)  # [R, K-1, C]
        # One gather over [every row's stored inputs, then x]: row r's stored input j
        # is entry r (K-1) + j, token n of the flat batch is entry R (K-1) + n.
        inputs = mx.concatenate([stored.astype(x.dtype).reshape(R * (K - 1), -1), x])
        windows, kept = _window_indices(self._offsets, K)
        # Summed in float32, as a convolution accumulates, whatever the inputs' dtype.
        taps = inputs[mx.array(windows)].astype(mx.float32) * weight.T.astype(mx.float32)  # [N, K, C]
        out = taps.sum(axis=1).astype(x.dtype)
        last = inputs[mx.array(kept)]  # [R, K-1, C]
        self.new_conv.append([Held(last, r) for r in range(R)])
        assert out.shape[0] == N
        return out

    def delta_rule(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array
    ) -> mx.array:
        """The gated delta rule over each row's tokens in order: q, k [N, Hv, Dk] (q
        scaled, both normalized), v [N, Hv, Dv], log_decay and beta [N, Hv] -> y [N, Hv, Dv].
        Rows of one token step together as one batch; a longer span runs by chunks
        (runtime/kv/delta_rule.py)."""
        Hv, Dv, Dk = v.shape[1], v.shape[2], q.shape[2]
        zeros = mx.zeros((Hv, Dv, Dk), dtype=mx.float32)
        return self._matrix_recurrence(layer, zeros, (q, k, v, log_decay, beta), delta_step, span_delta_rule)

    def ssm_scan(
        self, layer: int, x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array
    ) -> mx.array:
        """Mamba2's state-space scan over each row's tokens in order: x [N, H, Dh], dt and
        log_decay [N, H] (float32), B and C [N, G, Ds] (a group's heads adjacent) -> y
        [N, H, Dh], batched and chunked as `delta_rule` (runtime/kv/ssm_scan.py). Its state
        [H, Dh, Ds] is the layer's matrix state, where a Gated DeltaNet layer keeps the
        delta rule's."""
        zeros = mx.zeros((x.shape[1], x.shape[2], B.shape[2]), dtype=mx.float32)
        return self._matrix_recurrence(layer, zeros, (x, dt, B, C, log_decay), ssm_step, span_ssm_scan)

    def _matrix_recurrence(
        self,
        layer: int,
        zeros: mx.array,
        inputs: tuple[mx.array, ...],
        one_token: Recurrence,
        span: Recurrence,
    ) -> mx.array:
        """`layer`'s recurrence over each row's tokens: `inputs` [N, ...] per token; the
        rows of one token as one batch through `one_token` (states [R, ...]), each longer
        span through `span` (its state alone); every row's new state kept."""
        if layer != len(self.new_delta):
            raise ValueError(f"recurrent layer {layer} stepped out of order")
        new_states: list[Held | None] = [None] * len(self.rows)
        pieces, order = [], []
        singles = [i for i, (_, _, n) in enumerate(self.rows) if n == 1]
        if singles:
            at = mx.array(self._offsets[singles].astype(np.int32))
            state = self._layer_states("delta", layer, singles, zeros)
            y, state = one_token(*(a[at] for a in inputs), state)
            pieces.append(y)
            order.extend(self._offsets[singles].tolist())
            for j, i in enumerate(singles):
                new_states[i] = Held(state, j)
        for i, (_, _, n) in enumerate(self.rows):
            if n == 1:
                continue
            start = int(self._offsets[i])
            tokens = slice(start, start + n)
            state = self._layer_states("delta", layer, [i], zeros)[0]
            y, state = span(*(a[tokens] for a in inputs), state)
            pieces.append(y)
            order.extend(range(start, start + n))
            new_states[i] = Held(state[None], 0)
        self.new_delta.append(new_states)  # type: ignore[arg-type]  # every row's is set
        out = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
        if order != list(range(self._num_tokens)):  # back to the flat batch's order
            out = out[mx.array(np.argsort(np.array(order)).astype(np.int32))]
        return out


def _window_indices(offsets: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """For `convolve`'s gather: each token's K inputs [N, K], and each row's last
    K - 1 [R, K-1], as entries of [stored inputs (R (K-1)), then the flat batch]."""
    R = len(offsets) - 1
    base = R * (K - 1)
    windows = np.empty((int(offsets[-1]), K), dtype=np.int32)
    kept = np.empty((R, K - 1), dtype=np.int32)

    def entry(row: int, i: np.ndarray) -> np.ndarray:  # i: positions in the row's span (< 0: stored)
        return np.where(i >= 0, base + offsets[row] + i, row * (K - 1) + (K - 1) + i)

    for r in range(R):
        n = int(offsets[r + 1] - offsets[r])
        span = np.arange(n)[:, None] + np.arange(-(K - 1), 1)[None, :]  # [n, K]
        windows[offsets[r] : offsets[r] + n] = entry(r, span)
        kept[r] = entry(r, np.arange(n - (K - 1), n))
    return windows, kept
