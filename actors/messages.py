"""The values the actors exchange: a small closed set per channel, each naming its request.

    caller --Admit--> admission --Submit--> scheduler --StepPlan|Idle--> gpu --StepResult--> streamer
                          |                    ^  ^                       |                    |
                          +------Track---------|--|-----------------------|------------------->+
                                               |  +-------StepDone--------+                    |
                                               +------------------Abort------------------------+
    admission and streamer --Reply--> the caller's own channel (Accepted, Rejected, TextDelta, Finished, Failed)

A request's id travels in every message that concerns it (contextvars do not flow
into long-lived tasks), so each actor re-binds it for its log lines.
"""

from __future__ import annotations

from typing import TypeAlias

from runtime.errors import CadenceError
from runtime.runner import RowResult as RowToken
from runtime.sequence import FinishCause, SequenceParams
from runtime.step_plan import StepPlan

import attrs
import trio

from actors.requests import GenerateRequest, LogprobEntry, Usage

# --- to the caller, on its own reply channel -------------------------------------------


@attrs.frozen
class Accepted:
    request_id: str
    num_prompt_tokens: int


@attrs.frozen
class Rejected:
    request_id: str
    error: CadenceError


@attrs.frozen
class TextDelta:
    request_id: str
    text: str
    logprobs: tuple[LogprobEntry, ...] = ()  # one per token since the last delta, if asked


@attrs.frozen
class Finished:
    request_id: str
    text: str  # the tail held back by the detokenizer or the stop matcher
    cause: FinishCause
    usage: Usage
    logprobs: tuple[LogprobEntry, ...] = ()


@attrs.frozen
class Failed:
    request_id: str
    message: str
    param: str | None = None  # the request field whose value failed it (a grammar's)
    # The service stopped under the request (no fault of its own): ServiceClosedError, as
    # the asyncio bridge raises when its thread has gone, not GenerationError.
    is_service_stopped: bool = False


Reply: TypeAlias = Accepted | Rejected | TextDelta | Finished | Failed
ReplySender: TypeAlias = trio.MemorySendChannel[Reply]

# A reply channel's bound. Two slots stay free of deltas, for Accepted (which may
# arrive after the first deltas) and for the final Finished or Failed, so those never
# block; a reader that falls behind gets its text coalesced into fewer, longer deltas.
REPLY_BUFFER = 8
MAX_QUEUED_DELTAS = REPLY_BUFFER - 2


# --- to admission ------------------------------------------------------------------------


@attrs.define
class AdmitGroup:
    """Requests admitted all or none (n choices, a batch of prompts): none reaches the
    scheduler until every one is prepared, so a sibling refused never leaves the others
    to run a step for a response that is a 400."""

    size: int
    num_ready: int = 0
    is_refused: bool = False
    settled: trio.Event = attrs.Factory(trio.Event)

    async def all_ready(self) -> bool:
        """One member is prepared: wait for the rest; False if any was refused."""
        self.num_ready += 1
        if self.num_ready == self.size:
            self.settled.set()
        await self.settled.wait()
        return not self.is_refused

    def refuse(self) -> None:
        self.is_refused = True
        self.settled.set()


@attrs.frozen
class Admit:
    request_id: str
    request: GenerateRequest
    reply: ReplySender
    arrived_at: float  # trio.current_time()
    group: AdmitGroup | None = None


# --- to the scheduler ----------------------------------------------------------------------


@attrs.frozen
class Submit:
    request_id: str
    params: SequenceParams


@attrs.frozen
class Abort:
    request_id: str
    cause: str  # "cancelled", "disconnected", "stop_sequence", "shutdown"


@attrs.frozen
class StepDone:
    """The GPU collected `step`: each row's result; finished rows are already closed."""

    step: int
    rows: tuple[RowToken, ...] = ()


@attrs.frozen
class AbortAll:
    """Drain's deadline passed: abort everything still waiting or running."""

    cause: str = "shutdown"


@attrs.frozen
class AdmissionClosed:
    """No Submit will follow; stop once the last row is done."""


SchedulerMessage: TypeAlias = Submit | Abort | StepDone | AbortAll | AdmissionClosed


# --- to the GPU ----------------------------------------------------------------------------


@attrs.frozen
class Idle:
    """Nothing more to queue now: collect what is pending."""


GpuMessage: TypeAlias = StepPlan | Idle


# --- to the streamer ---------------------------------------------------------------------


@attrs.frozen
class Track:
    """Start streaming a request: sent by admission before its Submit."""

    request_id: str
    reply: ReplySender
    stop: tuple[str, ...]
    num_prompt_tokens: int
    arrived_at: float
    # Control tokens as text: Mistral's tool calls are [TOOL_CALLS]name[ARGS]{...}.
    keep_special_tokens: bool = False
    # A chat reply that may think in the model's tags (`<think>`, Mistral's `[THINK]`;
    # runtime/think_reply.py): the tags stay text, which stop strings do not read, and
    # `opening` (the tag a prompt left open) begins the reply's text, so that its parser
    # reads the thought as one.
    thinks: bool = False
    opening: str = ""


@attrs.frozen
class StepResult:
    step: int
    rows: tuple[RowToken, ...] = ()
    # closed by abort, with (cause, stage): forget them, and log the end of any still read
    released: tuple[tuple[str, tuple[str, str]], ...] = ()
    cached: tuple[tuple[str, int], ...] = ()  # rows opened: prompt tokens from the prefix cache


StreamerMessage: TypeAlias = Track | StepResult
