"""Plans in request ids -> Engine calls on handles, and back: the GPU actor's sans-IO core.

    runner = PlanRunner(engine)
    launched = runner.launch(plan)        # opens, closes, one submitted step
    results = runner.collect(launched)    # that step's tokens, by request id
    runner.start()                        # steps launched behind it run now (CPU)

`run_offline` drives a policy and an engine to completion on the calling thread
with the same lookahead as the actors (step N+1 launched before step N is
collected): the tests and benchmarks use it to exercise the real policy and
engine without an event loop.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping

from runtime.engine import Engine
from runtime.errors import CadenceError
from runtime.kv.base import RowSpan
from runtime.scheduler import FcfsScheduler
from runtime.sequence import FinishCause, SeqHandle, SequenceParams, StepBatch, TokenLogprob
from runtime.step_plan import StepPlan

import attrs
import structlog

log = structlog.get_logger("cadence.gpu")


@attrs.frozen
class RowResult:
    """One request's outcome in a step; `token` is None when the row failed."""

    request_id: str
    token: int | None
    finish: FinishCause | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None  # when the request asks for logprobs
    error_param: str | None = None  # the request field at fault for `error`, if any
    is_thinking: bool = False  # a constrained row inside its thought (StepOutcome)


@attrs.define
class Launched:
    plan: StepPlan
    failed: tuple[RowResult, ...]  # rows that could not open or submit
    row_ids: tuple[str, ...]  # the rows in the submitted step
    is_queued: bool  # the engine queued a step to collect
    submitted_at: float
    collected_at: float = 0.0


@attrs.define
class PlanRunner:
    engine: Engine
    rows: dict[str, SeqHandle] = attrs.Factory(dict)

    def launch(self, plan: StepPlan) -> Launched:
        for request_id in plan.closes:
            if (seq := self.rows.pop(request_id, None)) is not None:
                self.engine.close(seq)
        for request_id in plan.preempted:  # recomputed from 0: a hybrid model's state goes now
            if (seq := self.rows.get(request_id)) is not None:
                self.engine.drop_state(seq)
        failed = [RowResult(rid, None, FinishCause.ERROR, why) for rid, why in plan.rejects]
        for request_id, params, _ in plan.opens:
            try:
                self.rows[request_id] = self.engine.open(params)
            except Exception as error:  # a bad value fails its own request, never the runner
                if not isinstance(error, CadenceError):
                    log.exception("open failed", request_id=request_id)
                    error = CadenceError(f"engine error: {error}")
                failed.append(RowResult(request_id, None, FinishCause.ERROR, str(error)))
        for request_id, snapshot_id in plan.restores:  # a hybrid model's prefix hit
            if (seq := self.rows.get(request_id)) is not None:
                try:
                    self.engine.restore_state(seq, snapshot_id)
                except CadenceError as error:
                    failed += self._fail_rows((request_id,), str(error))
        if plan.snapshot_drops:
            self.engine.drop_snapshots(plan.snapshot_drops)
        # Rows that finished or failed after this plan was made are simply left out.
        spans = tuple(
            RowSpan(self.rows[s.request_id].seq_id, s.start, s.num_new, s.blocks, s.group_tables)
            for s in plan.spans
            if s.request_id in self.rows
        )
        row_ids = tuple(s.request_id for s in plan.spans if s.request_id in self.rows)
        saves = tuple(
            (self.rows[s.request_id].seq_id, s.save_as)
            for s in plan.spans
            if s.save_as is not None and s.request_id in self.rows
        )
        submitted_at = time.perf_counter()
        try:
            self.engine.submit(StepBatch(spans, plan.epoch, saves))
        except Exception as error:  # not one row's fault: every row of the step fails
            log.exception("submit failed", step=plan.step)
            failed += self._fail_rows(row_ids, f"engine error: {error}")
            return Launched(plan, tuple(failed), (), False, submitted_at)
        return Launched(plan, tuple(failed), row_ids, True, submitted_at)

    def collect(self, launched: Launched) -> tuple[RowResult, ...]:
        """Wait for the step; rows it finished are closed in the engine before this returns."""
        by_seq = {seq.seq_id: request_id for request_id, seq in self.rows.items()}
        results = list(launched.failed)
        outcomes = []
        try:
            if launched.is_queued:
                outcomes = self.engine.collect()
        except Exception as error:
            log.exception("collect failed", step=launched.plan.step)
            results += self._fail_rows(launched.row_ids, f"engine error: {error}")
        launched.collected_at = time.perf_counter()
        for outcome in outcomes:
            request_id = by_seq.get(outcome.seq_id)
            if request_id is None:
                continue  # closed by an abort after this step was queued
            results.append(
                RowResult(
                    request_id,
                    outcome.token,
                    outcome.finish,
                    outcome.error,
                    outcome.logprob,
                    outcome.error_param,
                    outcome.is_thinking,
                )
            )
            if outcome.finish is not None:
                self.engine.close(self.rows.pop(request_id))
        return tuple(results)

    def start(self) -> None:
        """Run the launched steps the engine holds back behind the one just collected
        (`Engine.defers_start`: on the CPU, starting them earlier would delay its tokens)."""
        try:
            self.engine.start_queued()
        except Exception:  # its collect evaluates the step again and fails its rows there
            log.exception("start failed")

    def close_all(self) -> None:
        for seq in self.rows.values():
            self.engine.close(seq)
        self.rows.clear()

    def _fail_rows(self, request_ids: tuple[str, ...], message: str) -> list[RowResult]:
        failed = []
        for request_id in request_ids:
            if (seq := self.rows.pop(request_id, None)) is not None:
                self.engine.close(seq)
                failed.append(RowResult(request_id, None, FinishCause.ERROR, message))
        return failed


