"""Gemma 4's replies through real HTTP, read by the official openai client: its thinking
apart from the answer (`reasoning` and `reasoning_content`), tool calls in its own
notation as JSON tool calls, forced calls written with its markers as tokens, and
assistant calls replayed into its template.

The checkpoint's tokenizer holds Gemma 4's markers as special tokens and its template
writes Gemma 4's markup (tests/actors/tool_templates.py). Random weights write none of
it, so a grammar writes the reply, its markers as the tokenizer's own tokens.
"""

import json

from runtime.gemma4_reply import CALL_CLOSE, CALL_OPEN, CHANNEL_CLOSE, CHANNEL_OPEN, QUOTE
from runtime.tokenizer import Tokenizer

import jsonschema
import pytest

from tests.actors import tool_templates
from tests.actors.test_http import in_thread, serving
from tests.actors.test_http_harmony import streamed
from tests.actors.test_http_tools import ASK, SCHEMAS, TOOLS, whole
from tests.actors.tool_templates import GEMMA4, with_markers

MARKERS = (CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN, CALL_CLOSE, QUOTE, "<|tool_response>", "<|turn>", "<turn|>")


@pytest.fixture(scope="module")
def gemma4(make_checkpoint, tmp_path_factory):
    """A tiny checkpoint speaking Gemma 4's markup: its markers special tokens,
    `<turn|>` and `<|tool_response>` among its EOS tokens."""
    size = Tokenizer.from_dir(make_checkpoint("llama")).vocab_size
    out = tmp_path_factory.mktemp("gemma4") / "gemma-4-like"
    return with_markers(make_checkpoint("llama", vocab_size=size + 8), out, GEMMA4, MARKERS, ("<turn|>", "<|tool_response>"))


def written(checkpoint, *parts):
    return tool_templates.written(checkpoint, MARKERS, *parts)


THOUGHT = (CHANNEL_OPEN, "thought\nThe user asks about Paris.", CHANNEL_CLOSE)
CALL = (CALL_OPEN, "call:get_weather{city:", QUOTE, "Paris", QUOTE, ",days:2}", CALL_CLOSE)


async def test_thinking_leaves_apart_from_the_answer_whole_and_streamed(gemma4):
    body = dict(messages=ASK, max_tokens=80, extra_body={"guided_grammar": written(gemma4, *THOUGHT, "Sunny.")})
    async with serving(gemma4) as server:
        assert server.llm.tool_style == "gemma4"
        done = await in_thread(whole, server, **body)
        reasoning, content, calls, finish, other = await in_thread(streamed, server, **body)
    message = done.choices[0].message
    assert message.content == "Sunny." and done.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "The user asks about Paris."
    assert (reasoning, content, calls, finish) == ("The user asks about Paris.", "Sunny.", [], "stop")
    assert other == reasoning


async def test_a_call_in_gemmas_notation_is_a_json_tool_call(gemma4):
    body = dict(
        messages=ASK, tools=TOOLS, max_tokens=80, extra_body={"guided_grammar": written(gemma4, *THOUGHT, *CALL)}
    )
    async with serving(gemma4) as server:
        done = await in_thread(whole, server, **body)
        reasoning, content, calls, finish, _ = await in_thread(streamed, server, **body)
        untooled = await in_thread(whole, server, **{k: v for k, v in body.items() if k != "tools"})
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert (reasoning, content, finish) == ("The user asks about Paris.", "", "tool_calls")
    assert calls == [["get_weather", call.function.arguments]]
    # Offered no tools, the call is the answer's text as the model wrote it.
    assert untooled.choices[0].message.tool_calls is None
    assert untooled.choices[0].message.content == "".join(CALL)


