"""Tools on the way in: which call format a model writes, the chat it is shown, and the
grammar that forces a call (`tool_choice` required or named).

The format follows the chat template, the thing that taught the model: a template that
writes `[TOOL_CALLS]` is Mistral's, one that writes `<function=` and `<parameter=` is
Qwen3-Coder's and Qwen3.5's XML, one that writes `<function_calls>` OLMo 3's Python calls,
one that writes `<|tool_call|>` Granite 3's JSON list, one that lists the tools in
`<|tool_list_start|>` LFM2's Python call list,
one with an `<|observation|>` turn and no `<tool_call>` GLM-4-0414's name-then-JSON,
one that writes `<tool_call>` otherwise is Hermes/Qwen's, one
with `<|python_tag|>` or an `ipython` role is Llama 3's JSON form, and Gemma (whose template has no tools at all) gets the
```tool_code form from Google's function-calling guide. Anything else: Hermes, the
most common. Templates that take `tools` get them as transformers passes them; for one
that does not, the tool list is written into the first user turn as the guide does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import keyword
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.chat_template import reads_variable
from runtime.gemma4_reply import CALL_CLOSE, CALL_OPEN, QUOTE, gemma4_arguments, gemma4_key
from runtime.grammar import JSON_OPTIONS, GrammarSpec, answer_json_schema
from runtime.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE
from runtime.qwen3_coder_reply import (
    FUNCTION,
    FUNCTION_END,
    PARAMETER,
    PARAMETER_END,
    XML_NAME_LIMIT,
    is_text,
    value_types,
    xml_call,
)
from runtime.tools import (
    ARGS,
    CALL_END_TAG,
    CALL_TAG,
    FUNCTION_CALLS,
    FUNCTION_CALLS_END,
    GRANITE_TOOL_CALL,
    LFM2_CALL_END,
    LFM2_CALL_START,
    TOOL_CALLS,
    TOOL_STYLES,
)

# Arguments stay JSON objects in forced calls, whatever a tool's own schema omits.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# OpenAI: "omitting parameters defines a function with an empty parameter list".
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_style_for(template_source: str, model_type: str) -> str:
    """One of TOOL_STYLES for a model with this chat template and config `model_type`."""
    if TOOL_CALLS in template_source:
        return "mistral"
    if CALL_OPEN in template_source:
        return "gemma4"
    if CHANNEL in template_source and MESSAGE in template_source:
        return "harmony"
    # Inside `<tool_call>` too, so before Hermes: its JSON templates write neither.
    if FUNCTION in template_source and PARAMETER in template_source:
        return "qwen3_coder"
    if FUNCTION_CALLS in template_source:
        return "olmo3"
    if GRANITE_TOOL_CALL in template_source:
        return "granite"
    # LFM2's template writes its tool list so, and never a call (they are the reply's text).
    if "<|tool_list_start|>" in template_source or LFM2_CALL_START in template_source:
        return "lfm2"
    if "<tool_call>" in template_source:
        return "hermes"
    # GLM-4-0414's and GLM-Z1's results are `observation` turns (GLM-4.5's write <tool_call>).
    if "<|observation|>" in template_source:
        return "glm4"
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3_json"
    if model_type.startswith("gemma") or "<start_of_turn>" in template_source:
        return "gemma"
    return "hermes"


def template_knows_tools(template_source: str) -> bool:
    # SmolLM3's reads its tools from `xml_tools` alone: given `tools`, it showed none.
    return reads_variable(template_source, "tools")


def tool_call_grammar(
    style: str,
    tools: Sequence[Mapping[str, Any]],
    forced_name: str | None,
    answer: GrammarSpec | None = None,
    control_tokens: Mapping[str, int] | None = None,
) -> GrammarSpec:
    """A Lark grammar (llguidance's, with embedded JSON schemas) for exactly one call, in
    `style`, of the named function or of any of `tools`; the name is written first.

    `answer`, a JSON grammar (`response_format`), is the other choice: the reply is one
    call or that answer, as OpenAI's `tool_choice: auto` beside a `response_format`.
    `control_tokens` (spelling -> id): Mistral's, harmony's or Hermes's markers that are
    the tokenizer's own tokens, written as those tokens (the model's own way), not
    spelled out."""
    assert style in TOOL_STYLES
    functions = [tool["function"] for tool in tools]
    if forced_name is not None:
        functions = [f for f in functions if f["name"] == forced_name]

    def marker(text: str) -> str:
        token_id = (control_tokens or {}).get(text)
        return json.dumps(text) if token_id is None else f"<[{token_id}]>"

    def marked_calls(opening: str, between: Callable[[str], str]) -> GrammarSpec:
        """`opening`, then one call: its `between(name)` and its arguments' JSON."""
        rules = [
            f"call_{i}: {between(f['name'])} %json "
            + json.dumps({**_own_resource(_parameters(f), i), "x-guidance": JSON_OPTIONS})
            for i, f in enumerate(functions)
        ]
        choice = " | ".join(f"call_{i}" for i in range(len(rules)))
        return _with_answer(f"tool_call: {opening} call\ncall: {choice}\n" + "\n".join(rules), answer)

    if style == "harmony":  # <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
        return marked_calls(
            f'{marker(CHANNEL)} "commentary to=functions."',
            lambda name: f'{json.dumps(name + " ")} {marker(CONSTRAIN)} "json" {marker(MESSAGE)}',
        )
    if style == "mistral":  # [TOOL_CALLS]name[ARGS]arguments
        return marked_calls(marker(TOOL_CALLS), lambda name: f"{json.dumps(name)} {marker(ARGS)}")
    if style == "glm4":  # NAME\n{arguments}
        return marked_calls('""', lambda name: json.dumps(name + "\n"))
    if style == "gemma4":  # <|tool_call>call:NAME{...}<tool_call|>, in Gemma's notation
        return _with_answer(_gemma4_calls(functions, marker), answer)
    if style == "olmo3":  # <function_calls>NAME(key=value, ...)</function_calls>
        return _with_answer(_python_call(functions, marker(FUNCTION_CALLS), marker(FUNCTION_CALLS_END)), answer)
    if style == "lfm2":  # <|tool_call_start|>[NAME(key=value, ...)]<|tool_call_end|>
        opening, closing = f'{marker(LFM2_CALL_START)} "["', f'"]" {marker(LFM2_CALL_END)}'
        return _with_answer(_python_call(functions, opening, closing), answer)
    if style == "qwen3_coder":  # <tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n...
        return _with_answer(_xml_calls(functions, marker), answer)
    key = "parameters" if style == "llama3_json" else "arguments"
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                key: _own_resource(_parameters(f), i),
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for i, f in enumerate(functions)
    ]
    # One JSON document per function: in one `anyOf` document two tools' parameters
    # with the same `$id` were one resource, and one tool's "#/$defs/..." won for both.
    call = " | ".join(f"call_{i}" for i in range(len(calls)))
    for i, schema in enumerate(calls):
        call += f"\ncall_{i}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"
    if style == "hermes":
        lark = f'tool_call: {marker(CALL_TAG)} "\\n" call "\\n" {marker(CALL_END_TAG)}\ncall: {call}'
    elif style == "gemma":
        lark = f'tool_call: "```tool_code\\n" call "\\n```"\ncall: {call}'
    elif style == "granite":  # <|tool_call|>[{"name": ..., "arguments": ...}]
        lark = f'tool_call: {marker(GRANITE_TOOL_CALL)} "[" call "]"\ncall: {call}'
    else:
        lark = f"tool_call: {call}"
    return _with_answer(lark, answer)


