"""Every MLX call runs on one dedicated thread, never on Trio's."""

import threading
import time

import mlx.core as mx
import pytest
import trio

from actors.mlx_thread import shared_mlx_thread


async def test_calls_run_in_order_on_one_thread_that_is_not_trios():
    thread = shared_mlx_thread()
    idents = [await thread.run(threading.get_ident) for _ in range(5)]
    assert set(idents) == {thread.ident}
    assert thread.ident != threading.get_ident()
    assert shared_mlx_thread() is thread  # one per process, reused


async def test_arrays_made_in_one_call_are_usable_in_the_next():
    # mlx streams are bound to their thread: this fails if calls hop threads.
    thread = shared_mlx_thread()
    a = await thread.run(lambda: mx.arange(4) * 2)
    assert await thread.run(lambda: (a + 1).sum().item()) == 16


async def test_exceptions_come_back_to_the_caller():
    thread = shared_mlx_thread()
    with pytest.raises(ZeroDivisionError):
        await thread.run(lambda: 1 / 0)
    assert await thread.run(lambda: "still alive") == "still alive"


async def test_a_cancelled_caller_waits_for_the_call_unless_it_may_abandon_it():
    finished = []

    def slow(tag):
        time.sleep(0.2)
        finished.append(tag)

    thread = shared_mlx_thread()
    with trio.move_on_after(0.01):
        await thread.run(slow, "waited")
    assert finished == ["waited"]  # the engine's state stays consistent
    with trio.move_on_after(0.01):
        await thread.run(slow, "abandoned", abandon_on_cancel=True)
    assert finished == ["waited"]
    await thread.run(lambda: None)  # queued behind the abandoned call
    assert finished == ["waited", "abandoned"]


async def test_the_follow_up_runs_after_the_caller_has_its_result():
    thread = shared_mlx_thread()
    returned, waited = threading.Event(), []
    assert await thread.run(lambda: 7, then=lambda: waited.append(returned.wait(30))) == 7
    returned.set()
    await thread.run(lambda: None)  # queued behind the follow-up
    assert waited == [True]


def fail():
    raise RuntimeError("follow-up failed")


async def test_a_failing_follow_up_is_dropped_and_the_thread_goes_on():
    thread = shared_mlx_thread()
    assert await thread.run(lambda: 1, then=fail) == 1
    with trio.fail_after(30):  # a dead thread would never answer
        assert await thread.run(lambda: 2, abandon_on_cancel=True) == 2


def test_a_call_abandoned_by_a_trio_run_that_ended_leaves_the_thread_serving_the_next():
    thread = shared_mlx_thread()
    release = threading.Event()

    async def abandon():
        with trio.CancelScope() as scope:
            scope.cancel()
            await thread.run(release.wait, abandon_on_cancel=True)

    async def next_call():
        with trio.fail_after(30):  # a dead thread would never answer
            return await thread.run(lambda: "served", abandon_on_cancel=True)

    trio.run(abandon)
    release.set()  # the call ends after its trio run: nothing is left to wake
    assert trio.run(next_call) == "served"
