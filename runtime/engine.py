"""The Engine: one ragged forward per step, whatever its mix of prefill and decode.

    seq = engine.open(SequenceParams(prompt_tokens=..., max_tokens=...))
    engine.submit(StepBatch((RowSpan(seq.seq_id, 0, 12, blocks),)))  # step N+1 queued ...
    outcomes = engine.collect()                                        # ... while N is read

A step is a flat list of row spans: a prefill chunk of any length, or one decode
token. A span that reaches the row's newest token samples the next one, so a row
takes its last prefill chunk and its first decode in the same step. The spans'
tokens become one batch `[N]`; past the last layer's attention (its output projection,
its MLP, the logits) only the tokens where a row samples are computed.

The engine never allocates KV: spans carry block tables chosen by the policy's
block pool (runtime/scheduler.py), and the engine only reads and writes them.
Each row's next input is the lazily sampled token of its previous step, so step
N+1 is queued before step N's tokens are known. A row that finishes at step N may
sit in step N+1; that speculative token is dropped and the policy frees its blocks.

A row with a grammar (structured output, runtime/grammar.py) samples under its
token mask, computed on the host from its collected tokens: it is never fed a
queued sample, so the policy plans it no speculative step; but for a row inside the
thought before its grammar, fed one queued sample under a mask picked on the device
(the thought's, or the one past `</think>`). Each outcome says whether its row is
there (`is_thinking`), for the policy. Its state lives in its row,
which a preemption keeps (only the K/V is recomputed), so a resumed row goes on where
its grammar, or the thought before it, was.

A forward that raises while its graph is built is retried in halves, down to
single spans: a span that still raises fails its row alone (ERROR, naming the
exception), and the other rows' samples join the step as if nothing happened. A
step builds at most 2n - 1 forwards for n spans, all of them only when every row
is at fault. An error that surfaces only when `collect` evaluates the step cannot
be pinned on a row: it raises there, and the runner fails the step's rows.

`CADENCE_FAULT_TOKEN=N` or `N:K` (read once, at init; a test and soak hook):
a row whose prompt holds token id N raises `InjectedFault` inside any forward
that finds it with K tokens sampled, collected or queued (K defaults to 0: its
prefill). Its queued samples are then dropped like any past a finish, so with
lookahead L a client sees max(K - L, 0) tokens. Unset, it costs one `is None`
test a forward.

Every method must run on one thread: mlx streams belong to the thread that made them.
"""

from __future__ import annotations

import itertools
import os
from collections import deque

from runtime.checkpoint import LoadedModel
from runtime.engine_plan import EngineRow, ForwardSamples, QueuedStep, StepPlan
from runtime.errors import CadenceError
from runtime.finishing import finish_step, first_cause
from runtime.grammar_masks import token_masks
from runtime.kv.base import RowSpan
from runtime.kv.budget import DEFAULT_BLOCK_SIZE, check_block_size, pool_blocks
from runtime.kv.layout import KVLayout
from runtime.kv.paged import PagedKV
from runtime.kv.recurrent import RecurrentStore, RowState
from runtime.ladder import BatchLadder, pad_step
from runtime.sampling import RowSampler, Sampled, joined, logprob_rows, sample
from runtime.sequence import (
    FinishCause,
    SeqHandle,
    SequenceParams,
    StepBatch,
    StepOutcome,
    TokenLogprob,
    check_sequence,
)

import mlx.core as mx
import structlog

log = structlog.get_logger("cadence.engine")

FAULT_ENV = "CADENCE_FAULT_TOKEN"


class InjectedFault(RuntimeError):
    """Raised inside a forward by `CADENCE_FAULT_TOKEN`, where a model error would be."""


