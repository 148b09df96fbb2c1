"""The embedding API's lifecycle on the fake pipeline (conftest.py): every way a
Generation ends, `async with` or not, must end its row and its count in the LLM, and
the service must end as its caller's block does."""

from runtime.errors import RequestError
from runtime.sequence import FinishCause

import pytest
import trio
import trio.testing

from actors import GenerationError, OverloadedError, ServiceClosedError
from actors.generation import Generation
from actors.messages import Abort, Accepted, Failed, Finished, Rejected, TextDelta
from actors.requests import GenerateRequest, Usage

# Real seconds (admission runs in a thread, so trio's autojump clock would leap to the
# deadline while it works; a step is 10 ms): a broken lifecycle fails here, not hangs.
TIMEOUT = 10


async def wait_for_no_open_rows(llm):
    while (await llm.engine_stats()).num_open:
        await trio.sleep(0.001)


async def test_cancelled_at_start_outside_async_with_never_runs_its_row(pipeline):
    async with pipeline(max_context=100_000) as (llm, engine):
        generation = llm.generate([1, 2, 3], max_tokens=50_000)  # 500 s of steps
        with trio.fail_after(TIMEOUT):
            with trio.move_on_after(0):  # cancelled while it waits for admission's answer
                await generation.start()
            await wait_for_no_open_rows(llm)
            await trio.sleep(0.5)  # a row still running would take 50 more steps here
        # Held by its caller, so only the cancellation itself can have aborted it.
        assert len(engine.submits_with(generation.request_id)) <= 2
        assert llm.num_active == 0 and (await llm.engine_stats()).num_used_blocks == 0


async def test_cancelled_while_reading_outside_async_with_aborts_its_row(pipeline):
    async with pipeline(max_context=100_000) as (llm, engine):
        generation = llm.generate([1, 2, 3], max_tokens=50_000)
        with trio.fail_after(TIMEOUT):
            with trio.CancelScope() as scope:
                async for _ in generation:
                    if len(engine.submits_with(generation.request_id)) >= 20:
                        scope.cancel()  # lands while it waits for the next delta
            submitted_at_cancel = len(engine.submits_with(generation.request_id))
            await wait_for_no_open_rows(llm)
        assert submitted_at_cancel < 25
        late = len(engine.submits_with(generation.request_id)) - submitted_at_cancel
        assert late <= 1  # only a step already queued when it left
        assert llm.num_active == 0 and (await llm.engine_stats()).num_used_blocks == 0


async def test_a_request_refused_at_admission_is_done_and_holds_up_no_drain(pipeline):
    with trio.fail_after(TIMEOUT):
        async with pipeline(max_context=64) as (llm, engine):
            refused = [
                llm.generate([1, 2, 3], max_tokens=100),  # past the context
                llm.generate([llm.vocab_size], max_tokens=2),  # no such token
            ]
            for generation in refused:
                with pytest.raises(RequestError):
                    await generation.start()
                assert llm.num_active == 0
            drain_started = trio.current_time()
        assert trio.current_time() - drain_started < 1  # nothing left to wait for


async def test_a_request_refused_as_overloaded_is_not_counted_active(pipeline):
    with trio.fail_after(TIMEOUT):
        async with pipeline(max_batch=1, max_waiting=1, max_context=100_000) as (llm, engine):
            running = llm.generate([1], max_tokens=50_000)
            await running.__anext__()  # it holds the only row
            waiting = llm.generate([2], max_tokens=2)
            await waiting.start()  # and this the only waiting slot
            assert llm.num_active == 2
            with pytest.raises(OverloadedError):
                await llm.generate([3], max_tokens=2).start()
            assert llm.num_active == 2
            for generation in (running, waiting):
                await generation.aclose()
            assert llm.num_active == 0


async def test_an_answer_all_in_and_unread_does_not_exempt_the_others_from_the_drain_timeout(
    pipeline,
):
    """The drain aborts what outlives its timeout unless every answer is in: one unread
    answer all in beside a running one must not let that one run on past the timeout."""
    failures = []

    async def read_all(generation):
        try:
            async for _ in generation:
                pass
        except ServiceClosedError as error:
            failures.append(str(error))

    with trio.fail_after(TIMEOUT):
        async with (
            trio.open_nursery() as outside,
            pipeline(max_context=100_000, drain_timeout=0.5) as (llm, engine),
        ):
            unread = llm.generate([1], max_tokens=2)
            await unread.start()
            running = llm.generate([2], max_tokens=50_000)  # 500 s of steps
            await running.start()
            outside.start_soon(read_all, running)
            while not unread.is_answered:
                await trio.sleep(0.001)
    assert failures == ["the service is shutting down: the request was aborted"]
    assert [delta.text async for delta in unread]  # the unread answer is still whole
    assert unread.finish_reason == "length"


