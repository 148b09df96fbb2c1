"""Tools and structured output on the OpenAI wire: the request fields in, tool calls out.

Structured output takes OpenAI's `response_format` (`text`, `json_object`, `json_schema`)
and, as an extension, vLLM's guided-decoding fields: the `structured_outputs` object
(`json`, `regex`, `choice`, `grammar`) or the older top-level `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` (Lark, llguidance's dialect). At most
one of them per request. They apply to chat and completions alike. Bad values raise
RequestError naming the field (a 400 over HTTP).

Tool calls leave as OpenAI's `tool_calls`: streamed, a call's first delta carries its
`id`, `type` and `name` with empty arguments, and the next ones the argument text.
A harmony model's (gpt-oss's), Gemma 4's and a thinking model's (Qwen3's `<think>`,
Magistral's `[THINK]`) replies are parsed on every chat request, tools or not, for
their reasoning, which leaves apart from the content (`Delta.reasoning`).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from typing import Any

from runtime.errors import RequestError
from runtime.grammar import GrammarSpec
from runtime.tools import (
    CallArguments,
    CallCutShort,
    CallStart,
    Content,
    Event,
    Reasoning,
    parser_for,
)

import attrs

from actors.requests import Delta

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *_GUIDED)
MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def structured_output(body: dict[str, Any]) -> GrammarSpec | None:
    """The one grammar `body` asks the output to follow, or None for free text."""
    asked = [name for name in STRUCTURED_FIELDS if body.get(name) is not None]
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        _refuse_unknown_keys(response_format, _RESPONSE_FORMAT_KEYS, "response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        asked.remove("response_format")  # text is no constraint
    if len(asked) > 1:
        raise RequestError(f"give at most one of {', '.join(asked)}", param=asked[1])
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        return _response_format(response_format)
    if name == "structured_outputs":
        options = body[name]
        if not isinstance(options, dict) or len(options) != 1 or next(iter(options)) not in _KINDS:
            raise RequestError(
                "'structured_outputs' must have exactly one of json, regex, choice, grammar",
                param=name,
            )
        ((kind, value),) = options.items()
        return _guided(kind, value, f"structured_outputs.{kind}")
    return _guided(_GUIDED[name], body[name], name)


def _response_format(value: Any) -> GrammarSpec:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind != "json_schema":
        raise RequestError(
            "'response_format.type' must be one of text, json_object, json_schema",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(
            "'response_format.json_schema' must be an object with a 'name'",
            param="response_format.json_schema",
        )
    _refuse_unknown_keys(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema")
    if not isinstance(spec.get("name"), str):
        # Required, as OpenAI's and vLLM's. Any string, as vLLM takes it: the name
        # changes nothing here, and clients send titles ("My schema") and generic
        # pydantic names ("Page[Item]") that OpenAI's pattern would refuse.
        raise RequestError(
            "'response_format.json_schema.name' must be a string",
            param="response_format.json_schema.name",
        )
    if not isinstance(spec.get("strict"), bool | None):
        raise RequestError(
            "'response_format.json_schema.strict' must be a boolean",
            param="response_format.json_schema.strict",
        )
    schema = spec.get("schema", {})  # OpenAI's default: any JSON
    if not isinstance(schema, dict | bool):
        raise RequestError(
            "'response_format.json_schema.schema' must be a JSON schema object",
            param="response_format.json_schema.schema",
        )
    # strict or not, the output follows the schema: llguidance enforces it either way.
    return GrammarSpec("json_schema", json.dumps(schema), "response_format.json_schema.schema")


# OpenAI's keys. Another one was dropped silently: {"type": "json_object", "schema": {...}},
# as some other servers take a schema, gave any JSON object, not one of that schema.
_RESPONSE_FORMAT_KEYS = frozenset({"type", "json_schema"})
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})  # description: a hint
# OpenAI's keys of a function tool. `strict` changes nothing: a forced call follows the
# parameters' schema whatever it says, and an `auto` one is not constrained either way.
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _refuse_unknown_keys(value: dict[str, Any], known: frozenset[str], where: str) -> None:
    if unknown := sorted(key for key in value if key not in known):
        param = f"{where}.{unknown[0][:64]}"
        raise RequestError(f"unknown field '{param}'", param=param, code="unknown_field")


def _guided(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise RequestError(
                    f"'{param}' is not valid JSON: {error.msg}", param=param
                ) from None
            except RecursionError:  # the body's own depth check never saw inside this text
                raise RequestError(f"'{param}' is nested too deeply", param=param) from None
            except ValueError:  # nor its digit check: an integer of more than 4,300 digits
                raise RequestError(
                    f"'{param}' holds a number of too many digits", param=param
                ) from None
        if not isinstance(value, dict | bool):
            raise RequestError(f"'{param}' must be a JSON schema", param=param)
        return GrammarSpec("json_schema", json.dumps(value), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RequestError(f"'{param}' must be a non-empty list of strings", param=param)
        return GrammarSpec("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{param}' must be a non-empty string", param=param)
    return GrammarSpec(_KINDS[kind], value, param)


@attrs.frozen
class ToolRequest:
    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "auto"  # "auto", "none", "required" or "function" (then `name`)
    name: str | None = None
    is_parallel: bool = True  # parallel_tool_calls: false keeps only a reply's first call


def tool_request(body: dict[str, Any]) -> ToolRequest:
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise RequestError(
                f"'{legacy}' is deprecated: send 'tools' and 'tool_choice'", param=legacy
            )
    # [] is no tools, where OpenAI and vLLM answer 400: agent clients send it when
    # they have none to offer (Koog, kimi-cli, LangGraph), and that 400 broke them.
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    first_of_name: dict[str, int] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            function is None
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                param=f"tools[{i}]",
            )
        # A typo'd key was dropped: "paramters" made a tool that takes no parameters.
        _refuse_unknown_keys(tool, _TOOL_KEYS, f"tools[{i}]")
        _refuse_unknown_keys(function, _FUNCTION_KEYS, f"tools[{i}].function")
        if _FUNCTION_NAME.fullmatch(function["name"]) is None:
            # OpenAI's rule. Quotes, newlines or markup in a name ('</tool_call>') break
            # the call format the model writes it in: a forced call came back as text.
            raise RequestError(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'",
                param=f"tools[{i}].function.name",
            )
        if (first := first_of_name.setdefault(function["name"], i)) != i:
            # A call names its tool: of two by one name, which did the model call, and
            # with whose parameters? (Anthropic's and DeepSeek's APIs refuse it too.)
            raise RequestError(
                f"tools[{i}].function.name '{function['name']}' is tools[{first}]'s too: "
                "tool names must be unique",
                param=f"tools[{i}].function.name",
            )
        if not isinstance(parameters := function.get("parameters", {}), dict):
            # Named, not folded into the whole tool's shape: `parameters: null` read as
            # a malformed tool, and the client could not tell which part.
            raise RequestError(
                f"tools[{i}].function.parameters must be a JSON schema object, "
                f"got {json.dumps(parameters)[:100]}",
                param=f"tools[{i}].function.parameters",
            )
        kind = parameters.get("type", "object")
        if kind != "object":
            # OpenAI's rule: arguments are a JSON object. A string schema made forced
            # calls whose `arguments` were no JSON at all (']', '<<=').
            raise RequestError(
                f"tools[{i}].function.parameters must be a JSON schema of type 'object', "
                f"got {json.dumps(kind)}",
                param=f"tools[{i}].function.parameters",
            )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    choice = body.get("tool_choice")
    # As OpenAI: a choice among no tools, or how to call none, is a mistake.
    for field, value in (("tool_choice", choice), ("parallel_tool_calls", parallel)):
        if value is not None and not tools:
            raise RequestError(f"'{field}' is only allowed when 'tools' are specified", param=field)
    names = [tool["function"]["name"] for tool in tools]
    is_parallel = parallel is not False
    if choice is None:
        return ToolRequest(tuple(tools), "auto", is_parallel=is_parallel)
    if choice in ("auto", "none", "required"):
        return ToolRequest(tuple(tools), choice, is_parallel=is_parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise RequestError(
            "'tool_choice' must be auto, none, required or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise RequestError(
            f"tool_choice names '{name[:64]}', which is not in 'tools'", param="tool_choice"
        )
    return ToolRequest(tuple(tools), "function", name, is_parallel)


def new_call_id(style: str) -> str:
    """A fresh id for a call written in `style`. Mistral's templates (Nemo, Small 3.2)
    refuse a chat whose call ids are not 9 letters and digits, so the id of a call made
    here, sent back with its result, must be one: there it is, as vLLM writes them."""
    if style == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.define
class ToolCallStream:
    """Text deltas -> (content, OpenAI `tool_calls` delta items), in `style`'s format.

    Whitespace at the end of the content so far waits for more text: before or after
    a call it is dropped, so `message.content` is null when the reply is only calls. The whole
    response is built by feeding all its text here too (`is_streamed` False), so the
    streamed deltas reassemble to it exactly, but for a call the reply ends inside of
    (max_tokens, a stop string, an EOS): streamed, it went out as it was written, and
    the finish reason is the reply's own ("length", as OpenAI streams one, or "stop";
    never "tool_calls", which told a client to run arguments it cannot read); in the
    whole response its arguments are no JSON, so it is text in `content`, as vLLM
    answers (the calls wait for the end).
    """

    style: str
    is_parallel: bool = True  # False: calls after the first are dropped
    is_streamed: bool = True
    parses_calls: bool = True  # False: harmony's reasoning split alone (no tools offered)
    # The (opening, closing) tags the reply may think between first (runtime/think_reply.py)
    think_tags: tuple[str, str] | None = None
    tools: tuple[dict[str, Any], ...] = ()  # the request's: they type Qwen3-Coder's arguments
    answer_tags: tuple[str, ...] = ()  # text tags around the answer, left out (Granite 3.3's)
    parser: Any = None
    reasoning: str = ""  # harmony's: reasoning text since `take_reasoning` last ran
    ids: list[str] = attrs.Factory(list)
    blank: str = ""  # trailing whitespace held back
    blank_before_call: str = ""  # ... and dropped before the last call began
    held: list[dict[str, Any]] = attrs.Factory(list)  # calls' deltas, when not streamed
    is_cut_short: bool = False  # a streamed call the reply ended inside of

    def __attrs_post_init__(self) -> None:
        self.parser = parser_for(self.style, self.parses_calls, self.think_tags, self.tools, self.answer_tags)

    def take_reasoning(self) -> str:
        text, self.reasoning = self.reasoning, ""
        return text

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self._convert(self.parser.feed(text), is_final=False)
        if self.is_streamed:
            return content, calls
        self.held += calls
        return content, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self._convert(self.parser.finish(), is_final=True)
        if self.is_streamed:
            return content, calls
        calls, self.held = self.held + calls, []
        return content, [call for call in calls if call["index"] < len(self.ids)]

    def finish_reason(self, reason: str) -> str:
        is_whole = self.has_calls and not self.is_cut_short
        return "tool_calls" if is_whole and reason == "stop" else reason

    def _convert(self, events: list[Event], is_final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, calls = "", list[dict[str, Any]]()
        for event in events:
            match event:
                case Content(text):
                    content += self._content(text)
                case Reasoning(text):
                    self.reasoning += text
                case CallStart(index, _) | CallArguments(index, _) | CallCutShort(index, _) if (
                    index > 0 and not self.is_parallel
                ):
                    continue
                case CallCutShort(index, text) if not self.is_streamed:
                    # The last call: its deltas are all held, and its id the last one.
                    self.ids.pop()
                    content += self._content(self.blank_before_call + text)
                case CallCutShort():  # streamed already, as it was written
                    self.is_cut_short = True
                case CallStart(index, name):
                    self.blank, self.blank_before_call = "", self.blank
                    self.ids.append(new_call_id(self.style))
                    function = {"name": name, "arguments": ""}
                    calls.append(
                        {
                            "index": index,
                            "id": self.ids[index],
                            "type": "function",
                            "function": function,
                        }
                    )
                case CallArguments(index, fragment) if calls and calls[-1]["index"] == index:
                    # One item per call in a delta: openai-python before its fix for #3201
                    # took a second item of one index for another call, and lost the text.
                    calls[-1]["function"]["arguments"] += fragment
                case CallArguments(index, fragment):
                    calls.append({"index": index, "function": {"arguments": fragment}})
        if is_final and self.blank and not self.has_calls:
            content, self.blank = content + self.blank, ""
        return content, calls

    def _content(self, text: str) -> str:
        # Trailing whitespace waits: before a call it is dropped, whatever the split.
        text = self.blank + text
        kept = text.rstrip()
        self.blank = text[len(kept) :]
        return kept


def with_tool_calls(choice: dict[str, Any], deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole chat choice with its `message.tool_calls` (content null when it was blank)."""
    if not deltas:
        return choice
    message = dict(choice["message"])
    message["content"] = message["content"] or None
    message["tool_calls"] = whole_tool_calls(deltas)
    return {**choice, "message": message}