def rows_are_finite(logits: mx.array) -> mx.array:
    """[S, V] -> [S] bool: no NaN or inf in the row. Per element: a row sum overflows
    float16 (65,504) over a 151,936-token vocabulary of ordinary logits."""
    return mx.isfinite(logits).all(axis=-1)


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch: int = 16,
        max_context: int | None = None,
        kv_budget: int | float | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_snapshots: int | None = None,
    ):
        """`kv_budget`: bytes, a fraction of available memory, or None for the default
        (30% of available memory, at most what `max_batch` rows of `max_context` need).
        `num_snapshots`: a hybrid model's prefix cache's recurrent-state snapshots, their
        bytes reserved off the budget (None: `max_batch`; 0 without prefix caching)."""
        check_block_size(block_size)  # before the pool's sizing divides by it
        config = loaded.config
        self.model = loaded.model
        self.config = config
        self.max_batch = max_batch
        if max_context is not None and not 0 < max_context <= config.max_position_embeddings:
            raise CadenceError(
                f"max_context {max_context} is outside this model's 1..{config.max_position_embeddings} "
                "tokens (max_position_embeddings)"
            )
        self.model_max_context = max_context or config.max_position_embeddings
        self.eos_ids = frozenset(config.eos_token_ids) | loaded.tokenizer.eos_token_ids
        dtype = self.model.model.norm.weight.dtype
        geometry = (config.kv_layers, config.num_key_value_heads, config.head_dim)
        kv_windows = config.layer_windows[: config.kv_layers]
        # Sliding-window layers keep pools of their own, sized for max_batch rows
        # (runtime/kv/layout.py); the budget's rest goes to the first group's blocks.
        self.kv_layout = KVLayout.for_layers(config.kv_layers, kv_windows)
        self.bytes_per_block, self.window_bytes = PagedKV.sizing(
            self.kv_layout, *geometry[1:], block_size, dtype, max_batch, config.layer_kv_shapes
        )
        blocks_per_row = self.kv_layout.row_blocks(0, self.model_max_context, block_size)
        # A hybrid model's linear-attention layers keep a state per row instead of K/V
        # (runtime/kv/recurrent.py): max_batch rows of it come off the budget first.
        self.states = RecurrentStore() if config.recurrent_row_bytes else None
        self.recurrent_bytes = max_batch * config.recurrent_row_bytes
        # ... and a cached prefix resumes from a snapshot of that state (runtime/kv/snapshots.py).
        self.num_snapshots = 0 if self.states is None else max_batch if num_snapshots is None else num_snapshots
        self.snapshot_bytes = self.num_snapshots * config.recurrent_row_bytes
        self._snapshots: dict[int, RowState] = {}  # by the policy's snapshot id
        reserved = (
            ("the sliding-window layers' KV", self.window_bytes),
            ("the linear-attention layers' state", self.recurrent_bytes),
            ("its prefix-cache snapshots", self.snapshot_bytes),
        )
        num_blocks = pool_blocks(
            kv_budget,
            max_batch * blocks_per_row,
            self.bytes_per_block,
            self.window_bytes + self.recurrent_bytes + self.snapshot_bytes,
            " and ".join(what for what, size in reserved if size) or reserved[0][0],
        )
        self.kv = PagedKV(
            *geometry, config.num_queries_per_kv, num_blocks, block_size, dtype,
            kv_windows, max_batch, config.layer_kv_shapes,
        )
        self.kv_tokens = self.kv_layout.max_row_tokens(num_blocks, block_size)
        self.max_context = min(self.model_max_context, self.kv_tokens)
        self._rows: dict[int, EngineRow] = {}
        self._queued: deque[QueuedStep] = deque()
        # On the CPU, mx.async_eval returns only when all but the last ~100 queued ops
        # have run (mlx bounds its active tasks), so starting step N+1 before step N is
        # read holds N's tokens back until N+1 is nearly done: a whole prompt chunk's
        # time (a 1-row step read 400 ms late behind a 175-token chunk). There, a step
        # with a prompt chunk submitted while another is in flight is only built, and
        # `start_queued` runs it once the older step is read. A decode-only step still
        # starts at once: its delay is short, and a start after the read leaves the
        # cores idle meanwhile (single-stream 4-bit decode: 119 vs 125 tok/s).
        self.defers_start = mx.default_device() == mx.cpu
        self._ids = itertools.count()
        self._fault = _fault_from_env()  # (token id, samples) or None
        self.ladder: BatchLadder | None = None  # pads steps to cheaper sizes when set

    # -- sequences ---------------------------------------------------------------

    @property
    def kv_bound(self) -> int | None:
        """The KV pool's tokens when they, not the model, bound a row's context: what a
        too-long request's error names (a pool sized to the context is the model's bound)."""
        return self.kv_tokens if self.kv_tokens < self.model_max_context else None

    def open(self, params: SequenceParams) -> SeqHandle:
        check_sequence(
            params,
            max_context=self.max_context,
            vocab_size=self.config.vocab_size,
            kv_tokens=self.kv_bound,
        )
        handle = SeqHandle(next(self._ids))
        fault = self._fault
        self._rows[handle.seq_id] = EngineRow(
            handle=handle,
            params=params,
            sampler=RowSampler.create(
                params.sampling, params.prompt_tokens, self.config.vocab_size
            ),
            eos_ids=frozenset() if params.ignore_eos else self.eos_ids | params.stop_token_ids,
            tokens=list(params.prompt_tokens),
            fault_at=fault[1] if fault is not None and fault[0] in params.prompt_tokens else None,
            grammar=(
                params.grammar.start(
                    self.eos_ids if params.ignore_eos else frozenset(), params.thought_first
                )
                if params.grammar is not None
                else None
            ),
        )
        return handle

    def close(self, seq: SeqHandle) -> None:
        self._rows.pop(seq.seq_id, None)
        if self.states is not None:
            self.states.release(seq.seq_id)

    def drop_state(self, seq: SeqHandle) -> None:
        """Free a preempted row's recurrent state (a hybrid model's): it is computed again
        from position 0, so while it waits it holds none, and the rows holding one are
        at most max_batch, as the KV budget counts them."""
        if self.states is not None:
            self.states.release(seq.seq_id)

    def restore_state(self, seq: SeqHandle, snapshot_id: int) -> None:
        """Start a hybrid model's row from a cached prefix's recurrent state."""
        snapshot = self._snapshots.get(snapshot_id)
        if self.states is None or snapshot is None:
            raise CadenceError(f"no recurrent-state snapshot {snapshot_id} to resume row {seq.seq_id} from")
        self.states.restore(seq.seq_id, snapshot)

    def drop_snapshots(self, snapshot_ids: tuple[int, ...]) -> None:
        for snapshot_id in snapshot_ids:
            self._snapshots.pop(snapshot_id, None)

    @property
    def num_snapshots_held(self) -> int:
        return len(self._snapshots)

    @property
    def num_open(self) -> int:
        return len(self._rows)

    @property
    def num_pending(self) -> int:
        return len(self._queued)

    def start_queued(self) -> None:
        """Hand every built, unstarted step to mlx, oldest first. On the CPU this
        returns when little of them is left to run (see `defers_start`)."""
        for step in self._queued:
            if not step.is_started:
                step.is_started = True
                mx.async_eval(*step.outputs)

    # -- steps -------------------------------------------------------------------

    def step(self, batch: StepBatch) -> list[StepOutcome]:
        self.submit(batch)
        return self.collect()

    def submit(self, batch: StepBatch) -> None:
        """Queue one forward over every span of `batch`: plan, forward, sample; and start
        it, unless a prompt chunk in it waits for `start_queued` behind a step in flight
        (`defers_start`).

        Rows whose forward raises fail alone; the rest are sampled in this one step."""
        plan = self._plan(batch)
        ran = self._isolating_forward(plan, batch.epoch) if plan.spans else []
        saved = self._save_states(batch)
        sampling = [row for part, _ in ran for row in part.sampling]
        if not sampling:  # prefill chunks only: just the K/V writes are wanted
            # Every slot's pool: with layer groups the last slot is not always written last.
            # Evaluated here, not queued: a queued reference to a pool (or an op reading
            # it, still waiting to run) would keep the next step's K/V write from taking
            # its buffer over (kernels/cpu/attention_ops.cpp), and the pool would be
            # copied. Such a step is a whole prefill chunk: waiting costs it only the
            # overlap with the next step's graph building (a few ms of hundreds).
            if ran:
                states = [] if self.states is None else self.states.arrays()
                mx.eval(*self.kv.keys, *self.kv.values, *states, *saved)
            self._queue(plan, [], None)
            return
        parts = [out for _, out in ran if out is not None]  # more than one if it was split
        sampled, is_finite = parts[0] if len(parts) == 1 else joined(parts)
        for i, row in enumerate(sampling):
            row.next_input = sampled.tokens[i : i + 1]
            row.sampler.record(row.next_input)
            row.num_pending += 1
        self._queue(plan, sampling, (sampled, is_finite), saved)

    def _save_states(self, batch: StepBatch) -> list[mx.array]:
        """Keep the snapshots `batch` asks for, of rows whose span ran (a failed or
        skipped row's state is not where its span ends); their arrays, to evaluate with
        the step (a lazy copy would hold the batch it copies from)."""
        if self.states is None or not batch.saves:
            return []
        ends = {span.seq_id: span.end for span in batch.spans}
        arrays = []
        for seq_id, snapshot_id in batch.saves:
            snapshot = self.states.snapshot(seq_id, ends.get(seq_id, -1))
            if snapshot is not None:
                self._snapshots[snapshot_id] = snapshot
                arrays += [held.batch for held in (*snapshot.conv, *snapshot.delta)]
        return arrays

    def collect(self) -> list[StepOutcome]:
        """Block for the oldest queued step and decide which rows it finished."""
        step = self._queued.popleft()
        outcomes = [StepOutcome(sid, None, FinishCause.ERROR, err) for sid, err in step.failures]
        # An error raised while evaluating cannot be pinned on a row (the graph is built):
        # it propagates, and the runner fails every row of the step.
        tokens: list[int] = step.tokens.tolist()  # type: ignore[assignment]  # [S] -> list
        finite: list[bool] = step.is_finite.tolist()  # type: ignore[assignment]
        logprobs = logprob_rows(step.logprobs, len(tokens))
        for seq_id, token, is_finite, logprob in zip(
            step.seq_ids, tokens, finite, logprobs, strict=True
        ):
            row = self._rows.get(seq_id)
            if row is None:
                continue  # closed since the step was queued
            row.num_pending -= 1
            if row.finished is not None:
                continue  # a speculative step past the finish: its token is dropped
            if not is_finite:
                row.finished = FinishCause.ERROR
                outcomes.append(StepOutcome(seq_id, None, FinishCause.ERROR, "non-finite logits"))
                continue
            row.tokens.append(token)
            if row.grammar is not None and (refused := row.grammar.advance(token)) is not None:
                row.finished = FinishCause.ERROR
                param = row.params.grammar.spec.param if row.params.grammar is not None else None
                outcomes.append(
                    StepOutcome(seq_id, None, FinishCause.ERROR, refused, error_param=param)
                )
                continue
            row.finished = finish_step(
                token=token,
                num_generated=row.num_generated,
                tokens=row.tokens,
                max_tokens=row.params.max_tokens,
                context_length=len(row.tokens),
                max_context=self.max_context,
                eos_ids=row.eos_ids,
                repetition_window=row.params.repetition_window,
            )
            if row.grammar is not None and row.grammar.is_done:
                # Complete: nothing but EOS could follow. It outranks LENGTH, as a sampled
                # EOS does: a whole answer on its max_tokens-th token was not cut short.
                row.finished = first_cause(row.finished, FinishCause.EOS)
            num_top = row.params.sampling.logprobs
            asked = None if num_top is None else TokenLogprob(logprob[0], logprob[1][:num_top])
            is_thinking = row.grammar is not None and row.grammar.is_thinking
            outcomes.append(
                StepOutcome(seq_id, token, row.finished, logprob=asked, is_thinking=is_thinking)
            )
        return outcomes

    # -- internals ---------------------------------------------------------------

    def _plan(self, batch: StepBatch) -> StepPlan:
        """The step's live spans, their input tokens, and which rows sample where."""
        plan = StepPlan()
        for span in batch.spans:
            row = self._rows.get(span.seq_id)
            if row is None or row.finished is not None:
                continue  # closed or done since the batch was planned
            try:
                tokens = self._row_input(row, span)
            except Exception as exc:  # one row's fault must not sink its batch
                plan.fail(row, exc)
                continue
            if tokens is not None:  # None: at its max_tokens or the context bound
                plan.add(span, tokens, row)
        return plan

    def _isolating_forward(self, plan: StepPlan, epoch: int) -> list[tuple[StepPlan, ForwardSamples | None]]:
        """`_forward` over `plan`; if that raises, over each half in turn, recursively.

        A span that raises alone fails its row (into `plan.failures`). n spans build at
        most 2n - 1 forwards: a binary tree of depth ceil(log2 n). A forward that raised
        may have queued K/V writes; each healthy row's retry rewrites its slots after
        them, and a failed row's blocks are never published to the prefix cache.
        """
        try:
            return [(plan, self._forward(plan, epoch))]
        except Exception as exc:
            if len(plan.spans) == 1:
                row = plan.rows[0]
                log.error(
                    "row failed alone in the forward",
                    seq_id=row.handle.seq_id,
                    request_id=row.params.request_id,
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=not isinstance(exc, InjectedFault),  # a planned fault needs no trace
                )
                plan.fail(row, exc)
                return []
            log.warning(
                "forward failed, retrying in halves",
                num_spans=len(plan.spans),
                error=f"{type(exc).__name__}: {exc}",
            )
        left, right = plan.halves()
        return self._isolating_forward(left, epoch) + self._isolating_forward(right, epoch)

    def _forward(self, plan: StepPlan, epoch: int) -> ForwardSamples | None:
        """One ragged forward over `plan`'s spans: their K/V writes, and (sampled [S],
        is_finite [S]) for its sampling rows, or None when none samples. Records nothing
        on the rows, and commits their recurrent states (a hybrid model's) only once it
        is built, so a forward that raises can be retried."""
        recurrent = None if self.states is None else self.states.step(plan.spans)
        view = self.kv.forward(plan.spans, epoch, recurrent)
        tokens, view = pad_step(self.ladder, mx.concatenate(plan.inputs), view)
        # Only the sampling tokens' states are wanted. When that is every token (a decode
        # step), selecting them would only add ops; when none samples, nothing reads them.
        is_selective = 0 < len(plan.sample_at) < tokens.size
        keep = mx.array(plan.sample_at, mx.int32) if is_selective else None
        hidden = self.model.hidden(tokens[None], view, keep)[0]  # [S, hidden]
        if self._fault is not None:
            self._inject_fault(plan)
        result = None  # no row samples: its K/V writes are evaluated (`submit`), not its states
        if plan.sampling:
            logits = self.model.project(hidden)  # [S, V]
            allowed = token_masks(
                [row.grammar for row in plan.sampling],
                logits.shape[-1],
                [row.next_input if row.num_pending else None for row in plan.sampling],
            )
            samples = sample(logits, [row.sampler for row in plan.sampling], allowed)
            result = samples, rows_are_finite(logits)
        if recurrent is not None:  # last: nothing after it raises
            self.states.commit(recurrent)  # type: ignore[union-attr]  # set with `recurrent`
        return result

    def _inject_fault(self, plan: StepPlan) -> None:
        """CADENCE_FAULT_TOKEN: raise as a model error would, judged on host counters only."""
        for row in plan.rows:
            if row.fault_at is not None and row.num_sampled == row.fault_at:
                raise InjectedFault(f"{FAULT_ENV}: row {row.handle.seq_id}, {row.fault_at} sampled")

    def _queue(
        self,
        plan: StepPlan,
        sampling: list[EngineRow],
        sampled: ForwardSamples | None,
        saved: list[mx.array] | None = None,
    ) -> None:
        samples, is_finite = sampled or (Sampled(mx.array([], mx.int32)), mx.array([], mx.bool_))
        seq_ids = tuple(row.handle.seq_id for row in sampling)
        step = QueuedStep(
            seq_ids, samples.tokens, is_finite, samples.logprobs, tuple(plan.failures), tuple(saved or ())
        )
        is_held_back = (
            self.defers_start and bool(self._queued) and plan.num_tokens > len(plan.spans)
        )
        self._queued.append(step)
        if not is_held_back:
            self.start_queued()

    def _row_input(self, row: EngineRow, span: RowSpan) -> mx.array | None:
        """The span's input tokens: [num_new] int32, the last possibly not computed yet.

        None when the span would sample past the row's max_tokens or context bound.
        """
        if span.start < 0 or span.num_new < 1 or span.end > row.frontier:
            raise ValueError(
                f"span [{span.start}, {span.end}) is outside row {row.handle.seq_id}'s "
                f"{row.frontier} tokens"
            )
        if span.end == row.frontier:
            max_tokens = row.params.max_tokens
            if (
                max_tokens is not None and row.num_sampled >= max_tokens
            ) or row.frontier >= self.max_context:
                return None
        if row.num_pending:
            # A constrained row's mask needs the queued token on the host, unless the row
            # is inside its thought and it is its only one (runtime/grammar.py).
            if row.grammar is not None and not (row.grammar.is_thinking and row.num_pending == 1):
                raise ValueError(f"row {row.handle.seq_id} is constrained: it skips lookahead")
            if span.start != row.frontier - 1 or span.num_new != 1:
                raise ValueError(f"row {row.handle.seq_id} has a queued sample: only it can be fed")
            assert row.next_input is not None
            return row.next_input
        return mx.array(row.tokens[span.start : span.end], dtype=mx.int32)


def _fault_from_env() -> tuple[int, int] | None:
    """CADENCE_FAULT_TOKEN "N" or "N:K" -> (N, K); unset or empty -> None."""
    text = os.environ.get(FAULT_ENV, "").strip()
    if not text:
        return None
    token, _, num_sampled = text.partition(":")
    try:
        return int(token), int(num_sampled or 0)
    except ValueError:
        raise CadenceError(f"{FAULT_ENV}={text!r}: give a token id N, or N:K") from None