async def test_an_error_in_the_block_stops_the_actors_at_once_and_is_raised_bare(pipeline):
    """As a Trio caller writes it: `except KeyError` catches it, not a group around it,
    and the block ends without waiting for the request running inside it."""
    with trio.fail_after(TIMEOUT), pytest.raises(KeyError, match="in the block"):
        async with pipeline(max_context=100_000) as (llm, engine):
            running = llm.generate([1], max_tokens=50_000)  # 500 s of steps
            await running.__anext__()
            raise KeyError("in the block")
    assert llm.is_draining
    with pytest.raises(ServiceClosedError):
        await llm.generate([1]).start()


def broken(*args):
    raise ZeroDivisionError("a bug in an actor")


async def test_an_actor_that_fails_is_raised_by_the_block_not_lost_behind_what_it_caused(
    pipeline,
):
    """The failing streamer tells its readers "the service stopped" and the block ends
    on that; the streamer's exit, closing its channels, then took a cancellation that
    replaced its error: nothing anywhere said what had stopped the service."""
    for _ in range(5):  # which of the two tasks runs first is trio's choice
        with trio.fail_after(TIMEOUT), pytest.raises(BaseExceptionGroup) as raised:
            async with pipeline() as (llm, engine):
                llm.metrics.on_first_token = broken  # the streamer calls it
                async with llm.generate([1], max_tokens=4) as generation:
                    async for _ in generation:
                        pass
        assert raised.group_contains(ZeroDivisionError, match="a bug in an actor")


async def test_a_reader_the_service_stopped_under_gets_service_closed_not_a_row_fault(pipeline):
    """GenerationError is a fault in the request's own row; a reader whose service died
    under it (here the streamer) got it, where the asyncio bridge says ServiceClosedError."""
    seen = []
    for _ in range(5):  # which of the two tasks runs first is trio's choice
        with trio.fail_after(TIMEOUT), pytest.raises(BaseExceptionGroup):
            async with pipeline() as (llm, engine):
                llm.metrics.on_first_token = broken  # the streamer calls it
                async with llm.generate([1], max_tokens=4) as generation:
                    try:
                        async for _ in generation:
                            pass
                    except Exception as error:
                        seen.append(error)
                        raise
    assert seen and {type(error) for error in seen} == {ServiceClosedError}
    assert str(seen[0]) == "the service stopped"


class HeldLLM:
    """What a Generation needs of its LLM, with admission's end of the reply channel
    held by the test (`reply`), and the Aborts sent to the scheduler kept (`aborts`)."""

    def __init__(self):
        self.num_admitted = self.num_released = 0
        self.is_aborting_all = False
        self._to_scheduler, self._sent = trio.open_memory_channel(8)
        self.reply = None

    def _admit(self, admit, generation):
        self.num_admitted += 1
        self.reply = admit.reply

    def _release(self, generation):
        self.num_released += 1

    @property
    def aborts(self):
        sent = []
        while True:
            try:
                sent.append(self._sent.receive_nowait())
            except trio.WouldBlock:
                return sent


def held_generation(request_id="r1"):
    llm = HeldLLM()
    return llm, Generation(llm, GenerateRequest(prompt="hi"), request_id=request_id)  # type: ignore[arg-type]


def test_a_generation_without_a_request_id_gets_one_of_its_own():
    llm = HeldLLM()
    ids = {Generation(llm, GenerateRequest(prompt="hi")).request_id for _ in range(3)}  # type: ignore[arg-type]
    assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert held_generation("mine")[1].request_id == "mine"


async def test_a_generation_is_submitted_once():
    llm, generation = held_generation()
    generation.submit()
    with pytest.raises(RuntimeError, match="starts once"):
        generation.submit()
    assert llm.num_admitted == 1


async def test_is_answered_once_the_last_reply_is_queued_and_not_before():
    llm, generation = held_generation()
    assert generation.is_answered is False  # not even submitted
    generation.submit()
    llm.reply.send_nowait(Accepted("r1", 2))
    assert await generation.start() == 2
    llm.reply.send_nowait(TextDelta("r1", "a"))
    assert generation.is_answered is False  # the service still owes it its end
    usage = Usage(prompt_tokens=2, completion_tokens=2)
    llm.reply.send_nowait(Finished("r1", "b", FinishCause.LENGTH, usage))
    llm.reply.close()
    assert generation.is_answered is True
    assert [delta.text async for delta in generation] == ["a", "b"]


