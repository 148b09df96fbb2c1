"""Gemma 4's replies: its thinking, its answer and its tool calls.

Its chat template teaches the model this markup (tokens of its vocabulary, which a
chat request to such a model keeps in its text: actors/admission.py):

    <|channel>thought
    The user asks ...<channel|>Paris is sunny.
    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

A `<|channel>` block is reasoning (its first line names the channel: "thought");
the rest is the answer, or calls. A call's arguments are Gemma's own notation, not
JSON: keys bare, strings between `<|"|>` marks, numbers, `true`/`false`/`null`,
`{...}` and `[...]` as in JSON. After its calls the model writes `<|tool_response>`
and waits: that token ends the reply (an end-of-turn token, as `<turn|>` is).

`Gemma4Parser` turns the text, fed in any split, into the events of runtime/tools.py:
reasoning as it grows, content as it grows, and each call whole once it closes, its
arguments as JSON. A call that does not parse, or that the reply ends inside of, is
the text the model wrote.
"""

from __future__ import annotations

import json
import re

from runtime.call_values import strict_json
from runtime.tools import (
    CallArguments,
    CallStart,
    Content,
    Event,
    Reasoning,
    marker_prefix_length,
)

import attrs

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
MARKERS = (CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN, CALL_CLOSE)
_CALL = re.compile(r"\s*call:([^{}\s]+)\s*(\{.*\})\s*\Z", re.DOTALL)
_BARE = re.compile(r"[^,:{}\[\]\s]+")


