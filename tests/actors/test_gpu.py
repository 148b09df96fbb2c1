"""The GPU actor on its own, around the pure-Python engine of the pipeline tests."""

from runtime.runner import PlanRunner
from runtime.sequence import SequenceParams
from runtime.step_plan import PlannedSpan, StepPlan

import trio

from actors.gpu import GpuActor
from tests.actors.conftest import FakeEngine, InlineThread


async def test_rows_still_open_when_the_inbox_closes_are_closed_in_the_engine():
    engine = FakeEngine()
    to_gpu, inbox = trio.open_memory_channel(1)
    to_streamer, _from_gpu = trio.open_memory_channel(1)
    to_scheduler, _done = trio.open_memory_channel(1)
    gpu = GpuActor(PlanRunner(engine), InlineThread(), inbox, to_streamer, to_scheduler)
    params = SequenceParams((1, 2, 3), max_tokens=8, request_id="r1")
    async with to_gpu:  # one step opens a row, then the scheduler is gone
        span = PlannedSpan("r1", 0, 3, (0,), samples=True)
        await to_gpu.send(StepPlan(1, opens=(("r1", params, 0),), spans=(span,)))
    await gpu.run()
    assert ("submit", 1, ("r1",)) in engine.calls and engine.num_open == 0
