"""`open_llm` for asyncio programs: cadence's Trio actors on a thread of their own.

    async with actors.open_llm_asyncio("path/or/org/repo") as llm:
        async for delta in llm.generate("Once upon a time", max_tokens=32):
            print(delta.text, end="")

The context manager starts one thread that runs `trio.run` and `open_llm` inside it
(MLX calls still go to the process's MLX thread). Neither loop ever blocks on the
other: asyncio hands work over with `TrioToken.run_sync_soon`, Trio hands results
back with `loop.call_soon_threadsafe`. (`trio.from_thread.run` from an executor
would park a worker thread per pending read, and cancelling the asyncio task would
not interrupt that thread's wait.)

Each generation is one Trio task, a pump, that owns the Trio `Generation` and reads
one delta per asyncio `__anext__`: the hand-off holds at most one delta, and a slow
consumer leaves text to coalesce in the Generation instead of blocking Trio. Leaving
early (break, cancellation, `aclose()`, garbage collection) cancels the pump, whose
exit closes the Generation: its Abort frees the row within an engine step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import outcome
import trio

from actors.generation import Generation
from actors.llm import LLM, EngineStats
from actors.requests import Delta, GenerationError, OverloadedError, ServiceClosedError, Usage
from actors.service import open_llm

_Result = outcome.Outcome[Any]


def _stopped() -> _Result:
    return outcome.Error(ServiceClosedError("the service has stopped"))


@contextlib.asynccontextmanager
async def open_llm_asyncio(
    model: str | Path | None = None, **open_llm_kwargs: Any
) -> AsyncIterator[AsyncioLLM]:
    """`actors.open_llm` for asyncio: same arguments, same deltas and exceptions.

    On exit it drains as `open_llm` does and joins its thread; an exception inside
    the block stops the actors at once. An actor's failure is raised, over the block's
    own exception if it has one.
    """
    llm = AsyncioLLM(model, open_llm_kwargs, asyncio.get_running_loop())
    llm._thread.start()
    try:
        llm.name = (await llm._ready).unwrap()
        yield llm
    except BaseException:
        await llm._stop(is_hard=True)
        raise
    await llm._stop(is_hard=False)


class AsyncioLLM:
    """A running model seen from asyncio: `generate()` streams, `engine_stats()`."""

    def __init__(self, model: str | Path | None, kwargs: dict[str, Any], loop: Any) -> None:
        self.name = ""  # the model's, once loaded
        self._model = model
        self._kwargs = kwargs
        self._loop: asyncio.AbstractEventLoop = loop
        self._ready: asyncio.Future[_Result] = loop.create_future()
        self._finished: asyncio.Future[_Result] = loop.create_future()
        self._thread = threading.Thread(target=self._run_trio, name="cadence-trio", daemon=True)
        self._lock = threading.Lock()  # orders a stop asked early against the token
        self._is_stop_asked = self._is_hard_stop = False
        self._token: trio.lowlevel.TrioToken | None = None
        # Set on the Trio thread before `_ready` resolves:
        self._llm: LLM | None = None
        self._tasks: trio.Nursery | None = None
        self._root: trio.CancelScope | None = None
        self._stop_event: trio.Event | None = None
        self._pumps: set[_Pump] = set()  # those running

    def generate(self, prompt: str | list[int] | None = None, **kwargs: Any) -> AsyncioGeneration:
        """`LLM.generate` for asyncio: iterate it, ideally inside `async with`.

        Raises RequestError for a bad argument.
        """
        assert self._llm is not None, "use it inside `async with open_llm_asyncio()`"
        # LLM.generate only checks and builds a value (no Trio state is touched), so
        # it runs here and raises RequestError at once, as it does under Trio.
        return AsyncioGeneration(self, self._llm.generate(prompt, **kwargs))

    async def engine_stats(self) -> EngineStats:
        """`LLM.engine_stats`, read on the Trio side."""
        self._check_loop()
        done: asyncio.Future[_Result] = self._loop.create_future()
        self._call_soon(self._read_stats, done)
        result: EngineStats = (await done).unwrap()
        return result

    # -- asyncio side --------------------------------------------------------------------

    def _check_loop(self) -> None:
        """Its futures resolve on the loop that opened it: awaited on another, asyncio
        refused them only once the request had been submitted, which ended it."""
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("open_llm_asyncio's LLM works on the event loop that opened it only")

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the Trio thread; it must not raise."""
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise ServiceClosedError("the service has stopped") from None

    async def _stop(self, *, is_hard: bool) -> None:
        self._ask_stop(is_hard=is_hard)
        try:
            result = await self._finished
        except asyncio.CancelledError:
            self._ask_stop(is_hard=True)
            # A hard stop waits at most for the MLX call in flight, and waits off the
            # loop: joined here, every other task stood still for it (0.8 s of a prefill).
            joined = asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            await asyncio.shield(joined)
            raise
        self._thread.join()
        # An actor's failure, even over the block's own error: that error was most likely
        # "the service stopped", which alone left the failure unseen.
        result.unwrap()

    def _ask_stop(self, *, is_hard: bool) -> None:
        with self._lock:
            self._is_stop_asked = True
            self._is_hard_stop |= is_hard
            token = self._token
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._apply_stop)

    # -- Trio side -----------------------------------------------------------------------

    def _run_trio(self) -> None:
        result = outcome.capture(trio.run, self._serve)
        if isinstance(result, outcome.Error):  # the bridge's nursery is not the caller's
            result = outcome.Error(_sole(result.error))
        stopped = outcome.Error(ServiceClosedError("stopped before it started"))
        if isinstance(result, outcome.Error):  # an outcome unwraps once: one for each
            self._hand_back(self._ready, outcome.Error(result.error))
        else:
            self._hand_back(self._ready, stopped)
        self._hand_back(self._finished, result)

    async def _serve(self) -> None:
        self._stop_event = trio.Event()
        with trio.CancelScope() as self._root:
            with self._lock:
                self._token = trio.lowlevel.current_trio_token()
                if self._is_stop_asked:  # before we had a token to be told with
                    self._apply_stop()
            # Pumps live outside open_llm, so they keep reading while it drains.
            async with trio.open_nursery() as self._tasks:
                async with open_llm(self._model, **self._kwargs) as llm:
                    self._llm = llm
                    self._hand_back(self._ready, outcome.Value(llm.name))
                    await self._stop_event.wait()
                # Drained. An answer all in is kept for its reader, who may read it after
                # this thread has gone, as a Trio caller reads its after open_llm's block:
                # cancelled, a slow reader lost the end of an answer the engine had done.
                for pump in list(self._pumps):
                    pump.keep_answer()

    def _apply_stop(self) -> None:
        assert self._root is not None and self._stop_event is not None
        if self._is_hard_stop:
            self._root.cancel()
        self._stop_event.set()

    def _spawn(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Start a task beside the actors; False once the service has stopped."""
        assert self._tasks is not None
        try:
            self._tasks.start_soon(async_fn, *args)
        except RuntimeError:  # the nursery has closed
            return False
        return True

    def _read_stats(self, done: asyncio.Future[_Result]) -> None:
        assert self._llm is not None
        if not self._spawn(self._deliver, done, self._llm.engine_stats):
            self._hand_back(done, _stopped())

    async def _deliver(
        self,
        done: asyncio.Future[_Result],
        async_fn: Callable[[], Awaitable[Any]],
        if_cancelled: Callable[[], _Result] = _stopped,
    ) -> _Result:
        """Await `async_fn()` and hand its outcome to `done`; cancelled: `if_cancelled()`,
        by default ServiceClosedError."""
        result: _Result | None = None
        try:
            result = outcome.Value(await async_fn())
        except Exception as error:  # trio.Cancelled is not one: it propagates
            result = outcome.Error(error)
        finally:
            self._hand_back(done, if_cancelled() if result is None else result)
        return result

    def _hand_back(self, done: asyncio.Future[_Result], result: _Result) -> None:
        def resolve() -> None:
            if not done.done():  # cancelled on the asyncio side: nobody is waiting
                done.set_result(result)

        with contextlib.suppress(RuntimeError):  # the asyncio loop has closed
            self._loop.call_soon_threadsafe(resolve)


@attrs.frozen
class _Read:
    done: asyncio.Future[_Result]
    is_start: bool  # admit only (`start()`), or read the next delta


class _Pump:
    """The Trio side of one generation; every method runs on the Trio thread.

    It holds no reference to its AsyncioGeneration, so dropping that one (a `break`)
    garbage-collects it and closes the pump.
    """

    def __init__(self, llm: AsyncioLLM, generation: Generation):
        self.generation = generation
        self._llm = llm
        self._scope = trio.CancelScope()
        self._reads_send, self._reads = trio.open_memory_channel[_Read](1)
        self._is_finished = False
        self._on_finished: list[asyncio.Future[_Result]] = []
        self._is_keeping = False  # the service has drained: the answer is being kept
        self.kept: collections.deque[_Result] = collections.deque()  # read once finished
        self._late_reads: list[_Read] = []  # asked for while it was being kept
        self._is_closed = False  # by its reader's side: aclose(), a break, cancellation

    def start(self, read: _Read) -> None:
        if self._llm._spawn(self._run):
            self._llm._pumps.add(self)
        else:
            self._is_finished = True
            self._reads.close()  # so `request` answers ServiceClosedError
        self.request(read)

    def request(self, read: _Read) -> None:
        if self._is_keeping:  # answered from what is kept, once all of it is
            if self._is_finished:
                self._llm._hand_back(read.done, self.answer_from_kept(read))
            else:
                self._late_reads.append(read)
            return
        try:
            self._reads_send.send_nowait(read)
        except trio.WouldBlock:
            busy = RuntimeError("another task is already reading this generation")
            self._llm._hand_back(read.done, outcome.Error(busy))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._llm._hand_back(read.done, _stopped())

    def close(self, done: asyncio.Future[_Result] | None = None) -> None:
        self._is_closed = True
        self._scope.cancel()
        if done is None:
            return
        if self._is_finished:
            self._llm._hand_back(done, outcome.Value(None))
        else:
            self._on_finished.append(done)

    def keep_answer(self) -> None:
        """The service has drained: read out an answer that is all in, to keep; close
        a generation that has none (never started, or aborted without its reply)."""
        if self.generation.is_answered:
            self._is_keeping = True
            self._reads_send.close()  # the reads already asked for are answered first
        else:
            self._scope.cancel()

    async def _run(self) -> None:
        try:
            with self._scope:
                async for read in self._reads:
                    step = self._start if read.is_start else self.generation.__anext__
                    cut_short = functools.partial(self._cut_short, read)
                    result = await self._llm._deliver(read.done, step, cut_short)
                    if _ends_it(result):
                        break  # finished, refused or failed: the generation is done
                if self._is_keeping:
                    await self._keep_rest()
        finally:
            self._is_finished = True
            self._llm._pumps.discard(self)
            self._answer_late_reads()
            self._reads.close()
            with trio.CancelScope(shield=True):
                await self.generation.aclose()  # still streaming: the Abort
            for done in self._on_finished:
                self._llm._hand_back(done, outcome.Value(None))

    def _cut_short(self, read: _Read) -> _Result:
        """What a read it does not take gets: closed from the asyncio side (another task
        of its reader's), what the Trio Generation's reader gets then; else the service
        stopped."""
        if not self._is_closed:
            return _stopped()
        if read.is_start:
            return outcome.Error(GenerationError("the request was closed before it started"))
        return outcome.Error(StopAsyncIteration())

    async def _keep_rest(self) -> None:
        """Read the answer out to its end; all of it is in the channel: nothing waits."""
        while True:
            try:
                self.kept.append(outcome.Value(await self.generation.__anext__()))
            except Exception as error:  # trio.Cancelled is not one: it propagates
                self.kept.append(outcome.Error(error))
                return

    def answer_from_kept(self, read: _Read) -> _Result:
        """A read it does not take: the next of what is kept, or cut short."""
        if not self.kept:
            return self._cut_short(read)
        if read.is_start:  # it has started: what start() returns
            return outcome.Value(self.generation.num_prompt_tokens)
        return self.kept.popleft()

    def _answer_late_reads(self) -> None:
        """Answer the reads it will not take: from what is kept, or ServiceClosedError.

        A read still in the channel (the first one waits there until this task runs,
        and a close or stop can come first) was dropped with it: its reader hung.
        """
        queued: list[_Read] = []
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
            while True:
                queued.append(self._reads.receive_nowait())
        self._late_reads[:0] = queued  # those came first
        for read in self._late_reads:
            self._llm._hand_back(read.done, self.answer_from_kept(read))
        self._late_reads.clear()

    async def _start(self) -> int | None:
        await self.generation.__aenter__()  # admits it unless it already started
        return self.generation.num_prompt_tokens


class AsyncioGeneration:
    """One request seen from asyncio: `async for delta in generation` (or `async with`)."""

    def __init__(self, llm: AsyncioLLM, generation: Generation):
        self.request_id = generation.request_id
        self._llm = llm
        self._generation = generation
        self._pump: _Pump | None = None
        self._is_done = False
        self._is_reading = False

    @property
    def num_prompt_tokens(self) -> int | None:
        return self._generation.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return self._generation.finish_reason

    @property
    def usage(self) -> Usage | None:
        return self._generation.usage

    async def start(self) -> int:
        """Admit the request (`Generation.start`); returns its prompt length in tokens."""
        if self._is_done:  # finished, refused, failed or closed
            raise RuntimeError("a Generation starts once")
        return await self._read(is_start=True) or 0

    def __aiter__(self) -> AsyncioGeneration:
        return self

    async def __anext__(self) -> Delta:
        if self._is_done:
            raise StopAsyncIteration
        delta: Delta = await self._read(is_start=False)
        return delta

    async def aclose(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        self._llm._check_loop()
        self._is_done = True
        pump, self._pump = self._pump, None
        if pump is not None:
            closed: asyncio.Future[_Result] = self._llm._loop.create_future()
            with contextlib.suppress(ServiceClosedError):
                self._llm._call_soon(pump.close, closed)
                await closed

    async def __aenter__(self) -> AsyncioGeneration:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped mid-stream (a `break` out of `async for`): close it on the Trio side,
        # where the last reference to the Trio Generation then goes.
        if self._pump is not None and not self._is_done:
            with contextlib.suppress(Exception):
                self._llm._call_soon(self._pump.close)

    async def _read(self, *, is_start: bool) -> Any:
        # Refused here, as Generation.__anext__ refuses it: refused by the pump, a second
        # reader's error ended the stream for the first one too, whose loop then stopped
        # after one delta while the row ran on to max_tokens.
        self._llm._check_loop()
        if self._is_reading:
            raise RuntimeError("another task is already reading this generation")
        self._is_reading = True
        try:
            return await self._read_one(is_start=is_start)
        finally:
            self._is_reading = False

    def _request(self, pump: _Pump, read: _Read) -> None:
        try:
            self._llm._call_soon(pump.request, read)
        except ServiceClosedError:  # the Trio thread has gone: what the pump kept is all
            if not pump.kept:
                raise
            read.done.set_result(pump.answer_from_kept(read))

    async def _read_one(self, *, is_start: bool) -> Any:
        done: asyncio.Future[_Result] = self._llm._loop.create_future()
        read = _Read(done, is_start)
        try:
            if self._pump is None:
                self._pump = _Pump(self._llm, self._generation)
                self._llm._call_soon(self._pump.start, read)
            else:
                self._request(self._pump, read)
            result = await done
        except BaseException:  # cancelled (or the service stopped): abort the request
            self._is_done = True
            if self._pump is not None:
                with contextlib.suppress(ServiceClosedError):
                    self._llm._call_soon(self._pump.close)
            raise
        if _ends_it(result):
            self._is_done = True
        return result.unwrap()


def _ends_it(result: _Result) -> bool:
    """An error ends a generation, but for a full queue: that one refuses before the
    request is queued, and a retry may be admitted, as under Trio."""
    return isinstance(result, outcome.Error) and not isinstance(result.error, OverloadedError)


def _sole(error: BaseException) -> BaseException:
    """The one exception a group of one wraps: the bridge's own nursery grouped what
    open_llm raised (a CheckpointError became an ExceptionGroup that `except
    CheckpointError` missed), where Trio's caller gets it bare."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
