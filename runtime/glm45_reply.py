"""GLM-4.5's, GLM-4.6's and GLM-4.7's tool calls: a name, then key and value tags.

Their chat templates teach the model (GLM-4.5 and 4.6 with the newlines, GLM-4.7 and
GLM-4.7-Flash without them)

    Let me check.
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name runs from `<tool_call>` to the first newline or tag; blanks between the tags
are markup. A value is the text between `<arg_value>` and `</arg_value>` as written
(the templates write a string raw, with nothing around it, and any other value as its
JSON), given its JSON type by the tool's schema as Qwen3-Coder's parameters are
(runtime/qwen3_coder_reply.py). The six tags, as `<think>` and `</think>`, are added
tokens of GLM's tokenizer (not special: decoding keeps them).

`KeyValueCallParser` turns the text, fed in any split, into the events of
runtime/tools.py as Qwen3-Coder's parser does: content as it grows, a call's name once
it ends, its arguments as a JSON object growing a pair at a time as each value closes,
`}` at `</tool_call>`. A key named twice keeps its first value, one with no name or no
value is dropped, text between pairs is dropped, and a `<tool_call>` followed by no
name is content as written; a reply that ends inside a call ends in `CallCutShort`.
"""

from __future__ import annotations

import json

from runtime.qwen3_coder_reply import XML_NAME_LIMIT, parameter_value
from runtime.tools import (
    CALL_END_TAG,
    CALL_TAG,
    CallArguments,
    CallCutShort,
    CallStart,
    Content,
    Event,
    marker_prefix_length,
)

import attrs

ARG_KEY, ARG_KEY_END = "<arg_key>", "</arg_key>"
ARG_VALUE, ARG_VALUE_END = "<arg_value>", "</arg_value>"
GLM45_TAGS = (CALL_TAG, CALL_END_TAG, ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END)
_BLANKS = " \t\r\n"


