"""The actors' protocol on trio's virtual clock, around a pure-Python engine (see conftest.py)."""

import threading

from runtime.errors import RequestError
from runtime.kv.blocks import BlockPool
from runtime.scheduler import FcfsScheduler
from runtime.sequence import FinishCause, SequenceParams

import pytest
import trio
import trio.testing
from structlog.testing import capture_logs

from actors import GenerationError, OverloadedError, ServiceClosedError
from actors.generation import Generation
from actors.messages import (
    REPLY_BUFFER,
    AbortAll,
    Accepted,
    Failed,
    Finished,
    Submit,
    TextDelta,
)
from actors.metrics import Metrics
from actors.requests import GenerateRequest, Usage
from actors.scheduler import SchedulerActor


async def collect(generation):
    deltas = []
    async with generation:
        async for delta in generation:
            deltas.append(delta)
    return deltas


async def consume_then_cancel(generation, num_deltas):
    """Read `num_deltas` deltas, then get cancelled while waiting for the next one."""
    with trio.CancelScope() as scope:
        num_read = 0
        async for _ in generation:
            num_read += 1
            if num_read == num_deltas:
                scope.cancel()
    return generation


async def wait_for(predicate, timeout=10):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.001)


async def test_a_request_streams_its_tokens_then_finish_reason_and_usage(
    pipeline, demo_tokenizer, autojump_clock
):
    async with pipeline() as (llm, engine):
        deltas = await collect(llm.generate([5, 6, 7], max_tokens=6))
    assert "".join(d.text for d in deltas) == demo_tokenizer.decode([engine.token] * 6)
    final = deltas[-1]
    assert (final.finish_reason, final.cause) == ("length", "length")
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 6)
    assert all(d.finish_reason is None for d in deltas[:-1])


async def test_step_n_plus_one_is_submitted_before_step_n_is_collected(pipeline, autojump_clock):
    async with pipeline() as (llm, engine):
        await collect(llm.generate([5, 6, 7], max_tokens=8))
    order = engine.calls
    steps = [c[1] for c in order if c[0] == "submit"]
    for step in steps[:-1]:
        assert order.index(("collect", step)) > next(
            i for i, c in enumerate(order) if c[:2] == ("submit", step + 1)
        ), f"step {step + 1} was not queued before step {step} was collected"


async def test_a_step_held_back_behind_another_is_started_right_after_that_one_is_read(
    pipeline, autojump_clock
):
    # Engine.defers_start: on the CPU, step N+1 runs only when `start_queued` is called;
    # the GPU actor must call it right after collecting step N, before anything else.
    async with pipeline() as (llm, engine):
        await collect(llm.generate([5, 6, 7], max_tokens=8))
    order = engine.calls
    collects = [i for i, c in enumerate(order) if c[0] == "collect"]
    assert len(collects) >= 8
    followed_by_start = [i + 1 < len(order) and order[i + 1] == ("start",) for i in collects]
    # All but the last collects (the drain, with nothing behind) start the next step.
    assert all(followed_by_start[:-1]), order


async def test_exiting_the_block_drains_and_the_close_cascades_through_every_actor(
    pipeline, autojump_clock
):
    async with pipeline() as (llm, engine), trio.open_nursery() as nursery:
        nursery.start_soon(collect, llm.generate([1, 2], max_tokens=20))
        await trio.sleep(0.02)
    # Reaching here means every actor task returned: the close cascaded down.
    assert engine.num_open == 0 and engine.num_pending == 0
    with pytest.raises(ServiceClosedError):
        await llm.generate([1]).start()


