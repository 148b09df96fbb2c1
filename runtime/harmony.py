"""gpt-oss's replies in OpenAI's harmony format: reasoning, content and tool calls.

A reply is messages, each a header then a body, marked by special tokens that a
request to such a model keeps in its text (actors/admission.py):

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The chat template's generation prompt ends in `<|start|>assistant`, so the reply
begins with the first message's header. A header names its `channel` (analysis:
reasoning; final: the answer; commentary: text to the user, or a tool call) and may
name a recipient (`to=functions.NAME`, before or after the channel): a message to a
function is a call whose body is its JSON arguments. `<|return|>` and `<|call|>` end
the reply; they are the model's EOS tokens, which reach no text.

`HarmonyParser` turns the text, fed in any split, into the events of runtime/tools.py
(Content, CallStart, CallArguments, CallCutShort) and `Reasoning`, streaming each
body as it grows. Text with no header at all (a reply a grammar forced to JSON from
its first token) is content.
"""

from __future__ import annotations

import re

from runtime.call_values import strict_json
from runtime.json_calls import means_no_arguments
from runtime.tools import (
    CallArguments,
    CallCutShort,
    CallStart,
    Content,
    Event,
    Reasoning,
)

import attrs

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN, RETURN, CALL)
HARMONY_HEADER = (CHANNEL, CONSTRAIN, MESSAGE)  # the markers a call's header is written with
HEADER_OPENS, BODY_OPENS = frozenset((START, CHANNEL)), frozenset((MESSAGE,))  # a header's span
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
FUNCTIONS = "functions."


@attrs.define
class HarmonyParser:
    """One reply's text -> events. `parses_calls`: a message to `functions.NAME` is a
    tool call (the request offered tools); otherwise its body is content."""

    parses_calls: bool = True
    state: str = "start"  # start | header | body | between
    header: str = ""  # the current message's header so far
    kind: str = "content"  # the current body's: content | reasoning | call
    held: str = ""  # text that may be the start of a marker
    num_calls: int = 0
    call_body: str = ""  # the open call's arguments so far
    num_sent: int = 0  # of call_body's characters, those out as CallArguments

    def feed(self, text: str) -> list[Event]:
        text = self.held + text
        cut = _partial_marker_start(text)
        self.held = text[cut:]
        return self._scan(text[:cut])

    def finish(self) -> list[Event]:
        events = self._scan(self.held)
        self.held = ""
        if self.state == "start" and self.header and not _MARKER.search(self.header):
            events += [Content(self.header)]  # plain text after all: keep what was written
        if self.state == "body":  # the reply ended in the body: <|call|> is an EOS token
            events += self._close_call(marked=False)
        return events

    def _scan(self, text: str) -> list[Event]:
        events: list[Event] = []
        at = 0
        for match in _MARKER.finditer(text):
            events += self._text(text[at : match.start()])
            events += self._marker(match.group())
            at = match.end()
        return events + self._text(text[at:])

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.state == "start" and not _may_begin_header(self.header + text):
            # No header after all: plain content, what was held for one included.
            text, self.header = self.header + text, ""
            self.state, self.kind = "body", "content"
        if self.state in ("start", "header"):
            self.header += text
            return []
        if self.state == "between":
            return []  # between messages: nothing the model says
        if self.kind == "reasoning":
            return [Reasoning(text)]
        if self.kind == "call":
            self.call_body += text
            return self._arguments(closing=False)
        return [Content(text)]

    def _marker(self, marker: str) -> list[Event]:
        if self.state in ("start", "header"):
            if marker != MESSAGE:  # part of the header (<|channel|>, <|constrain|>)
                self.header += marker
                return []
            return self._open_body()
        if marker == START:
            self.state, self.header = "header", ""
            return []
        if marker in (END, RETURN, CALL):
            events = self._close_call(marked=True) if self.state == "body" else []
            self.state = "between"
            return events
        return self._text(marker) if self.state == "body" else []  # stray markers in a body are text

    def _open_body(self) -> list[Event]:
        channel = _CHANNEL_NAME.search(self.header)
        recipient = _RECIPIENT.search(self.header)
        self.state, self.header = "body", ""
        if recipient and recipient.group(1).startswith(FUNCTIONS) and self.parses_calls:
            self.kind, self.call_body, self.num_sent = "call", "", 0
            self.num_calls += 1
            return [CallStart(self.num_calls - 1, recipient.group(1).removeprefix(FUNCTIONS))]
        self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        return []

    def _arguments(self, closing: bool, marked: bool = False) -> list[Event]:
        """The open call's arguments not yet out. Held while they may still read `null`:
        a call of none goes out as `{}`, as in the JSON styles (json_calls.py), since a
        client reads "null" as None and cannot call a function with it. A body of nothing
        is none only where a marker closed it; where the reply just ended, max_tokens may
        have cut it before its first character, and it stays a call cut short."""
        body, index = self.call_body, self.num_calls - 1
        if self.num_sent == 0:
            if not closing and "null".startswith(body.strip()):
                return []
            if closing and self._is_none(marked):
                self.num_sent = len(body)
                return [CallArguments(index, "{}")]
        fragment, self.num_sent = body[self.num_sent :], len(body)
        return [CallArguments(index, fragment)] if fragment else []

    def _is_none(self, marked: bool) -> bool:
        return means_no_arguments(self.call_body) and (marked or bool(self.call_body.strip()))

    def _close_call(self, marked: bool) -> list[Event]:
        if self.kind != "call":
            return []
        events = self._arguments(closing=True, marked=marked)
        if not self._is_none(marked) and not _is_arguments(self.call_body):
            events.append(CallCutShort(self.num_calls - 1, self.call_body))
        return events


def _partial_marker_start(text: str) -> int:
    """Where a possible marker begins at the end of `text` (a marker arrives whole from
    the detokenizer, but a stop string's held text may cut one), else len(text)."""
    at = text.rfind("<|")
    if at >= 0 and "|>" not in text[at:] and len(text) - at < max(map(len, MARKERS)):
        return at
    return len(text) - 1 if text.endswith("<") else len(text)


def _may_begin_header(text: str) -> bool:
    """Whether text at the very start of a reply reads as a header (a role or a
    recipient before its channel) rather than content."""
    stripped = text.lstrip()
    # A prefix of one counts too: the detokenizer may hand over " to" before "=functions".
    return any(stripped.startswith(head) or head.startswith(stripped) for head in ("assistant", "to=", "<|"))


def _is_arguments(text: str) -> bool:
    """Whether a call's body is arguments: a JSON object (OpenAI's `arguments`), not a
    bare value, nor NaN or Infinity that strict JSON readers refuse."""
    try:
        return isinstance(strict_json(text), dict)
    except (ValueError, RecursionError):
        return False