@attrs.define
class KeyValueCallParser:
    """One reply's text -> events, given the offered tools' parameter types
    (`parameter_types` of runtime/qwen3_coder_reply.py)."""

    types: dict[str, dict[str, frozenset[str]]] = attrs.Factory(dict)
    # text | name (past <tool_call>) | pairs (in a call) | key (past <arg_key>)
    # | between (past </arg_key>) | value (past <arg_value>)
    state: str = "text"
    pending: str = ""  # text not yet consumed
    searched: int = 0  # pending holds no closing tag before this
    num_calls: int = 0
    call_text: list[str] = attrs.Factory(list)  # the current call's text consumed, from its name
    function: str = ""
    key: str = ""
    sent: set[str] = attrs.Factory(set)  # the current call's keys reported

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        return self._scan(is_final=False)

    def finish(self) -> list[Event]:
        events = self._scan(is_final=True)
        rest, self.pending = self.pending, ""
        if self.state == "text":
            events += _content(rest)
        elif self.state != "name":  # a name that never ended went out as text in _name
            events.append(CallCutShort(self.num_calls, "".join(self.call_text) + rest))
        self.state = "text"
        return events

    def _scan(self, is_final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            step = getattr(self, f"_{self.state}")(is_final)
            if step is None:
                return events
            events += step

    def _consume(self, size: int) -> str:
        taken, self.pending, self.searched = self.pending[:size], self.pending[size:], 0
        if self.state != "text":
            self.call_text.append(taken)
        return taken

    def _text(self, is_final: bool) -> list[Event] | None:
        at = self.pending.find(CALL_TAG)
        if at < 0:  # hold back a tail that may begin a marker
            keep = 0 if is_final else marker_prefix_length(self.pending, CALL_TAG)
            return _content(self._consume(len(self.pending) - keep)) or None
        events = _content(self._consume(at))
        self.pending, self.state, self.call_text = self.pending[len(CALL_TAG) :], "name", []
        return events

    def _name(self, is_final: bool) -> list[Event] | None:
        # GLM-4.5's ends at a newline, GLM-4.7's at its first tag (or `</tool_call>`).
        found = (self.pending.find(stop, 0, XML_NAME_LIMIT + 1) for stop in ("\n", "<"))
        ends = [at for at in found if at >= 0]
        if not ends and len(self.pending) <= XML_NAME_LIMIT and not is_final:
            return None  # may still end
        end = min(ends) if ends else len(self.pending)
        name = self.pending[:end].strip()
        if not name or any(c in _BLANKS for c in name) or not ends:
            # No call: the text as written (a name too long, never ended, or none at all).
            self.state = "text"
            return _content(CALL_TAG)
        self._consume(end)
        self.function, self.sent, self.state = name, set(), "pairs"
        return [CallStart(self.num_calls, name)]

    def _pairs(self, is_final: bool) -> list[Event] | None:
        self._consume(len(self.pending) - len(self.pending.lstrip(_BLANKS)))
        if self.pending.startswith(ARG_KEY):
            self._consume(len(ARG_KEY))
            self.state = "key"
            return []
        if self.pending.startswith(CALL_END_TAG):
            self._consume(len(CALL_END_TAG))
            events: list[Event] = [CallArguments(self.num_calls, "}" if self.sent else "{}")]
            self.num_calls, self.state, self.call_text = self.num_calls + 1, "text", []
            return events
        if not self.pending or any(tag.startswith(self.pending) for tag in (ARG_KEY, CALL_END_TAG)):
            return None
        # Stray text between pairs: the call has gone out, so it is dropped, up to the
        # next "<" that may begin a tag.
        at = self.pending.find("<", 1)
        self._consume(len(self.pending) if at < 0 else at)
        return []

    def _key(self, is_final: bool) -> list[Event] | None:
        at = self.pending.find(ARG_KEY_END, self.searched)
        if at < 0:
            self.searched = max(0, len(self.pending) - len(ARG_KEY_END) + 1)
            return None
        self.key, self.state = self._consume(at).strip(), "between"
        self._consume(len(ARG_KEY_END))
        return []

    def _between(self, is_final: bool) -> list[Event] | None:
        self._consume(len(self.pending) - len(self.pending.lstrip(_BLANKS)))
        if self.pending.startswith(ARG_VALUE):
            self._consume(len(ARG_VALUE))
            self.state = "value"
            return []
        if not self.pending or ARG_VALUE.startswith(self.pending):
            return None
        self.state = "pairs"  # a key with no value: dropped
        return []

    def _value(self, is_final: bool) -> list[Event] | None:
        # Searched from where the last search left off: a long value is not rescanned.
        at = self.pending.find(ARG_VALUE_END, self.searched)
        if at < 0:
            self.searched = max(0, len(self.pending) - len(ARG_VALUE_END) + 1)
            return None
        text = self._consume(at)
        self._consume(len(ARG_VALUE_END))
        self.state = "pairs"
        if not self.key or self.key in self.sent:
            return []
        value = parameter_value(text, self.types.get(self.function, {}).get(self.key, frozenset()))
        pair = f"{json.dumps(self.key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        fragment = (", " if self.sent else "{") + pair
        self.sent.add(self.key)
        return [CallArguments(self.num_calls, fragment)]


def key_value_call(name: str, arguments: object) -> str:
    """A call as GLM-4.5's template writes one: a string value as its text, others as
    JSON. Arguments that are no object (text a client sent that is no JSON) go in as
    written."""
    lines = [f"{CALL_TAG}{name}"]
    if not isinstance(arguments, dict) and arguments not in (None, ""):
        lines.append(arguments if isinstance(arguments, str) else json.dumps(arguments))
    for key, value in (arguments.items() if isinstance(arguments, dict) else ()):
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        lines += [f"{ARG_KEY}{key}{ARG_KEY_END}", f"{ARG_VALUE}{text}{ARG_VALUE_END}"]
    return "\n".join([*lines, CALL_END_TAG])


def _content(text: str) -> list[Event]:
    return [Content(text)] if text else []