async def test_a_full_waiting_queue_refuses_at_once(pipeline, autojump_clock):
    async with pipeline(max_batch=1, max_waiting=2, max_context=10_000) as (llm, engine):
        running = llm.generate([1], max_tokens=5000)
        await running.start()
        await running.__anext__()  # it holds the only row now
        waiting = [llm.generate([1], max_tokens=5) for _ in range(2)]
        for generation in waiting:
            await generation.start()
        before = trio.current_time()
        with pytest.raises(OverloadedError):
            await llm.generate([1], max_tokens=5).start()
        assert trio.current_time() == before  # refused without waiting
        await waiting[0].aclose()  # leaving the queue returns the reservation ...
        await trio.testing.wait_all_tasks_blocked()  # ... once the scheduler hears of it
        extra = llm.generate([1], max_tokens=5)
        await extra.start()
        for generation in (running, waiting[1], extra):
            await generation.aclose()


async def test_a_rejected_request_returns_its_reservation(pipeline, autojump_clock):
    async with pipeline(max_waiting=1, max_context=16) as (llm, engine):
        for _ in range(3):
            with pytest.raises(RequestError) as error:
                await llm.generate([1, 2, 3], max_tokens=100).start()
            assert error.value.code == "context_length_exceeded"
        deltas = await collect(llm.generate([1, 2, 3], max_tokens=2))
        assert deltas[-1].finish_reason == "length"


async def test_a_cancelled_consumer_leaves_the_batch_within_one_step(pipeline, autojump_clock):
    async with pipeline(max_context=10_000) as (llm, engine):
        other = llm.generate([9], max_tokens=200)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, other)
            await consume_then_cancel(llm.generate([1, 2, 3], max_tokens=5000), 5)
            (leaver,) = [r[0].request_id for r in engine.rows.values() if r[0].max_tokens == 5000]
            submitted_at_abort = len([c for c in engine.calls if c[0] == "submit"])
            await wait_for(lambda: all(r[0].request_id != leaver for r in engine.rows.values()))
            late = [s for s in engine.submits_with(leaver) if s > submitted_at_abort]
            assert len(late) <= 1  # only a plan already on its way to the GPU
        assert other.finish_reason == "length"  # the other stream was unaffected


async def test_an_abort_during_prefill_stops_the_remaining_pieces(pipeline, autojump_clock):
    async with pipeline(max_context=10_000) as (llm, engine):
        generation = llm.generate(list(range(1, 201)), max_tokens=5)  # 199 tokens = 50 pieces
        await generation.start()
        await trio.sleep(0.05)  # a few steps of prefill
        await generation.aclose()
        await wait_for(lambda: engine.num_open == 0)
        assert 0 < len(engine.submits_with(generation.request_id)) < 20


async def test_a_fault_in_one_row_fails_that_request_only(pipeline, autojump_clock):
    async with pipeline() as (llm, engine):
        healthy = llm.generate([1], max_tokens=30)
        faulty = llm.generate([2], max_tokens=30)
        await faulty.start()
        engine.failing.add(faulty.request_id)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, healthy)
            with pytest.raises(GenerationError, match="injected fault"):
                await collect(faulty)
        assert healthy.finish_reason == "length" and healthy.usage.completion_tokens == 30
        assert engine.num_open == 0


async def test_a_stop_string_finishes_the_request_and_frees_its_row(
    pipeline, demo_tokenizer, autojump_clock
):
    async with pipeline(max_context=10_000) as (llm, engine):
        stop = demo_tokenizer.decode([engine.token] * 3)
        deltas = await collect(llm.generate([1], max_tokens=1000, stop=stop))
        assert (deltas[-1].finish_reason, deltas[-1].cause) == ("stop", "stop_sequence")
        assert deltas[-1].usage.completion_tokens == 3
        assert "".join(d.text for d in deltas) == ""
        await wait_for(lambda: engine.num_open == 0)
        assert len(engine.calls) < 20  # not 1000 steps


async def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop_not_length(
    pipeline, demo_tokenizer, autojump_clock
):
    """The engine says LENGTH at the 3rd token, the stop string ends at it too: the stop
    string comes first in finishing's order, as it would with a higher max_tokens."""
    async with pipeline(max_context=10_000) as (llm, engine):
        stop = demo_tokenizer.decode([engine.token] * 3)
        deltas = await collect(llm.generate([1], max_tokens=3, stop=stop))
    assert (deltas[-1].finish_reason, deltas[-1].cause) == ("stop", "stop_sequence")
    assert "".join(d.text for d in deltas) == ""