def whole_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed `tool_calls` delta items -> the whole message's `tool_calls`."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(
            delta["index"],
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if "id" in delta:
            call["id"] = delta["id"]
            call["function"]["name"] = delta["function"]["name"]
        call["function"]["arguments"] += delta["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@attrs.define
class ToolCallDeltas:
    """Each choice's deltas with tool calls taken out of the text into `Delta.tool_calls`,
    and the finish reason `tool_calls` when the choice made any."""

    style: str
    is_parallel: bool = True  # parallel_tool_calls
    is_streamed: bool = True  # False: the deltas make a whole response
    parses_calls: bool = True  # False: harmony's reasoning split alone (no tools offered)
    # The (opening, closing) tags the reply may think between first (runtime/think_reply.py)
    think_tags: tuple[str, str] | None = None
    tools: tuple[dict[str, Any], ...] = ()  # the request's: they type Qwen3-Coder's arguments
    answer_tags: tuple[str, ...] = ()  # text tags around the answer, left out (Granite 3.3's)
    streams: dict[int, ToolCallStream] = attrs.Factory(dict)  # by choice index

    def convert(self, index: int, delta: Delta) -> Delta:
        stream = self.streams.get(index)
        if stream is None:  # once per choice: its parser reads every tool's schema
            stream = self.streams[index] = ToolCallStream(
                self.style,
                self.is_parallel,
                self.is_streamed,
                self.parses_calls,
                self.think_tags,
                self.tools,
                self.answer_tags,
            )
        content, calls = stream.feed(delta.text)
        if delta.finish_reason is None:
            return attrs.evolve(
                delta, text=content, reasoning=stream.take_reasoning(), tool_calls=tuple(calls)
            )
        rest, more = stream.finish()
        return attrs.evolve(
            delta,
            text=content + rest,
            reasoning=stream.take_reasoning(),
            tool_calls=tuple(calls + more),
            finish_reason=stream.finish_reason(delta.finish_reason),
        )
