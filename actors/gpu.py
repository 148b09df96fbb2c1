"""The GPU actor: owns the Engine and makes every engine call on the one MLX thread.

Lookahead: it submits plan N+1 before it collects step N, so while the trio side
streams step N's tokens, step N+1 is already running. Engine rows are known here
only, by request id; the scheduler and streamer never see a handle.
"""

from __future__ import annotations

import collections
import time

from runtime.engine import Engine
from runtime.errors import CadenceError
from runtime.scheduler import StepPlan
from runtime.sequence import FinishCause, SeqHandle, StepBatch

import attrs
import structlog
import trio

from actors.messages import (
    GpuMessage,
    RowToken,
    SchedulerMessage,
    StepDone,
    StepResult,
    StreamerMessage,
)
from actors.mlx_thread import MlxThread

log = structlog.get_logger("cadence.gpu")


@attrs.define
class _Launched:
    plan: StepPlan
    is_queued: bool  # the engine queued a step to collect (a prefill-only one does not)
    failed: tuple[RowToken, ...]  # rows that could not open or submit
    row_ids: tuple[str, ...]  # the rows in the submitted batch
    submitted_at: float
    collected_at: float = 0.0


@attrs.define
class GpuActor:
    engine: Engine
    thread: MlxThread
    inbox: trio.MemoryReceiveChannel[GpuMessage]
    to_streamer: trio.MemorySendChannel[StreamerMessage]
    to_scheduler: trio.MemorySendChannel[SchedulerMessage]
    lookahead: int = 1
    rows: dict[str, SeqHandle] = attrs.Factory(dict)  # touched on the MLX thread only
    last_collected_at: float = 0.0  # when the previous step's tokens were read

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        pending: collections.deque[_Launched] = collections.deque()  # submitted, not collected
        async with self.inbox, self.to_streamer, self.to_scheduler:
            task_status.started()
            async for message in self.inbox:
                plan = message if isinstance(message, StepPlan) else None
                if pending and (plan is None or len(pending) == self.lookahead):
                    # One trip to the MLX thread: queue step N+1, then read step N.
                    oldest = pending.popleft()
                    launched, outcome = await self.thread.run(
                        self._launch_then_collect, plan, oldest
                    )
                    pending.extend([launched] if launched else [])
                    await self._report(oldest, *outcome)
                elif plan is not None:
                    pending.append(await self.thread.run(self._launch, plan))
            while pending:
                oldest = pending.popleft()
                await self._report(oldest, *await self.thread.run(self._collect, oldest))
            await self.thread.run(self._close_all)

    async def _report(
        self, launched: _Launched, rows: tuple[RowToken, ...], finished: tuple[str, ...]
    ) -> None:
        plan = launched.plan
        # A queued step starts running once the one before it is done.
        started_at = max(launched.submitted_at, self.last_collected_at)
        self.last_collected_at = launched.collected_at
        log.debug(
            "step",
            step=plan.step,
            rows=len(launched.row_ids),
            prefill_tokens=plan.num_prefill_tokens,
            decode_rows=len(plan.decode),
            step_ms=round((launched.collected_at - started_at) * 1e3, 3),
        )
        await self.to_streamer.send(StepResult(plan.step, rows, released=plan.closes))
        await self.to_scheduler.send(StepDone(plan.step, finished))

    # -- on the MLX thread ---------------------------------------------------------------

    def _launch(self, plan: StepPlan) -> _Launched:
        for request_id in plan.closes:
            if (seq := self.rows.pop(request_id, None)) is not None:
                self.engine.close(seq)
        failed = []
        for request_id, params in plan.opens:
            try:
                self.rows[request_id] = self.engine.open(params)
            except CadenceError as error:
                failed.append(RowToken(request_id, None, FinishCause.ERROR, str(error)))
            except Exception as error:  # an unchecked bad value fails its own request only
                log.exception("open failed", request_id=request_id)
                failed.append(RowToken(request_id, None, FinishCause.ERROR, f"engine error: {error}"))
        # Rows that finished or failed after this plan was made are simply left out.
        prefill = tuple((self.rows[r], p) for r, p in plan.prefill if r in self.rows)
        decode = tuple(self.rows[r] for r in plan.decode if r in self.rows)
        planned = [r for r, _ in plan.prefill] + list(plan.decode)
        row_ids = tuple(r for r in dict.fromkeys(planned) if r in self.rows)
        submitted_at = time.perf_counter()
        try:
            is_queued = self.engine.submit(StepBatch(decode=decode, prefill=prefill))
        except Exception as error:  # not one row's fault: every row of the step fails
            log.exception("submit failed", step=plan.step)
            failed += self._fail_rows(row_ids, f"engine error: {error}")
            return _Launched(plan, False, tuple(failed), (), submitted_at)
        return _Launched(plan, is_queued, tuple(failed), row_ids, submitted_at)

    def _launch_then_collect(
        self, plan: StepPlan | None, oldest: _Launched
    ) -> tuple[_Launched | None, tuple[tuple[RowToken, ...], tuple[str, ...]]]:
        launched = self._launch(plan) if plan is not None else None
        return launched, self._collect(oldest)

    def _collect(self, launched: _Launched) -> tuple[tuple[RowToken, ...], tuple[str, ...]]:
        by_seq = {seq.seq_id: request_id for request_id, seq in self.rows.items()}
        rows = list(launched.failed)
        try:
            outcomes = []
            if launched.is_queued:
                outcomes = self.engine.collect()
            elif launched.row_ids:
                self.engine.synchronize()  # pace prefill-only steps: their KV writes finish here
        except Exception as error:
            log.exception("collect failed", step=launched.plan.step)
            rows += self._fail_rows(launched.row_ids, f"engine error: {error}")
            outcomes = []
        launched.collected_at = time.perf_counter()
        for outcome in outcomes:
            request_id = by_seq.get(outcome.seq_id)
            if request_id is None:
                continue  # closed by an abort after this step was queued
            rows.append(RowToken(request_id, outcome.token, outcome.finish, outcome.error))
            if outcome.finish is not None:
                self.engine.close(self.rows.pop(request_id))
        finished = tuple(row.request_id for row in rows if row.finish is not None)
        return tuple(rows), finished

    def _fail_rows(self, request_ids: tuple[str, ...], message: str) -> list[RowToken]:
        failed = []
        for request_id in request_ids:
            if (seq := self.rows.pop(request_id, None)) is not None:
                self.engine.close(seq)
                failed.append(RowToken(request_id, None, FinishCause.ERROR, message))
        return failed

    def _close_all(self) -> None:
        for seq in self.rows.values():
            self.engine.close(seq)
        self.rows.clear()