async def test_text_held_for_a_stop_string_that_never_completes_comes_out_at_the_end(
    pipeline, demo_tokenizer, autojump_clock
):
    async with pipeline(max_context=10_000) as (llm, engine):
        # The text always ends in the stop's first two pieces: they are held to the end.
        stop = demo_tokenizer.decode([engine.token] * 2) + "\x00never"
        deltas = await collect(llm.generate([1], max_tokens=5, stop=stop))
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == demo_tokenizer.decode([engine.token] * 5)


async def test_drain_aborts_what_outlives_its_timeout(pipeline, autojump_clock):
    failures = []

    async def consume(generation):
        try:
            await collect(generation)
        except ServiceClosedError as error:  # no fault of the request's: HTTP's 503
            failures.append(str(error))

    async with trio.open_nursery() as outside:
        async with pipeline(max_context=100_000, drain_timeout=1.0) as (llm, engine):
            generation = llm.generate([1], max_tokens=50_000)  # 500 s of virtual steps
            await generation.start()
            outside.start_soon(consume, generation)
            started = trio.current_time()
        assert 1.0 <= trio.current_time() - started < 2.0
    assert failures == ["the service is shutting down: the request was aborted"]


async def test_a_consumer_that_never_reads_cannot_hold_up_the_drain(pipeline, autojump_clock):
    async with pipeline(max_context=100_000, drain_timeout=1.0) as (llm, engine):
        forgotten = llm.generate([1], max_tokens=50_000)
        await forgotten.start()
        started = trio.current_time()
    assert trio.current_time() - started < 3.0
    assert engine.num_open == 0
    with pytest.raises(ServiceClosedError, match="shutting down"):
        async for _ in forgotten:
            pass


async def test_the_default_lookahead_keeps_exactly_one_step_queued_behind_the_running_one(
    pipeline, autojump_clock
):
    async with pipeline() as (llm, engine):
        await collect(llm.generate([5, 6, 7], max_tokens=12))
    outstanding, deepest = 0, 0
    for call in engine.calls:
        outstanding += {"submit": 1, "collect": -1}.get(call[0], 0)
        deepest = max(deepest, outstanding)
    assert deepest == 2  # step N+1 submitted while N is uncollected, never N+2


async def test_lookahead_2_keeps_two_steps_queued_and_drains_them_when_nothing_is_left(
    pipeline, demo_tokenizer
):
    """The last steps are collected one Idle at a time: the scheduler owes one per step."""
    async with pipeline(lookahead=2) as (llm, engine):
        with trio.fail_after(30):  # real seconds (admission runs in a thread): a missing Idle hangs
            deltas = await collect(llm.generate([5, 6, 7], max_tokens=12))
    assert deltas[-1].usage.completion_tokens == 12
    outstanding, deepest = 0, 0
    for call in engine.calls:
        outstanding += {"submit": 1, "collect": -1}.get(call[0], 0)
        deepest = max(deepest, outstanding)
    assert deepest == 3


async def test_a_reader_that_falls_behind_gets_its_text_coalesced_and_holds_up_no_one(
    pipeline, demo_tokenizer, autojump_clock
):
    async with pipeline() as (llm, engine):
        slow = llm.generate([5, 6, 7], max_tokens=200)
        await slow.start()  # admitted, then not read while all 200 tokens are made
        others = await collect(llm.generate([8, 9], max_tokens=20))
        await wait_for(lambda: engine.num_open == 0)  # the slow row finished unread
        deltas = [delta async for delta in slow]
    assert "".join(d.text for d in others) == demo_tokenizer.decode([engine.token] * 20)
    assert "".join(d.text for d in deltas) == demo_tokenizer.decode([engine.token] * 200)
    assert len(deltas) <= REPLY_BUFFER  # not one message per token
    assert deltas[-1].finish_reason == "length"


