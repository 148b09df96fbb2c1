"""The grammar that forces a call (`tool_choice` required or named), in the format the
model writes (runtime/tool_prompts.py says which): Hermes' and Llama 3's JSON, Mistral's
and Granite's lists after their markers, Command R7B's between its action tokens, Gemma's
and Gemma 4's notations, harmony's channel, Qwen3-Coder's XML (Seed-OSS's in its own blocks), GLM-4.5's key and value tags, OLMo 3's and LFM2's Python calls, GLM-4's name then JSON.
Each call's arguments follow the tool's own schema; the request's `response_format`,
where given, shapes an answer the model may write instead."""

from __future__ import annotations

import json
import keyword
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.command_r7b_reply import END_ACTION, START_ACTION
from runtime.gemma4_reply import CALL_CLOSE, CALL_OPEN, QUOTE, gemma4_arguments, gemma4_key
from runtime.glm45_reply import ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END
from runtime.grammar import JSON_OPTIONS, GrammarSpec, answer_json_schema
from runtime.harmony import CHANNEL, CONSTRAIN, MESSAGE
from runtime.qwen3_coder_reply import (
    FUNCTION,
    FUNCTION_END,
    PARAMETER,
    PARAMETER_END,
    XML_NAME_LIMIT,
    is_text,
    value_types,
)
from runtime.tools import (
    ARGS,
    CALL_END_TAG,
    CALL_TAG,
    FUNCTION_CALLS,
    FUNCTION_CALLS_END,
    GRANITE_TOOL_CALL,
    HERMES_TAGS,
    LFM2_CALL_END,
    LFM2_CALL_START,
    SEED_TAGS,
    TOOL_CALLS,
    TOOL_STYLES,
    TOOLCALL,
    TOOLCALL_END,
)

# Arguments stay JSON objects in forced calls, whatever a tool's own schema omits.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# OpenAI: "omitting parameters defines a function with an empty parameter list".
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


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

    def marked_calls(opening: str, between: Callable[[str], str], closing: str = "") -> GrammarSpec:
        """`opening`, then one call: its `between(name)` and its arguments' JSON, then `closing`."""
        rules = [
            f"call_{i}: {between(f['name'])} %json "
            + json.dumps({**_own_resource(_parameters(f), i), "x-guidance": JSON_OPTIONS})
            for i, f in enumerate(functions)
        ]
        choice = " | ".join(f"call_{i}" for i in range(len(rules)))
        return _with_answer(f"tool_call: {opening} call {closing}\ncall: {choice}\n" + "\n".join(rules), answer)

    if style == "harmony":  # <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
        return marked_calls(
            f'{marker(CHANNEL)} "commentary to=functions."',
            lambda name: f'{json.dumps(name + " ")} {marker(CONSTRAIN)} "json" {marker(MESSAGE)}',
        )
    if style == "mistral":  # [TOOL_CALLS]name[ARGS]arguments
        return marked_calls(marker(TOOL_CALLS), lambda name: f"{json.dumps(name)} {marker(ARGS)}")
    if style == "command_r7b":  # as its template writes a call: the list's first, id "0"
        return marked_calls(
            f'{marker(START_ACTION)} "[\\n    "',
            lambda name: json.dumps(f'{{"tool_call_id": "0", "tool_name": {json.dumps(name)}, "parameters": '),
            f'"}}\\n]" {marker(END_ACTION)}',
        )
    if style == "glm4":  # NAME\n{arguments}
        return marked_calls('""', lambda name: json.dumps(name + "\n"))
    if style == "gemma4":  # <|tool_call>call:NAME{...}<tool_call|>, in Gemma's notation
        return _with_answer(_gemma4_calls(functions, marker), answer)
    if style == "olmo3":  # <function_calls>NAME(key=value, ...)</function_calls>
        return _with_answer(_python_call(functions, marker(FUNCTION_CALLS), marker(FUNCTION_CALLS_END)), answer)
    if style == "lfm2":  # <|tool_call_start|>[NAME(key=value, ...)]<|tool_call_end|>
        opening, closing = f'{marker(LFM2_CALL_START)} "["', f'"]" {marker(LFM2_CALL_END)}'
        return _with_answer(_python_call(functions, opening, closing), answer)
    if style == "glm45":  # <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>value</arg_value>\n...</tool_call>
        return _with_answer(_key_value_calls(functions, marker), answer)
    if style == "qwen3_coder":  # <tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n...
        return _with_answer(_xml_calls(functions, marker, HERMES_TAGS), answer)
    if style == "seed_oss":  # the same in <seed:tool_call> blocks
        return _with_answer(_xml_calls(functions, marker, SEED_TAGS), answer)
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
    elif style == "nemotron":  # <TOOLCALL>[{"name": ..., "arguments": ...}]</TOOLCALL>
        lark = f'tool_call: {marker(TOOLCALL)} "[" call "]" {marker(TOOLCALL_END)}\ncall: {call}'
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


