"""Qwen3-Coder's and Qwen3.5's tool calls: XML-like blocks whose parameters are text.

Their chat templates teach the model

    Let me check.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between its `<parameter=NAME>` and the next `</parameter>`, less
the one newline the template writes after the first and before the second (as vLLM's
`qwen3_coder` parser and llama.cpp strip them). It is given its JSON type by the
tool's schema for that parameter (`parameter_value`): a string stays the text, other
types are read as JSON, then as a Python literal (the Qwen3-Coder template writes
non-string values with Jinja's `string`, so a model may answer `True` or `{'a': 1}`),
and what reads as neither stays the text.

`XmlCallParser` turns the text, fed in any split, into the events of runtime/tools.py:
content as it grows, a call's name once its `<function=NAME>` closes, its arguments as
a JSON object that grows a parameter at a time as each closes (`{"city": "Paris"`,
then `, "days": 3`, then `}` at `</function>`). A parameter named twice keeps its first
value (what streamed cannot be taken back), and one with no name is dropped. Text in a
`<tool_call>` block that is no `<function=` is content as written; a reply that ends
inside a call's parameters ends in `CallCutShort`, as a Hermes call does. Each
character is scanned once: the end of a long value is searched from where the last
search stopped.

Seed-OSS writes the same calls in blocks of its own, `<seed:tool_call>` and
`</seed:tool_call>` (its `seed_oss` style): the block's tags are the parser's and
`xml_call`'s to be given.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from runtime.call_values import strict_json
from runtime.tools import (
    HERMES_TAGS,
    CallArguments,
    CallCutShort,
    CallStart,
    Content,
    Event,
    marker_prefix_length,
)

import attrs

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# A name runs to its ">": one longer than this, or broken by a newline or "<", is no
# name, so a stray "<function=" in text is not held to the end of the reply.
XML_NAME_LIMIT = 256
_JSON_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")


def value_types(
    schema: object, root: object = None, depth: int = 0, refs: dict[str, frozenset[str]] | None = None
) -> frozenset[str]:
    """The JSON types a parameter's schema admits, from its `type`, its `enum` or
    `const` values, the members of its `anyOf` / `oneOf` (any) and `allOf` (all), and
    a `$ref` into `root`, the tool's parameters ("#/$defs/Item", as Pydantic writes a
    nested model); empty where it says nothing (no schema, `{}`).

    `refs` holds the types of each ref read so far, so each is read once: read again
    wherever it was named, an anyOf of refs back to itself took exponential time (20 of
    them, under 1 kB of request, 0.7 s). One still being read (a loop) adds nothing."""
    if not isinstance(schema, Mapping) or depth > 8:
        return frozenset()
    refs = {} if refs is None else refs
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    types = {k for k in kinds if k in _JSON_TYPES}
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    values += [schema["const"]] if "const" in schema else []
    types |= {_type_of(v) for v in values}
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        for member in members if isinstance(members, list) else ():
            types |= value_types(member, root, depth + 1, refs)
    members = schema.get("allOf")
    for member in members if isinstance(members, list) else ():
        if member_types := value_types(member, root, depth + 1, refs):
            types = (types & member_types) if types else set(member_types)
    if isinstance(ref := schema.get("$ref"), str) and ref.startswith("#/"):
        if ref not in refs:
            refs[ref] = frozenset()  # while it is read: a loop back to it adds nothing
            target = root
            for part in ref[2:].split("/"):
                target = target.get(part) if isinstance(target, Mapping) else None
            refs[ref] = value_types(target, root, depth + 1, refs)
        types |= refs[ref]
    return frozenset(types)


def _type_of(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "null" if value is None else "array" if isinstance(value, list) else "object"


def is_text(types: frozenset[str]) -> bool:
    """Whether a value of these types is written as plain text: a string's (or one the
    schema says nothing of, as vLLM takes it)."""
    return types <= {"string", "null"} or "string" in types


def parameter_value(text: str, types: frozenset[str]) -> object:
    """A parameter's text as the JSON value its schema's `types` call for."""
    if "null" in types and text.strip() in ("null", "None"):
        return None
    if not types or types <= {"string", "null"}:
        return text
    value = _literal(text)
    if value is _NOT_READ or ("string" in types and _type_of(value) not in types):
        return text  # where a string may be, what reads as none of the other types
    return value


_NOT_READ = object()


def _literal(text: str) -> object:
    """`text` as JSON, else as a Python literal that is JSON (`True`, `{'a': None}`),
    else _NOT_READ."""
    try:
        return strict_json(text)
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(text.strip())
        json.dumps(value, allow_nan=False)  # a set, bytes, or inf is no JSON
    # MemoryError: CPython's parser raises it for nesting past its stack.
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return _NOT_READ
    if isinstance(value, float) and not math.isfinite(value):
        return _NOT_READ
    return value


def parameter_types(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, frozenset[str]]]:
    """Function name -> parameter name -> the types its schema admits."""
    types: dict[str, dict[str, frozenset[str]]] = {}
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties")
        if isinstance(properties, Mapping):
            types[function["name"]] = {name: value_types(s, parameters) for name, s in properties.items()}
    return types


@attrs.define
class XmlCallParser:
    """One reply's text -> events, given the offered tools' parameter types."""

    types: dict[str, dict[str, frozenset[str]]] = attrs.Factory(dict)
    tags: tuple[str, str] = HERMES_TAGS  # the block's opening and closing tags
    # text | block (in <tool_call>) | name (after <function=) | params (in a function)
    # | parameter (after <parameter=) | value (in a parameter)
    state: str = "text"
    pending: str = ""  # text not yet consumed
    searched: int = 0  # pending holds no closing marker before this
    blank: str = ""  # blanks consumed in a block before anything in it was decided
    block_calls: int = 0  # calls in the current <tool_call> block
    num_calls: int = 0
    call_text: list[str] = attrs.Factory(list)  # the current call's text consumed
    function: str = ""
    parameter: str = ""
    sent: set[str] = attrs.Factory(set)  # the current call's parameters reported

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        return self._scan()

    def finish(self) -> list[Event]:
        events = self._scan()
        rest, self.pending = self.pending, ""
        if self.state == "text":
            events += _content(rest)
        elif self.state == "name":  # its name never closed: text that never became a call
            events += _content(FUNCTION + rest)
        elif self.state in ("params", "parameter", "value"):
            events.append(CallCutShort(self.num_calls, "".join(self.call_text) + rest))
        # In a block, what is left is blanks or a marker begun: markup, not content.
        self.state = "text"
        return events

    def _scan(self) -> list[Event]:
        events: list[Event] = []
        while True:
            step = getattr(self, f"_{self.state}")()
            if step is None:
                return events
            events += step

    def _consume(self, size: int) -> str:
        taken, self.pending, self.searched = self.pending[:size], self.pending[size:], 0
        if self.state in ("params", "parameter", "value"):
            self.call_text.append(taken)
        return taken

    def _text(self) -> list[Event] | None:
        opening = self.tags[0]
        at = self.pending.find(opening)
        if at < 0:  # hold back a tail that may begin a marker
            keep = marker_prefix_length(self.pending, opening)
            return _content(self._consume(len(self.pending) - keep)) or None
        events = _content(self._consume(at))
        self._consume(len(opening))
        self.state, self.blank, self.block_calls = "block", "", 0
        return events

    def _block(self) -> list[Event] | None:
        head = self.pending.lstrip()
        self.blank += self.pending[: len(self.pending) - len(head)]
        self.pending = head
        if head.startswith(FUNCTION):
            self._consume(len(FUNCTION))
            self.state = "name"
            return []
        closing = self.tags[1]
        if head.startswith(closing):
            self._consume(len(closing))
            self.state = "text"
            return []
        if not head or FUNCTION.startswith(head) or closing.startswith(head):
            return None  # may still be either
        return self._stray("")

    def _stray(self, markup: str) -> list[Event]:
        """Text in a block that is no call: content as written, from the block's tag
        when the block holds no call."""
        opening = self.tags[0] + self.blank if self.block_calls == 0 else ""
        self.state = "text"
        return _content(opening + markup)

    def _name(self) -> list[Event] | None:
        name = self._tag_name()
        if name is None:
            return None
        # A newline is no part of one, around it too: while ">" was still to come it
        # broke the name, so split there the text read as text and whole as a call.
        # A blank one (stripped, "") is none either: it was a call no client can run.
        if not name.strip() or "\n" in name or any(c.isspace() for c in name.strip()) or "<" in name:
            return self._stray(FUNCTION)
        self._consume(len(name) + 1)
        self.function, self.sent, self.state = name.strip(), set(), "params"
        self.call_text = [FUNCTION + name + ">"]
        return [CallStart(self.num_calls, self.function)]

    def _tag_name(self) -> str | None:
        """The name up to ">" once it closes; "<" where no name can close any more;
        None while it may."""
        at = self.pending.find(">", 0, XML_NAME_LIMIT + 1)
        if at >= 0:
            return self.pending[:at]
        head = self.pending[:XML_NAME_LIMIT]
        broken = "\n" in head or "<" in head or len(self.pending) > XML_NAME_LIMIT
        return "<" if broken else None

    def _params(self) -> list[Event] | None:
        head = self.pending.lstrip()
        self._consume(len(self.pending) - len(head))
        if head.startswith(PARAMETER):
            self._consume(len(PARAMETER))
            self.state = "parameter"
            return []
        # `</tool_call>` where `</function>` belongs closes both, as vLLM's parser reads a
        # call that lacks it: otherwise the rest of the reply was stray text, dropped.
        for closing, after in ((FUNCTION_END, "block"), (self.tags[1], "text")):
            if head.startswith(closing):
                self._consume(len(closing))
                events: list[Event] = [CallArguments(self.num_calls, "}" if self.sent else "{}")]
                self.num_calls, self.block_calls, self.state = self.num_calls + 1, self.block_calls + 1, after
                self.blank, self.call_text = "", []
                return events
        if not head or any(m.startswith(head) for m in (PARAMETER, FUNCTION_END, self.tags[1])):
            return None
        # Stray text between parameters: the call has gone out, so it is dropped, up to
        # the next "<" that may begin a marker.
        at = head.find("<", 1)
        self._consume(len(head) if at < 0 else at)
        return []

    def _parameter(self) -> list[Event] | None:
        name = self._tag_name()
        if name is None:
            return None
        if "<" in name or "\n" in name:  # no name: the text is stray, as between parameters
            self.state = "params"
            return []
        self._consume(len(name) + 1)
        self.parameter, self.state = name.strip(), "value"
        return []

    def _value(self) -> list[Event] | None:
        # Searched from where the last search left off: a long value is not rescanned.
        at = self.pending.find(PARAMETER_END, self.searched)
        if at < 0:
            self.searched = max(0, len(self.pending) - len(PARAMETER_END) + 1)
            return None
        text = self._consume(at)
        self._consume(len(PARAMETER_END))
        self.state = "params"
        text = text.removeprefix("\n").removesuffix("\n")
        name = self.parameter
        if not name or name in self.sent:
            return []
        types = self.types.get(self.function, {}).get(name, frozenset())
        value = parameter_value(text, types)
        pair = f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        fragment = (", " if self.sent else "{") + pair
        self.sent.add(name)
        return [CallArguments(self.num_calls, fragment)]


def xml_call(name: str, arguments: object, tags: tuple[str, str] = HERMES_TAGS) -> str:
    """A call as the templates write one, in a block of `tags`: a string value as its
    text, others as JSON. Arguments that are no object (text a client sent that is no
    JSON) go in as written."""
    lines = [tags[0], f"{FUNCTION}{name}>"]
    if not isinstance(arguments, Mapping) and arguments not in (None, ""):
        lines.append(arguments if isinstance(arguments, str) else json.dumps(arguments))
    for key, value in (arguments.items() if isinstance(arguments, Mapping) else ()):
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        lines += [f"{PARAMETER}{key}>", text, PARAMETER_END]
    return "\n".join([*lines, FUNCTION_END, tags[1]])


def _content(text: str) -> list[Event]:
    return [Content(text)] if text else []