async def test_a_stop_string_never_matches_inside_a_marker(gemma4):
    """"call" and "channel" are in the markers' spellings; the call's own text ends it."""
    grammar = written(gemma4, *THOUGHT, *CALL)
    body = dict(messages=ASK, tools=TOOLS, max_tokens=80, stop=["channel", "call"], extra_body={"guided_grammar": grammar})
    async with serving(gemma4) as server:
        done = await in_thread(whole, server, **body)
    choice = done.choices[0]
    assert choice.message.model_extra["reasoning"] == "The user asks about Paris."
    # Cut by the stop in "call:get_weather", the call never closed: its text is content.
    assert (choice.message.content, choice.finish_reason) == (CALL_OPEN, "stop")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_a_forced_call_is_written_in_gemmas_notation_with_its_markers_as_tokens(gemma4, choice):
    body = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60, logprobs=True)
    async with serving(gemma4) as server:
        done = await in_thread(whole, server, **body)
        _, content, calls, finish, _ = await in_thread(streamed, server, **body)
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    (call,) = choice_.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    # The keys of its schema, each value one its schema allows (here enums).
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    tokens = [entry.token for entry in choice_.logprobs.content]
    assert tokens[0] == CALL_OPEN and tokens[-1] == CALL_CLOSE
    assert (content, finish) == ("", "tool_calls")
    assert calls == [[call.function.name, call.function.arguments]]


async def test_a_call_and_its_result_replayed_reach_the_template_in_gemmas_turn(gemma4):
    """The call in Gemma's notation, its result as the turn's `tool_responses`, the
    generation going on inside that turn."""
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    async with serving(gemma4) as server:
        done = await in_thread(whole, server, messages=history, max_tokens=1)
    tokenizer = Tokenizer.from_dir(gemma4)
    prompt = tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ], "tool_responses": [{"name": "get_weather", "response": {"sky": "clear"}}]}]
    )
    assert prompt.endswith(
        f'<|turn>model\n{CALL_OPEN}call:get_weather{{city:{QUOTE}Paris{QUOTE}}}{CALL_CLOSE}'
        '<|tool_response>response:get_weather{"sky": "clear"}<tool_response|>'
        f"{CHANNEL_OPEN}thought\n{CHANNEL_CLOSE}"
    )
    assert done.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


ODD_TOOLS = {
    # Keys a bare key would not hold: written quoted, as the parser reads them.
    "keys": ({"type": "object", "properties": {"first name": {"const": True}, "a:b": {"enum": ["x"]}, "": {"const": 1}},
              "required": ["first name", "a:b", ""]}, {"first name": True, "a:b": "x", "": 1}),
    # Enum and const values that are objects or arrays: in Gemma's notation, not JSON.
    "values": ({"type": "object", "properties": {"u": {"enum": [{"a": 1}]}, "v": {"const": [1, "x"]}},
                "required": ["u", "v"]}, {"u": {"a": 1}, "v": [1, "x"]}),
    # No parameters: the arguments are `{}`, nothing else (a tool with no `parameters` at
    # all gets this schema: `tool_call_grammar`'s test; this template needs the field).
    "none": ({"type": "object", "properties": {}, "additionalProperties": False}, {}),
}


async def test_a_forced_call_to_tools_with_odd_schemas_is_a_call_with_the_arguments_they_allow(gemma4):
    async with serving(gemma4) as server:
        for name, (parameters, arguments) in ODD_TOOLS.items():
            function = {"name": "f", "parameters": parameters}
            body = dict(
                messages=ASK, tools=[{"type": "function", "function": function}], max_tokens=60,
                tool_choice={"type": "function", "function": {"name": "f"}},
            )
            done = await in_thread(whole, server, **body)
            _, content, calls, finish, _ = await in_thread(streamed, server, **body)
            choice = done.choices[0]
            assert choice.finish_reason == "tool_calls", (name, choice.message.content)
            (call,) = choice.message.tool_calls
            assert json.loads(call.function.arguments) == arguments, name
            assert (content, finish, calls) == ("", "tool_calls", [["f", call.function.arguments]]), name
