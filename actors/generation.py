"""One request as its caller sees it: admission, then an async iterator of deltas.

A caller that goes away becomes an Abort: cancellation while waiting for a delta,
`aclose()`, leaving `async with` early, or (last resort) garbage collection, which
closes the reply channel so the streamer aborts the row at its next token.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import uuid
from typing import TYPE_CHECKING

from runtime.errors import CadenceError, RequestError

import trio

from actors.messages import (
    REPLY_BUFFER,
    Abort,
    Accepted,
    Admit,
    AdmitGroup,
    Failed,
    Finished,
    Rejected,
    Reply,
    TextDelta,
)
from actors.requests import Delta, GenerateRequest, GenerationError, ServiceClosedError, Usage

if TYPE_CHECKING:
    from actors.llm import LLM


class _ClosedByCaller(Exception):
    """The reader's channel was closed under it by aclose() from another task."""


class _State(enum.Enum):
    NEW = "new"
    ADMITTING = "admitting"  # queued in admission: its reply channel is the only link
    STREAMING = "streaming"  # the scheduler knows it: leaving sends an Abort
    DONE = "done"


class Generation:
    def __init__(
        self,
        llm: LLM,
        request: GenerateRequest,
        *,
        request_id: str | None = None,
        cancel_cause: str = "cancelled",
    ):
        self.request_id = request_id or uuid.uuid4().hex  # unique among requests in flight
        # The abort cause logged when its reader is cancelled: the HTTP server's reader
        # is, when its client disconnects.
        self.cancel_cause = cancel_cause
        self.request = request
        self.num_prompt_tokens: int | None = None
        self.finish_reason: str | None = None  # "stop" or "length" once finished
        self.usage: Usage | None = None
        self.refusal: CadenceError | None = None  # what admission refused it with
        self._llm = llm
        self._state = _State.NEW
        self._replies: trio.MemoryReceiveChannel[Reply] | None = None
        self._stash: collections.deque[Reply] = collections.deque()  # read before the channel
        self._is_reading = False

    @property
    def is_answered(self) -> bool:
        """Its last reply (finished, failed, refused) is queued for the reader: the
        service, which closes its end of the channel then, owes it nothing more."""
        return self._replies is not None and self._replies.statistics().open_send_channels == 0

    def submit(self, group: AdmitGroup | None = None) -> None:
        """Queue the request for admission now, taking a waiting slot; never waits.

        Raises OverloadedError (waiting queue full) or ServiceClosedError (draining).
        `start()` submits first unless this was called. `group`: admitted with the
        others of its group or refused with them (actors/choices.py).
        """
        if self._state is not _State.NEW:
            raise RuntimeError("a Generation starts once")
        send, self._replies = trio.open_memory_channel[Reply](REPLY_BUFFER)
        admit = Admit(self.request_id, self.request, send, trio.current_time(), group)
        self._llm._admit(admit, self)
        self._state = _State.ADMITTING

    async def start(self) -> int:
        """Admit the request; returns its prompt length in tokens.

        Raises OverloadedError (waiting queue full), ServiceClosedError (draining),
        RequestError (bad prompt, context_length_exceeded) before any text streams.
        """
        if self._state is _State.NEW:
            self.submit()
        elif self._state is not _State.ADMITTING:
            raise RuntimeError("a Generation starts once")
        try:
            reply = await self._receive()
            while isinstance(reply, TextDelta):  # text overtook Accepted (sent after the
                self._stash.append(reply)  # Submit), which is on its way: it tells the length
                reply = await self._receive()
        except _ClosedByCaller:
            raise GenerationError("the request was closed before it started") from None
        match reply:
            case Accepted(_, num_prompt_tokens):
                self.num_prompt_tokens = num_prompt_tokens
            case Finished(_, _, _, usage, _):  # overtook it too, and tells the length as well
                self._stash.append(reply)
                self.num_prompt_tokens = usage.prompt_tokens
            case Rejected(_, error):
                self._done()
                self.refusal = error
                raise error.with_traceback(None)  # admission's frames are not the caller's
            case Failed(_, message) if not self._stash:
                self._done()
                raise ServiceClosedError(message)
            case Failed():  # after text: the reader's GenerationError
                self._stash.append(reply)
        self._state = _State.STREAMING
        return self.num_prompt_tokens or 0

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Delta:
        # Two readers would split the deltas between them, and the one left waiting
        # when the other took the last was told "the service stopped".
        if self._is_reading:
            raise RuntimeError("another task is already reading this generation")
        self._is_reading = True
        try:
            return await self._next()
        finally:
            self._is_reading = False

    async def _next(self) -> Delta:
        if self._state in (_State.NEW, _State.ADMITTING):  # ADMITTING: submit() alone
            await self.start()
        while self._state is not _State.DONE:
            try:
                message = self._stash.popleft() if self._stash else await self._receive()
            except _ClosedByCaller:  # aclose() from another task: a stop button
                break
            match message:
                case TextDelta(_, text, logprobs):
                    return Delta(text, logprobs=logprobs)
                case Finished(_, text, cause, usage, logprobs):
                    self._done()
                    self.finish_reason, self.usage = cause.openai_reason, usage
                    self.num_prompt_tokens = usage.prompt_tokens
                    return Delta(text, cause.openai_reason, cause.value, usage, logprobs)
                case Failed(_, error, None, is_service_stopped):
                    self._done()
                    if is_service_stopped:
                        raise ServiceClosedError(error)
                    if self._llm.is_aborting_all:  # cut by the drain, no fault: HTTP's 503
                        raise ServiceClosedError(f"the service is shutting down: {error}")
                    raise GenerationError(error)
                case Failed(_, error, param):  # the request's own value failed mid-reply
                    self._done()
                    raise RequestError(error, param=param)
        raise StopAsyncIteration

    async def aclose(self, cause: str = "cancelled") -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        is_scheduled = self._state is _State.STREAMING or (
            self._state is _State.ADMITTING and self._is_submitted_unread()
        )
        self._done()
        if is_scheduled:  # the row may be running, or waiting: free it within a step
            with (
                trio.CancelScope(shield=True),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
            ):
                await self._llm._to_scheduler.send(Abort(self.request_id, cause))

    async def __aenter__(self) -> Generation:
        if self._state is _State.NEW:
            await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped without aclose(): closing the reply channel is enough for the
        # streamer to abort the row at its next token.
        with contextlib.suppress(Exception):
            self._done()

    async def _receive(self) -> Reply:
        assert self._replies is not None
        try:
            return await self._replies.receive()
        except trio.EndOfChannel:
            self._done()
            raise GenerationError("the service stopped") from None
        except trio.ClosedResourceError:  # our own end, closed by aclose() in another task
            raise _ClosedByCaller from None
        except BaseException:
            await self.aclose(self.cancel_cause)  # cancelled while waiting: the caller is gone
            raise

    def _is_submitted_unread(self) -> bool:
        """Whether the scheduler has the request though start() has not seen it yet.

        Admission replies Accepted only after it sent the Submit; a caller that leaves
        before that reply is queued is aborted by admission, which finds the channel
        closed. A reply already queued (Accepted, or text that overtook it) is ours to
        abort, else the request held a waiting slot and was computed for nobody.
        """
        assert self._replies is not None
        if self._stash:
            return True
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
            return not isinstance(self._replies.receive_nowait(), Rejected)
        return False

    def _done(self) -> None:
        if self._state in (_State.NEW, _State.DONE):
            self._state = _State.DONE
            return
        self._state = _State.DONE
        if self._replies is not None:
            self._replies.close()
        self._llm._release(self)
