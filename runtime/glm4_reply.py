"""GLM-4-0414's and GLM-Z1's tool calls: a reply whose first line is a tool's name.

Their chat template shows the model a call as an assistant turn with the tool's name
as its `metadata` and the arguments' JSON as its text,

    <|assistant|>get_weather
    {"city": "Paris"}

and a text reply as `<|assistant|>` and a newline, then the text; the model ends a call
with `<|observation|>` (one of its end tokens) and reads the result in an `observation`
turn. There is no marker: a reply is a call when its first line is the name of a tool
the request offers and the rest is one JSON object (blanks around them aside), as
LLaMA-Factory's and ms-swift's GLM-4 readers take it, and content otherwise. Text that
could still become such a line waits; the call is reported whole once its JSON closes,
and one the reply ends inside of (max_tokens) is content as written.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from runtime.call_values import strict_json
from runtime.json_ends import ValueEnd
from runtime.tools import CallArguments, CallStart, Content, Event

import attrs

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

_BLANKS = " \t\r\n"


def tool_names(tools: Sequence[Mapping[str, object]]) -> frozenset[str]:
    """The names of the request's tools (OpenAI's `{"type": "function", "function": {...}}`)."""
    names = set()
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return frozenset(names)


@attrs.define
class FirstLineCall:
    """The reply's text, fed in any split, as content or one call."""

    names: frozenset[str]  # the request's tools: a first line naming none is text
    pending: str = ""  # text not yet reported
    state: str = "undecided"  # then "text", "arguments" (past a tool's name) or "called"
    name: str = ""
    read: int = 0  # characters of `pending` read for the first line
    name_at: int | None = None  # where the first line's text begins, past blanks, once it does
    name_end: int | None = None  # ... and ends, at a blank
    arguments_at: int = 0  # where the arguments' JSON may begin in `pending`: past blanks read
    value_end: ValueEnd | None = None  # where it ends, once it does

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        return self._scan(is_final=False)

    def finish(self) -> list[Event]:
        return self._scan(is_final=True)

    def _scan(self, is_final: bool) -> list[Event]:
        if self.state == "undecided":
            self._read_first_line(is_final)
        if self.state == "arguments":
            return self._arguments(is_final)
        if self.state == "undecided":
            return []
        return self._take_text()  # text, or what follows the call

    def _read_first_line(self, is_final: bool) -> None:
        # Read from where the last feed stopped, each character once: the blanks before
        # a name and after it, stripped again at every token, made a run of blank tokens
        # cost O(n^2) (20,000 of them, ~1.5 s of the event loop).
        while self.read < len(self.pending):
            character = self.pending[self.read]
            self.read += 1
            if character not in _BLANKS:
                if self.name_end is not None:  # text past a blank: no name (none holds one)
                    self.state = "text"
                    return
                self.name_at = self.read - 1 if self.name_at is None else self.name_at
            elif self.name_at is not None and self.name_end is None:
                self.name_end = self.read - 1  # GLM-Z1-Rumination's template writes a blank here
            if character == "\n" and self.name_end is not None:
                break
        else:  # no line yet: a name may still be written, unless none begins so
            if self.name_at is None:
                self.state = "text" if is_final else self.state
                return
            written = self.pending[self.name_at : self.name_end]
            is_whole = self.name_end is not None
            may_be_name = written in self.names if is_whole else any(n.startswith(written) for n in self.names)
            if is_final or not may_be_name:
                self.state = "text"
            return
        name = self.pending[self.name_at : self.name_end]
        if name not in self.names:
            self.state = "text"
            return
        self.state, self.name, self.arguments_at = "arguments", name, self.read

    def _arguments(self, is_final: bool) -> list[Event]:
        start = self.arguments_at
        while start < len(self.pending) and self.pending[start] in _BLANKS:
            start += 1
        self.arguments_at = start  # blanks read once, not again at every token
        if start == len(self.pending) and not is_final:
            return []
        if start == len(self.pending) or self.pending[start] != "{":
            return self._as_text()
        if self.value_end is None or self.value_end.start != start:
            self.value_end = ValueEnd(start)
        end = self.value_end.find(self.pending, is_final)
        if end is None:
            return self._as_text() if is_final else []  # cut short: the text as written
        try:  # strictly: NaN or 1e999, re-written by json.dumps, would go out as no JSON
            arguments = strict_json(self.pending[start:end])
        except (ValueError, RecursionError):
            return self._as_text()
        if not isinstance(arguments, dict):
            return self._as_text()
        text = json.dumps(arguments, ensure_ascii=False)
        self.state, self.pending = "called", self.pending[end:]
        return [CallStart(0, self.name), CallArguments(0, text), *self._scan(is_final)]

    def _as_text(self) -> list[Event]:
        self.state = "text"
        return self._take_text()

    def _take_text(self) -> list[Event]:
        text, self.pending = self.pending, ""
        return [Content(text)] if text else []
