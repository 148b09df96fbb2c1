"""One OS thread that makes every MLX call.

mlx streams belong to the thread that created them: mlx 0.32.4 raises "There is no
Stream(cpu, 0) in current thread" when `trio.to_thread.run_sync` lands a call on
another worker. So the GPU actor sends each call here, to a single long-lived
thread, and awaits the result; the thread wakes Trio through its TrioToken.

The process keeps one such thread and never stops it: a thread that ran MLX work
and then exits races the process's own exit in mlx's C++ teardown and can abort it
("terminate called without an active exception": 6 of 160 exits under load here),
while a thread left blocked on its queue cannot.

The same abort met every process that ended while the thread was still inside a call
its caller had abandoned (a SIGTERM while `cadence serve` loaded: 5 of 6 runs). So at
exit the process waits for such a call to end (`wait_until_idle`, registered with
atexit); the CLI, which has its exit status at hand, leaves at once instead
(`exit_now_if_busy`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import structlog
import trio

T = TypeVar("T")
log = structlog.get_logger("cadence.mlx_thread")


class MlxThread:
    def __init__(self, name: str = "cadence-mlx"):
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.ident: int | None = None
        self._jobs_in_flight = 0  # queued or running, under _idle
        self._idle = threading.Condition()

    def start(self) -> None:
        self._thread.start()
        self.ident = self._thread.ident

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        abandon_on_cancel: bool = False,
        then: Callable[[], None] | None = None,
    ) -> T:
        """Run `fn(*args)` on the MLX thread and return (or raise) its result.

        `then`, if given, runs on the thread right after the result is handed back,
        before any later call: work that must follow `fn` but need not delay its caller.
        It must not raise (it is logged and dropped if it does).

        An MLX call cannot be interrupted, so by default a cancelled caller waits for
        it to finish (the engine's state stays consistent). With `abandon_on_cancel`
        (model loading) the caller leaves at once and the result is dropped.
        """
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def job() -> None:
            box.append(outcome.capture(fn, *args))
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)
            if then is not None:
                try:
                    then()
                except Exception:
                    # Its log line may fail too (a stream closed under the logger): the
                    # thread must go on either way, or every later call waits forever.
                    with contextlib.suppress(Exception):
                        log.exception(
                            "MLX thread follow-up failed", fn=getattr(then, "__name__", "?")
                        )

        with self._idle:
            self._jobs_in_flight += 1
        self._jobs.put(job)
        if abandon_on_cancel:
            await done.wait()
        else:
            with trio.CancelScope(shield=True):
                await done.wait()
        return box[0].unwrap()

    @property
    def is_busy(self) -> bool:
        """A call is queued or running."""
        return self._jobs_in_flight > 0

    def wait_until_idle(self, timeout: float | None = None) -> bool:
        """Block until no call is queued or running (or `timeout` seconds pass)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._jobs_in_flight == 0, timeout)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            finally:
                with self._idle:
                    self._jobs_in_flight -= 1
                    if self._jobs_in_flight == 0:
                        self._idle.notify_all()


_shared: MlxThread | None = None
_shared_lock = threading.Lock()


def shared_mlx_thread() -> MlxThread:
    """The process's MLX thread, started on first use (a daemon: it never blocks exit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MlxThread()
            _shared.start()
            atexit.register(_shared.wait_until_idle)
        return _shared


def exit_now_if_busy(status: int) -> None:
    """End the process with `status` at once if the MLX thread is inside a call (one
    abandoned by a cancelled load): a normal exit would tear mlx's C++ state down under
    it and abort, and waiting could take as long as the whole load."""
    if _shared is not None and _shared.is_busy:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