# Gemma 4's notation: any value, and its pieces. A string's text holds no "<" (its
# closing mark begins with one). A number has at most 20 digits before its point and 2
# in its exponent, so that a float holds it (1e999 would read back as Infinity).
_GEMMA4_VALUES = """value: string | NUMBER | "true" | "false" | "null" | "{" pairs? "}" | "[" (value ("," value)*)? "]"
pairs: pair ("," pair)*
pair: KEY ":" value
string: mark TEXT? mark
KEY: /[A-Za-z_][A-Za-z0-9_]*/
INTEGER: /-?(0|[1-9][0-9]*)/
NUMBER: /-?(0|[1-9][0-9]{0,19})(\\.[0-9]+)?([eE][+-]?[0-9]{1,2})?/
TEXT: /[^<]+/"""


def _gemma4_calls(functions: Sequence[Mapping[str, Any]], marker: Callable[[str], str]) -> str:
    """One call in Gemma 4's notation of one of `functions`. Where a tool's parameters
    list their properties, its arguments are those keys in that order, the required ones
    always, each value of its type (string, number, integer, boolean, an enum or const
    of them; anything else any value); otherwise any keys."""
    rules = [
        f"tool_call: {marker(CALL_OPEN)} \"call:\" call {marker(CALL_CLOSE)}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
    ]
    for i, function in enumerate(functions):
        parameters = _parameters(function)
        properties = parameters.get("properties")
        if properties == {} and parameters.get("additionalProperties") is False:
            rules.append(f'call_{i}: {json.dumps(function["name"])} "{{" "}}"')  # takes none
            continue
        if not isinstance(properties, dict) or not properties:
            rules.append(f'call_{i}: {json.dumps(function["name"])} "{{" pairs? "}}"')
            continue
        rules.append(f'call_{i}: {json.dumps(function["name"])} "{{" args_{i}_0_first "}}"')
        pairs = {
            name: f"{_gemma4_literal(gemma4_key(name))} \":\" {_gemma4_value(schema)}"
            for name, schema in properties.items()
        }
        rules += _arguments_in_order(i, pairs, set(parameters.get("required") or ()), '","')
    rules += [_GEMMA4_VALUES, f"mark: {marker(QUOTE)}"]
    return "\n".join(rules)


