"""What the Engine (runtime/engine.py) keeps per open row, the plan of one step's
forward (its spans, inputs and sampling rows; halved when a forward is retried), and a
step queued on the device until `collect` reads it."""

from __future__ import annotations

from runtime.grammar import GrammarState
from runtime.kv.base import RowSpan
from runtime.sampling import Logprobs, RowSampler, Sampled
from runtime.sequence import FinishCause, SeqHandle, SequenceParams

import attrs
import mlx.core as mx


@attrs.define
class EngineRow:
    handle: SeqHandle
    params: SequenceParams
    sampler: RowSampler
    eos_ids: frozenset[int]
    tokens: list[int]  # prompt, then every collected token
    next_input: mx.array | None = None  # [1] the newest sample, maybe not computed yet
    num_pending: int = 0  # samples queued and not collected
    finished: FinishCause | None = None
    fault_at: int | None = None  # CADENCE_FAULT_TOKEN: its forward raises at this many samples
    grammar: GrammarState | None = None  # structured output: where the row is in its grammar

    @property
    def num_sampled(self) -> int:
        return self.num_generated + self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.params.prompt_tokens)

    @property
    def frontier(self) -> int:
        """Tokens known or queued: a span ending here samples the next one."""
        return len(self.tokens) + self.num_pending


@attrs.define
class StepPlan:
    spans: list[RowSpan] = attrs.Factory(list)
    inputs: list[mx.array] = attrs.Factory(list)  # each span's input tokens, [num_new] int32
    rows: list[EngineRow] = attrs.Factory(list)  # each span's row
    sampling: list[EngineRow] = attrs.Factory(list)  # rows whose span ends at their newest token
    sample_at: list[int] = attrs.Factory(list)  # ... and where, in the flat batch
    failures: list[tuple[int, str]] = attrs.Factory(list)  # shared by a plan's halves
    num_tokens: int = 0

    def add(self, span: RowSpan, tokens: mx.array, row: EngineRow) -> None:
        self.spans.append(span)
        self.inputs.append(tokens)
        self.rows.append(row)
        self.num_tokens += span.num_new
        if span.end == row.frontier:
            self.sampling.append(row)
            self.sample_at.append(self.num_tokens - 1)

    def fail(self, row: EngineRow, exc: Exception) -> None:
        row.finished = FinishCause.ERROR
        self.failures.append((row.handle.seq_id, f"{type(exc).__name__}: {exc}"))

    def halves(self) -> tuple[StepPlan, StepPlan]:
        left, right = StepPlan(failures=self.failures), StepPlan(failures=self.failures)
        mid = len(self.spans) // 2
        for i, span in enumerate(self.spans):
            (left if i < mid else right).add(span, self.inputs[i], self.rows[i])
        return left, right


ForwardSamples = tuple[Sampled, mx.array]  # a forward's samples [S], and is_finite [S] bool


@attrs.define
class QueuedStep:
    seq_ids: tuple[int, ...]  # rows that sample, in the order of `tokens`
    tokens: mx.array  # [S] int32
    is_finite: mx.array  # [S] bool: the row's logits had no NaN/inf
    logprobs: Logprobs | None  # [S] and [S, K], when any sampling row asks
    failures: tuple[tuple[int, str], ...]  # rows that failed while the step was built
    saved: tuple[mx.array, ...] = ()  # recurrent-state snapshots the step keeps, evaluated with it
    is_started: bool = False  # handed to mlx to run (`Engine.start_queued`)

    @property
    def outputs(self) -> tuple[mx.array, ...]:
        lp = self.logprobs
        logprobs = () if lp is None else (lp.token, lp.top_ids, lp.top)
        return (self.tokens, self.is_finite, *logprobs, *self.saved)
