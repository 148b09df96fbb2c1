"""The asyncio bridge end to end, on a real tiny checkpoint: plain `asyncio.run`."""

import asyncio
import contextlib
import gc
import subprocess
import sys
import threading
import time
from pathlib import Path

from runtime.errors import CadenceError, CheckpointError, RequestError

import pytest
import trio

import actors
from actors.asyncio_bridge import _sole
from actors.generation import Generation
from actors.mlx_thread import shared_mlx_thread
from actors.requests import GenerationError, OverloadedError, ServiceClosedError

PROMPTS = ["The quick brown fox", "def main():", "Hello", "1, 2, 3, 4"]
ROOT = Path(__file__).resolve().parents[2]


async def complete(llm, prompt, **kwargs):
    return "".join([d.text async for d in llm.generate(prompt, **kwargs)])


async def complete_generation(generation):
    return "".join([d.text async for d in generation])


async def queued_beside_a_close(llm, generation, call):
    """`call()` (a read or a start) and the generation's aclose() run together on the
    Trio thread, before its pump task starts; returns `call`'s task once the close ran."""
    trio_is_free = threading.Event()
    llm._call_soon(trio_is_free.wait)  # the next two calls queue up behind it...
    task = asyncio.create_task(call())
    await asyncio.sleep(0)  # (its call is queued)
    close = asyncio.create_task(generation.aclose())
    await asyncio.sleep(0)
    trio_is_free.set()  # ... and run together, before the pump task starts
    await close
    return task


async def wait_for_no_open_rows(llm, timeout=5):
    async with asyncio.timeout(timeout):
        while (await llm.engine_stats()).num_open:
            await asyncio.sleep(0.005)


async def started_long_stream(llm):
    """A long generation that has streamed its first delta, and that delta."""
    generation = llm.generate("Once upon a time", max_tokens=900, ignore_eos=True)
    return generation, await generation.__anext__()


def test_concurrent_streams_equal_the_trio_api(tiny):
    async def with_trio():
        async with actors.open_llm(tiny) as llm:
            return [await complete(llm, p, max_tokens=16, ignore_eos=True) for p in PROMPTS]

    async def with_asyncio():
        async with actors.open_llm_asyncio(tiny, max_batch=4) as llm:
            return await asyncio.gather(
                *(complete(llm, PROMPTS[i % 4], max_tokens=16, ignore_eos=True) for i in range(8))
            )

    expected = trio.run(with_trio)
    assert asyncio.run(with_asyncio()) == expected * 2 and all(expected)


def test_a_cancelled_task_frees_its_row(tiny):
    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            streamed = asyncio.Event()
            generation = llm.generate("Once upon a time", max_tokens=900, ignore_eos=True)

            async def consume():
                async for _ in generation:
                    streamed.set()

            task = asyncio.create_task(consume())
            await streamed.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_for_no_open_rows(llm, timeout=0.5)
            # closed as aclose() closes it: it ends, not "the service has stopped"
            assert [d async for d in generation] == []

    asyncio.run(main())


def test_breaking_out_of_the_loop_frees_its_row(tiny):
    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            async for _ in llm.generate("Once upon a time", max_tokens=900, ignore_eos=True):
                break
            await wait_for_no_open_rows(llm, timeout=0.5)
            generation, _ = await started_long_stream(llm)
            await generation.aclose()
            await wait_for_no_open_rows(llm, timeout=0.5)
            assert [d async for d in generation] == []  # closed: nothing more streams

    asyncio.run(main())


def test_a_second_reader_is_refused_and_the_first_reads_on(tiny):
    """Refused by the pump, the second reader's error ended the first one's stream too:
    its loop stopped after one delta, as if the generation had finished."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            alone = await complete(llm, PROMPTS[0], max_tokens=16, ignore_eos=True)
            generation = llm.generate(PROMPTS[0], max_tokens=16, ignore_eos=True)

            async def read_all():
                return "".join([d.text async for d in generation])

            first, second = await asyncio.gather(read_all(), read_all(), return_exceptions=True)
            await wait_for_no_open_rows(llm)
            return alone, first, second, generation.finish_reason

    alone, first, second, finish_reason = asyncio.run(main())
    assert first == alone and finish_reason == "length"
    assert isinstance(second, RuntimeError) and "already reading" in str(second)


def test_a_first_read_queued_when_its_generation_closes_is_answered(tiny):
    """The first read waits in the pump's channel until the pump task runs; a close
    (or a stop) before that dropped it with the channel, and its reader waited forever.
    Closed by its own program, it ends as a Trio Generation's read does then."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation = llm.generate("Once upon a time", max_tokens=900, ignore_eos=True)
            read = await queued_beside_a_close(llm, generation, generation.__anext__)
            async with asyncio.timeout(5):
                with pytest.raises(StopAsyncIteration):
                    await read
            await wait_for_no_open_rows(llm)

    asyncio.run(main())


