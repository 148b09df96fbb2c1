"""Tool calls written as JSON objects, `{"name": ..., "arguments": {...}}` (or
`"parameters"`), as Hermes, Llama 3's, Mistral's list form, Granite's, Nemotron's, OLMo 3's
and LFM2's JSON lists write them: one after another in a growing text (`JsonCalls`,
streamed), or a whole list (`json_list_calls`, `whole_call`). The styles' markers around
them are runtime/tools.py's and runtime/marked_calls_reply.py's."""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.call_values import strict_json
from runtime.json_constants import NonFiniteAsNull, with_non_finite_as_null
from runtime.json_ends import ValueEnd
from runtime.tool_events import CallArguments, CallCutShort, CallStart, Content, Event

import attrs

# A call object whose name comes first, up to where its arguments' value begins.
_NAME_FIRST = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


@attrs.define
class JsonCalls:
    """Calls written as JSON objects one after another (separated by `;` or blanks), in a
    growing body of text; reports each name once known and its arguments as they grow.
    A call may begin with `leading_tag`, which is markup, not text."""

    leading_tag: str = ""
    num_calls: int = 0  # calls started before the current body
    position: int = 0  # where the next call object begins in the body
    name_seen: bool = False  # the current call's name was reported
    arguments_at: int = 0  # where its arguments' text begins in the body
    num_sent: int = 0  # characters of its arguments reported
    call_end: ValueEnd | None = None  # where the current call object ends, once it does
    arguments_end: ValueEnd | None = None  # ... and its arguments' value
    # NaN and Infinity, which Python's json takes but no client's JSON reader does, go
    # out as null: streamed as they grow, the arguments cannot be taken back.
    literals: NonFiniteAsNull = attrs.Factory(NonFiniteAsNull)

    def update(self, body: str, is_final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            start = self._next_start(body)
            if start >= len(body):
                return events
            if not self.name_seen and (named := _name_first(body, start)):
                events.append(CallStart(self.num_calls, named[0]))
                self.name_seen, self.arguments_at = True, named[1]
            if self.name_seen:
                events += self._arguments(body, is_final)
            if self.call_end is None or self.call_end.start != start:
                self.call_end = ValueEnd(start)
            whole = self.call_end.find(body, is_final)
            if whole is None:  # the call is not complete yet
                if is_final and not self.name_seen:
                    events.append(Content(body[start:]))  # text that never became a call
                    self.position = len(body)
                return events
            is_call = self.name_seen
            if not self.name_seen:  # a call whose keys came in another order: reported whole
                raw = body[start:whole]
                # Strictly: re-written by json.dumps, NaN or 1e999 would go out as no JSON.
                whole_events = whole_call(self.num_calls, decoded_json(raw), raw)
                is_call = isinstance(whole_events[0], CallStart)  # else JSON left as text
                events += whole_events
            self.num_calls += is_call  # indexes count calls only: 0, 1, ... as OpenAI's
            self.position, self.name_seen, self.num_sent = whole, False, 0
            self.call_end = self.arguments_end = None
            self.literals = NonFiniteAsNull()

    def cut_short(self, body: str) -> CallCutShort | None:
        """After the final update: the call the reply ended in, if its arguments are not
        whole. One whose arguments are whole stands, though its `}` never came."""
        if not self.name_seen or self.call_end is None:
            return None
        if self.arguments_end is not None and self.arguments_end.find(body, True) is not None:
            return None
        return CallCutShort(self.num_calls, body[self.call_end.start :])

    def _next_start(self, body: str) -> int:
        """Where the next call begins: past separators and its leading tag. A tag only
        begun waits there, for its JSON cannot start with "<"."""
        start = self.position
        while True:
            while start < len(body) and body[start] in " \t\r\n;":
                start += 1
            if not self.leading_tag or not body.startswith(self.leading_tag, start):
                return start
            start += len(self.leading_tag)

    def _arguments(self, body: str, is_final: bool) -> list[Event]:
        """The current call's arguments text not yet reported. Arguments the model wrote
        as a JSON string (`"arguments": "{\\"a\\": 1}"`) are that string's text, sent
        once it is complete, as `whole_call` reports them when the keys come the other
        way round; a string cut off by the end of the reply is sent as it stands."""
        at = self.arguments_at
        if at == len(body):  # cut where they would begin, by the closing marker: none yet
            return []
        if self.arguments_end is None or self.arguments_end.start != at:
            self.arguments_end = ValueEnd(at)
        end = self.arguments_end.find(body, is_final)
        # A string, or null, NaN or -Infinity (none, as NaN goes out as null): sent
        # whole, once it closes.
        is_held = body[at] in '"nNI-'
        if is_held and end is not None and self.num_sent == 0:
            self.num_sent = end - at
            raw = body[at:end]
            text = with_non_finite_as_null(json.loads(raw) if raw[0] == '"' else raw)
            return [CallArguments(self.num_calls, _as_arguments(text))]
        if is_held and not is_final:
            return []
        known = len(body) if end is None else end
        fragment = body[at + self.num_sent : known]
        self.num_sent += len(fragment)
        text = self.literals.feed(fragment)
        if end is not None or is_final:
            text += self.literals.finish()
        return [CallArguments(self.num_calls, text)] if text else []


def _name_first(body: str, start: int) -> tuple[str, int] | None:
    """A call object's name, and where its arguments begin, when the name comes first;
    None otherwise, or when the name is no JSON string (a bad escape, a raw newline)."""
    match = _NAME_FIRST.match(body, start)
    if match is None:
        return None
    try:
        return json.loads(f'"{match.group(1)}"'), match.end()
    except json.JSONDecodeError:
        return None


def json_list_calls(body: str) -> list[dict[str, Any]] | None:
    """A JSON list of {"name", "arguments"} calls, else None (an item that is no call
    makes the whole list text, as a Python list with one does)."""
    listed = decoded_json(body.strip())
    if not isinstance(listed, list) or not listed:
        return None
    if not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in listed):
        return None
    return listed


def whole_call(index: int, call: object, raw: str = "") -> list[Event]:
    """A parsed call's events; JSON that is not a call stays the text it was (`raw`)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return [Content(raw)]
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # JSON text in a string: as the model wrote it
        text = with_non_finite_as_null(arguments)
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    return [CallStart(index, call["name"]), CallArguments(index, _as_arguments(text))]


def means_no_arguments(text: str) -> bool:
    """Arguments text that says there are none: nothing, or `null` (a model's call of a
    tool without parameters; a client's too)."""
    return text.strip() in ("", "null")


def _as_arguments(text: str) -> str:
    """A call's arguments text as the client gets it: none (`means_no_arguments`) is
    `{}`, OpenAI's object of none. "null" (vLLM's and SGLang's whole reply) reads as
    None, which no client can call a function with (`f(**None)`)."""
    return "{}" if means_no_arguments(text) else text


def decoded_json(text: str) -> object:
    """The JSON value `text` holds, strictly (no NaN), or None."""
    try:
        return strict_json(text)
    except (ValueError, RecursionError):
        return None