def _xml_calls(functions: Sequence[Mapping[str, Any]], marker: Callable[[str], str], tags: tuple[str, str]) -> str:
    """One call in Qwen3-Coder's XML of one of `functions`, in a block of `tags`. Where a tool's parameters
    list their properties, its parameters are those in that order, the required ones
    always, the others maybe; a string's value is text (one of its enum, if it has
    one), any other its JSON; otherwise any parameters, their values text."""
    rules = [
        f'tool_call: {marker(tags[0])} "\\n{FUNCTION}" call "{FUNCTION_END}\\n" {marker(tags[1])}',
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
        f'any_parameter: "{PARAMETER}" KEY ">\\n" text',
    ]
    rules += _named_parameter_calls(
        functions, ">\n", _is_xml_name, lambda name: json.dumps(f"{PARAMETER}{name}>\n"), _XML_END
    )
    return "\n".join([*rules, _XML_TEXT, _XML_KEY])


def _named_parameter_calls(
    functions: Sequence[Mapping[str, Any]],
    after_name: str,
    is_name: Callable[[str], bool],
    opening: Callable[[str], str],
    end: str,
) -> list[str]:
    """`call_i` for each of `functions` in the XML-like forms (Qwen3-Coder's, GLM-4.5's):
    its name and `after_name`, then its parameters, each `opening(name)` and its value
    up to `end`. Where a tool's parameters list their properties, they are those in
    that order, the required ones always, the others maybe; otherwise any parameters,
    their values text (`any_parameter`)."""
    rules = []
    for i, function in enumerate(functions):
        parameters = _parameters(function)
        properties = parameters.get("properties")
        head = json.dumps(function["name"] + after_name)
        if properties == {} and parameters.get("additionalProperties") is False:
            rules.append(f"call_{i}: {head}")  # takes none
            continue
        # A name the parser cannot read back (`<parameter=a>b>` reads as `a`) goes out
        # as any parameters, as OLMo 3's do: written, it made a call of other keys.
        if not isinstance(properties, dict) or not properties or not all(map(is_name, properties)):
            rules.append(f"call_{i}: {head} any_parameter*")
            continue
        required = set(parameters.get("required") or ())
        # A property's "#/$defs/..." refs point into the parameters' schema.
        shared: dict[str, Any] = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
        body = []
        for k, (name, schema) in enumerate(properties.items()):
            value, *terminals = _xml_value(schema, parameters, shared, f"VALUE_{i}_{k}", end)
            rules += [f"parameter_{i}_{k}: {opening(name)} {value}", *terminals]
            body.append(f"parameter_{i}_{k}" + ("" if name in required else "?"))
        rules.append(f"call_{i}: {head} {' '.join(body)}")
    return rules


def _key_value_calls(functions: Sequence[Mapping[str, Any]], marker: Callable[[str], str]) -> str:
    """One call in GLM-4.5's key and value tags of one of `functions`, its newlines as
    GLM-4.5's template writes them; its pairs as Qwen3-Coder's parameters (`_xml_calls`).
    A value's text holds no `</arg_value>`: where the tag is a token, the text ends at
    that token; where it is text, the text's terminal holds it, as `_XML_TEXT` does."""
    value_end = marker(ARG_VALUE_END)
    if value_end.startswith("<["):  # the token ends the text
        text, end = f"text: /(?s:.*)/ {value_end} \"\\n\"", f'{value_end} "\\n"'
    else:
        text = "text[lazy]: (/(?s:.*)/ & ~/(?s:.*)<\\/arg_value>(?s:.*)/) /<\\/arg_value>\\n/"
        end = json.dumps(f"{ARG_VALUE_END}\n")

    def opening(key: str) -> str:
        return f'{marker(ARG_KEY)} {key} {marker(ARG_KEY_END)} "\\n" {marker(ARG_VALUE)}'

    rules = [
        f"tool_call: {marker(CALL_TAG)} call {marker(CALL_END_TAG)}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
        f"any_parameter: {opening('KEY')} text",
        text,
        _XML_KEY,
    ]
    rules += _named_parameter_calls(functions, "\n", _is_key_name, lambda name: opening(json.dumps(name)), end)
    return "\n".join(rules)


def _is_key_name(name: str) -> bool:
    """Whether a key `name` reads back as itself from `<arg_key>NAME</arg_key>`."""
    return 0 < len(name) <= XML_NAME_LIMIT and name == name.strip() and "</arg_key>" not in name


def _is_xml_name(name: str) -> bool:
    """Whether a parameter `name` reads back as itself from `<parameter=NAME>`."""
    return 0 < len(name) <= XML_NAME_LIMIT and name == name.strip() and not any(c in name for c in "<>\n")


def _xml_value(
    schema: Any, parameters: dict[str, Any], shared: dict[str, Any], terminal: str, end: str = _XML_END
) -> list[str]:
    """The Lark expression for a parameter's value and its end, in Qwen3-Coder's XML:
    text for a string (or what its schema leaves open), JSON for any other type; then
    the definition of `terminal`, the name its string enum's values take, if it has one."""
    if not isinstance(schema, dict):
        return ["text"]
    if not is_text(value_types(schema, parameters)):
        json_schema = {**schema, **shared, "x-guidance": JSON_OPTIONS}
        return [f"%json {json.dumps(json_schema)} {end}"]
    consts = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None
    if consts and all(isinstance(c, str) for c in consts):
        # One terminal, which the lexer matches: as alternatives of a rule, past 2,000
        # values llguidance's parser refused the grammar (the JSON styles take them).
        return [f"{terminal} {end}", f"{terminal}: " + " | ".join(json.dumps(c) for c in consts)]
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
