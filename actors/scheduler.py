"""The scheduler actor: feeds events to the FCFS policy and hands its plans to the GPU.

Lookahead protocol with the GPU actor: at most `lookahead + 1` plans are in flight
(sent, not yet reported done). The GPU collects its oldest step when a new plan
arrives while it holds `lookahead` submitted steps, or when it gets `Idle`; so
whenever steps are in flight and there is nothing more to plan, the scheduler owes
the GPU an `Idle`. Plan N+lookahead+1 is built only after step N is done, so a row
that finished at N is in at most `lookahead` speculative steps.

The actor never waits on anything but its inbox: its sends to the GPU fit the
channel by construction, so the pipeline cannot deadlock on a full channel.
"""

from __future__ import annotations

from runtime.runner import step_results
from runtime.scheduler import FcfsScheduler

import attrs
import structlog
import trio

from actors.messages import (
    Abort,
    AbortAll,
    AdmissionClosed,
    GpuMessage,
    Idle,
    SchedulerMessage,
    StepDone,
    Submit,
)
from actors.metrics import Metrics

log = structlog.get_logger("cadence.scheduler")


@attrs.define
class SchedulerActor:
    policy: FcfsScheduler
    inbox: trio.MemoryReceiveChannel[SchedulerMessage]
    to_gpu: trio.MemorySendChannel[GpuMessage]  # buffer >= 2 * lookahead + 3
    waiting_slots: trio.Semaphore  # admission's reservations, returned here
    metrics: Metrics
    lookahead: int = 1
    num_in_flight: int = 0
    is_idle_sent: bool = False
    is_admission_closed: bool = False
    is_aborting_all: bool = False
    # (cause, stage) of each abort not yet planned: the plan's closes carry them to the
    # streamer, which logs the one terminal event (a row aborted while its last token
    # was in flight had logged `finished` there and `aborted` here)
    abort_causes: dict[str, tuple[str, str]] = attrs.Factory(dict)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox, self.to_gpu:  # sync close: see Streamer.run
            task_status.started()
            async for message in self.inbox:
                self._apply(message)
                while True:  # take the whole burst before planning
                    try:
                        self._apply(self.inbox.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await self._dispatch()
                if self.is_done:
                    break

    @property
    def is_done(self) -> bool:
        return self.is_admission_closed and not self.policy.has_work and self.num_in_flight == 0

    def _apply(self, message: SchedulerMessage) -> None:
        match message:
            case Submit(request_id, params):
                self.policy.add(request_id, params)
                self.metrics.on_queued(request_id, trio.current_time())
                if self.is_aborting_all:
                    self._abort(request_id, "shutdown")
            case Abort(request_id, cause):
                self._abort(request_id, cause)
            case StepDone(step, rows):
                self.num_in_flight -= 1
                self.is_idle_sent = False
                self.policy.on_step_done(step, step_results(rows))
            case AbortAll(cause):
                self.is_aborting_all = True
                ids = [r.request_id for r in self.policy.waiting] + list(self.policy.running)
                for request_id in ids:
                    self._abort(request_id, cause)
            case AdmissionClosed():
                self.is_admission_closed = True

    def _abort(self, request_id: str, cause: str) -> None:
        where = self.policy.abort(request_id)
        if where == "waiting":
            self.waiting_slots.release()
            self.metrics.on_dequeued(request_id, trio.current_time(), is_scheduled=False)
        if where is None and cause == "disconnected":
            # Its reader left while its last tokens were computed: the streamer forgot
            # it unended and waits for its release to log how it ended.
            self.policy.report_closed(request_id)
            where = "running"
        if where is not None:
            self.abort_causes[request_id] = (cause, where)

    async def _dispatch(self) -> None:
        while self.num_in_flight <= self.lookahead:
            plan = self.policy.schedule()
            if plan is None:  # nothing to plan until a step is done: let the GPU collect
                if self.num_in_flight and not self.is_idle_sent:
                    await self.to_gpu.send(Idle())
                    self.is_idle_sent = True
                return
            now = trio.current_time()
            for request_id, *_ in plan.opens:  # these left the waiting queue...
                self.waiting_slots.release()
                self.metrics.on_dequeued(request_id, now, is_scheduled=True)
            for request_id, _ in plan.rejects:  # ... and these
                self.waiting_slots.release()
                self.metrics.on_dequeued(request_id, now, is_scheduled=False)
            for request_id in plan.preempted:
                log.info(
                    "preempted",
                    request_id=request_id,
                    cause="kv_pool_full",
                    num_preemptions=self.policy.num_preemptions,
                )
            causes = tuple(self.abort_causes.pop(r, ("cancelled", "running")) for r in plan.closes)
            await self.to_gpu.send(attrs.evolve(plan, close_causes=causes))
            self.num_in_flight += 1
            self.is_idle_sent = False