@attrs.define
class Gemma4Parser:
    """One reply's text -> events. `parses_calls`: calls are reported (the request
    offered tools); otherwise they are content, as written."""

    parses_calls: bool = True
    state: str = "content"  # content | channel_name | reasoning | call
    pending: str = ""  # text not yet reported
    call: str = ""  # the open call's text, past its marker
    num_calls: int = 0

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        return self._scan(is_final=False)

    def finish(self) -> list[Event]:
        events = self._scan(is_final=True)
        if self.state == "call":  # cut short: the call as the model wrote it
            events.append(Content(CALL_OPEN + self.call))
        elif self.pending and self.state != "channel_name":
            events.append(Reasoning(self.pending) if self.state == "reasoning" else Content(self.pending))
        self.pending, self.call, self.state = "", "", "content"
        return events

    def _scan(self, is_final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self.state == "channel_name":  # the channel's name is its first line
                end = self.pending.find("\n")
                closed_at = self.pending.find(CHANNEL_CLOSE)
                if closed_at >= 0 and (end < 0 or closed_at < end):  # an empty channel: "<|channel><channel|>"
                    self.pending, self.state = self.pending[closed_at:], "reasoning"
                    continue
                if end < 0:
                    return events
                self.pending, self.state = self.pending[end + 1 :], "reasoning"
                continue
            closing = {"reasoning": CHANNEL_CLOSE, "call": CALL_CLOSE}.get(self.state)
            openings = (CHANNEL_OPEN, CALL_OPEN) if self.parses_calls else (CHANNEL_OPEN,)
            markers: tuple[str, ...] = openings if closing is None else (closing,)
            at, marker = _first(self.pending, markers)
            if at < 0:  # all of it but a tail that may begin a marker
                keep = 0 if is_final else max(marker_prefix_length(self.pending, m) for m in markers)
                events += self._emit(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return events
            events += self._emit(self.pending[:at])
            self.pending = self.pending[at + len(marker) :]
            if marker == CHANNEL_OPEN:
                self.state = "channel_name"
            elif marker == CALL_OPEN:
                self.state = "call"
            elif marker == CALL_CLOSE:
                events += self._close_call()
            else:
                self.state = "content"

    def _emit(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.state == "reasoning":
            return [Reasoning(text)]
        if self.state == "call":
            self.call += text
            return []
        return [Content(text)]

    def _close_call(self) -> list[Event]:
        self.state, text, self.call = "content", self.call, ""
        parsed = _parsed_call(text)
        if parsed is None:
            return [Content(CALL_OPEN + text + CALL_CLOSE)]
        name, arguments = parsed
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [CallStart(index, name), CallArguments(index, json.dumps(arguments, ensure_ascii=False))]


def _parsed_call(text: str) -> tuple[str, dict[str, object]] | None:
    """`call:NAME{...}` -> (NAME, its arguments), or None if it is not that."""
    match = _CALL.match(text)
    if match is None:
        return None
    try:
        arguments, end = _value(match.group(2), 0)
    except (ValueError, IndexError, RecursionError):
        return None
    if end != len(match.group(2)) or not isinstance(arguments, dict):
        return None
    return match.group(1), arguments


def _value(text: str, at: int) -> tuple[object, int]:
    """The Gemma-notation value at `at` -> (its Python value, where it ends)."""
    at = _skip_blanks(text, at)
    if text.startswith(QUOTE, at):
        end = text.index(QUOTE, at + len(QUOTE))
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text[at] == "{":
        return _container(text, at + 1, "}", is_object=True)
    if text[at] == "[":
        return _container(text, at + 1, "]", is_object=False)
    match = _BARE.match(text, at)
    if match is None:
        raise ValueError(f"no value at {at}")
    word = match.group()
    if word in ("true", "false", "null"):
        return json.loads(word), match.end()
    number = strict_json(word)  # a ValueError unless a JSON number a float can hold
    if not isinstance(number, int | float):
        raise ValueError(word)
    return number, match.end()


def _container(text: str, at: int, close: str, is_object: bool) -> tuple[object, int]:
    items: dict[str, object] | list[object] = {} if is_object else []
    at = _skip_blanks(text, at)
    if text[at] == close:
        return items, at + 1
    while True:
        if isinstance(items, dict):
            key, at = _key(text, at)
            at = _skip_blanks(text, at)
            if text[at] != ":":
                raise ValueError(f"no ':' at {at}")
            items[key], at = _value(text, at + 1)
        else:
            value, at = _value(text, at)
            items.append(value)
        at = _skip_blanks(text, at)
        if text[at] == close:
            return items, at + 1
        if text[at] != ",":
            raise ValueError(f"no ',' at {at}")
        at = _skip_blanks(text, at + 1)


def _key(text: str, at: int) -> tuple[str, int]:
    """A key: bare, or quoted as a string is (the template's nested keys may be)."""
    if text.startswith(QUOTE, at):
        end = text.index(QUOTE, at + len(QUOTE))
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    match = _BARE.match(text, at)
    if match is None:
        raise ValueError(f"no key at {at}")
    return match.group(), match.end()


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    found = [(text.find(m), m) for m in markers if m in text]
    return min(found) if found else (-1, "")


def gemma4_arguments(arguments: object) -> str:
    """JSON arguments in Gemma's notation (the template's `format_argument`, keys bare
    where a bare key reads back whole: `gemma4_key`)."""
    if isinstance(arguments, str):
        return QUOTE + arguments + QUOTE
    if isinstance(arguments, bool):
        return "true" if arguments else "false"
    if isinstance(arguments, dict):
        pairs = (f"{gemma4_key(k)}:{gemma4_arguments(v)}" for k, v in sorted(arguments.items()))
        return "{" + ",".join(pairs) + "}"
    if isinstance(arguments, list):
        return "[" + ",".join(gemma4_arguments(v) for v in arguments) + "]"
    return json.dumps(arguments)


def gemma4_key(key: str) -> str:
    """A key in Gemma's notation: bare, as the template writes keys, unless a bare key
    would not read back whole (a space, ":", ",", a bracket, or nothing at all): then
    quoted, as a string is, which the parser takes too."""
    return key if _BARE.fullmatch(key) else QUOTE + key + QUOTE
