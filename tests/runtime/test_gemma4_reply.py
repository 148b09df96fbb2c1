"""Gemma 4's reply markup -> reasoning, content and JSON tool calls, in any split."""

import json

from runtime.gemma4_reply import (
    CALL_CLOSE,
    CALL_OPEN,
    CHANNEL_CLOSE,
    CHANNEL_OPEN,
    QUOTE,
    gemma4_arguments,
)
from runtime.tool_prompts import chat_for_template, tool_style_for
from runtime.tools import CallArguments, CallStart, Content, Reasoning, parser_for

import pytest

Q = QUOTE
REPLY = (
    f"{CHANNEL_OPEN}thought\nThe user asks.\nTwo lines.{CHANNEL_CLOSE}Sure, checking.\n"
    f"{CALL_OPEN}call:get_weather{{city:{Q}Paris, <FR>{Q},days:3,opts:{{metric:true,none:null,"
    f"tags:[{Q} a {Q},-1.5e2,[]]}}}}{CALL_CLOSE}{CALL_OPEN}call:ping{{}}{CALL_CLOSE}"
)


def parsed(text, split, parses_calls=True):
    """(reasoning, content, [(name, arguments)]) from `text` fed `split` characters at a time."""
    parser = parser_for("gemma4", parses_calls)
    events = [e for i in range(0, len(text), split) for e in parser.feed(text[i : i + split])]
    events += parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [[e.name, ""] for e in events if isinstance(e, CallStart)]
    for e in events:
        if isinstance(e, CallArguments):
            calls[e.index][1] += e.fragment
    return reasoning, content, [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7, 11, 1000])
def test_reasoning_content_and_calls_come_out_the_same_in_any_split(split):
    reasoning, content, calls = parsed(REPLY, split)
    assert reasoning == "The user asks.\nTwo lines."  # the channel's name line is no reasoning
    assert content == "Sure, checking.\n"
    assert calls == [
        ("get_weather", {"city": "Paris, <FR>", "days": 3, "opts": {"metric": True, "none": None,
                                                               "tags": [" a ", -150.0, []]}}),
        ("ping", {}),
    ]


@pytest.mark.parametrize("split", [1, 4, 1000])
def test_offered_no_tools_a_call_is_content_as_written(split):
    reasoning, content, calls = parsed(REPLY, split, parses_calls=False)
    assert calls == [] and reasoning == "The user asks.\nTwo lines."
    assert content == "Sure, checking.\n" + REPLY.split("checking.\n", 1)[1]


@pytest.mark.parametrize(
    "body",
    [
        "call:f{a:}", "call:f{a:1,}", "call:f{a 1}", "call:f{a:wat}", f"call:f{{a:{Q}open}}", "call:f[1]",
        "call:{a:1}", "f{a:1}", "call:f{a:1}}",
        # No ':' after a key, no ',' between pairs, text after the call, a JSON string
        # that is no Gemma string (its strings are between <|"|> marks).
        "call:f{a 12}", f"call:f{{a:{Q}x{Q} bb:2}}", "call:f{a:1} then more", 'call:f{a:"x"}',
        # Not JSON once written as JSON: NaN and Infinity, or a float past a float's range.
        "call:f{a:NaN}", "call:f{a:-Infinity}", "call:f{a:Infinity}", "call:f{a:1e999}", "call:f{a:[-1e400]}",
    ],
)
def test_a_call_that_does_not_parse_is_the_text_the_model_wrote(body):
    reasoning, content, calls = parsed(f"Hi {CALL_OPEN}{body}{CALL_CLOSE}", 3)
    assert calls == [] and content == f"Hi {CALL_OPEN}{body}{CALL_CLOSE}"


def test_a_call_over_several_lines_parses_and_its_text_stays_unescaped():
    text = f"{CALL_OPEN}call:note{{\n  text:{Q}Zürich\nline two{Q},\n  n:1\n}}\n{CALL_CLOSE}"
    parser = parser_for("gemma4")
    events = parser.feed(text) + parser.finish()
    assert events == [CallStart(0, "note"), CallArguments(0, '{"text": "Zürich\\nline two", "n": 1}')]


def test_a_call_the_reply_ends_inside_of_is_text():
    _, content, calls = parsed(f"Hi {CALL_OPEN}call:f{{a:1", 2)
    assert calls == [] and content == f"Hi {CALL_OPEN}call:f{{a:1"


def test_an_empty_thought_channel_and_reasoning_cut_short():
    assert parsed(f"{CHANNEL_OPEN}{CHANNEL_CLOSE}Answer.", 1) == ("", "Answer.", [])
    assert parsed(f"{CHANNEL_OPEN}{CHANNEL_CLOSE}Answer.\nMore.", 1000) == ("", "Answer.\nMore.", [])  # one delta
    assert parsed(f"{CHANNEL_OPEN}thought\nStill thinking", 3) == ("Still thinking", "", [])
    assert parsed(f"{CHANNEL_OPEN}thou", 3) == ("", "", [])  # the name alone: nothing yet


def test_a_marker_begun_at_the_end_of_a_delta_waits_and_a_lone_one_is_text():
    parser = parser_for("gemma4")
    assert parser.feed("Hello <|tool") == [Content("Hello ")]
    assert parser.finish() == [Content("<|tool")]


def test_arguments_written_back_in_gemmas_notation_parse_to_the_same_json():
    arguments = {"b": [1, 2.5, True, None, "x"], "a": {"k": "v, <w>"}, "c": False}
    text = f"{CALL_OPEN}call:f{gemma4_arguments(arguments)}{CALL_CLOSE}"
    assert gemma4_arguments(arguments).startswith("{a:{k:")  # keys sorted, bare, as the template writes them
    assert parsed(text, 4)[2] == [("f", arguments)]


def test_keys_a_bare_key_would_not_hold_are_written_quoted_and_read_back():
    arguments = {"first name": 1, "a:b": 2, "": 3, "x,y": [4], "{k}": {"in ner": 1e99}, "plain": 5}
    written = gemma4_arguments(arguments)
    assert f"{Q}first name{Q}:1" in written and ",plain:5" in written  # quoted only where needed
    assert parsed(f"{CALL_OPEN}call:f{written}{CALL_CLOSE}", 3)[2] == [("f", arguments)]


def test_a_template_that_writes_gemma4s_call_marker_is_its_style():
    assert tool_style_for("{{ '<|tool_call>call:' + name }}", "gemma4_text") == "gemma4"
    assert tool_style_for("<start_of_turn>user", "gemma3_text") == "gemma"


def test_tool_results_become_the_tool_responses_of_the_turn_that_called():
    """As Gemma 4's template takes them: inside the model's turn, named after the call the
    result answers (by id), the response its JSON where it is JSON."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": '{"sky": "clear"}'}]},
        {"role": "tool", "tool_call_id": "c7", "name": "get_moon", "content": "full"},  # no such id: its own name
        {"role": "tool", "content": "?"},  # neither
        {"role": "user", "content": "Thanks"},
        {"role": "tool", "tool_call_id": "c9", "content": "stray"},  # after no call: a turn of its own
    ]
    chat = chat_for_template(messages, [], "gemma4", True)
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "tool"]
    assert chat[1]["tool_responses"] == [
        {"name": "get_time", "response": "noon"},
        {"name": "get_weather", "response": {"sky": "clear"}},
        {"name": "get_moon", "response": "full"},
        {"name": "unknown", "response": "?"},
    ]
    assert chat[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # Other formats' templates take OpenAI's tool turns as they are.
    assert [m["role"] for m in chat_for_template(messages, [], "hermes", True)] == [m["role"] for m in messages]
