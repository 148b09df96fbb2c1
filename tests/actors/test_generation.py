"""The embedding API's lifecycle on the fake pipeline (conftest.py): every way a
Generation ends, `async with` or not, must end its row and its count in the LLM, and
the service must end as its caller's block does."""

from runtime.errors import RequestError

import pytest
import trio

from actors import OverloadedError, ServiceClosedError

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