def test_a_reader_slower_than_the_drain_still_gets_the_whole_answer(tiny):
    """The block ends once every answer is in, read or not; the bridge then cancelled
    its pumps, and a reader still reading got ServiceClosedError for the rest of an
    answer that a Trio caller reads to its end after `open_llm`'s block."""

    async def main():
        read_on = asyncio.Event()
        async with actors.open_llm_asyncio(tiny) as llm:
            alone = await complete(llm, PROMPTS[1], max_tokens=64, ignore_eos=True)
            generation = llm.generate(PROMPTS[1], max_tokens=64, ignore_eos=True)
            first = await generation.__anext__()

            async def read_the_rest():
                await read_on.wait()
                # started: start() tells its length, and takes nothing from the rest
                assert await generation.start() == generation.num_prompt_tokens
                return first.text + "".join([d.text async for d in generation])

            reader = asyncio.create_task(read_the_rest())
        read_on.set()  # the service has drained and its thread has gone
        async with asyncio.timeout(5):
            return alone, await reader, generation.finish_reason

    alone, read_late, finish_reason = asyncio.run(main())
    assert read_late == alone and finish_reason == "length"


def test_start_returns_the_prompt_length_and_a_finished_stream_stays_finished(tiny):
    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation = llm.generate([1, 2, 3], max_tokens=2, ignore_eos=True)
            num_prompt_tokens = await generation.start()
            deltas = [d async for d in generation]
            again = [d async for d in generation]  # finished: it ends at once
            return num_prompt_tokens, generation, deltas, again

    num_prompt_tokens, generation, deltas, again = asyncio.run(main())
    assert num_prompt_tokens == 3 == generation.num_prompt_tokens
    assert deltas[-1].finish_reason == "length" and again == []


def test_a_generation_closed_by_another_task_ends_its_readers_stream(tiny):
    """A stop button: the reader got ServiceClosedError, though the service ran on."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation, _ = await started_long_stream(llm)

            async def read_on():
                return len([d async for d in generation])

            reader = asyncio.create_task(read_on())
            await asyncio.sleep(0.1)
            await generation.aclose()
            async with asyncio.timeout(5):
                num_read = await reader
            await wait_for_no_open_rows(llm)
            return num_read, generation.finish_reason, await complete(llm, "hi", max_tokens=2)

    num_read, finish_reason, after = asyncio.run(main())
    assert num_read < 899 and finish_reason is None and after


def test_a_start_refused_for_a_full_queue_can_be_retried_as_under_trio(tiny):
    """The bridge ended the generation on any error: iterating it after an
    OverloadedError yielded nothing, with no error and no finish_reason."""

    async def main():
        async with actors.open_llm_asyncio(tiny, max_batch=1, max_waiting=1) as llm:
            running, _ = await started_long_stream(llm)  # it holds the only row
            queued = llm.generate("hi", max_tokens=3, ignore_eos=True)
            await queued.start()  # it holds the only waiting slot
            refused = llm.generate("hi", max_tokens=3, ignore_eos=True)
            with pytest.raises(OverloadedError):
                await refused.start()
            await running.aclose()
            await queued.aclose()
            async with asyncio.timeout(10):
                while True:  # the slot comes back once the scheduler takes the abort
                    with contextlib.suppress(OverloadedError):
                        await refused.start()
                        break
                    await asyncio.sleep(0.01)
                deltas = [d async for d in refused]
            return deltas, refused.finish_reason

    deltas, finish_reason = asyncio.run(main())
    assert len(deltas) == 3 and finish_reason == "length"


def test_starting_a_finished_generation_is_refused_as_under_trio(tiny):
    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation = llm.generate("hi", max_tokens=2, ignore_eos=True)
            assert len([d async for d in generation]) == 2
            with pytest.raises(RuntimeError, match="starts once"):
                await generation.start()  # was ServiceClosedError, the service running

    asyncio.run(main())


def test_using_it_from_another_event_loop_is_refused_before_anything_is_submitted(tiny):
    """Its futures resolve on the loop that opened it: awaited on another, asyncio's
    "attached to a different loop" came once the request was submitted, and it ended
    the generation for its own loop too."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation = llm.generate("hi", max_tokens=2, ignore_eos=True)

            async def use_elsewhere():
                with pytest.raises(RuntimeError, match="event loop that opened it"):
                    await generation.start()
                with pytest.raises(RuntimeError, match="event loop that opened it"):
                    await generation.aclose()
                with pytest.raises(RuntimeError, match="event loop that opened it"):
                    await llm.engine_stats()

            await asyncio.to_thread(asyncio.run, use_elsewhere())
            return [d async for d in generation]  # still its own loop's to read

    assert len(asyncio.run(main())) == 2


