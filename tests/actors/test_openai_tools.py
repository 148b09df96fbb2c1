"""Tool calls into OpenAI's deltas, without a server: ids, blank content, parallel calls."""

import json
import re

from runtime.errors import RequestError
from runtime.grammar import GrammarSpec

import pytest

from actors.openai_responses import sse, wire_json
from actors.openai_tools import (
    MAX_TOOLS,
    ToolCallDeltas,
    ToolCallStream,
    ToolRequest,
    structured_output,
    tool_request,
    whole_tool_calls,
    with_tool_calls,
)
from actors.requests import Delta

TWO_CALLS = (
    'Sure. \n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n'
)


def run(stream, text, step):
    content, deltas = "", []
    for start in range(0, len(text), step):
        more, calls = stream.feed(text[start : start + step])
        content, deltas = content + more, deltas + calls
    more, calls = stream.finish()
    return content + more, deltas + calls


def test_deltas_carry_the_id_and_name_once_and_reassemble_in_any_split():
    whole = run(ToolCallStream("hermes"), TWO_CALLS, len(TWO_CALLS))
    for step in (1, 2, 5, 17):
        content, deltas = run(ToolCallStream("hermes"), TWO_CALLS, step)
        assert content == whole[0] == "Sure."  # blanks before and between calls dropped
        firsts = [d for d in deltas if "id" in d]
        assert [(d["index"], d["function"]["name"]) for d in firsts] == [(0, "a"), (1, "b")]
        calls = whole_tool_calls(deltas)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("a", '{"x": 1}'),
            ("b", "{}"),
        ]


@pytest.mark.parametrize("step", [1, 5, 17, len(TWO_CALLS)])
def test_one_delta_holds_at_most_one_item_per_call(step):
    """A call's start and its first arguments, in one feed, were two items of one index:
    openai-python before its fix for #3201 took the second for another call."""
    stream = ToolCallStream("hermes")
    for start in range(0, len(TWO_CALLS), step):
        _, calls = stream.feed(TWO_CALLS[start : start + step])
        indexes = [call["index"] for call in calls]
        assert len(indexes) == len(set(indexes)), calls


def test_parallel_tool_calls_false_keeps_the_first_call():
    stream = ToolCallStream("hermes", is_parallel=False)
    content, deltas = run(stream, TWO_CALLS, 3)
    assert [c["function"]["name"] for c in whole_tool_calls(deltas)] == ["a"]
    assert stream.finish_reason("stop") == "tool_calls" and content == "Sure."


@pytest.mark.parametrize("is_parallel", [True, False])
def test_json_that_is_no_call_before_a_call_stays_content_and_the_call_is_kept(is_parallel):
    # The model's "[1]" once counted as call 0: the real call came as 1, past the ids
    # (IndexError: a 500, or a stream cut off), and parallel_tool_calls false dropped it.
    text = '<tool_call>\n[1]\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'
    for step in (1, 4, len(text)):
        stream = ToolCallStream("hermes", is_parallel=is_parallel)
        content, deltas = run(stream, text, step)
        calls = whole_tool_calls(deltas)
        assert content == "[1]" and [d["index"] for d in deltas if "id" in d] == [0]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("f", '{"a": 2}')
        ]
        assert stream.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "\\ud800", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"a": "\\udfff"}, "name": "f"}\n</tool_call>',
    ],
)
def test_a_lone_surrogate_a_model_escapes_into_a_call_still_goes_out_as_json(text):
    # Decoded, "\ud800" is a lone surrogate with no UTF-8 form: encoding the response
    # raised UnicodeEncodeError (a 500, or a stream cut off).
    _, deltas = run(ToolCallStream("hermes"), text, 5)
    (call,) = whole_tool_calls(deltas)
    chunk = {"choices": [{"index": 0, "delta": {"tool_calls": deltas}}]}
    for wire in (sse(chunk)[len(b"data: ") :], wire_json({"tool_calls": [call]})):
        assert json.loads(wire.decode("utf-8"))  # valid UTF-8 and valid JSON
    assert json.loads(wire)["tool_calls"][0] == call  # nothing lost: the escape goes out