async def test_a_reader_that_falls_behind_gets_every_logprob_entry_once_in_order(
    pipeline, demo_tokenizer, autojump_clock
):
    async with pipeline() as (llm, engine):
        slow = llm.generate([5, 6, 7], max_tokens=200, logprobs=2)
        deltas = []
        async with slow:
            async for delta in slow:  # read, but far slower than tokens are made
                deltas.append(delta)
                await trio.sleep(0.05)
    assert any(len(d.logprobs) > 1 for d in deltas[:-1])  # text deltas were coalesced
    entries = [entry for delta in deltas for entry in delta.logprobs]
    assert [entry.logprob for entry in entries] == [-n / 1000 for n in range(1, 201)]
    token = demo_tokenizer.decode([engine.token], skip_special_tokens=False)
    assert all(e.token == token and e.top == ((token, e.logprob),) * 2 for e in entries)


async def test_a_request_that_arrives_after_abort_all_is_aborted_at_once():
    """A Submit still in the inbox when the drain's deadline aborted everything: it must
    not start, and admission's reservation comes back."""
    policy = FcfsScheduler(4, BlockPool(num_blocks=64, block_size=4), 256)
    to_gpu, _ = trio.open_memory_channel(8)
    _, inbox = trio.open_memory_channel(8)
    slots = trio.Semaphore(4)
    await slots.acquire()  # admission's reservation for the late request
    actor = SchedulerActor(policy, inbox, to_gpu, slots, Metrics("fake", policy))
    actor._apply(AbortAll("shutdown"))
    actor._apply(Submit("late", SequenceParams((1, 2, 3), max_tokens=4, request_id="late")))
    assert not policy.waiting and not policy.running and slots.value == 4
    assert policy.pending_closes == ["late"]  # reported as released with the next plan


END_EVENTS = ("finished", "aborted", "rejected", "failed", "abandoned")  # "abandoned": none should


async def test_a_caller_gone_before_admission_answered_returns_its_reservation(
    pipeline, autojump_clock
):
    """Admission found the reply channel closed when it went to say Accepted: its Abort
    takes the request out of the queue, rather than holding a waiting slot until a row
    frees up for a request nobody reads."""
    with capture_logs() as logs:
        async with (
            pipeline(max_batch=1, max_waiting=1, max_context=10_000) as (llm, engine),
            llm.generate([1], max_tokens=5000) as running,
        ):
            await running.__anext__()  # it holds the only row
            gone = llm.generate([2], max_tokens=5)
            gone.submit()
            await gone.aclose()  # before admission got to it
            await wait_for(lambda: llm.num_waiting == 0)
            extra = llm.generate([3], max_tokens=5)
            await extra.start()  # the slot came back
            await extra.aclose()
            aborts = llm.metrics.success.labels(llm.name, "abort")._value.get()
    assert engine.submits_with(gone.request_id) == []
    # Its one end event, the one a request aborted later gets, and counted in /metrics.
    ends = [e for e in logs if e.get("request_id") == gone.request_id and e["event"] in END_EVENTS]
    assert [(e["event"], e["cause"], e["stage"]) for e in ends] == [("aborted", "disconnected", "admission")]
    assert aborts >= 1


@pytest.mark.parametrize("leave", ["aclose", "cancelled start"])
async def test_a_caller_gone_after_admission_answered_unread_is_aborted(
    pipeline, autojump_clock, leave
):
    """Admission had queued Accepted, so it saw no closed channel: the Generation must
    send the Abort, else the request held its waiting slot (others were refused) and
    was computed for nobody once a row freed."""
    async with pipeline(max_batch=1, max_waiting=1, max_context=10_000) as (llm, engine):
        async with llm.generate([1], max_tokens=5000) as running:
            await running.__anext__()  # it holds the only row
            gone = llm.generate([2], max_tokens=5)
            gone.submit()
            await wait_for(lambda: gone._replies.statistics().current_buffer_used)  # Accepted
            if leave == "aclose":
                await gone.aclose()
            else:
                with trio.move_on_after(0):  # a deadline already past
                    await gone.start()
            await wait_for(lambda: llm.num_waiting == 0)
            extra = llm.generate([3], max_tokens=5)
            await extra.start()  # the slot came back
            await extra.aclose()
        await trio.sleep(1)  # the row is free: nothing left to run the request
    assert engine.submits_with(gone.request_id) == []


