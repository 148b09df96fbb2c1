"""Every MLX call runs on one dedicated thread, never on Trio's."""

import subprocess
import sys
import threading
import time

import mlx.core as mx
import pytest
import trio

from actors import mlx_thread
from actors.mlx_thread import exit_now_if_busy, shared_mlx_thread


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


async def test_a_follow_up_whose_log_line_fails_too_leaves_the_thread_serving(monkeypatch):
    """Logging a failed follow-up can raise in turn (a stream closed under the logger):
    the exception left the thread's loop, the thread died, and every later MLX call,
    the server's included, waited forever."""

    def broken_log(*args, **kwargs):
        raise ValueError("I/O operation on closed file")

    monkeypatch.setattr(mlx_thread.log, "exception", broken_log)
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


# A process whose MLX thread is still inside an abandoned call when it ends (a load cut
# short by SIGTERM). Before the fix mlx's C++ teardown aborted it: "terminate called
# without an active exception", exit status 134 (5 runs of 5).
ABANDONED_CALL_SCRIPT = """
import sys, time
import trio
import mlx.core as mx
from actors.mlx_thread import exit_now_if_busy, shared_mlx_thread

def load():
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        mx.eval(mx.random.normal((500, 500)) @ mx.random.normal((500, 500)))
    print("load finished", flush=True)

async def main():
    with trio.move_on_after(0.3):
        await shared_mlx_thread().run(load, abandon_on_cancel=True)

trio.run(main)
print("trio returned", flush=True)
if sys.argv[1] == "exit-now":
    exit_now_if_busy(3)
"""


def run_abandoning_script(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", ABANDONED_CALL_SCRIPT, mode],
        capture_output=True, text=True, timeout=120,
    )


def test_a_process_that_ends_during_an_abandoned_call_waits_for_it_and_exits_cleanly():
    done = run_abandoning_script("return")
    assert "terminate called" not in done.stderr
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["trio", "returned", "load", "finished"]  # waited for it


def test_exit_now_if_busy_leaves_at_once_with_the_status_it_was_given():
    done = run_abandoning_script("exit-now")
    assert "terminate called" not in done.stderr
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["trio", "returned"]  # did not wait for the load


def test_exit_now_if_busy_returns_when_the_thread_is_idle():
    async def call():
        with trio.fail_after(30):  # a dead thread would never answer
            return await shared_mlx_thread().run(lambda: 5)

    assert trio.run(call) == 5
    assert not shared_mlx_thread().is_busy
    exit_now_if_busy(3)  # returns: nothing is running