def _arguments_in_order(i: int, pairs: Mapping[str, str], required: set[str], separator: str) -> list[str]:
    """Rules `args_{i}_0_first` and on: the arguments `pairs` (name -> its Lark
    expression) in their order, `separator` between two, the `required` ones always and
    the others maybe."""
    rules = []
    names = list(pairs)
    for k, name in enumerate(names):
        for started in (False, True):
            here = f"args_{i}_{k}_{'more' if started else 'first'}"
            after = f" args_{i}_{k + 1}_more" if k + 1 < len(names) else ""
            this = f"{separator + ' ' if started else ''}{pairs[name]}{after}"
            skip = f"args_{i}_{k + 1}_{'more' if started else 'first'}" if k + 1 < len(names) else ""
            if name in required:
                rules.append(f"{here}: {this}")
            elif skip:
                rules.append(f"{here}: {this} | {skip}")
            else:
                rules.append(f"{here}: ({this})?")
    return rules


def _python_call(functions: Sequence[Mapping[str, Any]], opening: str, closing: str) -> str:
    """One call as OLMo 3 and LFM2 write it, of one of `functions`: `name(key=value, ...)`
    between `opening` and `closing` (Lark), each value JSON. Where a tool's parameters
    list their properties, its arguments are those keys in that order, the required ones
    always, each value of its schema; otherwise any keys, any JSON values."""
    rules = [
        f"tool_call: {opening} call {closing}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
        f"any_pair: KEY \"=\" %json {json.dumps({'x-guidance': JSON_OPTIONS})}",
        # A keyword (`from=`) is no Python keyword argument: the call read as text.
        "KEY: /[A-Za-z_][A-Za-z0-9_]*/ & ~/" + "|".join(keyword.kwlist) + "/",
    ]
    for i, function in enumerate(functions):
        parameters = _parameters(function)
        properties = parameters.get("properties")
        head = json.dumps(function["name"] + "(")
        if properties == {} and parameters.get("additionalProperties") is False:
            rules.append(f'call_{i}: {head} ")"')  # takes none
            continue
        if not isinstance(properties, dict) or not properties or not all(map(_is_keyword, properties)):
            rules.append(f'call_{i}: {head} (any_pair ("," " " any_pair)*)? ")"')
            continue
        # A property's "#/$defs/..." refs point into the parameters' schema.
        shared = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
        # A property's schema may be a boolean, as JSON Schema has it (`true`: any value,
        # `false`: never given): spread into a dict, it failed the request as a bug.
        pairs = {
            name: f"{json.dumps(name + '=')} %json {json.dumps({**schema, **shared, 'x-guidance': JSON_OPTIONS})}"
            for name, schema in ((n, {} if s is True else s) for n, s in properties.items())
            if isinstance(schema, dict)
        }
        if not pairs:  # none can be given
            rules.append(f'call_{i}: {head} ")"')
            continue
        rules.append(f'call_{i}: {head} args_{i}_0_first ")"')
        rules += _arguments_in_order(i, pairs, set(parameters.get("required") or ()), '", "')
    return "\n".join(rules)


