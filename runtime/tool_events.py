"""What a reply parser reports (runtime/tools.py): the answer's text, each call's name and
arguments as they grow, a call the reply ended inside, and reasoning apart from the answer."""

from __future__ import annotations

import attrs


@attrs.frozen
class Content:
    text: str


@attrs.frozen
class CallStart:
    index: int  # the call's position among this response's calls
    name: str


@attrs.frozen
class CallArguments:
    index: int
    fragment: str  # the next piece of the call's arguments, as JSON text


@attrs.frozen
class CallCutShort:
    """The reply ended (max_tokens, a stop) inside the arguments of the call at `index`,
    whose name and arguments so far were reported: they are no complete JSON. `text` is
    the call as the model wrote it, from its first character."""

    index: int
    text: str


@attrs.frozen
class Reasoning:
    """Text the model reasons in, apart from its answer (gpt-oss's analysis channel, a
    `<think>` or `[THINK]` block)."""

    text: str


Event = Content | CallStart | CallArguments | CallCutShort | Reasoning