def test_a_reply_without_calls_keeps_its_whitespace_and_reason():
    stream = ToolCallStream("hermes")
    assert run(stream, "plain text \n", 4) == ("plain text \n", [])
    assert stream.finish_reason("stop") == "stop"
    choice = {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}
    assert with_tool_calls(choice, []) is choice


@pytest.mark.parametrize("tools", [{}, "", 0, False])
def test_tools_that_are_not_a_list_are_refused_even_when_empty(tools):
    with pytest.raises(RequestError) as caught:
        tool_request({"tools": tools})
    assert caught.value.param == "tools"


def test_a_bad_strict_is_named_as_strict_not_as_the_schema():
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}}
    with pytest.raises(RequestError) as caught:
        structured_output(body)
    assert caught.value.param == "response_format.json_schema.strict"
    assert "strict" in str(caught.value)


def test_whitespace_before_a_call_does_not_reappear_after_it():
    text = 'A \n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nDone. '
    for step in (1, 4, len(text)):
        assert run(ToolCallStream("hermes"), text, step)[0] == "A\nDone."


def test_a_reply_cut_short_after_a_call_keeps_length_as_its_reason():
    stream = ToolCallStream("hermes")
    run(stream, TWO_CALLS, 7)
    assert stream.finish_reason("length") == "length"
    assert stream.finish_reason("stop") == "tool_calls"  # its calls are whole


CUT_CALL = '<tool_call>\n{"name": "b", "arguments": {"y": "lon'


def names_and_arguments(deltas):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in whole_tool_calls(deltas)]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_call_cut_short_is_its_text_in_a_whole_response_and_streams_as_written(step):
    """A reply that max_tokens ends inside a call's arguments: streamed, the call went
    out as it was written and "length" says it stops short (OpenAI's stream); whole, it
    was a call whose arguments no client can read: it is its text, in content (vLLM's
    answer), and the calls before it stand. A stop string or an EOS ending it streamed
    "tool_calls", which told a client to run those arguments: it says "stop"."""
    text = TWO_CALLS.split('<tool_call>\n{"name": "b"')[0] + CUT_CALL
    streamed = ToolCallStream("hermes")
    content, deltas = run(streamed, text, step)
    assert content == "Sure."
    assert names_and_arguments(deltas) == [("a", '{"x": 1}'), ("b", '{"y": "lon')]
    assert streamed.finish_reason("length") == "length"
    assert streamed.finish_reason("stop") == "stop"
    whole = ToolCallStream("hermes", is_streamed=False)
    content, deltas = run(whole, text, step)
    assert content == 'Sure.\n{"name": "b", "arguments": {"y": "lon'
    assert names_and_arguments(deltas) == [("a", '{"x": 1}')]
    assert whole.finish_reason("length") == "length"
    assert whole.finish_reason("stop") == "tool_calls"  # a stop string may end it too
    alone = ToolCallStream("hermes", is_streamed=False)
    content, deltas = run(alone, "Sure. " + CUT_CALL, step)
    assert (content, deltas) == ('Sure. {"name": "b", "arguments": {"y": "lon', [])
    assert alone.finish_reason("stop") == "stop"  # no call left: not "tool_calls"


def test_each_call_has_its_own_openai_style_id():
    _, deltas = run(ToolCallStream("hermes"), TWO_CALLS, 4)
    ids = [d["id"] for d in deltas if "id" in d]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_a_streamed_call_cut_short_goes_out_as_it_was_written():
    """ToolCallDeltas streams by default: a call the reply ends inside of went out."""
    deltas = ToolCallDeltas("hermes")
    first = deltas.convert(0, Delta(CUT_CALL))
    last = deltas.convert(0, Delta("", finish_reason="length"))
    calls = list(first.tool_calls + last.tool_calls)
    assert names_and_arguments(calls) == [("b", '{"y": "lon')]
    assert (first.text, last.text, last.finish_reason) == ("", "", "length")