async def test_a_generation_closed_by_another_task_ends_its_readers_stream(
    pipeline, autojump_clock
):
    """A stop button: the reader's loop ends (it got trio.ClosedResourceError), and the
    row is aborted."""
    async with pipeline(max_context=100_000) as (llm, engine):
        generation = llm.generate([1, 2, 3], max_tokens=50_000)
        await generation.start()
        num_read = 0

        async def read():
            nonlocal num_read
            async for _ in generation:
                num_read += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await wait_for(lambda: num_read >= 3)
            await generation.aclose()
        await wait_for(lambda: engine.num_open == 0)
    assert generation.finish_reason is None and 3 <= num_read < 100


async def test_a_generation_closed_by_another_task_while_it_starts_says_so(
    pipeline, monkeypatch
):
    async with pipeline() as (llm, engine):
        tokenizer, prepared = llm._admission.tokenizer, threading.Event()
        encode = tokenizer.encode

        def slow_encode(*args, **kwargs):  # admission is still at it when the request closes
            prepared.wait(10)
            return encode(*args, **kwargs)

        monkeypatch.setattr(tokenizer, "encode", slow_encode)
        starting, errors = llm.generate("hi", max_tokens=5), []

        async def start():
            try:
                await starting.start()
            except GenerationError as error:
                errors.append(str(error))

        with trio.fail_after(20):  # real seconds: admission runs in a thread
            async with trio.open_nursery() as nursery:
                nursery.start_soon(start)
                await wait_for(lambda: llm.num_waiting == 1)
                await starting.aclose()
            prepared.set()
            await wait_for(lambda: llm.num_waiting == 0)  # admission aborted it: slot back
    assert errors == ["the request was closed before it started"]
    assert engine.submits_with(starting.request_id) == []


async def test_iterating_a_submitted_generation_starts_it(pipeline, autojump_clock):
    """submit() then `async for`, without start(): the refusal was lost (the reader got
    "the service stopped"), and a streaming one was never aborted by aclose()."""
    async with pipeline(max_context=16) as (llm, engine):
        refused = llm.generate(list(range(1, 40)), max_tokens=4)  # longer than the context
        refused.submit()
        with pytest.raises(RequestError, match="maximum context length"):
            async for _ in refused:
                pass
        running = llm.generate([1, 2, 3], max_tokens=12)
        running.submit()
        async for _ in running:
            break
        await running.aclose()
        await wait_for(lambda: engine.num_open == 0)
        assert len(engine.submits_with(running.request_id)) < 12


async def test_a_drain_cut_short_by_the_callers_deadline_still_lets_the_block_end(pipeline):
    """drain() marked the service closed before it waited: cancelled, it left the
    channels open, and the block's own drain, finding it closed, waited on the actors
    forever."""
    with trio.fail_after(20):  # real seconds: admission runs in a thread
        async with pipeline(max_context=100_000) as (llm, engine):
            generation = llm.generate([1, 2, 3], max_tokens=50_000)  # ~500 s of steps
            await generation.start()
            with trio.move_on_after(0.2):
                await llm.drain()
            assert llm.is_draining
    with pytest.raises(ServiceClosedError, match="aborted"):  # cut short: aborted at once
        async for _ in generation:
            pass
    assert engine.num_open == 0


@pytest.mark.parametrize("timeout", [-1, float("nan")])
async def test_a_drain_timeout_that_is_no_duration_is_refused_and_changes_nothing(
    pipeline, timeout
):
    with trio.fail_after(20):  # real seconds: admission runs in a thread
        async with pipeline() as (llm, engine):
            with pytest.raises(ValueError, match="drain timeout"):
                await llm.drain(timeout)
            assert not llm.is_draining
            assert len(await collect(llm.generate([1], max_tokens=3))) == 3