async def test_a_finished_generation_closed_again_sends_no_abort_and_is_released_once():
    llm, generation = held_generation()
    generation.submit()
    llm.reply.send_nowait(Accepted("r1", 2))
    llm.reply.send_nowait(Finished("r1", "a", FinishCause.LENGTH, Usage(2, 1)))
    async with generation:
        assert [delta.text async for delta in generation] == ["a"]
    await generation.aclose()
    assert llm.num_released == 1 and llm.aborts == []


@pytest.mark.parametrize(
    ("replies", "is_aborted"),
    [
        ((), False),  # admission will find the channel closed and abort it itself
        ((Rejected("r1", RequestError("bad")),), False),  # never queued
        ((Accepted("r1", 2),), True),  # queued: admission saw the caller still there
        ((TextDelta("r1", "a"),), True),  # running: its text overtook Accepted
    ],
    ids=["unanswered", "rejected", "accepted unread", "text unread"],
)
async def test_a_submitted_generation_closed_unread_is_aborted_only_if_it_was_queued(
    replies, is_aborted
):
    llm, generation = held_generation()
    generation.submit()
    for reply in replies:
        llm.reply.send_nowait(reply)
    await generation.aclose()
    assert llm.aborts == ([Abort("r1", "cancelled")] if is_aborted else [])
    assert llm.num_released == 1


async def test_a_start_cancelled_after_text_overtook_accepted_aborts_the_row():
    """start() had taken the text aside while it waited for Accepted: the request runs."""
    llm, generation = held_generation()
    generation.submit()
    llm.reply.send_nowait(TextDelta("r1", "a"))
    with trio.move_on_after(0.01):
        await generation.start()
    assert llm.aborts == [Abort("r1", "cancelled")] and llm.num_released == 1


async def test_a_second_reader_of_one_generation_is_refused_while_the_first_waits():
    llm, generation = held_generation()
    generation.submit()
    llm.reply.send_nowait(Accepted("r1", 2))
    await generation.start()
    with trio.fail_after(TIMEOUT):  # a second reader let in would wait for text forever
        async with trio.open_nursery() as nursery:
            nursery.start_soon(generation.__anext__)  # waits: no text yet
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(RuntimeError, match="another task is already reading"):
                await generation.__anext__()
            llm.reply.send_nowait(TextDelta("r1", "a"))
    llm.reply.send_nowait(TextDelta("r1", "b"))
    assert (await generation.__anext__()).text == "b"  # the first reader is done


async def test_a_generation_closed_before_it_started_never_starts():
    llm, generation = held_generation()
    await generation.aclose()
    with trio.fail_after(TIMEOUT), pytest.raises(RuntimeError, match="starts once"):
        await generation.start()  # not submitted, then left waiting for an answer
    assert (llm.num_admitted, llm.num_released, llm.aborts) == (0, 0, [])


async def test_start_tells_no_prompt_length_when_the_request_failed_before_it_was_told():
    """Text, then a failure, with no Accepted between: the length was never told."""
    llm, generation = held_generation()
    generation.submit()
    llm.reply.send_nowait(TextDelta("r1", "a"))
    llm.reply.send_nowait(Failed("r1", "non-finite logits"))
    assert await generation.start() == 0 and generation.num_prompt_tokens is None


@pytest.mark.parametrize(
    ("failed", "is_aborting_all", "raised", "message"),
    [
        (Failed("r1", "injected fault"), False, GenerationError, "injected fault"),
        (
            Failed("r1", "aborted"),
            True,
            ServiceClosedError,
            "the service is shutting down: aborted",
        ),
        (Failed("r1", "stopped", is_service_stopped=True), False, ServiceClosedError, "stopped"),
        (Failed("r1", "no match", "grammar"), False, RequestError, "no match"),
    ],
    ids=["row fault", "drain", "service stopped", "request's own value"],
)
async def test_a_failure_mid_reply_is_raised_as_whose_fault_it_was(
    failed, is_aborting_all, raised, message
):
    llm, generation = held_generation()
    generation.submit()
    for reply in (Accepted("r1", 2), TextDelta("r1", "a"), failed):
        llm.reply.send_nowait(reply)
    assert (await generation.__anext__()).text == "a"
    llm.is_aborting_all = is_aborting_all
    with pytest.raises(raised) as error:
        await generation.__anext__()
    assert type(error.value) is raised and str(error.value) == message
    assert getattr(error.value, "param", None) == failed.param and llm.num_released == 1