def test_a_whole_responses_calls_come_with_its_last_delta():
    deltas = ToolCallDeltas("hermes", is_streamed=False)
    first = deltas.convert(0, Delta(TWO_CALLS))
    assert (first.text, first.tool_calls) == ("Sure.", ())
    last = deltas.convert(0, Delta("", finish_reason="stop"))
    assert [c["function"]["name"] for c in whole_tool_calls(list(last.tool_calls))] == ["a", "b"]
    assert last.finish_reason == "tool_calls"


def test_each_choice_has_its_own_calls_and_its_last_delta_releases_what_was_held():
    deltas = ToolCallDeltas("gemma", is_parallel=False)
    cut = deltas.convert(0, Delta("```tool_code\nf(a=1)\ng(b=2)"))  # cut short: parsed at the end
    plain = deltas.convert(1, Delta("hi \n"))
    assert (cut.text, cut.tool_calls, plain.text, plain.tool_calls) == ("", (), "hi", ())
    last = deltas.convert(0, Delta("", finish_reason="length"))
    calls = whole_tool_calls(list(last.tool_calls))
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"a": 1}'}]  # not g
    assert (last.text, last.finish_reason) == ("", "length")
    end = deltas.convert(1, Delta("", finish_reason="stop"))
    assert (end.text, end.tool_calls, end.finish_reason) == (" \n", (), "stop")


def test_a_choices_reply_parser_is_made_once_not_at_every_delta(monkeypatch):
    """A choice's ToolCallStream was built anew at each delta and dropped (`setdefault`
    builds its default every time), and with it a Qwen3-Coder parser that reads every
    tool's schema: with 128 Pydantic-like tools, 48 ms of each token, on the server's
    event loop. Each choice's is built once."""
    from runtime import qwen3_coder_reply

    built = []
    types = qwen3_coder_reply.parameter_types
    monkeypatch.setattr(qwen3_coder_reply, "parameter_types", lambda tools: built.append(1) or types(tools))
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}},)
    deltas = ToolCallDeltas("qwen3_coder", tools=tools)
    text = "<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    pieces = [deltas.convert(index, Delta(text[at : at + 5])) for at in range(0, len(text), 5) for index in (0, 1)]
    last = deltas.convert(0, Delta("", finish_reason="stop"))
    calls = [call for piece in pieces[::2] + [last] for call in piece.tool_calls]
    assert names_and_arguments(calls) == [("f", '{"n": 7}')]
    assert len(built) == 2  # one per choice


def test_a_last_delta_that_holds_a_whole_call_carries_it():
    """A reader behind the engine gets its text coalesced: the final delta may hold
    a call from its first character to its last."""
    call = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
    last = ToolCallDeltas("hermes").convert(0, Delta(call, finish_reason="stop"))
    calls = whole_tool_calls(list(last.tool_calls))
    assert [c["function"] for c in calls] == [{"name": "a", "arguments": '{"x": 1}'}]
    assert (last.text, last.finish_reason) == ("", "tool_calls")