async def test_a_ctrl_c_while_the_block_drains_comes_out_bare(pipeline, monkeypatch):
    """It came out as a BaseExceptionGroup around the KeyboardInterrupt, which an
    `except KeyboardInterrupt` around the block missed."""

    async def interrupted_wait():
        await trio.sleep(0.1)
        raise KeyboardInterrupt

    with trio.fail_after(20), pytest.raises(KeyboardInterrupt):
        async with pipeline(max_context=100_000) as (llm, engine):
            generation = llm.generate([1, 2, 3], max_tokens=50_000)
            await generation.start()
            monkeypatch.setattr(llm, "_until_idle_or_answered", interrupted_wait)


async def test_an_unexpected_error_preparing_a_prompt_is_a_request_error_for_it_only(
    pipeline, autojump_clock
):
    """A tokenizer or template bug (not a CadenceError) fails that request as a
    RequestError, returns its reservation, and the service goes on."""
    async with pipeline(max_waiting=1) as (llm, engine):
        tokenizer = llm._admission.tokenizer
        encode = tokenizer.encode

        def broken_encode(text, *args, **kwargs):
            if text == "boom":
                raise KeyError("a tokenizer bug")
            return encode(text, *args, **kwargs)

        tokenizer.encode = broken_encode
        try:
            for _ in range(2):
                with pytest.raises(RequestError, match="could not prepare the prompt"):
                    await llm.generate("boom", max_tokens=2).start()
        finally:
            del tokenizer.encode
        deltas = await collect(llm.generate("fine", max_tokens=2))
    assert deltas[-1].finish_reason == "length"


def scheduler_actor(policy, slots):
    to_gpu, _ = trio.open_memory_channel(8)
    _, inbox = trio.open_memory_channel(8)
    return SchedulerActor(policy, inbox, to_gpu, slots, Metrics("fake", policy))


async def test_a_burst_of_submits_already_in_the_inbox_opens_together_in_the_first_plan():
    """The scheduler takes every message waiting before it plans: one step, not three."""
    policy = FcfsScheduler(4, BlockPool(num_blocks=64, block_size=4), 256)
    to_gpu, from_scheduler = trio.open_memory_channel(8)
    to_scheduler, inbox = trio.open_memory_channel(8)
    actor = SchedulerActor(policy, inbox, to_gpu, trio.Semaphore(4), Metrics("fake", policy))
    for request_id in ("a", "b", "c"):
        params = SequenceParams((1, 2, 3), max_tokens=4, request_id=request_id)
        await to_scheduler.send(Submit(request_id, params))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        first = await from_scheduler.receive()
        nursery.cancel_scope.cancel()
    assert [request_id for request_id, *_ in first.opens] == ["a", "b", "c"]


async def test_abort_all_takes_the_waiting_requests_too_and_returns_their_reservations():
    policy = FcfsScheduler(1, BlockPool(num_blocks=64, block_size=4), 256)
    slots = trio.Semaphore(4)
    actor = scheduler_actor(policy, slots)
    for request_id in ("running", "queued"):
        await slots.acquire()
        params = SequenceParams((1, 2, 3), max_tokens=40, request_id=request_id)
        actor._apply(Submit(request_id, params))
    await actor._dispatch()  # "running" gets the only row, "queued" waits
    assert list(policy.running) == ["running"] and slots.value == 3
    actor._apply(AbortAll("shutdown"))
    assert not policy.waiting and not policy.running and slots.value == 4
    assert not actor.metrics._queued_at  # no queue-time entry is kept for the aborted one


async def test_a_request_the_pool_can_never_hold_returns_its_reservation_unqueued():
    """Rejected by the policy (admission had no KV bound to check): its slot comes back,
    and it observes no queue time, as it was never scheduled."""
    policy = FcfsScheduler(1, BlockPool(num_blocks=8, block_size=4), 256)
    slots = trio.Semaphore(4)
    actor = scheduler_actor(policy, slots)
    await slots.acquire()
    huge = SequenceParams(tuple(range(1, 41)), max_tokens=4, request_id="huge")
    actor._apply(Submit("huge", huge))
    await actor._dispatch()
    assert not policy.waiting and slots.value == 4
    labels = {"model_name": "fake"}
    count = actor.metrics.registry.get_sample_value(
        "cadence:request_queue_time_seconds_count", labels
    )
    assert count == 0


