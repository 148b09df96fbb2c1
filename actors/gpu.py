"""The GPU actor: owns the Engine and makes every engine call on the one MLX thread.

Lookahead: it launches plan N+1 before it collects step N, so while the trio side
streams step N's tokens, step N+1 is already running. On the CPU, a step N+1 with a
prompt chunk is only built then, and runs once step N is read (`Engine.defers_start`):
the MLX thread hands step N's tokens back first, then starts step N+1. The
plan-to-engine mapping (request ids to row handles) is `runtime.runner.PlanRunner`;
this actor only moves it onto the MLX thread and the results onto the channels.
"""

from __future__ import annotations

import collections

from runtime.runner import Launched, PlanRunner
from runtime.step_plan import StepPlan

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
class GpuActor:
    runner: PlanRunner
    thread: MlxThread
    inbox: trio.MemoryReceiveChannel[GpuMessage]
    to_streamer: trio.MemorySendChannel[StreamerMessage]
    to_scheduler: trio.MemorySendChannel[SchedulerMessage]
    lookahead: int = 1
    last_collected_at: float = 0.0  # when the previous step's tokens were read

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        pending: collections.deque[Launched] = collections.deque()  # launched, not collected
        with self.inbox, self.to_streamer, self.to_scheduler:  # sync close: see Streamer.run
            task_status.started()
            async for message in self.inbox:
                plan = message if isinstance(message, StepPlan) else None
                if pending and (plan is None or len(pending) == self.lookahead):
                    # One trip to the MLX thread: queue step N+1, then read step N.
                    oldest = pending.popleft()
                    launched, rows = await self.thread.run(
                        self._launch_then_collect, plan, oldest, then=self.runner.start
                    )
                    pending.extend([launched] if launched else [])
                    await self._report(oldest, rows)
                elif plan is not None:
                    pending.append(await self.thread.run(self.runner.launch, plan))
            while pending:
                oldest = pending.popleft()
                await self._report(oldest, await self.thread.run(self.runner.collect, oldest))
            await self.thread.run(self.runner.close_all)

    def _launch_then_collect(
        self, plan: StepPlan | None, oldest: Launched
    ) -> tuple[Launched | None, tuple[RowToken, ...]]:
        launched = self.runner.launch(plan) if plan is not None else None
        return launched, self.runner.collect(oldest)

    async def _report(self, launched: Launched, rows: tuple[RowToken, ...]) -> None:
        plan = launched.plan
        # A queued step starts running once the one before it is done.
        started_at = max(launched.submitted_at, self.last_collected_at)
        self.last_collected_at = launched.collected_at
        log.debug(
            "step",
            step=plan.step,
            rows=len(launched.row_ids),
            tokens=plan.num_tokens,
            prefill_rows=plan.num_prefill_rows,
            prefill_tokens=plan.num_prefill_tokens,
            decode_rows=len(plan.spans) - plan.num_prefill_rows,
            cached_tokens=sum(num_cached for _, _, num_cached in plan.opens),
            preempted=len(plan.preempted),
            free_blocks=plan.num_free_blocks,
            prefix_hit_rate=round(plan.hit_rate, 3),
            step_ms=round((launched.collected_at - started_at) * 1e3, 3),
        )
        cached = tuple((request_id, n) for request_id, _, n in plan.opens)
        released = tuple(zip(plan.closes, plan.close_causes, strict=True))
        await self.to_streamer.send(StepResult(plan.step, rows, released, cached))
        await self.to_scheduler.send(StepDone(plan.step, rows))