def test_a_whole_reply_of_calls_only_has_null_content():
    """OpenAI's message: `content` is null beside `tool_calls`, not the empty string."""
    stream = ToolCallStream("hermes")
    content, deltas = run(stream, TWO_CALLS.removeprefix("Sure. "), 4)
    choice = {"index": 0, "message": {"role": "assistant", "content": content}}
    message = with_tool_calls(choice, deltas)["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 2
    said = {"index": 0, "message": {"role": "assistant", "content": "Sure."}}
    assert with_tool_calls(said, deltas)["message"]["content"] == "Sure."


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),  # two: not the first
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        # JSON text nested past json's depth: a RecursionError was a 500.
        ({"guided_json": "[" * 100_000 + "]" * 100_000}, "guided_json"),
        ({"structured_outputs": {"json": "[" * 100_000}}, "structured_outputs.json"),
        # and an integer past 4,300 digits, which json refuses with a bare ValueError
        ({"guided_json": '{"const": ' + "1" * 5000 + "}"}, "guided_json"),
        ({"response_format": "json_object"}, "response_format.type"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": 1}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "s"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
        ({"structured_outputs": "a+"}, "structured_outputs"),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),  # JSON text, but no schema
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_grammar": ["start"]}, "guided_grammar"),
    ],
)
def test_bad_structured_output_is_refused_naming_the_field(body, param):
    with pytest.raises(RequestError) as caught:
        structured_output(body)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        # Some servers take a schema here; this one gave any JSON object, not that schema.
        ({"type": "json_object", "schema": {"type": "integer"}}, "response_format.schema"),
        ({"type": "text", "strict": True}, "response_format.strict"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "pattern": "a"}},
            "response_format.json_schema.pattern",
        ),
    ],
)
def test_an_unknown_response_format_key_is_refused_naming_it(response_format, param):
    with pytest.raises(RequestError) as caught:
        structured_output({"response_format": response_format})
    assert (caught.value.param, caught.value.code) == (param, "unknown_field")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object", "", "response_format")),
        # OpenAI's default schema: any JSON.
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            GrammarSpec("json_schema", "{}", "response_format.json_schema.schema"),
        ),
        ({"structured_outputs": {"regex": "a+"}}, GrammarSpec("regex", "a+", "structured_outputs.regex")),
        (
            {"structured_outputs": {"choice": ["a", "b"]}},
            GrammarSpec("choice", '["a", "b"]', "structured_outputs.choice"),
        ),
        (
            {"structured_outputs": {"json": {"type": "integer"}}},
            GrammarSpec("json_schema", '{"type": "integer"}', "structured_outputs.json"),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "a"'}},
            GrammarSpec("lark", 'start: "a"', "structured_outputs.grammar"),
        ),
        ({"guided_json": {"type": "object"}}, GrammarSpec("json_schema", '{"type": "object"}', "guided_json")),
        ({"guided_choice": ["yes", "no"]}, GrammarSpec("choice", '["yes", "no"]', "guided_choice")),
        ({"guided_grammar": 'start: "a"'}, GrammarSpec("lark", 'start: "a"', "guided_grammar")),
        ({}, None),
    ],
)
def test_each_structured_output_field_gives_its_grammar(body, expected):
    assert structured_output(body) == expected


def test_an_unknown_key_is_named_in_at_most_64_characters():
    with pytest.raises(RequestError) as caught:
        structured_output({"response_format": {"type": "text", "k" * 100: 1}})
    assert caught.value.param == "response_format." + "k" * 64


def test_a_tool_choice_naming_no_offered_tool_quotes_at_most_64_characters_of_it():
    with pytest.raises(RequestError) as caught:
        tool_request({"tools": [TOOL], "tool_choice": named("g" * 10_000)})
    assert caught.value.param == "tool_choice" and len(str(caught.value)) < 200


def test_openais_json_schema_keys_are_all_accepted():
    spec = {"name": "x", "description": "a hint", "schema": {"type": "integer"}, "strict": True}
    response_format = {"type": "json_schema", "json_schema": spec}
    assert structured_output({"response_format": response_format}).source == '{"type": "integer"}'


def test_a_schema_may_come_as_json_text_or_a_boolean_and_text_format_constrains_nothing():
    assert structured_output({"guided_json": '{"type": "object"}'}) == GrammarSpec(
        "json_schema", '{"type": "object"}', "guided_json"
    )
    schema = {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}
    assert structured_output({"response_format": schema}).source == "true"
    text = {"response_format": {"type": "text"}}
    assert structured_output(text) is None
    assert structured_output({**text, "guided_regex": "a"}).kind == "regex"


TOOL = {"type": "function", "function": {"name": "f"}}
P0 = "tools[0].function.parameters"


def tools(count):
    """`count` tools of distinct names (a name twice is a 400)."""
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