async def test_a_generation_starts_once(pipeline, autojump_clock):
    async with pipeline() as (llm, engine):
        generation = llm.generate([1, 2], max_tokens=3)
        assert await generation.start() == 2
        with pytest.raises(RuntimeError, match="starts once"):
            await generation.start()  # it must not read a delta as if it were the answer
        deltas = await collect(generation)
    assert deltas[-1].usage.completion_tokens == 3 and len(deltas) == 3


class ScriptedLLM:
    """What a Generation needs of its LLM: admission answers with `replies` at once."""

    def __init__(self, *replies):
        self.replies = replies
        self.num_released = 0
        self.is_aborting_all = False

    def _admit(self, admit, generation):
        for reply in self.replies:
            admit.reply.send_nowait(reply(admit.request_id))
        admit.reply.close()

    def _release(self, generation):
        self.num_released += 1


async def test_a_service_that_stops_before_accepting_is_service_closed_at_start():
    llm = ScriptedLLM(lambda request_id: Failed(request_id, "the service stopped"))
    generation = Generation(llm, GenerateRequest(prompt="hi"))  # type: ignore[arg-type]
    with pytest.raises(ServiceClosedError, match="the service stopped"):
        await generation.start()
    assert llm.num_released == 1


async def test_deltas_that_overtake_accepted_still_tell_the_prompt_length_at_the_end():
    usage = Usage(prompt_tokens=5, completion_tokens=2)
    llm = ScriptedLLM(
        lambda request_id: TextDelta(request_id, "a"),
        lambda request_id: Finished(request_id, "b", FinishCause.LENGTH, usage),
    )
    generation = Generation(llm, GenerateRequest(prompt="hi"))  # type: ignore[arg-type]
    texts = [delta.text async for delta in generation]
    assert texts == ["a", "b"] and generation.finish_reason == "length"
    assert generation.num_prompt_tokens == 5 and generation.usage == usage
    assert llm.num_released == 1


@pytest.mark.parametrize("num_deltas", [1, 3])
async def test_start_tells_the_prompt_length_when_text_overtakes_accepted(num_deltas):
    """Admission says Accepted after its Submit, so the first text can reach the caller
    first: start() waits for Accepted (it returned 0), and no text is lost."""
    usage = Usage(prompt_tokens=7, completion_tokens=num_deltas + 1)
    llm = ScriptedLLM(
        *[lambda request_id, i=i: TextDelta(request_id, str(i)) for i in range(num_deltas)],
        lambda request_id: Accepted(request_id, 7),
        lambda request_id: Finished(request_id, "end", FinishCause.LENGTH, usage),
    )
    generation = Generation(llm, GenerateRequest(prompt="hi"))  # type: ignore[arg-type]
    assert await generation.start() == 7
    texts = [delta.text async for delta in generation]
    assert texts == [*map(str, range(num_deltas)), "end"]


async def test_a_failure_after_text_that_overtook_accepted_is_a_generation_error():
    llm = ScriptedLLM(
        lambda request_id: TextDelta(request_id, "a"),
        lambda request_id: Failed(request_id, "non-finite logits"),
    )
    generation = Generation(llm, GenerateRequest(prompt="hi"))  # type: ignore[arg-type]
    await generation.start()  # admitted: its text came
    assert (await generation.__anext__()).text == "a"
    with pytest.raises(GenerationError, match="non-finite logits"):
        await generation.__anext__()