def _is_keyword(name: str) -> bool:
    """Whether `name` can be a Python call's keyword (the parser reads the calls as Python)."""
    return name.isidentifier() and not keyword.iskeyword(name)


# A parameter's text and its end: lazy, so it ends at the first "\n</parameter>\n", and
# holding no "</parameter>", where the parser would end it.
_XML_TEXT = 'text[lazy]: (/(?s:.*)/ & ~/(?s:.*)<\\/parameter>(?s:.*)/) /\\n<\\/parameter>\\n/'
_XML_KEY = f"KEY: /[A-Za-z_][A-Za-z0-9_.-]{{0,{XML_NAME_LIMIT - 1}}}/"  # the parser reads no longer one
_XML_END = json.dumps(f"\n{PARAMETER_END}\n")


def _xml_calls(functions: Sequence[Mapping[str, Any]], marker: Callable[[str], str]) -> str:
    """One call in Qwen3-Coder's XML of one of `functions`. Where a tool's parameters
    list their properties, its parameters are those in that order, the required ones
    always, the others maybe; a string's value is text (one of its enum, if it has
    one), any other its JSON; otherwise any parameters, their values text."""
    rules = [
        f'tool_call: {marker(CALL_TAG)} "\\n{FUNCTION}" call "{FUNCTION_END}\\n" {marker(CALL_END_TAG)}',
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
        f'any_parameter: "{PARAMETER}" KEY ">\\n" text',
    ]
    for i, function in enumerate(functions):
        parameters = _parameters(function)
        properties = parameters.get("properties")
        head = json.dumps(function["name"] + ">\n")
        if properties == {} and parameters.get("additionalProperties") is False:
            rules.append(f"call_{i}: {head}")  # takes none
            continue
        # A name the parser cannot read back (`<parameter=a>b>` reads as `a`) goes out
        # as any parameters, as OLMo 3's do: written, it made a call of other keys.
        if not isinstance(properties, dict) or not properties or not all(map(_is_xml_name, properties)):
            rules.append(f"call_{i}: {head} any_parameter*")
            continue
        required = set(parameters.get("required") or ())
        # A property's "#/$defs/..." refs point into the parameters' schema.
        shared: dict[str, Any] = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
        body = []
        for k, (name, schema) in enumerate(properties.items()):
            opening = json.dumps(f"{PARAMETER}{name}>\n")
            value, *terminals = _xml_value(schema, parameters, shared, f"VALUE_{i}_{k}")
            rules += [f"parameter_{i}_{k}: {opening} {value}", *terminals]
            body.append(f"parameter_{i}_{k}" + ("" if name in required else "?"))
        rules.append(f"call_{i}: {head} {' '.join(body)}")
    return "\n".join([*rules, _XML_TEXT, _XML_KEY])


def _is_xml_name(name: str) -> bool:
    """Whether a parameter `name` reads back as itself from `<parameter=NAME>`."""
    return 0 < len(name) <= XML_NAME_LIMIT and name == name.strip() and not any(c in name for c in "<>\n")


