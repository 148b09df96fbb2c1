"""The streamer: turns each row's tokens into text deltas on its request's reply channel.

It detokenizes, applies stop strings (a hit finishes the request with STOP_SEQUENCE
and asks the scheduler to close the row), and ends each reply channel with Finished
or Failed. A reply channel whose reader went away becomes an Abort.

Reply channels hold a few messages (REPLY_BUFFER). A reader that falls behind never
holds up the engine or the other streams: its text waits in `unsent` and leaves,
coalesced, with the next delta that fits or with the final message; its logprob
entries wait and leave beside it, so each token's entry arrives once, in order. So
memory per slow reader is its own unread text, and `send_nowait` never blocks.
"""

from __future__ import annotations

import bisect
import contextlib

from runtime.detokenizer import IncrementalDetokenizer
from runtime.finishing import first_cause
from runtime.harmony import BODY_OPENS, HEADER_OPENS
from runtime.sequence import FinishCause, TokenLogprob
from runtime.stop_strings import MarkupSplitter, StopMatcher
from runtime.think_reply import ThinkTags
from runtime.tokenizer import Tokenizer

import attrs
import structlog
import trio

from actors.messages import (
    MAX_QUEUED_DELTAS,
    Abort,
    Failed,
    Finished,
    Reply,
    ReplySender,
    RowToken,
    SchedulerMessage,
    StepResult,
    StreamerMessage,
    TextDelta,
    Track,
)
from actors.metrics import Metrics
from actors.requests import LogprobEntry, Usage

log = structlog.get_logger("cadence.streamer")


@attrs.define
class _Stream:
    track: Track
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher
    markup: MarkupSplitter  # the text the stop matcher does not read
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    unsent: str = ""  # text held back while the reader is behind
    unsent_logprobs: list[LogprobEntry] = attrs.Factory(list)  # ... and its tokens' logprobs,
    unsent_starts: list[int] = attrs.Factory(list)  # ... each where its token's text starts
    num_chars_in: int = 0  # characters fed to the stop matcher (its output is a prefix)
    num_chars_out: int = 0  # ... and let through by it

    @property
    def request_id(self) -> str:
        return self.track.request_id

    @property
    def reply(self) -> ReplySender:
        return self.track.reply