async def test_the_scheduler_owes_the_gpu_one_idle_until_a_step_is_done():
    """More events with nothing to plan send no more Idles: each would make the GPU read
    a step early (and they could fill the channel the scheduler never waits on)."""
    policy = FcfsScheduler(4, BlockPool(num_blocks=64, block_size=4), 256)
    to_gpu, sent = trio.open_memory_channel(8)
    _, inbox = trio.open_memory_channel(8)
    slots = trio.Semaphore(4)
    actor = SchedulerActor(policy, inbox, to_gpu, slots, Metrics("fake", policy))
    await slots.acquire()
    actor._apply(Submit("a", SequenceParams((1, 2, 3), max_tokens=1, request_id="a")))
    await actor._dispatch()  # its one token is planned: then nothing is left to plan
    await actor._dispatch()  # another event, still nothing to plan
    kinds = []
    while True:
        try:
            kinds.append(type(sent.receive_nowait()).__name__)
        except trio.WouldBlock:
            break
    assert kinds == ["StepPlan", "Idle"]


async def test_a_rejected_request_returns_its_reservation_once(pipeline, autojump_clock):
    """Returned twice, the waiting queue grew by one with every refusal."""
    async with (
        pipeline(max_batch=1, max_waiting=1, max_context=10_000) as (llm, engine),
        llm.generate([1], max_tokens=5000) as running,
    ):
        await running.__anext__()  # it holds the only row
        for _ in range(2):
            with pytest.raises(RequestError):
                await llm.generate([1, 2, 3], max_tokens=20_000).start()
        assert llm.num_waiting == 0
        async with llm.generate([2], max_tokens=2):  # takes the one waiting slot
            with pytest.raises(OverloadedError):
                await llm.generate([3], max_tokens=2).start()
            assert llm.num_waiting == 1


async def test_a_request_made_while_the_service_drains_is_refused(pipeline, autojump_clock):
    refusals = []

    async def start_during_the_drain(llm):
        await wait_for(lambda: llm.is_draining)
        with pytest.raises(ServiceClosedError):
            await llm.generate([2], max_tokens=2).start()
        refusals.append(trio.current_time())

    async with trio.open_nursery() as outside:
        async with pipeline(max_context=10_000) as (llm, engine):
            running = llm.generate([1], max_tokens=100)  # 1 s of virtual steps
            await running.start()
            outside.start_soon(collect, running)
            outside.start_soon(start_during_the_drain, llm)
        finished_at = trio.current_time()
    assert len(refusals) == 1 and refusals[0] < finished_at
    assert running.finish_reason == "length"  # the drain let it finish


async def test_an_unset_priority_is_0_and_runs_before_priority_1(pipeline, autojump_clock):
    async with pipeline(max_batch=1, max_context=10_000) as (llm, engine):
        async with llm.generate([1], max_tokens=5000) as first:
            await first.__anext__()  # it holds the only row
            later = llm.generate([2], max_tokens=2, priority=1)
            unset = llm.generate([3], max_tokens=2)
            await later.start()  # queued first ...
            await unset.start()
        for generation in (later, unset):
            await collect(generation)
    # ... and scheduled second: priority before arrival
    assert engine.submits_with(unset.request_id)[0] < engine.submits_with(later.request_id)[0]


async def test_serving_with_no_step_queued_behind_the_running_one_is_refused(pipeline):
    """The GPU actor reads step N only once N+1 is queued: lookahead 0 would never read one."""
    with trio.fail_after(10), pytest.raises(ValueError, match="lookahead"):
        async with pipeline(lookahead=0):
            pass


async def test_an_answered_generation_left_unread_does_not_slow_the_blocks_exit(pipeline):
    """Nothing runs, so nothing is aborted, and no second waited for its reader: the
    answer waits whole for it. (Real time: under the autojump clock the first
    admission's tokenizer thread lets the clock run ahead.)"""
    with trio.fail_after(5):
        async with pipeline() as (llm, engine):
            generation = llm.generate([1], max_tokens=3)
            await generation.start()
            await wait_for(lambda: generation.is_answered)
        assert not llm.is_aborting_all  # nothing to abort, so no wait for its readers
    deltas = await collect(generation)
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 3