def test_errors_keep_their_types(tiny):
    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            with pytest.raises(RequestError):
                llm.generate("hi", temperature=-1)
            with pytest.raises(RequestError):  # refused by admission, on the Trio side
                await complete(llm, "hi " * 10_000, max_tokens=4)
            return await complete(llm, "hi", max_tokens=4)  # still serving

    assert asyncio.run(main())


def test_chat_messages_follow_the_rules_http_follows(tiny):
    """A role outside HTTP's closed set reached the template; text parts were refused."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            with pytest.raises(RequestError) as raised:
                llm.generate(messages=[{"role": "robot", "content": "hi"}])
            parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
            stream = llm.generate(messages=parts, max_tokens=3, ignore_eos=True)
            return raised.value.param, [d async for d in stream]

    param, deltas = asyncio.run(main())
    assert param == "messages[0].role"
    assert deltas[-1].usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("arguments", "error"),
    [({"model": "/no/such/checkpoint"}, CheckpointError), ({"max_batch": 0}, CadenceError)],
)
def test_errors_opening_it_are_the_ones_trio_sees_not_a_group(arguments, error):
    """The bridge's own nursery wrapped them: `except CheckpointError` missed."""

    async def main():
        async with actors.open_llm_asyncio(**arguments):
            pass

    with pytest.raises(error) as raised:
        asyncio.run(main())
    assert not isinstance(raised.value, BaseExceptionGroup)
    # raised alone: not "during handling of" a "stopped before it started" of the bridge's
    assert raised.value.__context__ is None


def test_a_group_of_several_errors_stays_a_group():
    """Only a group of one is the bridge's own wrapping; several errors are all reported."""
    several = ExceptionGroup("two failures", [ValueError("a"), KeyError("b")])
    assert _sole(several) is several
    assert isinstance(_sole(ExceptionGroup("one", [several])), ExceptionGroup)
    assert isinstance(_sole(ExceptionGroup("one", [ExceptionGroup("one", [KeyError()])])), KeyError)


def test_no_thread_is_left_behind(tiny):
    shared_mlx_thread()  # process-wide and never stopped, by design (actors/mlx_thread.py)

    def bridge_threads():
        # Trio's process-wide worker cache (admission's tokenizer calls) idles out by itself.
        return {t for t in threading.enumerate() if not t.name.startswith("Trio thread")}

    before = bridge_threads()

    async def main(fail):
        async with actors.open_llm_asyncio(tiny, drain_timeout=0.1) as llm:
            generation, _ = await started_long_stream(llm)  # held open: the drain aborts it
            assert any(t.name == "cadence-trio" for t in threading.enumerate())
            if fail:
                raise KeyError("inside the block")
        return generation

    assert asyncio.run(main(fail=False)).finish_reason is None  # aborted, not finished
    with pytest.raises(KeyError):
        asyncio.run(main(fail=True))
    assert bridge_threads() == before