@attrs.define
class Streamer:
    tokenizer: Tokenizer
    inbox: trio.MemoryReceiveChannel[StreamerMessage]
    to_scheduler: trio.MemorySendChannel[SchedulerMessage]
    metrics: Metrics
    eos_ids: frozenset[int] = frozenset()  # the engine's: their token ends a row as no text
    tool_style: str = "hermes"  # the model's reply format (runtime/tools.py)
    # The tags chat replies think between (`<think>`, Mistral's `[THINK]`), if any
    # (actors/admission.py)
    think_tags: ThinkTags | None = None
    streams: dict[str, _Stream] = attrs.Factory(dict)
    awaiting_release: set[str] = attrs.Factory(set)  # forgotten (reader gone), end unlogged

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Every actor closes its channels with `with`, not `async with`: aclose() is a
        # checkpoint, and a failing actor's, cancelled by then, raised Cancelled over
        # its error, so the service stopped with no word of why.
        with self.inbox, self.to_scheduler:
            task_status.started()
            try:
                async for message in self.inbox:
                    if isinstance(message, Track):
                        self.streams[message.request_id] = _Stream(
                            message,
                            self.tokenizer.detokenizer(
                                skip_special_tokens=not message.keep_special_tokens,
                                kept_ids=self._think_ids(message),
                            ),
                            StopMatcher(message.stop),
                            self._markup(message),
                            unsent=message.opening,  # leaves with the first text
                        )
                    else:
                        await self._on_step(message)
            finally:
                for stream in list(self.streams.values()):
                    stopped = Failed(
                        stream.request_id, "the service stopped", is_service_stopped=True
                    )
                    self._end(stream, stopped)
                for request_id in self.awaiting_release:  # their release never came
                    self._log_aborted(request_id, "disconnected", "running")

    async def _on_step(self, result: StepResult) -> None:
        for request_id, (cause, stage) in result.released:  # aborted: tell a reader still there
            if (stream := self.streams.get(request_id)) is not None:
                self._send(stream, Failed(request_id, "the request was aborted"))
                self._forget(stream)
                self._log_aborted(request_id, cause, stage)
            elif request_id in self.awaiting_release:  # its reader left first
                self.awaiting_release.discard(request_id)
                self._log_aborted(request_id, cause, stage)
        for request_id, num_cached in result.cached:
            if (stream := self.streams.get(request_id)) is not None:
                stream.num_cached_tokens = num_cached
        for row in result.rows:
            if (stream := self.streams.get(row.request_id)) is None:
                continue  # already ended (stop string, abort) or never tracked
            abort_cause = self._on_token(stream, row)
            if abort_cause is not None:
                # The scheduler may be gone already: shutting down.
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.to_scheduler.send(Abort(row.request_id, abort_cause))

    def _on_token(self, stream: _Stream, row: RowToken) -> str | None:
        """Stream one token; returns an abort cause when the row must be closed."""
        if row.token is None or row.finish is FinishCause.ERROR:
            message = row.error or "generation failed"
            self._end(stream, Failed(stream.request_id, message, row.error_param))
            return None
        now = trio.current_time()
        if stream.first_token_at is None:
            stream.first_token_at = now
            ttft = now - stream.track.arrived_at
            log.info("first_token", request_id=stream.request_id, ttft_ms=_ms(ttft))
            self.metrics.on_first_token(stream.track.num_prompt_tokens, ttft)
        else:
            self.metrics.on_next_token(now - stream.last_token_at)
        stream.last_token_at = now
        stream.num_completion_tokens += 1
        if row.logprob is not None:
            # Mid-sequence once any token came before it: a lone "▁" first decodes to
            # nothing (a Strip decoder), yet the word start after it keeps its space.
            after_text = stream.detokenizer.has_tokens  # before this token joins it
            stream.unsent_logprobs.append(self._logprob_entry(row.token, row.logprob, after_text))
            stream.unsent_starts.append(stream.num_chars_in)
        # An EOS token that ended the row is no text, as in vLLM and mlx-lm: where a
        # tokenizer does not flag it special, decoding spelled it out. (A grammar that
        # completes ends its row as EOS too, on a token of its text.)
        is_eos = row.finish is FinishCause.EOS and row.token in self.eos_ids
        piece = "" if is_eos else stream.detokenizer.add(row.token)
        text, is_stop = _feed(stream, *stream.markup.split(row.token, piece))
        cause = first_cause(row.finish, FinishCause.STOP_SEQUENCE if is_stop else None)
        if cause is not None and not is_stop:
            tail, is_stop = _feed(stream, stream.detokenizer.flush())
            text += tail if is_stop else tail + stream.stop_matcher.flush()
            cause = first_cause(row.finish, FinishCause.STOP_SEQUENCE if is_stop else None)
        stream.unsent += text
        stream.num_chars_out += len(text)
        if cause is None:
            # Asked at every token, text or not: a reader gone while its tokens made no
            # text (special tokens, a character's first bytes, a held-back stop) was
            # noticed only at the next text, so a dropped one ran on to max_tokens.
            if not self._send_text(stream):
                # Its abort comes back released, with the cause (the caller's own, or
                # this one): the terminal event is logged then.
                self._forget(stream)
                self.awaiting_release.add(stream.request_id)
                return "disconnected"
            return None
        usage = Usage(
            stream.track.num_prompt_tokens, stream.num_completion_tokens, stream.num_cached_tokens
        )
        # A stop string cuts the tokens of its text, and those after it, out of the
        # logprobs too, so they hold the text's tokens (only the cut text was spelled).
        logprobs = _take_logprobs(stream, is_all=not is_stop)
        self._end(stream, Finished(stream.request_id, stream.unsent, cause, usage, logprobs))
        # The engine already closed a row it finished; a stop string is ours to close.
        return "stop_sequence" if row.finish is None else None

    def _markup(self, track: Track) -> MarkupSplitter:
        """What of a request's text is its format's markup: control tokens, where it
        keeps them as text, harmony's headers, and the thinking tags."""
        spellings = self.think_tags.spellings if self.think_tags is not None else ()
        thinking = dict(zip(self._think_ids(track), spellings, strict=False))
        if not track.keep_special_tokens:
            return MarkupSplitter(thinking)
        if self.tool_style == "harmony":
            return MarkupSplitter(self.tokenizer.control_spellings, HEADER_OPENS, BODY_OPENS)
        return MarkupSplitter({**self.tokenizer.control_spellings, **thinking})

    def _think_ids(self, track: Track) -> tuple[int, ...]:
        """The thinking tags' ids, kept as text though special, for a reply that thinks."""
        if not track.thinks or self.think_tags is None or self.think_tags.ids is None:
            return ()  # (text tags are no tokens of their own)
        return self.think_tags.ids

    def _end(self, stream: _Stream, message: Finished | Failed) -> None:
        self._send(stream, message)
        self._forget(stream)
        bound = log.bind(request_id=stream.request_id)
        if isinstance(message, Failed):
            self.metrics.on_failed()
            bound.info("failed", error=message.message)
            return
        now = trio.current_time()
        assert stream.first_token_at is not None
        self.metrics.on_finished(message.cause.openai_reason, now - stream.track.arrived_at)
        bound.info(
            "finished",
            reason=message.cause.openai_reason,
            cause=message.cause.value,
            prompt_tokens=message.usage.prompt_tokens,
            completion_tokens=message.usage.completion_tokens,
            cached_tokens=message.usage.cached_tokens,
            ttft_ms=_ms(stream.first_token_at - stream.track.arrived_at),
            e2e_ms=_ms(now - stream.track.arrived_at),
        )

    def _log_aborted(self, request_id: str, cause: str, stage: str) -> None:
        """The request's one terminal event when it ends unfinished: the streamer tracks
        it from admission, so it alone knows whether `finished` came first (a row aborted
        while its last token was in flight logged both, one here, one in the scheduler)."""
        self.metrics.on_aborted()
        log.info("aborted", request_id=request_id, cause=cause, stage=stage)

    def _forget(self, stream: _Stream) -> None:
        self.streams.pop(stream.request_id, None)
        stream.reply.close()

    def _send_text(self, stream: _Stream) -> bool:
        """Send the unsent text, if any, unless the reader is behind; False when the reader left."""
        stats = stream.reply.statistics()
        if stats.open_receive_channels == 0:
            return False
        if stats.current_buffer_used >= MAX_QUEUED_DELTAS or not stream.unsent:
            return True  # held back (or nothing yet): it leaves with the next delta that fits
        text, stream.unsent = stream.unsent, ""
        logprobs = _take_logprobs(stream, is_all=False)
        return self._send(stream, TextDelta(stream.request_id, text, logprobs))

    def _logprob_entry(self, token: int, logprob: TokenLogprob, after_text: bool) -> LogprobEntry:
        text, raw = self.tokenizer.token_piece(token, after_text)
        pieces = [(self.tokenizer.token_piece(t, after_text), value) for t, value in logprob.top]
        top = tuple((top_text, value) for (top_text, _), value in pieces)
        return LogprobEntry(text, logprob.logprob, top, raw, tuple(b for (_, b), _ in pieces))

    def _send(self, stream: _Stream, message: Reply) -> bool:
        try:
            stream.reply.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            return False
        return True


def _feed(stream: _Stream, text: str, markup: str = "") -> tuple[str, bool]:
    stream.num_chars_in += len(text) + len(markup)
    return stream.stop_matcher.feed(text, markup)


def _take_logprobs(stream: _Stream, *, is_all: bool) -> tuple[LogprobEntry, ...]:
    """The unsent entries to send: all of them, or those of tokens whose text has begun
    to go out. One whose text is all held back (the start of a stop string, or a
    character's first bytes) waits: a stop may yet cut it away."""
    num = len(stream.unsent_starts) if is_all else bisect.bisect_left(
        stream.unsent_starts, stream.num_chars_out
    )
    taken = tuple(stream.unsent_logprobs[:num])
    del stream.unsent_logprobs[:num], stream.unsent_starts[:num]
    return taken


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