def _xml_value(schema: Any, parameters: dict[str, Any], shared: dict[str, Any], terminal: str) -> list[str]:
    """The Lark expression for a parameter's value and its end, in Qwen3-Coder's XML:
    text for a string (or what its schema leaves open), JSON for any other type; then
    the definition of `terminal`, the name its string enum's values take, if it has one."""
    if not isinstance(schema, dict):
        return ["text"]
    if not is_text(value_types(schema, parameters)):
        json_schema = {**schema, **shared, "x-guidance": JSON_OPTIONS}
        return [f"%json {json.dumps(json_schema)} {_XML_END}"]
    consts = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None
    if consts and all(isinstance(c, str) for c in consts):
        # One terminal, which the lexer matches: as alternatives of a rule, past 2,000
        # values llguidance's parser refused the grammar (the JSON styles take them).
        return [f"{terminal} {_XML_END}", f"{terminal}: " + " | ".join(json.dumps(c) for c in consts)]
    return ["text"]


def _gemma4_value(schema: Any) -> str:
    """The Lark expression for a value of `schema`, in Gemma 4's notation."""
    if not isinstance(schema, dict):
        return "value"
    consts = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None
    if consts:
        return "(" + " | ".join(_gemma4_literal(gemma4_arguments(c)) for c in consts) + ")"
    kinds = {"string": "string", "number": "NUMBER", "integer": "INTEGER", "boolean": '("true" | "false")'}
    kind = schema.get("type")
    return kinds.get(kind, "value") if isinstance(kind, str) else "value"


def _gemma4_literal(text: str) -> str:
    """Text in Gemma's notation as a Lark sequence: its string marks as the `mark` rule
    (the tokenizer's token), the rest as literals."""
    parts: list[str] = []
    for k, piece in enumerate(text.split(QUOTE)):
        parts += ["mark"] * (k > 0) + [json.dumps(piece)] * (piece != "")
    return " ".join(parts)


def _with_answer(lark: str, answer: GrammarSpec | None) -> GrammarSpec:
    """The call grammar `lark` alone, or beside `answer` as the other choice."""
    if answer is None:
        return GrammarSpec("lark", f"start: tool_call\n{lark}", "tool_choice")
    answer_schema = {**answer_json_schema(answer), "x-guidance": JSON_OPTIONS}
    lark += f"\nanswer: %json {json.dumps(answer_schema)}"
    return GrammarSpec("lark", f"start: tool_call | answer\n{lark}", answer.param)


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    """The schema of a call's arguments: an object always (a schema without a `type`
    admits any JSON value, and arguments that are no object parse as no call)."""
    if (parameters := function.get("parameters")) is None:
        return _NO_PARAMETERS
    return {**parameters, "type": "object"} if parameters else _ANY_OBJECT


def _own_resource(parameters: dict[str, Any], index: int) -> dict[str, Any]:
    """A tool's parameters as a schema resource of their own (an `$id`), so that their
    "#..." refs resolve against them: inside the call schema that wraps them, "#" was
    the call, and "#/$defs/Item" (as Pydantic writes nested models) pointed at nothing.
    An `$id` the parameters already have is theirs to keep."""
    return {"$id": f"urn:cadence:tool:{index}", **parameters}