def test_the_example_streams_two_generations():
    run = subprocess.run(
        [sys.executable, "examples/embed_asyncio.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "[a] " in run.stdout and "[b] " in run.stdout and "row is already free" in run.stdout


def test_an_error_in_the_block_stops_at_once_without_draining(tiny):
    """The error ends the service as it does under Trio: the stream held open is aborted,
    not waited for (here 900 slow steps, about a minute)."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation, _ = await started_long_stream(llm)
            engine = llm._llm._engine
            submit = engine.submit
            engine.submit = lambda batch: (time.sleep(0.05), submit(batch))[1]
            raise KeyError("inside the block")

    started = time.monotonic()
    with pytest.raises(KeyError):
        asyncio.run(main())
    assert time.monotonic() - started < 20


def test_cancelling_the_task_that_holds_the_llm_leaves_the_loop_running(tiny):
    """Cancelled while it drains, the block stops hard, which waits for the MLX call in
    flight: it joined the thread on the loop, and every other task stood still for that
    call (here 2 s)."""
    gaps = []

    async def heartbeat():
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    async def hold(stepping):
        async with actors.open_llm_asyncio(tiny) as llm:
            await started_long_stream(llm)  # unread: the drain waits for it
            engine = llm._llm._engine
            submit = engine.submit

            def slow_submit(batch):
                stepping.set()
                time.sleep(2.0)
                return submit(batch)

            engine.submit = slow_submit

    async def main():
        stepping = threading.Event()
        beating = asyncio.create_task(heartbeat())
        holder = asyncio.create_task(hold(stepping))
        while not stepping.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # draining, a slow step in flight
        gaps.clear()
        holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holder
        beating.cancel()
        # joined off the loop, but joined: the block's end is the service's, cancelled too
        assert not any(t.name == "cadence-trio" for t in threading.enumerate())

    asyncio.run(main())
    assert gaps and max(gaps) < 1.0, max(gaps)


def test_a_cancelled_read_reaches_no_error_handler(tiny):
    """The pump's answer to a read its task gave up on is dropped, not set on a future
    that was cancelled (an InvalidStateError in asyncio's handler, logged as a fault)."""
    errors = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: errors.append(context)
        )
        async with actors.open_llm_asyncio(tiny) as llm:
            for _ in range(3):
                generation = llm.generate("Once upon a time", max_tokens=900, ignore_eos=True)
                read = asyncio.create_task(generation.__anext__())
                await asyncio.sleep(0.01)
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await read
            await wait_for_no_open_rows(llm)

    asyncio.run(main())
    assert errors == []


def broken(*args):
    raise ZeroDivisionError("a bug in an actor")


def test_an_actor_that_fails_is_raised_when_the_block_exits_cleanly(tiny):
    """The Trio side's failure is the caller's to see, as `open_llm` raises it under Trio,
    even when the block itself only saw its requests end."""

    async def main():
        async with asyncio.timeout(60), actors.open_llm_asyncio(tiny) as llm:
            llm._llm.metrics.on_first_token = broken  # the streamer calls it
            with pytest.raises(ServiceClosedError):  # the service stopped, as under Trio
                await complete(llm, "hi", max_tokens=4)

    with pytest.raises(ZeroDivisionError, match="a bug in an actor"):
        asyncio.run(main())


def test_an_actor_that_fails_is_raised_over_the_error_it_caused_in_the_block(tiny):
    """The block's own error ("the service stopped") was raised alone, and the actor's
    failure behind it was lost: nothing said what had stopped the service. Under Trio
    the failure cancels the block and is what `open_llm` raises."""

    async def main():
        async with asyncio.timeout(60), actors.open_llm_asyncio(tiny) as llm:
            llm._llm.metrics.on_first_token = broken  # the streamer calls it
            await complete(llm, "hi", max_tokens=4)

    with pytest.raises(ZeroDivisionError, match="a bug in an actor") as raised:
        asyncio.run(main())
    stopped = raised.value.__context__
    assert isinstance(stopped, ServiceClosedError)  # the block's, not lost


def test_a_stop_cancelled_on_the_asyncio_side_still_stops_the_trio_side(tiny):
    """Cancelled while it drained, the bridge must stop the service at once and take its
    thread down with it, not leave it draining (here 900 slow steps, about a minute)."""
    ended = []

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation, _ = await started_long_stream(llm)  # the drain waits for it
            engine = llm._llm._engine
            submit = engine.submit
            engine.submit = lambda batch: (time.sleep(0.05), submit(batch))[1]
            asyncio.get_running_loop().call_later(0.5, asyncio.current_task().cancel)

    def run():
        try:
            asyncio.run(main())
        except BaseException as error:
            ended.append(error)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(timeout=20)  # joining the Trio thread blocks asyncio's loop: watch from here
    assert not caller.is_alive(), "the cancelled stop did not return"
    assert len(ended) == 1 and isinstance(ended[0], asyncio.CancelledError)
    assert not any(t.name == "cadence-trio" for t in threading.enumerate())


def test_a_block_cancelled_while_the_model_loads_stops_without_hanging(tiny):
    """Cancelled before the Trio thread could be told to stop, the stop must still reach
    it once it starts: else it loaded the model, served, and the cancelled caller waited
    for a stop that never came."""

    async def hold():
        async with actors.open_llm_asyncio(tiny):
            await asyncio.sleep(60)  # never: it is cancelled while it loads

    async def main():
        holder = asyncio.create_task(hold())
        await asyncio.sleep(0)  # (it waits for the model)
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(holder, 10)
        return any(t.name == "cadence-trio" for t in threading.enumerate())

    for _ in range(3):
        assert asyncio.run(main()) is False


def test_a_generation_read_to_its_end_inside_async_with_exits_at_once(tiny):
    """`async with` closes it on exit: a close after the pump had finished waited for a
    finish that had already come, and the block never ended."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            async with asyncio.timeout(10):
                async with llm.generate("hi", max_tokens=3, ignore_eos=True) as generation:
                    deltas = [d async for d in generation]
                await generation.aclose()  # again: safe
            return deltas, generation.finish_reason

    deltas, finish_reason = asyncio.run(main())
    assert len(deltas) == 3 and finish_reason == "length"


def test_a_start_refused_for_a_full_queue_and_never_retried_does_not_hold_up_the_exit(tiny):
    """Refused, it was never submitted: the drain owes it no answer, and its reader
    gets ServiceClosedError after the block, as a Trio caller's retry then does."""

    async def main():
        async with asyncio.timeout(20):
            async with actors.open_llm_asyncio(
                tiny, max_batch=1, max_waiting=1, drain_timeout=0.1
            ) as llm:
                running, _ = await started_long_stream(llm)  # it holds the only row
                queued = llm.generate("hi", max_tokens=3, ignore_eos=True)
                await queued.start()  # it holds the only waiting slot
                refused = llm.generate("hi", max_tokens=3, ignore_eos=True)
                with pytest.raises(OverloadedError):
                    await refused.start()
            with pytest.raises(ServiceClosedError):
                await refused.start()

    asyncio.run(main())


def test_finished_generations_are_not_kept_alive_by_the_bridge(tiny):
    """A long-running service must not hold every answer it ever streamed."""

    def trio_generations():
        gc.collect()
        return sum(isinstance(o, Generation) for o in gc.get_objects())

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            for prompt in PROMPTS:
                await complete(llm, prompt, max_tokens=2, ignore_eos=True)
            await llm.engine_stats()  # (the pumps' exits have run)
            return trio_generations()

    before = trio_generations()  # (any an earlier test left)
    assert asyncio.run(main()) <= before  # (an earlier test's may be freed meanwhile)


def test_a_generation_closed_before_it_started_never_runs(tiny):
    """Closing one never read must not fail, and must not let a later read submit it."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation = llm.generate("Once upon a time", max_tokens=900, ignore_eos=True)
            await generation.aclose()
            with pytest.raises(RuntimeError, match="starts once"):
                await generation.start()
            assert [d async for d in generation] == []
            assert (await llm.engine_stats()).num_open == 0
            return generation.num_prompt_tokens

    assert asyncio.run(main()) is None


def test_a_reader_whose_service_stops_under_it_is_told_so(tiny):
    """An error in the block stops the service at once; a task still reading must get
    ServiceClosedError, not a stream that ends as if its answer were complete."""

    async def main():
        with pytest.raises(KeyError):
            async with actors.open_llm_asyncio(tiny) as llm:
                generation, _ = await started_long_stream(llm)
                reader = asyncio.create_task(complete_generation(generation))
                await asyncio.sleep(0.05)  # it reads on
                raise KeyError("inside the block")
        async with asyncio.timeout(5):
            with pytest.raises(ServiceClosedError):
                await reader
        return generation.finish_reason

    assert asyncio.run(main()) is None


def test_a_start_queued_when_its_generation_closes_is_refused_as_under_trio(tiny):
    """Closed by another task before it was admitted, `start()` raises GenerationError, as
    a Trio Generation's start does then: not the end of a stream nor a stopped service."""

    async def main():
        async with actors.open_llm_asyncio(tiny) as llm:
            generation = llm.generate("Once upon a time", max_tokens=900, ignore_eos=True)
            start = await queued_beside_a_close(llm, generation, generation.start)
            async with asyncio.timeout(5):
                with pytest.raises(GenerationError, match="closed before it started"):
                    await start
            await wait_for_no_open_rows(llm)

    asyncio.run(main())