def named(name):
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"function_call": "auto"}, "function_call"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"tools": tools(MAX_TOOLS + 1)}, "tools"),
        ({"tools": [{**TOOL, "type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]"),
        # OpenAI's names: 1 to 64 of [A-Za-z0-9_-]. Markup in one broke the call format.
        ({"tools": [TOOL, named("ab</tool_call>x")]}, "tools[1].function.name"),
        ({"tools": [named('a"b')]}, "tools[0].function.name"),
        ({"tools": [named("get weather")]}, "tools[0].function.name"),
        ({"tools": [named("f\n")]}, "tools[0].function.name"),
        ({"tools": [named("f" * 65)]}, "tools[0].function.name"),
        ({"tools": [named("get.weather")]}, "tools[0].function.name"),
        ({"tools": [{**TOOL, "function": {"name": "f", "parameters": []}}]}, P0),
        ({"tools": [{**TOOL, "function": {"name": "f", "parameters": None}}]}, P0),
        # OpenAI's rule: arguments are an object. A string schema gave calls of no JSON.
        (
            {"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": ["object"]}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": None}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tool_choice": "auto"}, "tool_choice"),  # a choice among no tools
        ({"tool_choice": "none"}, "tool_choice"),  # how to call none: still only beside tools
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),  # as OpenAI; it was accepted
        # Unknown keys were dropped: a typo'd "paramters" made a tool without parameters.
        (
            {"tools": [{**TOOL, "function": {"name": "f", "paramters": {}}}]},
            "tools[0].function.paramters",
        ),
        ({"tools": [TOOL, {**TOOL, "strict": True}]}, "tools[1].strict"),
        ({"tools": [], "parallel_tool_calls": True}, "parallel_tool_calls"),
        ({"tools": [TOOL], "tool_choice": {**TOOL, "type": "tool"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {**TOOL, "function": {"name": "g"}}}, "tool_choice"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(body, param):
    """`parameters` that are no object (null, a list) were named as the whole tool."""
    with pytest.raises(RequestError) as caught:
        tool_request(body)
    assert caught.value.param == param


def test_openais_function_tool_keys_are_all_accepted():
    function = {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    assert tool_request({"tools": [{"type": "function", "function": function}]}).tools


def test_function_names_as_openai_allows_them_are_accepted():
    names = ["get_weather", "get-time", "F0", "f" * 64]
    request = tool_request({"tools": [named(n) for n in names], "tool_choice": named("f" * 64)})
    assert [tool["function"]["name"] for tool in request.tools] == names


def test_a_request_without_tools_lets_the_model_answer_freely():
    assert tool_request({}) == ToolRequest()
    assert tool_request({"tools": None, "tool_choice": None}) == ToolRequest()


def test_a_named_tool_choice_forces_that_function():
    body = {"tools": [named("f"), named("g")], "tool_choice": named("g")}
    request = tool_request(body)
    assert (request.choice, request.name, request.is_parallel) == ("function", "g", True)


def test_at_most_128_tools_as_openai():
    assert len(tool_request({"tools": tools(128)}).tools) == 128
    with pytest.raises(RequestError):
        tool_request({"tools": tools(129)})


def test_parallel_tool_calls_are_on_unless_turned_off():
    assert tool_request({"tools": [TOOL]}).is_parallel
    assert tool_request({"tools": [TOOL], "parallel_tool_calls": None}).is_parallel
    assert not tool_request({"tools": [TOOL], "parallel_tool_calls": False}).is_parallel
    assert tool_request({"tools": tools(MAX_TOOLS), "tool_choice": "none"}).choice == "none"


def test_reasoning_streams_out_with_each_delta_not_only_the_last():
    deltas = ToolCallDeltas("harmony", parses_calls=False)
    first = deltas.convert(0, Delta("<|channel|>analysis<|message|>Hm, "))
    second = deltas.convert(0, Delta("Paris.<|end|><|start|>assistant<|channel|>final<|message|>Paris"))
    last = deltas.convert(0, Delta(".", finish_reason="stop"))
    assert [d.reasoning for d in (first, second, last)] == ["Hm, ", "Paris.", ""]
    assert "".join(d.text for d in (first, second, last)) == "Paris."


def test_structured_output_fields_sent_as_null_are_as_absent():
    body = {"response_format": None, "guided_regex": None, "structured_outputs": None, "guided_json": {}}
    assert structured_output(body) == GrammarSpec("json_schema", "{}", "guided_json")