def step_results(results: tuple[RowResult, ...]) -> list[tuple[str, int | None, bool, bool]]:
    """What the policy's `on_step_done` takes."""
    return [(r.request_id, r.token, r.finish is not None, r.is_thinking) for r in results]


@attrs.frozen
class OfflineResult:
    tokens: tuple[int, ...]
    finish: FinishCause | None
    error: str | None
    num_cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asks


def run_offline(
    engine: Engine,
    policy: FcfsScheduler,
    requests: Mapping[str, SequenceParams],
    *,
    lookahead: int = 1,
    on_step: Callable[[StepPlan], None] | None = None,
) -> dict[str, OfflineResult]:
    """Run `requests` to completion through `policy` and `engine` on this thread."""
    runner = PlanRunner(engine)
    for request_id, params in requests.items():
        policy.add(request_id, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in requests}
    ends: dict[str, tuple[FinishCause | None, str | None]] = {}
    cached: dict[str, int] = {}
    pending: collections.deque[Launched] = collections.deque()
    while True:
        plan = policy.schedule() if len(pending) <= lookahead else None
        if plan is not None:
            cached.update((rid, n) for rid, _, n in plan.opens)
            if on_step is not None:
                on_step(plan)
            pending.append(runner.launch(plan))
            continue
        if not pending:
            if policy.has_work:
                raise RuntimeError("the policy has work but plans nothing with no step in flight")
            break
        oldest = pending.popleft()
        results = runner.collect(oldest)
        runner.start()
        for result in results:
            if result.token is not None:
                tokens[result.request_id].append(result.token)
            if result.logprob is not None:
                logprobs[result.request_id].append(result.logprob)
            if result.finish is not None:
                ends[result.request_id] = (result.finish, result.error)
        policy.on_step_done(oldest.plan.step, step_results(results))
    return {
        rid: OfflineResult(
            tuple(tokens[rid]),
            *ends.get(rid, (None, None)),
            cached.get(rid, 0),
            tuple(logprobs[rid]),
        )
        for rid in requests
    }