def tools_for_template(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as a template reads them: a function without `parameters`
    (OpenAI: no parameters) given an empty object schema, as Qwen3-Coder's template reads
    `tool.parameters.properties` and refused the chat without them."""
    shown = []
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, Mapping) and function.get("parameters") is None:
            tool = {**tool, "function": {**function, "parameters": {"type": "object", "properties": {}}}}
        shown.append(dict(tool))
    return shown


def chat_for_template(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    style: str,
    knows_tools: bool,
) -> list[dict[str, Any]]:
    """`messages` as the template wants them.

    Assistant `tool_calls` carry their arguments as JSON text on the wire; templates
    read them as objects (`arguments | tojson`), so they are parsed, as vLLM does. For
    a template without tools, calls and results become text in the model's own format,
    and the tool list goes into the first user turn.
    """
    chat = [_with_parsed_arguments(m) for m in messages]
    if style == "mistral":
        chat = _mistral_call_ids(chat)
    if knows_tools:
        if style == "granite":
            return _granite_turns(chat)
        if style == "glm4":
            return _glm4_turns(chat)
        if style == "lfm2":
            return _lfm2_turns(chat)
        return _responses_in_turn(chat) if style == "gemma4" else chat
    chat = _results_joined(chat, [_as_text(m, style) for m in chat])
    if tools:
        preamble = _tools_preamble(tools, style)
        first_user = next((i for i, m in enumerate(chat) if m["role"] == "user"), None)
        if first_user is None:
            chat.insert(0, {"role": "user", "content": preamble})
        else:
            content = chat[first_user].get("content") or ""
            chat[first_user] = {**chat[first_user], "content": f"{preamble}\n\n{content}"}
    return chat


# The call ids Mistral's templates (Nemo, Small 3.x) take; any other refuses the chat.
_MISTRAL_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ID_CHARACTERS = string.ascii_letters + string.digits


def _mistral_call_ids(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`chat` with each call id as Mistral's templates take it: 9 letters and digits. An
    id another client or server wrote (OpenAI's `call_` and 24 characters) was a 400 the
    client could not fix; it is shown as 9 characters of its hash, the same in the call
    and in its result, and in every request that sends it (a cached prefix still
    matches). vLLM keeps the last 9 characters, which left shorter ids refused and made
    two that end alike one call; here two ids are one only where their hashes agree."""
    ids = [call.get("id") for m in chat for call in m.get("tool_calls") or ()]
    ids += [m.get("tool_call_id") for m in chat if m["role"] == "tool"]
    kept = {i for i in ids if isinstance(i, str) and _MISTRAL_CALL_ID.fullmatch(i)}
    taken = set(kept)  # grows with each id shown: copying it per id took quadratic time
    shown: dict[str, str] = {}
    for call_id in ids:
        if isinstance(call_id, str) and call_id not in kept and call_id not in shown:
            shown[call_id] = _nine_characters(call_id, taken)
            taken.add(shown[call_id])
    if not shown:
        return chat
    out = []
    for message in chat:
        if message.get("tool_calls"):
            calls = [{**c, "id": shown.get(c.get("id"), c.get("id"))} for c in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        if message["role"] == "tool" and message.get("tool_call_id") in shown:
            message = {**message, "tool_call_id": shown[message["tool_call_id"]]}
        out.append(message)
    return out


def _nine_characters(call_id: str, taken: set[str]) -> str:
    """9 letters and digits from the hash of `call_id`, none of `taken`."""
    attempt = 0
    while True:  # a clash (about one in 62**9 for each id taken) draws again
        digest = int.from_bytes(hashlib.sha256(f"{attempt}:{call_id}".encode()).digest(), "big")
        chosen = ""
        for _ in range(9):
            digest, index = divmod(digest, len(_ID_CHARACTERS))
            chosen += _ID_CHARACTERS[index]
        if chosen not in taken:
            return chosen
        attempt += 1


def _results_joined(chat: list[dict[str, Any]], texts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`texts` (`chat` as text) with the results of one turn's calls in one user turn:
    templates that make user and assistant alternate (Gemma 2 and 3, Mixtral) refused
    two in a row, so a round trip of parallel calls was a 400."""
    out: list[dict[str, Any]] = []
    for index, (message, text) in enumerate(zip(chat, texts, strict=True)):
        if message["role"] == "tool" and index and chat[index - 1]["role"] == "tool":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{text['content']}"}
        else:
            out.append(text)
    return out


def _responses_in_turn(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's `tool` messages as Gemma 4's template takes results: the `tool_responses`
    ({name, response}) of the assistant turn that made the calls, the name that of the
    call whose id the result answers, the response its JSON where it is JSON. The
    template writes them inside the model's turn, and the model goes on from there."""
    out: list[dict[str, Any]] = []
    for message in chat:
        calls = out[-1].get("tool_calls") if out and out[-1]["role"] == "assistant" else None
        if message["role"] != "tool" or not calls:
            out.append(message)
            continue
        name = next(
            (c["function"].get("name") for c in calls if c.get("id") == message.get("tool_call_id")),
            message.get("name") or "unknown",
        )
        content = message.get("content") or ""
        if not isinstance(content, str):  # text parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
        response: Any = content
        with contextlib.suppress(ValueError, RecursionError):
            response = json.loads(content)
        responses = [*out[-1].get("tool_responses", []), {"name": name, "response": response}]
        out[-1] = {**out[-1], "tool_responses": responses}
    return out


def _granite_turns(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's calls and results as Granite 3's templates take them: those write each
    turn's role and `content` alone, so a call is its `<|tool_call|>` list in the
    assistant's content (its `tool_calls` were never shown, and a null content broke the
    template), and a result the `tool_response` role Granite was taught (as Ollama and
    llama.cpp write it), not `tool`."""
    out = []
    for message in chat:
        if message["role"] == "tool":
            message = {**message, "role": "tool_response"}
        elif message["role"] == "assistant" and message.get("tool_calls"):
            written = _call_text_granite([call["function"] for call in message["tool_calls"]])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = (message.get("content") or "") + written
        out.append(message)
    return out


def _glm4_turns(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's calls and results as GLM-4-0414's template takes them: each call an
    assistant turn of its own, the tool's name its `metadata` and the arguments' JSON its
    text, after one for the turn's text if it has any, and a result an `observation`
    turn. The template writes neither `tool_calls` nor a `tool` turn: both were dropped."""
    out: list[dict[str, Any]] = []
    for message in chat:
        if message["role"] == "tool":
            out.append({"role": "observation", "content": message.get("content") or ""})
        elif message["role"] == "assistant" and message.get("tool_calls"):
            if message.get("content"):
                out.append({k: v for k, v in message.items() if k != "tool_calls"})
            for call in message["tool_calls"]:
                name, arguments = _glm4_call(call["function"])
                out.append({"role": "assistant", "metadata": name, "content": arguments})
        else:
            out.append(message)
    return out


def _lfm2_turns(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's calls as LFM2's template takes them: it writes each turn's `content`
    alone (its `tool_calls` were dropped, a null content written as `null`), so a turn's
    calls are its one `<|tool_call_start|>[...]` list, before its text as LFM2 writes
    them. Results stay `tool` turns, which the template marks."""
    out = []
    for message in chat:
        if message["role"] == "assistant" and message.get("tool_calls"):
            written = _call_text_lfm2([call["function"] for call in message["tool_calls"]])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = written + (message.get("content") or "")
        out.append(message)
    return out


def _call_text_lfm2(functions: Sequence[Mapping[str, Any]]) -> str:
    return LFM2_CALL_START + "[" + ", ".join(map(_python_call_text, functions)) + "]" + LFM2_CALL_END


def _python_call_text(function: Mapping[str, Any]) -> str:
    """`name(key=value, ...)`, each value JSON (arguments that are no JSON object as sent)."""
    arguments = function.get("arguments") or {}
    pairs = ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items()) if isinstance(arguments, dict) else arguments
    return f"{function['name']}({pairs})"


def _glm4_call(function: Mapping[str, Any]) -> tuple[str, str]:
    """A call's name and its arguments' JSON text, as GLM-4 writes them."""
    arguments = function.get("arguments") or {}
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return function["name"], text


def _call_text_granite(functions: Sequence[Mapping[str, Any]]) -> str:
    calls = [{"name": f["name"], "arguments": f.get("arguments") or {}} for f in functions]
    return GRANITE_TOOL_CALL + json.dumps(calls)


def _with_parsed_arguments(message: Mapping[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    parsed = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str) and not arguments.strip():
            # No arguments, as some clients send a call of a tool without parameters:
            # an object, as vLLM takes it (templates that read `arguments|items` failed).
            function["arguments"] = {}
        elif isinstance(arguments, str):
            # Text that is not JSON reaches the template as the client sent it, and so
            # does JSON that Python cannot read: an integer past 4,300 digits (ValueError)
            # or nesting past the recursion limit.
            with contextlib.suppress(ValueError, RecursionError):
                function["arguments"] = json.loads(arguments)
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


def _as_text(message: Mapping[str, Any], style: str) -> dict[str, Any]:
    """Tool turns for a template that knows only user and assistant text."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"```tool_output\n{message.get('content', '')}\n```"}
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return dict(message)
    if style == "granite":  # one list of the turn's calls, as its template shows them
        written = _call_text_granite([call["function"] for call in calls])
    elif style == "lfm2":
        written = _call_text_lfm2([call["function"] for call in calls])
    else:
        written = "\n".join(_call_text(call["function"], style) for call in calls)
    content = message.get("content") or ""
    text = f"{content}\n{written}" if content else written
    return {"role": "assistant", "content": text}


def _call_text(function: Mapping[str, Any], style: str) -> str:
    arguments = function.get("arguments") or {}
    if style == "gemma" and isinstance(arguments, dict):
        pairs = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        return f"```tool_code\n{function['name']}({pairs})\n```"
    call = {"name": function["name"], "arguments": arguments}
    if style == "mistral":
        return f"{TOOL_CALLS}{function['name']}{ARGS}{json.dumps(arguments)}"
    if style == "harmony":
        header = f"{CHANNEL}commentary to=functions.{function['name']} {CONSTRAIN}json{MESSAGE}"
        return f"{header}{json.dumps(arguments)}{CALL}"
    if style == "hermes":
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    if style == "gemma4":
        return f"{CALL_OPEN}call:{function['name']}{gemma4_arguments(arguments)}{CALL_CLOSE}"
    if style == "qwen3_coder":
        return xml_call(function["name"], arguments)
    if style == "glm4":
        return "\n".join(_glm4_call(function))
    if style == "olmo3":  # as its template writes them; text that is no JSON as it is
        return f"{FUNCTION_CALLS}{_python_call_text(function)}{FUNCTION_CALLS_END}"
    return json.dumps({"name": function["name"], "parameters": arguments})


def _tools_preamble(tools: Sequence[Mapping[str, Any]], style: str) -> str:
    listed = "\n".join(json.dumps(tool["function"]) for tool in tools)
    if style == "gemma":
        how = (
            "If you decide to invoke any of the function(s), you MUST put it in the format of\n"
            "```tool_code\nfunction_name(param_name=param_value, ...)\n```\n"
            "You SHOULD NOT include any other text in the response if you call a function."
        )
    elif style == "granite":
        how = f'To call a function, reply with {GRANITE_TOOL_CALL}[{{"name": <function-name>, "arguments": <args-json-object>}}]'
    elif style == "glm4":
        how = "To call a function, reply with its name alone on the first line, then its arguments as a JSON object."
    elif style == "olmo3":
        how = f"To call a function, reply with {FUNCTION_CALLS}<function-name>(<param-name>=<json-value>, ...){FUNCTION_CALLS_END}"
    elif style == "lfm2":
        how = f"To call functions, reply with {LFM2_CALL_START}[<function-name>(<param-name>=<value>, ...), ...]{LFM2_CALL_END}"
    elif style == "qwen3_coder":
        how = "To call a function, reply with\n" + xml_call("<function-name>", {"<parameter-name>": "<value>"})
    elif style == "hermes":
        how = (
            "To call a function, reply with\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )
    elif style == "mistral":
        how = f"To call a function, reply with {TOOL_CALLS}<function-name>{ARGS}<args-json-object>"
    elif style == "harmony":
        how = "To call a function, send its JSON arguments on the commentary channel to=functions.<function-name>."
    else:
        how = 'To call a function, reply with only {"name": <function-name>, "parameters": <args>}.'
    return f"You have access to the following functions:\n{listed}\n\n{how}"
