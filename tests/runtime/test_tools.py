"""Tool calls in text: each family's parser, fed in any split; the format a template
implies; the chat a template sees; and the grammar that forces a call."""

import ast
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from runtime import json_ends, tool_prompts
from runtime.call_values import python_calls
from runtime.errors import RequestError
from runtime.glm4_reply import tool_names
from runtime.glm45_reply import GLM45_TAGS, key_value_call
from runtime.grammar import GrammarCompiler, GrammarSpec
from runtime.qwen3_coder_reply import parameter_types, parameter_value, value_types, xml_call
from runtime.tokenizer import Tokenizer
from runtime.tool_grammars import tool_call_grammar
from runtime.tool_prompts import (
    arguments_of_no_object,
    chat_for_template,
    template_knows_tools,
    tool_style_for,
    with_object_arguments,
)
from runtime.tools import (
    NEMOTRON_TAGS,
    SEED_TAGS,
    CallArguments,
    CallCutShort,
    CallStart,
    Content,
    Reasoning,
    parser_for,
)

import pytest
import tokenizers
import transformers

from tests.actors.tool_templates import GEMMA, HARMONY, HERMES, LLAMA3_JSON, MISTRAL

DEMO_DIR = Path(__file__).resolve().parents[2] / "runtime" / "demo"
DEMO = Tokenizer.from_dir(DEMO_DIR)


def with_template(template):
    """The demo tokenizer with `template` as its chat template."""
    backend = tokenizers.Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    return Tokenizer(backend, chat_template=template)


def parse(style, text, cuts=(), tools=()):
    """(content, [(name, arguments)]) from `text` fed in pieces split at `cuts`."""
    parser, events, last = parser_for(style, tools=tools), [], 0
    for cut in [*sorted(cuts), len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish()
    calls = {}
    for event in events:
        if isinstance(event, CallStart):
            assert event.index not in calls  # a name is reported once, before its arguments
            calls[event.index] = [event.name, ""]
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.fragment
    content = "".join(e.text for e in events if isinstance(e, Content))
    assert sorted(calls) == list(range(len(calls)))  # indexes count the calls: 0, 1, ...
    return content, [tuple(calls[i]) for i in sorted(calls)]


CASES = [
    (
        "hermes",
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 12}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n</tool_call>',
        (
            "Let me check.\n",
            [("get_weather", '{"city": "Paris", "days": 12}'), ("get_time", '{"tz": "UTC"}')],
        ),
    ),
    ("hermes", "No call, just <tool talk.", ("No call, just <tool talk.", [])),
    ("hermes", "It ends in <tool_ca", ("It ends in <tool_ca", [])),  # held as a marker, then text
    (
        "hermes",  # cut short by max_tokens: the arguments so far
        'A <tool_call>\n{"name": "f", "arguments": {"a": "xy',
        ("A ", [("f", '{"a": "xy')]),
    ),
    (
        "hermes",  # cut short inside the closing marker: no markup left as content
        'A <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call',
        ("A ", [("f", "{}")]),
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "g", "parameters": {"n": 123}}',
        ("", [("get_weather", '{"city": "Rome"}'), ("g", '{"n": 123}')]),
    ),
    ("llama3_json", '{"name": "f", "parameters": {}}', ("", [("f", "{}")])),
    ("llama3_json", "Plain {text} answer", ("Plain {text} answer", [])),
    # A name that is no JSON string (a raw newline, a bad escape) makes no call: text.
    ("llama3_json", '{"name": "a\nb", "parameters": {}}', ('{"name": "a\nb", "parameters": {}}', [])),
    (
        "hermes",
        'A <tool_call>\n{"name": "a\\x", "arguments": {}}\n</tool_call>',
        ('A {"name": "a\\x", "arguments": {}}\n', []),
    ),
    (
        "gemma",
        'Sure.\n```tool_code\nget_weather(city="Paris", days=3)\n```',
        ("Sure.\n", [("get_weather", '{"city": "Paris", "days": 3}')]),
    ),
    (
        "gemma",
        '```tool_code\n{"name": "f", "arguments": {"a": [1, 2]}}\n```',
        ("", [("f", '{"a": [1, 2]}')]),
    ),
    ("gemma", "```tool_code\nnot a call(\n```", ("```tool_code\nnot a call(\n```", [])),
    # JSON that is no call stays text and takes no call index: the call after it is 0.
    (
        "hermes",
        '<tool_call>\n[1]\n{"name": "f", "arguments": {}}\n</tool_call>',
        ("[1]", [("f", "{}")]),
    ),
    (
        "hermes",
        '<tool_call>\n5; {"arguments": {"a": 1}, "name": "f"}\n</tool_call>',
        ("5", [("f", '{"a": 1}')]),
    ),
    (
        "hermes",  # a number is whole only once what follows it is seen: "2.5" of "2.5e3"
        '<tool_call>\n2.5e3; {"name": "f", "arguments": {}}\n</tool_call>',
        ("2.5e3", [("f", "{}")]),
    ),
    ("llama3_json", '{"a": 1}; {"name": "f", "parameters": {}}', ('{"a": 1}', [("f", "{}")])),
    (
        "gemma",  # cut short by max_tokens inside a call: the text as written, no fence added
        'Sure.\n```tool_code\nget_weather(city="Par',
        ('Sure.\n```tool_code\nget_weather(city="Par', []),
    ),
    # Keys in another order: the call is reported whole, its arguments under either key.
    (
        "llama3_json",
        '{"parameters": {"city": "Rome"}, "name": "get_weather"}',
        ("", [("get_weather", '{"city": "Rome"}')]),
    ),
    (
        "hermes",  # arguments the model wrote as JSON text are that text, not re-encoded
        '<tool_call>\n{"arguments": "{\\"a\\": 1}", "name": "f"}\n</tool_call>',
        ("", [("f", '{"a": 1}')]),
    ),
    (
        "hermes",  # ... whichever key comes first (streamed, it was the quoted string)
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        ("", [("f", '{"a": 1}')]),
    ),
    (
        "gemma",  # arguments keep their characters, as JSON text not \\u-escaped
        '```tool_code\nget_weather(city="Zürich")\n```',
        ("", [("get_weather", '{"city": "Zürich"}')]),
    ),
    (
        "gemma",  # one block after another: the second block's call is the second call
        'A\n```tool_code\nf(a=1)\n```\nB\n```tool_code\ng(b=2)\n```',
        ("A\n\nB\n", [("f", '{"a": 1}'), ("g", '{"b": 2}')]),
    ),
    (
        "gemma",  # one call a line
        '```tool_code\nf(a=1)\ng(b="x")\n```',
        ("", [("f", '{"a": 1}'), ("g", '{"b": "x"}')]),
    ),
    ("gemma", "```tool_code\n[]\n```", ("```tool_code\n[]\n```", [])),  # no call: text
    # Blanks before the first character do not decide the reply is text...
    ("llama3_json", '\n {"name": "f", "parameters": {}}', ("", [("f", "{}")])),
    # A second call after its own tag (a call's leading tag is markup, not text).
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}; <|python_tag|>{"name": "g", "parameters": {"a": 1}}',
        ("", [("f", "{}"), ("g", '{"a": 1}')]),
    ),
    # A tag inside a call is text: the first tag anywhere was blanked, in an argument too.
    (
        "llama3_json",
        '{"name": "f", "parameters": {"code": "<|python_tag|>x"}}',
        ("", [("f", '{"code": "<|python_tag|>x"}')]),
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"a": "<|python_tag|>"}}',
        ("", [("f", '{"a": "<|python_tag|>"}')]),
    ),
    # ...and a reply of blanks alone is its text.
    ("llama3_json", " \n\n", (" \n\n", [])),
    # Arguments that never become JSON run to the closing marker, and not into it: a
    # delta ending in "</tool_" sent those characters as arguments before the marker
    # was whole.
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": abc}\n</tool_call>\nDone.',
        ("\nDone.", [("f", "abc}\n")]),
    ),
    (
        "hermes",  # ... and so do arguments the model never closed
        '<tool_call>\n{"name": "f", "arguments": {"a": [1</tool_call>',
        ("", [("f", '{"a": [1')]),
    ),
    (
        "hermes",  # ... and the call after them is the next call, not a second call 0
        '<tool_call>\n{"name": "f", "arguments": {"a": [1</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
        ("\n", [("f", '{"a": [1'), ("g", "{}")]),
    ),
    # A block with nothing in it: no call. Hermes' markup goes; gemma's stays the text it
    # was, as any block that holds no call.
    ("hermes", "A<tool_call></tool_call>B", ("AB", [])),
    ("gemma", "A```tool_code```B", ("A```tool_code```B", [])),
    # Python that is no list of calls: text, whatever its shape.
    ("gemma", "```tool_code\n[f(a=1)][0]\n```", ("```tool_code\n[f(a=1)][0]\n```", [])),
    # A call reported whole (keys in another order) takes its index: the next call is 1.
    (
        "llama3_json",
        '{"parameters": {"a": 1}, "name": "f"}; {"name": "g", "parameters": {}}',
        ("", [("f", '{"a": 1}'), ("g", "{}")]),
    ),
    # Mistral's calls: name[ARGS]arguments after each marker (text before the first), or
    # the older JSON list; what follows a marker and is neither stays the text it was.
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]g[ARGS] {}',
        ("Sure.", [("get_weather", '{"city": "Paris"}'), ("g", "{}")]),
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, "]"]}}, {"name": "g", "arguments": {}}]',
        ("", [("f", '{"a": [1, "]"]}'), ("g", "{}")]),
    ),
    # Two calls whose arguments begin at the same place after their markers; a name in blanks.
    (
        "mistral",
        '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": 22}[TOOL_CALLS] h [ARGS]{}',
        ("", [("f", '{"a": 1}'), ("g", '{"b": 22}'), ("h", "{}")]),
    ),
    ("mistral", "[TOOL_CALLS]f[ARGS][1] then", ("[TOOL_CALLS]f[ARGS][1] then", [])),
    ("mistral", '[TOOL_CALLS][{"a": 1}]', ('[TOOL_CALLS][{"a": 1}]', [])),
    ("mistral", "[TOOL_CALLS]no arguments", ("[TOOL_CALLS]no arguments", [])),
    ("mistral", "[TOOL_CALLS][] then", ("[TOOL_CALLS][] then", [])),  # a list of no calls
    ("mistral", '[TOOL_CALLS] [ARGS]{"a": 1}', ('[TOOL_CALLS] [ARGS]{"a": 1}', [])),  # no name
    # NaN, Infinity, a float past its range: JSON that strict readers refuse, so no call.
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": NaN}', ('[TOOL_CALLS]f[ARGS]{"a": NaN}', [])),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1e999}}]',
     ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1e999}}]', [])),
    # ... as for a call whose keys come the other way round, which is re-written, not streamed:
    # 1e999 went out as `Infinity`.
    ("hermes", '<tool_call>{"arguments": {"a": 1e999}, "name": "f"}</tool_call>',
     ('{"arguments": {"a": 1e999}, "name": "f"}', [])),
    ("llama3_json", '{"parameters": {"a": NaN}, "name": "f"}', ('{"parameters": {"a": NaN}, "name": "f"}', [])),
    # Streamed as they grow when the name comes first, NaN and Infinity go out as null:
    # they went out as written, and a client's JSON reader refused the whole call. In a
    # string, or a word of arguments that are no JSON, they stay.
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": NaN, "b": [-Infinity,Infinity ], "c": "NaN"}}</tool_call>',
        ("", [("f", '{"a": null, "b": [null,null ], "c": "NaN"}')]),
    ),
    ("hermes", '<tool_call>{"name": "f", "arguments": a=NaNa}</tool_call>', ("", [("f", "a=NaNa}")])),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": NaN}"}</tool_call>', ("", [("f", '{"a": null}')])),
    ("llama3_json", '{"name": "f", "parameters": {"a": [NaN]}}', ("", [("f", '{"a": [null]}')])),
    ("llama3_json", '{"name": "f", "parameters": {"a": -Infinity', ("", [("f", '{"a": null')])),
    ("mistral", "a [TOOL_C", ("a [TOOL_C", [])),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "cut', ('[TOOL_CALLS]f[ARGS]{"a": "cut', [])),
    # Arguments of none, written `null` (or a string of nothing or of null), are `{}`,
    # OpenAI's: "null" went out, which a client reads as None, no arguments to call with.
    ("hermes", '<tool_call>\n{"name": "f", "arguments": null}\n</tool_call>', ("", [("f", "{}")])),
    ("hermes", '<tool_call>\n{"arguments": null, "name": "f"}\n</tool_call>', ("", [("f", "{}")])),
    ("hermes", '<tool_call>{"name": "f", "arguments": "null"}</tool_call><tool_call>{"name": "g", "arguments": ""}</tool_call>',
     ("", [("f", "{}"), ("g", "{}")])),
    ("hermes", '<tool_call>{"name": "f", "arguments": nothing}</tool_call>', ("", [("f", "nothing}")])),
    ("llama3_json", '{"name": "f", "parameters": null}', ("", [("f", "{}")])),
    ("llama3_json", '{"name": "f", "parameters": null', ("", [("f", "{}")])),  # whole, though its } was cut
    # So are arguments of NaN or Infinity, which go out as null: "null" went out.
    ("hermes", '<tool_call>{"name": "f", "arguments": NaN}</tool_call>', ("", [("f", "{}")])),
    ("llama3_json", '{"name": "f", "parameters": -Infinity}', ("", [("f", "{}")])),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": Infinity}',
     ("", [("f", '{"a": 1}'), ("g", "{}")])),
    ("llama3_json", '{"name": "f", "parameters": -5}', ("", [("f", "-5")])),  # no object: as written
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": null}]', ("", [("f", "{}")])),
    # ... and in Mistral's named form, where `null` was no object, so the call was text
    ("mistral", "[TOOL_CALLS]f[ARGS]null", ("", [("f", "{}")])),
    ("mistral", "[TOOL_CALLS]f[ARGS] null[TOOL_CALLS]g[ARGS]{}", ("", [("f", "{}"), ("g", "{}")])),
    ("mistral", "[TOOL_CALLS]f[ARGS]nul", ("[TOOL_CALLS]f[ARGS]nul", [])),  # cut short: text
    ("granite", '<|tool_call|>[{"name": "f", "arguments": null}]', ("", [("f", "{}")])),
    ("nemotron", '<TOOLCALL>[{"name": "f", "arguments": null}]</TOOLCALL>', ("", [("f", "{}")])),
    ("command_r7b", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": null}]<|END_ACTION|>',
     ("", [("f", "{}")])),
    ("lfm2", '<|tool_call_start|>[{"name": "f", "arguments": null}]<|tool_call_end|>', ("", [("f", "{}")])),
    ("olmo3", '<function_calls>{"name": "f", "arguments": null}</function_calls>', ("", [("f", "{}")])),
    # A third call after a tagged second one: each call is found, the tag split anywhere.
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}; <|python_tag|>{"name": "g", "parameters": {}}; '
        '{"name": "h", "parameters": {"a": 1}}',
        ("", [("f", "{}"), ("g", "{}"), ("h", '{"a": 1}')]),
    ),
]


@pytest.mark.parametrize(("style", "text", "expected"), CASES)
def test_every_split_of_the_text_gives_the_same_calls(style, text, expected):
    assert parse(style, text) == expected
    for cut in range(1, len(text)):  # every one place a delta may end
        assert parse(style, text, [cut]) == expected, cut
    assert parse(style, text, range(1, len(text))) == expected  # a character a delta
    rng = random.Random(0)
    for _ in range(200):  # multi-token deltas from lookahead split anywhere
        cuts = rng.sample(range(1, len(text)), k=rng.randint(1, min(12, len(text) - 1)))
        assert parse(style, text, cuts) == expected, cuts


def random_json(rng, depth=0):
    kind = rng.choice(["str", "num", "lit", "list", "dict"] if depth < 4 else ["str", "num"])
    if kind == "str":
        characters = 'ab "{}[]\\/\n\u00e9\U0001f600,:'  # quotes, brackets, escapes, wide
        return "".join(rng.choice(characters) for _ in range(rng.randint(0, 12)))
    if kind == "num":
        return rng.choice([0, -3, 12.5, 10**20, 1e-7])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {random_json(rng, 9): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


@pytest.mark.parametrize("style", ["hermes", "llama3_json"])
def test_scanning_each_character_once_finds_the_ends_decoding_everything_again_finds(
    style, monkeypatch
):
    """The incremental scan (each token's text scanned once: decoding the whole call at
    every token was O(n^2), seconds for a long one) gives what decoding gives, for calls
    whole, cut short, and broken, fed in any split."""
    rng = random.Random(7)
    texts = []
    for _ in range(150):
        call = {"name": "f", "arguments" if style == "hermes" else "parameters": random_json(rng)}
        body = json.dumps(call, ensure_ascii=rng.random() < 0.5)
        if rng.random() < 0.3:  # broken: a character dropped
            at = rng.randrange(len(body))
            body = body[:at] + body[at + 1 :]
        text = f"<tool_call>\n{body}\n</tool_call>" if style == "hermes" else body
        texts.append(text[: rng.randint(1, len(text))] if rng.random() < 0.3 else text)
    scanned = []
    for text in texts:
        cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 40)))
        scanned.append((text, cuts, parse(style, text, cuts)))

    def decoded(value_end, text, is_final):
        return json_ends.json_end(text, value_end.start, is_final)

    monkeypatch.setattr(json_ends.ValueEnd, "find", decoded)
    for text, cuts, got in scanned:
        assert parse(style, text, cuts) == got, text


def test_hermes_streams_the_name_then_argument_fragments():
    parser = parser_for("hermes")
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu') == []
    assert parser.feed('ments": {"city": "Pa') == [
        CallStart(0, "get_weather"),
        CallArguments(0, '{"city": "Pa'),
    ]
    assert parser.feed('ris"}}\n</tool_call>') == [CallArguments(0, 'ris"}')]
    assert parser.finish() == []


def test_llama3_json_streams_the_name_then_argument_fragments():
    """A reply that is calls streams them as they are written, not at its end."""
    parser = parser_for("llama3_json")
    assert parser.feed('<|python_tag|>{"name": "get_weather", "param') == []
    assert parser.feed('eters": {"city": "Pa') == [
        CallStart(0, "get_weather"),
        CallArguments(0, '{"city": "Pa'),
    ]
    assert parser.feed('ris"}}; {"name": "g", ') == [CallArguments(0, 'ris"}')]
    assert parser.feed('"parameters": {}}') == [CallStart(1, "g"), CallArguments(1, "{}")]
    assert parser.finish() == []


@pytest.mark.parametrize("style", ["hermes", "llama3_json"])
def test_argument_fragments_are_never_empty_whatever_the_split(style):
    """A delta that adds nothing to a call's arguments sends nothing: an empty fragment
    is an empty `tool_calls` delta on the wire."""
    key = "arguments" if style == "hermes" else "parameters"
    body = f'{{"name": "f", "{key}": {{"city": "Paris"}}}}'
    text = f"<tool_call>\n{body}\n</tool_call>" if style == "hermes" else f"{body}; {body}"
    parser = parser_for(style)
    events = [e for character in text for e in parser.feed(character)] + parser.finish()
    fragments = [e.fragment for e in events if isinstance(e, CallArguments)]
    assert "".join(fragments).startswith('{"city": "Paris"}') and all(fragments)


CUT_SHORT = [
    (
        "hermes",
        'A <tool_call>\n{"name": "f", "arguments": {"a": "xy',
        '{"name": "f", "arguments": {"a": "xy',
    ),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a', '{"name": "f", "arguments": "{\\"a'),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_c',
        '{"name": "f", "arguments": {"a": 1',
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": [1, ',
        '{"name": "f", "parameters": [1, ',
    ),
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {',
        '{"name": "g", "parameters": {',
    ),
]


@pytest.mark.parametrize(("style", "text", "call_text"), CUT_SHORT)
def test_a_call_the_reply_ends_inside_of_is_reported_cut_short_with_its_text(
    style, text, call_text
):
    """A call's name and arguments stream as they are written; when the reply ends
    (max_tokens) before its arguments are whole JSON, the last event says so, so a
    whole response can give the call as the text it is, not as a call."""
    for cut in range(1, len(text)):
        parser = parser_for(style)
        events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        index = sum(isinstance(e, CallStart) for e in events) - 1
        assert events[-1] == CallCutShort(index, call_text), cut
        assert not any(isinstance(e, CallCutShort) for e in events[:-1])


@pytest.mark.parametrize(
    ("style", "text"),
    [
        ("hermes", 'A <tool_call>\n{"name": "f", "arguments": {"a": "xy"}'),  # only "}" missing
        ("hermes", 'A <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'),  # closed: not cut
        ("llama3_json", '{"name": "f", "parameters": {"a": [1]}'),
        ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parame'),  # g: no call
        ("llama3_json", '{"name": "f", "parameters": 12'),  # a number ends with the reply
        ("llama3_json", '{"name": "f", "parameters": "{\\"a\\": 1}"'),  # ... and a string
    ],
)
def test_a_call_whose_arguments_are_whole_is_not_cut_short(style, text):
    parser = parser_for(style)
    events = parser.feed(text) + parser.finish()
    assert any(isinstance(e, CallStart) for e in events)
    assert not any(isinstance(e, CallCutShort) for e in events)


def test_a_gemma_json_call_cut_short_is_its_text_as_its_python_calls_are():
    """Gemma's calls go out whole, when their block closes: one the reply ended inside
    of was a call with its arguments cut, as no other style's whole response is."""
    text = 'A\n```tool_code\n{"name": "f", "arguments": {"a": 1}}\n{"name": "g", "arguments": {"b'
    assert parse("gemma", text) == ('A\n{"name": "g", "arguments": {"b', [("f", '{"a": 1}')])


@pytest.mark.parametrize("end", ["</tool_call>", "</tool"])
def test_a_call_closed_where_its_arguments_should_begin_is_no_error(end):
    """The name is reported once something follows `"arguments": `; when that something
    was the closing marker (whole, or begun when max_tokens cut the reply), the body
    ended where the arguments begin, and reading their first character raised
    IndexError out of the HTTP handler (ToolCallDeltas.convert)."""
    text = '<tool_call>\n{"name": "f", "arguments": ' + end
    for cut in range(1, len(text)):
        content, calls = parse("hermes", text, [cut])
        assert [name for name, _ in calls] in ([], ["f"]) and "tool_call" not in content


def test_json_nested_too_deep_to_decode_is_text_or_raw_arguments_not_an_error():
    deep = "[" * 3000
    assert parse("hermes", f"<tool_call>{deep}</tool_call>") == (deep, [])
    assert parse("llama3_json", f'{{"name": "f", "parameters": {deep}') == ("", [("f", deep)])


def test_an_integer_too_long_for_python_is_text_or_raw_arguments_not_an_error():
    """json refuses integers past 4,300 digits with a bare ValueError, which the parser
    let out: a 500 for the whole answer, a stream cut with no error event."""
    arguments = '{"x": ' + "1" * 5000 + "}"
    for style, call in [
        ("hermes", f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'),
        ("llama3_json", f'{{"name": "f", "parameters": {arguments}}}'),
    ]:
        text, [(name, raw)] = parse(style, call)
        assert (text, name) == ("", "f") and raw.startswith(arguments)  # the rest, unparsed
    reordered = f'<tool_call>{{"arguments": {arguments}, "name": "f"}}</tool_call>'
    assert parse("hermes", reordered) == (reordered.removeprefix("<tool_call>").removesuffix("</tool_call>"), [])


def test_a_number_ends_only_once_what_follows_cannot_continue_it():
    """A number at the end of the text so far may still grow ("12" of "123", "2" of
    "2.5" or "2e-5"): its end is not known until a character that cannot continue it."""
    for growing in ("12", "2.", "2e", "2E+", "2e-", "-"):
        assert json_ends.json_end(growing, 0, is_final=False) is None, growing
    for text, end in (("12}", 2), ("12, ", 2), ("2.5]", 3), ("2e-5 ", 4), ("true,", 4)):
        assert json_ends.json_end(text, 0, is_final=False) == end, text
    assert json_ends.json_end("2e-", 0, is_final=True) == 1  # the reply ended: what decodes


def test_llama3_json_text_streams_once_its_first_character_says_it_is_no_call():
    """Only a reply that may still become a call waits: plain text goes out as it comes."""
    parser = parser_for("llama3_json")
    assert parser.feed("<|py") == []  # may be the tag yet
    assert parser.feed("x") == [Content("<|pyx")]
    parser = parser_for("llama3_json")
    assert parser.feed(" Hel") == [Content(" Hel")]
    assert parser.feed("lo") == [Content("lo")]
    assert parser.finish() == []


def test_an_unknown_style_is_refused():
    with pytest.raises(ValueError, match="unknown tool-call style 'xml'"):
        parser_for("xml")


def test_a_long_call_is_decoded_once_however_many_deltas_it_comes_in(monkeypatch):
    """Each delta's text is scanned once and what closes is decoded once: decoding the
    whole call again at every token made a long call O(n^2), seconds of the event loop."""
    decodes = []
    json_end = json_ends.json_end

    def counted(text, start, is_final):
        decodes.append(start)
        return json_end(text, start, is_final)

    monkeypatch.setattr(json_ends, "json_end", counted)

    def decodes_for(size):
        decodes.clear()
        arguments = json.dumps({"text": "x" * size, "n": [1, 2]})
        text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        assert parse("hermes", text, range(1, len(text), 3)) == ("", [("f", arguments)])
        return len(decodes)

    assert decodes_for(10) == decodes_for(2000) <= 4


def test_python_calls():
    assert python_calls('f(a=1, b="x")') == [{"name": "f", "arguments": {"a": 1, "b": "x"}}]
    assert python_calls("[f(), g(x=[1, 2])]") == [
        {"name": "f", "arguments": {}},
        {"name": "g", "arguments": {"x": [1, 2]}},
    ]
    assert python_calls("__import__('os').system('x')") is None  # only plain calls of literals
    assert python_calls("f(1)") is None  # positional arguments have no names
    # Nor has a `**` splat: its arguments were dropped, a call of `f` with `{}` instead.
    assert python_calls('f(a=1, **{"b": 2})') is None and python_calls("f(**{})") is None
    for value in ("{1, 2}", "...", "b'x'", "1e999"):  # literals JSON cannot hold
        assert python_calls(f"f(a={value})") is None
    text = "```tool_code\nf(a={1, 2})\n```"
    assert parse("gemma", text) == (text, [])
    assert python_calls('f(a=1)\ng(b="x")') == [
        {"name": "f", "arguments": {"a": 1}},
        {"name": "g", "arguments": {"b": "x"}},
    ]
    assert python_calls("[]") is None and python_calls("") is None  # no call at all
    # Nesting past what Python's parser takes: RecursionError, or MemoryError (10,000 "-"),
    # which went out of the parser and failed the whole response.
    for deep in ("-" * 3_000 + "1", "-" * 10_000 + "1", "not " * 10_000 + "True"):
        assert python_calls(f"f(a={deep})") is None
        text = f"```tool_code\nf(a={deep})\n```"
        assert parse("gemma", text) == (text, [])
    assert python_calls("[f(a=1)][0]") is None and python_calls("[x] = [f(a=1)]") is None


def test_python_calls_refuses_what_is_no_call_with_asserts_stripped():
    """Its checks were asserts: under `python -O`, `x + 1` raised AttributeError out of the
    parser and `f(1)` or `g.h(a=1)` were taken for calls."""
    probe = (
        "from runtime.call_values import python_calls; "
        "print([python_calls(t) for t in ('x + 1', 'f(1)', 'g.h(a=1)', 'f(**{})', '1', 'f(a=2)')])"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-O", "-c", probe], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([None] * 5 + [[{"name": "f", "arguments": {"a": 2}}]])


def test_the_format_follows_the_template():
    assert tool_style_for(HERMES, "qwen2") == "hermes"
    assert tool_style_for(LLAMA3_JSON, "llama") == "llama3_json"
    assert tool_style_for(GEMMA, "gemma3_text") == "gemma"
    assert tool_style_for("{{ messages }}", "mistral") == "hermes"
    # Mistral's by the marker its template writes calls with, whatever the family.
    assert tool_style_for(MISTRAL, "ministral3") == tool_style_for(MISTRAL, "llama") == "mistral"
    assert tool_style_for(HARMONY, "gpt_oss") == tool_style_for(HARMONY, "llama") == "harmony"
    assert tool_style_for("<|channel|>{{ messages }}", "gpt_oss") == "hermes"  # half the markers
    # Gemma is known by its model_type too, or by its turn markers in any family.
    assert tool_style_for("{{ messages }}", "gemma3_text") == "gemma"
    assert tool_style_for("<start_of_turn>{{ messages }}", "custom") == "gemma"
    assert template_knows_tools(HERMES) and not template_knows_tools(GEMMA)


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages }}{%- if tools %}<|python_tag|>{%- endif %}",
        "{%- for m in messages %}<|start_header_id|>{{ m.role }}{%- endfor %}Environment: ipython",
    ],
    ids=["python_tag only", "ipython only"],
)
def test_either_llama3_marker_alone_makes_the_format_llama3_json(template):
    """Llama 3.1's template has both; a fine-tune's may keep only one."""
    assert tool_style_for(template, "llama") == "llama3_json"
    assert tool_style_for(template, "custom") == "llama3_json"


def test_a_template_that_writes_tool_call_is_hermes_whatever_the_family():
    """A Gemma or Llama fine-tune taught Hermes' `<tool_call>` writes Hermes calls."""
    assert tool_style_for(HERMES, "gemma2") == "hermes"
    assert tool_style_for(f"<start_of_turn>{HERMES}", "gemma3_text") == "hermes"
    assert tool_style_for(f"{HERMES}{{# ipython <|python_tag|> #}}", "llama") == "hermes"


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def test_a_tool_history_round_trips_into_a_template_that_takes_tools():
    rendered = with_template(HERMES).apply_chat_template(
        chat_for_template(HISTORY, TOOLS, "hermes", knows_tools=True), template_kwargs=None
    )
    # Arguments sent as JSON text reach the template as an object (`| tojson` of a dict).
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered


def test_mistral_call_ids_are_nine_characters_a_call_and_its_result_alike():
    """Mistral's templates refuse ids not of 9 letters and digits; another client's ids
    are shown as such, each the same in its call and its result, distinct ids distinct,
    one already of that form kept, and the same every time the chat is sent."""
    ids = ["call_1", "call_Xq3bZk9LmN2pR7sT4vW8yA1c", "xyzcall_Xq3bZk9LmN2pR7sT4vW8yA1c", "", "Ab3dE6gH9"]
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]
    chat = [
        HISTORY[0],
        {"role": "assistant", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": i, "content": "ok"} for i in ids),
    ]
    shown = chat_for_template(chat, TOOLS, "mistral", knows_tools=True)
    call_ids = [call["id"] for call in shown[1]["tool_calls"]]
    assert all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in call_ids)
    assert len(set(call_ids)) == len(ids) and call_ids[-1] == "Ab3dE6gH9"
    assert [m["tool_call_id"] for m in shown[2:]] == call_ids
    assert chat_for_template(chat, TOOLS, "mistral", knows_tools=True) == shown
    assert chat_for_template(chat, TOOLS, "hermes", knows_tools=True)[1]["tool_calls"][0]["id"] == "call_1"


def test_a_result_without_a_call_id_takes_that_of_the_call_it_answers_by_place():
    """Mistral's templates write each result's id and refused the chat without one;
    the k-th result after a turn of calls answers its k-th call, as templates without
    ids read them, and one with no call to answer gets an id of its own."""
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ("call_1", "Ab3dE6gH9")]
    chat = [
        HISTORY[0],
        {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "content": "one"},
        {"role": "tool", "content": "two"},
        {"role": "tool", "content": "three"},
    ]
    shown = chat_for_template(chat, TOOLS, "mistral", knows_tools=True)
    call_ids = [call["id"] for call in shown[1]["tool_calls"]]
    result_ids = [m["tool_call_id"] for m in shown[2:]]
    assert result_ids[:2] == call_ids and call_ids[1] == "Ab3dE6gH9"
    assert re.fullmatch("[A-Za-z0-9]{9}", result_ids[2]) and result_ids[2] not in call_ids
    assert "tool_call_id" not in chat_for_template(chat, TOOLS, "hermes", knows_tools=True)[2]


def test_a_result_before_any_call_gets_an_id_of_its_own():
    """A client's result that answers no call (none came before it) has none to take:
    it gets an id of its own, 9 characters as Mistral's templates want, and the chat
    renders."""
    chat = [HISTORY[0], {"role": "tool", "content": "sunny"}, *HISTORY[1:]]
    shown = chat_for_template(chat, TOOLS, "mistral", knows_tools=True)
    call_id = shown[2]["tool_calls"][0]["id"]
    assert re.fullmatch("[A-Za-z0-9]{9}", shown[1]["tool_call_id"]) and shown[1]["tool_call_id"] != call_id


def test_a_mistral_call_id_shown_never_takes_one_the_chat_already_holds():
    """An id whose hash spells an id of the chat's own (kept as it is) draws again: two
    calls are never shown as one."""
    ids = ["call_1", "Cn4EhgXRh"]  # the second: the first's first draw
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]
    chat = [HISTORY[0], {"role": "assistant", "tool_calls": calls}]
    shown = [call["id"] for call in chat_for_template(chat, TOOLS, "mistral", knows_tools=True)[1]["tool_calls"]]
    assert shown[1] == "Cn4EhgXRh" and re.fullmatch("[A-Za-z0-9]{9}", shown[0]) and shown[0] != shown[1]


def test_two_mistral_call_ids_whose_hashes_agree_are_still_shown_apart(monkeypatch):
    """A clash between two ids shown (one in 62**9 per pair) draws again, as a clash
    with a kept one does: here every id's draws are the same (its first, its second)."""
    real = hashlib.sha256
    monkeypatch.setattr(tool_prompts.hashlib, "sha256", lambda data: real(data.split(b":")[0]))
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ("call_1", "call_2", "call_3")]
    chat = [HISTORY[0], {"role": "assistant", "tool_calls": calls}]
    shown = [call["id"] for call in chat_for_template(chat, TOOLS, "mistral", knows_tools=True)[1]["tool_calls"]]
    assert len(set(shown)) == 3 and all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in shown)


def test_mistral_call_ids_take_time_linear_in_their_number():
    """Each id shown was drawn against a fresh copy of every id taken so far: 16,000
    calls (a long agent history, well under the body limit) took seconds."""

    def seconds(num_calls):
        calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "f"}} for i in range(num_calls)]
        chat = [HISTORY[0], {"role": "assistant", "tool_calls": calls}]
        started = time.perf_counter()
        shown = chat_for_template(chat, TOOLS, "mistral", knows_tools=True)
        assert len({call["id"] for call in shown[1]["tool_calls"]}) == num_calls
        return time.perf_counter() - started

    small = min(seconds(2_000) for _ in range(3))
    assert seconds(16_000) < 20 * small + 1.0  # linear: 8 times; quadratic: 64 (~4 s)


def test_hermes_template_is_given_the_tools():
    tokenizer = with_template(HERMES)
    ids = tokenizer.encode_chat(HISTORY[:1], tools=TOOLS)
    assert json.dumps(TOOLS[0]) in tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("parameters", "shown"),
    [
        (None, {"type": "object", "properties": {}}),
        ({}, {"type": "object", "properties": {}}),
        ({"type": "object"}, {"type": "object", "properties": {}}),
        ({"type": "object", "required": []}, {"type": "object", "required": [], "properties": {}}),
        # A schema of properties, however few, is the client's, untouched.
        ({"type": "object", "properties": {}}, {"type": "object", "properties": {}}),
        (TOOLS[0]["function"]["parameters"], TOOLS[0]["function"]["parameters"]),
    ],
)
def test_a_template_is_shown_each_tool_with_properties_and_the_clients_own_as_sent(parameters, shown):
    """A schema without `properties` gets empty ones (Seed-OSS's template iterates them);
    one with properties, and every other field and tool, is the client's as sent."""
    function = {"name": "now", "description": "d"} | ({} if parameters is None else {"parameters": parameters})
    tools = [{"type": "function", "function": function}, *TOOLS, {"type": "function"}]
    given = json.loads(json.dumps(tools))
    assert tool_prompts.tools_for_template(tools) == [
        {"type": "function", "function": {"name": "now", "description": "d", "parameters": shown}},
        *TOOLS,
        {"type": "function"},
    ]
    assert tools == given  # the request's own tools are not changed


def test_a_template_without_tools_gets_them_in_the_first_user_turn():
    chat = chat_for_template(HISTORY, TOOLS, "gemma", knows_tools=False)
    assert [m["role"] for m in chat] == ["user", "assistant", "user"]
    assert "get_weather" in chat[0]["content"] and "```tool_code" in chat[0]["content"]
    assert chat[1]["content"] == "```tool_code\nget_weather(city='Paris')\n```"
    assert chat[2]["content"] == "```tool_output\nsunny, 21 C\n```"
    # ...and the call reads back through the parser as the call it was.
    assert parse("gemma", chat[1]["content"]) == ("", [("get_weather", '{"city": "Paris"}')])


def admits(grammar, text: str) -> bool:
    state = grammar.start()
    return all(state.advance(token) is None for token in DEMO.encode(text, add_special_tokens=False))


def test_gemma4s_forced_call_takes_no_keys_without_parameters_and_only_numbers_a_float_holds():
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    bare = compiler.compile(tool_call_grammar("gemma4", [{"type": "function", "function": {"name": "f"}}], "f"))
    assert admits(bare, "<|tool_call>call:f{}<tool_call|>")
    assert not admits(bare, "<|tool_call>call:f{a:1}<tool_call|>")
    number = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": "g", "parameters": number}}]
    grammar = compiler.compile(tool_call_grammar("gemma4", tools, "g"))
    assert admits(grammar, "<|tool_call>call:g{x:-12345678901234567890.5e99}<tool_call|>")
    assert not admits(grammar, "<|tool_call>call:g{x:1e999}<tool_call|>")  # Infinity, read back
    assert not admits(grammar, "<|tool_call>call:g{x:" + "9" * 400 + ".0}<tool_call|>")


def test_gemma4s_forced_call_takes_the_required_keys_always_the_others_maybe_each_of_its_kind():
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    parameters = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"const": "c"}, "days": {"type": "integer"}},
        "required": ["city"],
    }
    tools = [
        {"type": "function", "function": {"name": "g", "parameters": parameters}},
        {"type": "function", "function": {"name": "h", "parameters": {"type": "object", "properties": {}}}},
    ]
    grammar = compiler.compile(tool_call_grammar("gemma4", tools, None))
    q = '<|"|>'

    def call(text):
        return admits(grammar, f"<|tool_call>call:{text}<tool_call|>")

    assert call(f"g{{city:{q}Paris{q}}}") and call(f"g{{city:{q}Rome{q},unit:{q}c{q},days:3}}")
    assert not call("g{days:3}")  # a required key left out
    assert not call(f"g{{city:{q}Berlin{q}}}") and not call(f"g{{city:{q}Rome{q},unit:{q}f{q}}}")
    assert not call(f"g{{city:{q}Rome{q},days:1.5}}")
    # Properties listed as none, but not closed by additionalProperties: any keys.
    assert call("h{}") and call(f"h{{a:1,b:{q}x{q}}}")


@pytest.mark.parametrize("style", ["hermes", "llama3_json", "gemma", "mistral", "harmony"])
@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_the_forced_call_grammar_admits_a_call_and_refuses_text(style, forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    grammar = compiler.compile(tool_call_grammar(style, TOOLS, forced))
    key = "parameters" if style == "llama3_json" else "arguments"
    call = json.dumps({"name": "get_weather", key: {"city": "Rome"}})
    wrapped = {
        "hermes": f"<tool_call>\n{call}\n</tool_call>",
        "gemma": f"```tool_code\n{call}\n```",
        "llama3_json": call,
        "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
        "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}',
    }[style]
    state = grammar.start()
    for token in DEMO.encode(wrapped, add_special_tokens=False):
        assert state.advance(token) is None, wrapped
    assert state.is_done
    assert parse(style, wrapped)[1] == [("get_weather", '{"city": "Rome"}')]
    refused = grammar.start().advance(DEMO.encode("Hello", add_special_tokens=False)[0])
    assert refused is not None


@pytest.mark.parametrize("cuts", [(), (1,), (3, 9)])
def test_llama3_json_that_is_not_a_call_stays_the_text_it_was(cuts):
    assert parse("llama3_json", '{"answer":42,  "ok":true}', cuts) == (
        '{"answer":42,  "ok":true}',
        [],
    )


@pytest.mark.parametrize("template", [HERMES, LLAMA3_JSON])
def test_tools_render_as_transformers_renders_them(tmp_path, template):
    """transformers' apply_chat_template(tools=...) is the oracle, history included."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template})
    )
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    chat = chat_for_template(HISTORY, TOOLS, "hermes", knows_tools=True)
    text = oracle.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected = oracle(text, add_special_tokens=False)["input_ids"]
    assert Tokenizer.from_dir(tmp_path).encode_chat(chat, tools=TOOLS) == expected


@pytest.mark.parametrize(
    "style",
    [
        "hermes", "llama3_json", "gemma", "mistral", "harmony", "qwen3_coder", "olmo3", "granite", "glm4", "lfm2",
        "nemotron", "glm45", "seed_oss", "command_r7b",
    ],
)
def test_a_template_without_tools_is_taught_each_format_and_shown_calls_in_it(style):
    said = {**HISTORY[1], "content": "Let me check."}
    chat = chat_for_template([HISTORY[0], said, HISTORY[2]], TOOLS, style, knows_tools=False)
    first = chat[0]["content"]
    assert first.endswith("\n\nWeather in Paris?")  # the user's own words stay, after it
    taught = {
        "hermes": '<tool_call>\n{"name": <function-name>, "arguments"',
        "llama3_json": '{"name": <function-name>, "parameters"',
        "gemma": "```tool_code\nfunction_name(",
        "mistral": "[TOOL_CALLS]<function-name>[ARGS]<args-json-object>",
        "harmony": "on the commentary channel to=functions.<function-name>",
        "qwen3_coder": "<tool_call>\n<function=<function-name>>\n<parameter=<parameter-name>>\n<value>\n",
        "olmo3": "<function_calls><function-name>(<param-name>=<json-value>, ...)</function_calls>",
        "granite": '<|tool_call|>[{"name": <function-name>, "arguments": <args-json-object>}]',
        "glm4": "reply with its name alone on the first line, then its arguments as a JSON object",
        "lfm2": "<|tool_call_start|>[<function-name>(<param-name>=<value>, ...), ...]<|tool_call_end|>",
        "nemotron": '<TOOLCALL>[{"name": <function-name>, "arguments": <args-json-object>}, ...]</TOOLCALL>',
        "glm45": "<tool_call><function-name>\n<arg_key><key></arg_key>\n<arg_value><value></arg_value>\n</tool_call>",
        "seed_oss": "<seed:tool_call>\n<function=<function-name>>\n<parameter=<parameter-name>>\n<value>\n",
        "command_r7b": '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": <function-name>, "parameters": '
        "<args-json-object>}, ...]<|END_ACTION|>",
    }
    assert taught[style] in first and json.dumps(TOOLS[0]["function"]) in first
    # The assistant's text, then its call in the model's own format: it parses back.
    assert chat[1]["content"].startswith("Let me check.\n")
    assert "tool_calls" not in chat[1]  # the calls are its text now
    content, calls = parse(style, chat[1]["content"].removeprefix("Let me check.\n"), tools=TOOLS)
    assert (content, calls) == ("", [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize(
    ("style", "written"),
    [
        (
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
        (
            "harmony",
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        ),
    ],
)
def test_a_past_call_is_shown_under_the_key_its_format_teaches(style, written):
    """Llama 3 is taught `parameters`: a history written with `arguments` shows the
    model a form other than the one it is asked to write."""
    chat = chat_for_template(HISTORY, TOOLS, style, knows_tools=False)
    assert chat[1]["content"] == written


def test_a_chat_without_a_user_turn_gets_the_tools_in_one_of_its_own():
    system = {"role": "system", "content": "Be brief."}
    chat = chat_for_template([system], TOOLS, "hermes", knows_tools=False)
    assert [m["role"] for m in chat] == ["user", "system"]
    assert "get_weather" in chat[0]["content"] and chat[1] == system


def test_call_arguments_that_are_not_json_reach_the_template_as_sent():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    (kept,) = chat_for_template([message], [], "hermes", knows_tools=True)
    assert kept["tool_calls"][0]["function"]["arguments"] == "{oops"


@pytest.mark.parametrize(
    "style",
    [
        "hermes", "llama3_json", "gemma", "mistral", "harmony", "gemma4", "qwen3_coder", "olmo3", "granite", "glm4", "lfm2",
        "nemotron", "glm45", "seed_oss", "command_r7b",
    ],
)
def test_call_arguments_that_are_not_json_are_written_into_a_template_without_tools(style):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    (written,) = chat_for_template([message], [], style, knows_tools=False)
    assert written["role"] == "assistant" and "{oops" in written["content"]
    if style == "olmo3":  # in its own form still, not Llama 3's JSON
        assert written["content"] == "<function_calls>f({oops)</function_calls>"


@pytest.mark.parametrize(
    "arguments",
    ['{"n": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000],
    ids=["integer past 4,300 digits", "nested past the recursion limit"],
)
def test_call_arguments_python_cannot_read_reach_the_template_as_sent(arguments):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    (kept,) = chat_for_template([message], [], "hermes", knows_tools=True)
    assert kept["tool_calls"][0]["function"]["arguments"] == arguments


def test_call_arguments_nested_too_deeply_to_render_are_a_request_error():
    """Half the recursion limit: json.dumps writes it, a Python walk of it overflows."""
    depth = sys.getrecursionlimit() // 2
    arguments = "[" * depth + "]" * depth
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    with pytest.raises(RequestError, match="nest too deeply") as info:
        with_template(HERMES).encode_chat(chat_for_template(chat, [], "hermes", knows_tools=True))
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    ("style", "markers"),
    [
        ("mistral", ("[TOOL_CALLS]", "[ARGS]")),
        ("harmony", ("<|channel|>", "<|constrain|>", "<|message|>")),
        ("nemotron", NEMOTRON_TAGS),
        ("seed_oss", SEED_TAGS),
        ("glm45", GLM45_TAGS),
    ],
)
def test_a_forced_calls_markers_that_are_control_tokens_are_written_as_those_tokens(style, markers):
    tokens = {marker: 100 + i for i, marker in enumerate(markers)}
    source = tool_call_grammar(style, TOOLS, None, control_tokens=tokens).source
    for marker, token_id in tokens.items():
        assert f"<[{token_id}]>" in source and json.dumps(marker) not in source, marker
    if style == "glm45":  # a value's text ends at the `</arg_value>` token, no terminal of text
        assert 'text: /(?s:.*)/ <[105]> "\\n"' in source and "text[lazy]" not in source
        GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids).compile(tool_call_grammar(style, TOOLS, None, control_tokens=tokens))


def test_a_forced_name_admits_only_that_function():
    other = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    grammar = compiler.compile(tool_call_grammar("llama3_json", [other, *TOOLS], "get_weather"))
    state = grammar.start()
    refused = None
    for token in DEMO.encode('{"name": "get_time"', add_special_tokens=False):
        refused = refused or state.advance(token)
    assert refused is not None
    state = grammar.start()
    call = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert all(state.advance(t) is None for t in DEMO.encode(call, add_special_tokens=False))
    assert state.is_done


def test_a_forced_call_of_a_function_without_parameters_takes_no_arguments():
    """OpenAI: omitting parameters defines an empty parameter list (it was any object)."""
    bare = {"type": "function", "function": {"name": "now"}}
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    grammar = compiler.compile(tool_call_grammar("llama3_json", [bare], "now"))

    def admits(call):
        state = grammar.start()
        return all(state.advance(t) is None for t in DEMO.encode(call, add_special_tokens=False))

    assert admits('{"name": "now", "parameters": {}}')
    assert not admits('{"name": "now", "parameters": {"tz": "UTC"}}')


def admitted_by(grammar, text):
    state = grammar.start()
    return all(state.advance(t) is None for t in DEMO.encode(text, add_special_tokens=False))


def test_a_forced_call_is_its_name_and_its_arguments_and_nothing_else():
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    grammar = compiler.compile(tool_call_grammar("llama3_json", TOOLS, "get_weather"))
    assert admitted_by(grammar, '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert not admitted_by(grammar, '{"name": "get_weather"}')  # no arguments: no call
    extra = '{"name": "get_weather", "parameters": {"city": "Rome"}, "id": 1}'
    assert not admitted_by(grammar, extra)


@pytest.mark.parametrize(
    "parameters",
    [
        {},  # says nothing of the arguments, but they are still an object
        # No `type` admits any JSON value, and arguments that are no object parse as
        # no call: a forced call wrote a string.
        {"maxLength": 4},
    ],
    ids=["empty", "no_type"],
)
def test_a_forced_calls_arguments_are_an_object_whatever_the_schema_leaves_out(parameters):
    tools = [{"type": "function", "function": {"name": "log", "parameters": parameters}}]
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    grammar = compiler.compile(tool_call_grammar("hermes", tools, "log"))

    def admits(arguments):
        call = f'{{"name": "log", "arguments": {arguments}}}'
        return admitted_by(grammar, f"<tool_call>\n{call}\n</tool_call>")

    assert admits('{"line": "x", "n": 2}')
    assert not admits("5") and not admits('"text"') and not admits("[1]")


ORDER = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
        "then": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["items", "then"],
    "additionalProperties": False,
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {"sku": {"type": "string"}},
            "required": ["sku"],
            "additionalProperties": False,
        }
    },
}


ITEMS_BY_ID = {"type": "array", "items": {"$ref": "https://example.com/order.json#/$defs/Item"}}


@pytest.mark.parametrize(
    "order",
    [
        ORDER,
        {"$id": "https://example.com/order.json", **ORDER},
        # A ref through the parameters' own $id resolves only while that $id is theirs.
        {
            "$id": "https://example.com/order.json",
            **ORDER,
            "properties": {**ORDER["properties"], "items": ITEMS_BY_ID},
        },
    ],
    ids=["pydantic", "own_id", "ref_by_own_id"],
)
def test_a_forced_call_follows_parameters_that_refer_to_their_own_defs(order):
    """Pydantic writes nested models as "#/$defs/..." refs and recursion as "#"; both
    mean the parameters schema, not the call object the grammar wraps it in."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "order", "parameters": order}}]
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    grammar = compiler.compile(tool_call_grammar("hermes", tools, None))

    def admits(arguments):
        text = f'<tool_call>\n{{"name": "order", "arguments": {arguments}}}\n</tool_call>'
        state = grammar.start()
        return all(state.advance(t) is None for t in DEMO.encode(text, add_special_tokens=False))

    assert admits('{"items": [{"sku": "a"}], "then": {"items": [], "then": null}}')
    assert not admits('{"items": [{"name": "a"}], "then": null}')
    assert not admits('{"items": [], "then": {"sku": "a"}}')


def test_tools_whose_parameters_share_an_id_each_keep_their_own_defs():
    """Two tools' parameters with one `$id` were one schema resource in the call
    grammar's `anyOf`: one tool's "#/$defs/X" won for both, so a forced call of the
    other wrote arguments its own schema refuses."""

    def parameters(x):
        return {
            "$id": "https://example.com/args",
            "$defs": {"X": x},
            "type": "object",
            "properties": {"v": {"$ref": "#/$defs/X"}},
            "required": ["v"],
            "additionalProperties": False,
        }

    tools = [
        {
            "type": "function",
            "function": {"name": "count", "parameters": parameters({"type": "integer"})},
        },
        {
            "type": "function",
            "function": {"name": "pick", "parameters": parameters({"enum": ["x"]})},
        },
    ]
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    grammar = compiler.compile(tool_call_grammar("hermes", tools, None))

    def admits(name, v):
        call = json.dumps({"name": name, "arguments": {"v": v}})
        return admitted_by(grammar, f"<tool_call>\n{call}\n</tool_call>")

    assert admits("count", 1) and admits("pick", "x")
    assert not admits("count", "x") and not admits("pick", 1)


def test_a_gemma_call_or_the_answer_each_in_its_own_form():
    """`auto` tools beside a response_format in Gemma's format: the call fenced as
    ```tool_code, the answer bare; anything else is refused."""
    answer = GrammarSpec("json_schema", '{"type": "integer"}', "response_format")
    either = tool_call_grammar("gemma", TOOLS, None, answer)
    assert either.param == "response_format"
    grammar = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids).compile(either)
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})
    assert admitted_by(grammar, f"```tool_code\n{call}\n```") and admitted_by(grammar, "7")
    assert not admitted_by(grammar, f"<tool_call>\n{call}\n</tool_call>")
    assert not admitted_by(grammar, call)  # a call is fenced, never bare
    assert not admitted_by(grammar, '"7"') and not admitted_by(grammar, "Hello")


@pytest.mark.parametrize("as_string", [False, True])
@pytest.mark.parametrize("style", ["hermes", "llama3_json"])
def test_a_call_fed_a_character_a_delta_is_scanned_and_decoded_once(style, as_string, monkeypatch):
    """Each character of a call is scanned once and what closes is decoded once, also
    while blanks trail its closed arguments, and arguments written as a JSON string:
    scanning again what was scanned, or decoding closed arguments again, at every delta
    made a long call O(n^2)."""
    scanned, decodes = [], []
    json_end = json_ends.json_end

    class Counted:
        def __init__(self, pattern):
            self.pattern = pattern

        def search(self, text, at):
            found = self.pattern.search(text, at)
            scanned.append((len(text) if found is None else found.end()) - at)
            return found

    def counted_end(text, start, is_final):
        decodes.append(start)
        return json_end(text, start, is_final)

    monkeypatch.setattr(json_ends, "_IN_STRING", Counted(json_ends._IN_STRING))
    monkeypatch.setattr(json_ends, "_STRUCTURE", Counted(json_ends._STRUCTURE))
    monkeypatch.setattr(json_ends, "json_end", counted_end)
    arguments = json.dumps({"text": "x" * 300, "n": [1, 2]})
    key = "arguments" if style == "hermes" else "parameters"
    written = json.dumps(arguments) if as_string else arguments
    call = f'{{"name": "f", "{key}": {written}{" " * 50}}}'
    text = f"<tool_call>\n{call}\n</tool_call>" if style == "hermes" else call
    assert parse(style, text, range(1, len(text))) == ("", [("f", arguments)])
    assert sum(scanned) <= 2 * len(call) and len(decodes) <= 2


def test_the_results_of_parallel_calls_are_one_user_turn_for_a_template_without_tools():
    """Each result was a user turn of its own: two in a row, which templates that make
    turns alternate refuse (Gemma 2 and 3, Mixtral), so a round trip of parallel calls
    was a 400. Rendered through Gemma 2's published template."""
    template = (Path(__file__).parents[1] / "actors" / "templates" / "google-gemma-2-2b-it.jinja").read_text()
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
        for i, city in enumerate(("Paris", "Rome"))
    ]
    history = [
        HISTORY[0],
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]
    chat = chat_for_template(history, TOOLS, "gemma", knows_tools=False)
    assert [m["role"] for m in chat] == ["user", "assistant", "user"]
    assert chat[2]["content"] == "```tool_output\nsunny\n```\n```tool_output\nrainy\n```"
    rendered = with_template(template).apply_chat_template(chat, template_kwargs=None)
    assert rendered.endswith("```tool_output\nsunny\n```\n```tool_output\nrainy\n```<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize(
    "template",
    [
        # SmolLM3's reads its tool list from `xml_tools` alone (its card passes them so).
        "{%- if xml_tools -%}<tools>{%- for tool in xml_tools[:] -%}{{ tool | string }}{%- endfor -%}"
        "</tools>{%- endif -%}{%- for m in messages -%}{{ m.content }}{%- endfor -%}",
        "{# no tools here #}{% for m in messages %}{{ m.content }} (tools: none){% endfor %}",
    ],
)
def test_a_template_that_reads_no_tools_variable_gets_them_in_the_first_user_turn(template):
    """"tools" inside another name, a comment or text took a template to take `tools`:
    they were passed to it, it showed none, and the model never saw them."""
    assert not template_knows_tools(template)
    chat = chat_for_template(HISTORY[:1], TOOLS, "hermes", template_knows_tools(template))
    rendered = with_template(template).apply_chat_template(chat, template_kwargs=None)
    assert json.dumps(TOOLS[0]["function"]) in rendered


# Qwen3-Coder's and Qwen3.5's XML calls: their published templates, as llama.cpp keeps them.
TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "actors" / "templates"
QWEN3_CODER = (TEMPLATE_DIR / "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja").read_text()
QWEN3_5 = (TEMPLATE_DIR / "Qwen-Qwen3.5-4B.jinja").read_text()
QWEN3 = (TEMPLATE_DIR / "Qwen-Qwen3-0.6B.jinja").read_text()  # Hermes JSON in <tool_call>
TYPED = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object"},
        "note": {"type": ["string", "null"]},
        "zone": {"enum": ["UTC", "CET"]},
        "step": {"enum": [1, 2]},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "code": {"type": ["integer", "string"]},
        "free": {},
        "place": {"$ref": "#/$defs/Place"},  # as Pydantic writes a nested model
        "level": {"allOf": [{"$ref": "#/$defs/Level"}], "description": "how loud"},
        "loop": {"$ref": "#/$defs/Loop"},
    },
    "$defs": {
        "Place": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "Level": {"enum": [1, 2, 3]},
        "Loop": {"$ref": "#/$defs/Loop"},  # refers to itself: says nothing
    },
}
XML_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": TYPED}},
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]


def xml(name, *pairs):
    """A call as the templates write it."""
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in pairs)
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


XML_CASES = [
    (
        "Let me check.\n" + xml("get_weather", ("city", "Paris"), ("days", "3")) + "\n" + xml("get_time"),
        ("Let me check.\n\n", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]),
    ),
    (  # two functions in one block, blanks anywhere between the markers
        "<tool_call><function=get_time>  </function>\n\n<function=get_weather><parameter=city>Rome</parameter>"
        "</function></tool_call> Done.",
        (" Done.", [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]),
    ),
    (  # only the newline after the tag and the one before its end are markup
        xml("get_weather", ("city", "\n  Paris, France\n\nnext line  \n")),
        ("", [("get_weather", json.dumps({"city": "\n  Paris, France\n\nnext line  \n"}))]),
    ),
    (  # nested markers in a value are its text; a parameter given twice keeps its first value
        xml("get_weather", ("city", "<tool_call><function=x><parameter=y>"), ("city", "Rome")),
        ("", [("get_weather", json.dumps({"city": "<tool_call><function=x><parameter=y>"}))]),
    ),
    (  # a parameter with no name is dropped, stray text between parameters too
        "<tool_call>\n<function=get_weather>\n<parameter=>\nx\n</parameter>\nhmm <b>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>",
        ("", [("get_weather", '{"days": 2}')]),
    ),
    (  # a block that holds no call is text, as written
        'A <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> B',
        ('A <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> B', []),
    ),
    (  # a name that cannot be one: text
        "<tool_call>\n<function=get time>\n</function>\n</tool_call>",
        ("<tool_call>\n<function=get time>\n</function>\n</tool_call>", []),
    ),
    (  # nor a blank one: it was a call named "", which no client can run
        "<tool_call>\n<function= >\n</function>\n</tool_call>",
        ("<tool_call>\n<function= >\n</function>\n</tool_call>", []),
    ),
    (  # nor can one with a newline in it: read whole, it was the call "get_time"
        "<tool_call>\n<function=\nget_time>\n</function>\n</tool_call>",
        ("<tool_call>\n<function=\nget_time>\n</function>\n</tool_call>", []),
    ),
    (  # </tool_call> where </function> belongs closes both
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</tool_call> Done.",
        (" Done.", [("get_time", '{"zone": "UTC"}')]),
    ),
    ("It ends in <tool_ca", ("It ends in <tool_ca", [])),  # held as a marker, then text
    ("x <function=f>\n</function>", ("x <function=f>\n</function>", [])),  # outside a block: text
]


@pytest.mark.parametrize(("text", "expected"), XML_CASES)
def test_qwen3_coder_calls_are_the_same_whatever_the_split(text, expected):
    assert parse("qwen3_coder", text, tools=XML_TOOLS) == expected
    for cut in range(1, len(text)):
        assert parse("qwen3_coder", text, [cut], tools=XML_TOOLS) == expected, cut
    assert parse("qwen3_coder", text, range(1, len(text)), tools=XML_TOOLS) == expected
    rng = random.Random(0)
    for _ in range(100):
        cuts = rng.sample(range(1, len(text)), k=rng.randint(1, min(12, len(text) - 1)))
        assert parse("qwen3_coder", text, cuts, tools=XML_TOOLS) == expected, cuts


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("city", "42", "42"),  # a string stays the text
        ("city", "null", "null"),
        ("days", "3", 3),
        ("days", "three", "three"),  # not what its type reads as: the text
        ("days", "1" * 5000, "1" * 5000),  # too long for Python's int: the text
        ("scale", "2.5", 2.5),
        ("scale", "1e999", "1e999"),  # no finite number: the text
        ("metric", "true", True),
        ("metric", "False", False),  # Python's, as the Qwen3-Coder template writes it
        ("hours", "[9, 12]", [9, 12]),
        ("where", '{"lat": 1}', {"lat": 1}),
        ("where", "{'lat': None}", {"lat": None}),  # a Python literal
        ("where", "{1, 2}", "{1, 2}"),  # a set is no JSON: the text
        ("where", "[" * 5000, "[" * 5000),  # too deep to read: the text
        ("note", "None", None),
        ("note", "null", None),
        ("note", "nothing", "nothing"),
        ("zone", "UTC", "UTC"),
        ("step", "2", 2),  # an enum of integers
        ("limit", "7", 7),
        ("limit", "null", None),
        ("code", "12", 12),
        ("code", "A12", "A12"),
        ("free", "12", "12"),  # a schema that says nothing: text, as vLLM's
        ("unknown", "12", "12"),  # no schema: text
        ("place", '{"lat": 1.5}', {"lat": 1.5}),
        ("level", "2", 2),
        ("loop", "2", "2"),
    ],
)
def test_qwen3_coder_values_take_their_type_from_the_schema(key, text, value):
    _, [(_, arguments)] = parse("qwen3_coder", xml("get_weather", (key, text)), tools=XML_TOOLS)
    assert json.loads(arguments, parse_constant=pytest.fail) == {key: value}


def test_a_qwen3_coder_schema_whose_refs_branch_back_is_read_once_per_ref(monkeypatch):
    """Each "#/$defs/A" was read again at every place it is named: an anyOf of 20 refs
    back to itself (under 1 kB of request) was 20**4 reads, 0.7 s for each reply's parser,
    and twice the refs 16 times that. Each ref is read once; one in a loop adds nothing."""
    from runtime import qwen3_coder_reply

    reads = []
    read = qwen3_coder_reply.value_types
    monkeypatch.setattr(qwen3_coder_reply, "value_types", lambda *a, **k: reads.append(1) or read(*a, **k))
    branches = {"anyOf": [{"$ref": "#/$defs/A"}] * 20 + [{"type": "integer"}, {"$ref": "#/$defs/B"}]}
    parameters = {"$defs": {"A": branches, "B": {"type": "null"}}, "properties": {"x": {"$ref": "#/$defs/A"}}}
    assert qwen3_coder_reply.value_types(parameters["properties"]["x"], parameters) == {"integer", "null"}
    assert len(reads) < 100


def test_qwen3_coder_streams_the_name_then_each_parameter_as_it_closes():
    parser = parser_for("qwen3_coder", tools=XML_TOOLS)
    assert parser.feed("Sure.\n<tool_call>\n<function=get_wea") == [Content("Sure.\n")]
    assert parser.feed("ther>\n<parameter=city>\nPar") == [CallStart(0, "get_weather")]
    assert parser.feed("is\n</parameter>\n<parameter=days>\n3\n</param") == [CallArguments(0, '{"city": "Paris"')]
    assert parser.feed("eter>\n</function>") == [CallArguments(0, ', "days": 3'), CallArguments(0, "}")]
    assert parser.feed("\n</tool_call>") == []
    assert parser.finish() == []


@pytest.mark.parametrize(
    ("text", "call_text"),
    [
        ("A <tool_call>\n<function=f>\n<parameter=a>\nxy", "<function=f>\n<parameter=a>\nxy"),
        ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n", "<function=f>\n<parameter=a>\n1\n</parameter>\n"),
        ("<tool_call>\n<function=f>\n<parameter=a", "<function=f>\n<parameter=a"),
        ("<tool_call>\n<function=f>\n</funct", "<function=f>\n</funct"),
    ],
)
def test_a_qwen3_coder_call_the_reply_ends_inside_of_is_cut_short_with_its_text(text, call_text):
    for cut in range(1, len(text)):
        parser = parser_for("qwen3_coder")
        events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert events[-1] == CallCutShort(0, call_text), cut
        assert [e for e in events if isinstance(e, CallStart)] == [CallStart(0, "f")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A <tool_call>\n<function=get_wea", ("A <function=get_wea", [])),  # no name yet: text
        ("<tool_call>\n<function=f>\n</function>", ("", [("f", "{}")])),  # whole, though unclosed
        ("A <tool_call>\n<func", ("A ", [])),  # a marker begun: markup
    ],
)
def test_a_qwen3_coder_reply_ending_before_or_after_a_calls_parameters(text, expected):
    for cut in range(1, len(text)):
        assert parse("qwen3_coder", text, [cut]) == expected, cut


def test_an_unclosed_qwen3_coder_name_is_text_once_it_cannot_be_one():
    """A `<function=` with no `>` in sight is not held to the end of the reply."""
    parser = parser_for("qwen3_coder")
    assert parser.feed("<tool_call><function=f") == []
    assert "".join(e.text for e in parser.feed("\nmore")) == "<tool_call><function=f\nmore"
    parser = parser_for("qwen3_coder")
    events = parser.feed("<tool_call><function=" + "x" * 300)
    assert "".join(e.text for e in events) == "<tool_call><function=" + "x" * 300


def test_a_qwen3_coder_name_is_read_up_to_its_length_limit():
    for size, called in ((256, True), (257, False)):
        text = f"<tool_call>\n<function={'f' * size}>\n</function>\n</tool_call>"
        assert parse("qwen3_coder", text) == (("", [("f" * size, "{}")]) if called else (text, [])), size
    parser = parser_for("qwen3_coder")  # one of the limit's length still waits for its ">"
    assert parser.feed("<tool_call>\n<function=" + "f" * 256) == []
    assert parser.feed(">") == [CallStart(0, "f" * 256)]
    # An empty name is none at once: no call, the text as written.
    assert "".join(e.text for e in parser_for("qwen3_coder").feed("<tool_call><function=>")) == "<tool_call><function=>"


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ("<parameter=a></parameter>", '{"a": ""}'),  # an empty value, no newlines
        ("x<parameter=a>\n1\n</parameter>", '{"a": "1"}'),  # stray text up to the next marker
    ],
)
def test_qwen3_coder_parameters_at_their_edges_in_any_split(text, arguments):
    text = f"<tool_call>\n<function=f>\n{text}\n</function>\n</tool_call>"
    assert parse("qwen3_coder", text) == ("", [("f", arguments)])
    assert parse("qwen3_coder", text, range(1, len(text))) == ("", [("f", arguments)])


def test_a_past_call_is_written_as_qwen3_coder_xml():
    def body(arguments):
        return xml_call("f", arguments).removeprefix("<tool_call>\n<function=f>\n").removesuffix("</function>\n</tool_call>")

    assert body(None) == body("") == body({}) == ""
    assert body("not json") == "not json\n"  # text a client sent goes in as written
    assert body({"a": "Zürich", "b": ["Zürich"]}) == "<parameter=a>\nZürich\n</parameter>\n<parameter=b>\n[\"Zürich\"]\n</parameter>\n"


def test_stray_text_after_a_qwen3_coder_call_in_its_block_is_content_without_the_blocks_tag():
    text = "<tool_call>\n<function=f>\n</function>\nhi</tool_call>"
    assert parse("qwen3_coder", text) == ("hi</tool_call>", [("f", "{}")])


def test_qwen3_coder_value_types_stop_at_a_depth_of_eight():
    def nested(key, depth):
        schema: object = {"type": "integer"}
        for _ in range(depth):
            schema = {key: [schema]}
        return schema

    for key in ("anyOf", "allOf"):
        assert value_types(nested(key, 8)) == {"integer"} and value_types(nested(key, 9)) == set(), key
    for depth, types in ((8, {"integer"}), (9, set())):  # a chain of refs, each a level
        defs = {f"D{k}": {"$ref": f"#/$defs/D{k + 1}"} for k in range(depth - 1)} | {f"D{depth - 1}": {"type": "integer"}}
        assert value_types({"$ref": "#/$defs/D0"}, {"$defs": defs}) == types, depth
    assert value_types(True) == value_types(None) == set()  # a boolean schema says nothing


@pytest.mark.parametrize(
    ("text", "types", "value"),
    [
        ("1.5", {"string", "number"}, 1.5),
        ("[1]", {"string", "array"}, [1]),
        ("{}", {"string", "object"}, {}),
        ("true", {"string", "integer"}, "true"),  # a string where no other type reads it
        ('"Paris"', {"string"}, '"Paris"'),  # a string's text is its value, quotes and all
        ('"Paris"', {"string", "null"}, '"Paris"'),
    ],
)
def test_a_qwen3_coder_value_that_may_be_a_string_is_another_type_only_of_its_schema(text, types, value):
    assert parameter_value(text, frozenset(types)) == value


def test_qwen3_coder_parameter_types_skip_tools_without_a_function_or_parameters():
    tools = [{"type": "function"}, {"type": "function", "function": {"name": "f"}}]
    assert parameter_types(tools) == {}


def test_a_long_qwen3_coder_value_fed_a_character_a_delta_takes_linear_time():
    """Each delta's text is searched once for the value's end: searching the whole value
    again at every token made a long one O(n^2)."""

    def seconds(size):
        text = xml("get_weather", ("city", "x<" * size))
        parser, events = parser_for("qwen3_coder", tools=XML_TOOLS), []
        started = time.perf_counter()
        for at in range(0, len(text), 4):
            events += parser.feed(text[at : at + 4])
        took = time.perf_counter() - started
        arguments = "".join(e.fragment for e in events + parser.finish() if isinstance(e, CallArguments))
        assert json.loads(arguments) == {"city": "x<" * size}
        return took

    # The least of a few timings: one run slowed by a busy machine failed the check.
    small = min(seconds(20_000) for _ in range(3))
    assert min(seconds(160_000) for _ in range(2)) < 20 * small + 1.0  # linear: 8 times; quadratic: 64


def test_qwen3_coder_calls_in_a_thought_are_reasoning():
    from runtime.think_reply import THINK_TAGS
    from runtime.tools import Reasoning

    parser = parser_for("qwen3_coder", think_tags=THINK_TAGS, tools=XML_TOOLS)
    thought = "\n" + xml("get_time") + "\n"
    events = parser.feed(f"<think>{thought}</think>\n\n" + xml("get_weather", ("days", "2"))) + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == thought.strip()
    calls = [e for e in events if isinstance(e, CallStart | CallArguments)]
    assert calls == [CallStart(0, "get_weather"), CallArguments(0, '{"days": 2'), CallArguments(0, "}")]


def test_the_qwen3_coder_and_qwen3_5_templates_are_xml_and_qwen3s_stays_hermes():
    assert tool_style_for(QWEN3_CODER, "qwen3_moe") == tool_style_for(QWEN3_5, "qwen3_5") == "qwen3_coder"
    assert tool_style_for(QWEN3, "qwen3") == tool_style_for(HERMES, "qwen3_moe") == "hermes"
    assert template_knows_tools(QWEN3_CODER) and template_knows_tools(QWEN3_5)


@pytest.mark.parametrize("template", [QWEN3_CODER, QWEN3_5])
def test_a_tool_history_renders_into_the_xml_templates_as_parameters(template):
    """The templates iterate `arguments|items`: the JSON text a client sends back must
    reach them as a mapping."""
    history = [*HISTORY[:1], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}, HISTORY[2]]
    rendered = with_template(template).apply_chat_template(
        chat_for_template(history, TOOLS, "qwen3_coder", knows_tools=True), template_kwargs=None
    )
    written = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    assert written in rendered and "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_qwen3_coder_call_is_its_xml_typed_by_the_schema(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    weather = {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome"]},
            "days": {"type": "integer"},
            "note": {"type": "string"},
            "place": {"$ref": "#/$defs/Place"},
        },
        "required": ["city", "days"],
        "$defs": {"Place": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}, *XML_TOOLS[1:]]
    grammar = compiler.compile(tool_call_grammar("qwen3_coder", tools, forced))
    call = xml("get_weather", ("city", "Rome"), ("days", "2"), ("note", "a <b> c"))
    assert admitted_by(grammar, call)
    assert parse("qwen3_coder", call, tools=tools) == ("", [("get_weather", '{"city": "Rome", "days": 2, "note": "a <b> c"}')])
    assert admitted_by(grammar, xml("get_weather", ("city", "Rome"), ("days", "2")))  # note is optional
    assert not admitted_by(grammar, xml("get_weather", ("city", "Berlin")))  # not of its enum
    assert not admitted_by(grammar, xml("get_weather", ("days", "2")))  # city is required
    assert not admitted_by(grammar, xml("get_weather", ("city", "Rome"), ("days", "two")))
    assert not admitted_by(grammar, xml("get_weather", ("city", "Rome"), ("days", "2"), ("note", "a</parameter>b")))
    place = xml("get_weather", ("city", "Rome"), ("days", "2"), ("place", '{"lat": 1.5}'))
    assert admitted_by(grammar, place) and not admitted_by(grammar, place.replace('"lat"', '"x"'))
    assert admitted_by(grammar, xml("get_time", ("any", "x"))) == (forced is None)
    assert not admitted_by(grammar, "Sure. " + call)


@pytest.mark.parametrize(
    ("parameters", "admitted", "refused"),
    [
        # Listing no properties, but not closed to others: any parameters.
        ({"type": "object", "properties": {}}, [[("q", "x")], []], []),
        ({"type": "object", "properties": {}, "additionalProperties": False}, [[]], [[("q", "x")]]),  # none
        # Closed to others, listing some (of one character, of 256), none required: each maybe.
        ({"type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": False}, [[("q", "x")], []], [[("r", "1")]]),
        ({"type": "object", "properties": {"k" * 256: {}}, "additionalProperties": False}, [[("k" * 256, "x")]], [[("r", "1")]]),
        ({"type": "object", "properties": {"q": True}}, [[("q", "{not json")]], [[("r", "1")]]),  # `true`: any text
        ({"type": "object", "properties": {"q": {"enum": ["a", 1]}}}, [[("q", "a")], [("q", "1")]], []),  # text
    ],
)
def test_a_forced_qwen3_coder_call_takes_the_parameters_its_schema_allows(parameters, admitted, refused):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": parameters}}]
    grammar = compiler.compile(tool_call_grammar("qwen3_coder", tools, "lookup"))
    for pairs in admitted:
        assert admitted_by(grammar, xml("lookup", *pairs)), pairs
    for pairs in refused:
        assert not admitted_by(grammar, xml("lookup", *pairs)), pairs


@pytest.mark.parametrize("odd", ["a>b", "x\ny", "<", "", " pad", "n" * 300])
def test_a_forced_qwen3_coder_call_never_writes_a_parameter_name_that_reads_back_as_another(odd):
    """`<parameter=a>b>` reads as the parameter `a` (its value `b>...`), and a name with a
    newline, a "<", blanks around it, none or over 256 characters as no name at all: the
    grammar wrote such names, and a forced call came out with other keys than its own."""
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    parameters = {"type": "object", "properties": {odd: {"type": "string"}, "q": {"type": "string"}}, "required": [odd]}
    tools = [{"type": "function", "function": {"name": "odd", "parameters": parameters}}]
    grammar = compiler.compile(tool_call_grammar("qwen3_coder", tools, "odd"))
    assert not admitted_by(grammar, xml("odd", (odd, "v")))
    # Its parameters go as any names the parser reads back, as where none are listed.
    call = xml("odd", ("q", "v"), ("other", "w"))
    assert admitted_by(grammar, call)
    assert parse("qwen3_coder", call, tools=tools) == ("", [("odd", '{"q": "v", "other": "w"}')])


def test_a_forced_qwen3_coder_call_takes_a_string_enum_of_thousands():
    """Each value of a string enum was an alternative of the parameter's rule: past
    2,000 of them llguidance's parser refused the grammar, a 400 for a forced call that
    the JSON styles take. The values are one terminal now, matched by the lexer."""
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    zones = [f"Zone/{i}" for i in range(5000)] + ["", "a\nb"]
    clock = {"type": "object", "properties": {"zone": {"enum": zones}}, "required": ["zone"]}
    grammar = compiler.compile(tool_call_grammar("qwen3_coder", [{"type": "function", "function": {"name": "get_time", "parameters": clock}}], "get_time"))
    for zone in ("Zone/4999", "Zone/1", "", "a\nb"):
        assert admitted_by(grammar, xml("get_time", ("zone", zone)))
    assert not admitted_by(grammar, xml("get_time", ("zone", "Zone/5000")))
    assert not admitted_by(grammar, xml("get_time", ("zone", "Zone/1 ")))


# OLMo 3 Instruct's Python calls in <function_calls>, each value JSON: its published
# template (OLMo 3.1 32B Instruct's, as its tokenizer_config ships it).
OLMO3 = (TEMPLATE_DIR / "allenai-Olmo-3.1-32B-Instruct.jinja").read_text()
OLMO3_CASES = [
    (
        'Let me check.<function_calls>get_weather(city="Paris", days=2)\n'
        'get_time(zone="UTC", exact=true, note=null, at={"h": [1, 2.5]})</function_calls>',
        (
            "Let me check.",
            [
                ("get_weather", '{"city": "Paris", "days": 2}'),
                ("get_time", '{"zone": "UTC", "exact": true, "note": null, "at": {"h": [1, 2.5]}}'),
            ],
        ),
    ),
    ("<function_calls>now()</function_calls> Done.", (" Done.", [("now", "{}")])),
    ("No <function call here.", ("No <function call here.", [])),
    # Not calls (a name that is no JSON literal, a positional value): the text stays.
    ("<function_calls>f(a=maybe)</function_calls>", ("<function_calls>f(a=maybe)</function_calls>", [])),
    ('<function_calls>f("x")</function_calls>', ('<function_calls>f("x")</function_calls>', [])),
    # Cut short (max_tokens): the text as written, no call.
    ('Sure.<function_calls>get_weather(city="Par', ('Sure.<function_calls>get_weather(city="Par', [])),
    ("It ends in <function_ca", ("It ends in <function_ca", [])),
]


@pytest.mark.parametrize(("text", "expected"), OLMO3_CASES)
def test_olmo3_calls_are_the_same_whatever_the_split(text, expected):
    assert parse("olmo3", text) == expected
    for cut in range(1, len(text)):
        assert parse("olmo3", text, [cut]) == expected, cut
    assert parse("olmo3", text, range(1, len(text))) == expected


def test_json_literals_are_values_only_where_asked():
    """Gemma's calls are Python: `true` there is an unknown name, no value."""
    assert python_calls("f(a=true, b=[null, false])", json_literals=True) == [
        {"name": "f", "arguments": {"a": True, "b": [None, False]}}
    ]
    assert python_calls("f(a=true)") is None and python_calls("f(a=yes)", json_literals=True) is None
    assert python_calls("f(a=[true, yes])", json_literals=True) is None  # a name inside a value too


def test_a_python_call_of_a_tool_whose_name_holds_a_hyphen_is_that_call():
    """OpenAI's tool names may hold "-", Python's names never: such a call (OLMo 3's
    template writes the name as it is, and so does its forced call) was text."""
    assert parse("olmo3", '<function_calls>get-weather(city="Ro-me", days=-1)\nx-y()</function_calls>') == (
        "", [("get-weather", '{"city": "Ro-me", "days": -1}'), ("x-y", "{}")]
    )
    assert python_calls('[a-b(x="p-q(")]') == [{"name": "a-b", "arguments": {"x": "p-q("}}]
    assert python_calls("a -b(x=1)") is None  # a subtraction, no name
    assert python_calls("a-b(x=1)") == [{"name": "a-b", "arguments": {"x": 1}}]  # from the text's second character
    assert python_calls("get-_weather(x=1)") == [{"name": "get-_weather", "arguments": {"x": 1}}]
    # A "-" joins two name characters between calls only: not a sign, no value's.
    assert python_calls("f(x=1e-5)") == [{"name": "f", "arguments": {"x": 1e-5}}]
    assert python_calls("f(x=1)\n-g(y=2)") is None and python_calls("f-(x=1)") is None
    assert python_calls("f(x=1)\ng-") is None  # no error at the text's last character
    # A bracket or an escaped quote in a string leaves the depth between calls alone.
    for value in ['"("', "'('", '"(\\""', '""']:
        assert python_calls(f"f(x={value})\ng-h(y=1)") == [
            {"name": "f", "arguments": {"x": ast.literal_eval(value)}}, {"name": "g-h", "arguments": {"y": 1}}
        ]
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    tools = [{"type": "function", "function": {"name": "get-weather", "parameters": TOOLS[0]["function"]["parameters"]}}]
    grammar = compiler.compile(tool_call_grammar("olmo3", tools, None))
    assert admitted_by(grammar, '<function_calls>get-weather(city="Rome")</function_calls>')


def test_the_olmo3_template_is_olmo3s_and_the_others_keep_theirs():
    assert tool_style_for(OLMO3, "olmo3") == tool_style_for(OLMO3, "llama") == "olmo3"
    assert template_knows_tools(OLMO3)
    kept = {HERMES: "hermes", QWEN3: "hermes", QWEN3_CODER: "qwen3_coder", LLAMA3_JSON: "llama3_json",
            MISTRAL: "mistral", HARMONY: "harmony", GEMMA: "gemma"}
    assert {tool_style_for(t, "olmo2"): style for t, style in kept.items()} == {s: s for s in kept.values()}


def test_an_olmo3_history_renders_its_calls_as_python_and_results_as_environment_turns():
    history = [*HISTORY[:1], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "exact": true}'}}]}, HISTORY[2]]
    rendered = with_template(OLMO3).apply_chat_template(
        chat_for_template(history, TOOLS, "olmo3", knows_tools=True), template_kwargs=None
    )
    written = '<function_calls>get_weather(city="Paris", days=3, exact=true)</function_calls>'
    assert written in rendered and "<|im_start|>environment\nsunny, 21 C<|im_end|>" in rendered
    assert parse("olmo3", written) == ("", [("get_weather", '{"city": "Paris", "days": 3, "exact": true}')])
    # A template without tools is shown the same form, which parses back.
    (_, said, _) = chat_for_template(history, TOOLS, "olmo3", knows_tools=False)
    assert said["content"] == written


def test_the_first_past_call_whose_arguments_are_no_object_is_named_and_each_such_becomes_none():
    """Admission names the first call (by message, then by call) whose arguments are
    no JSON object's text, where the chat renders with `{}` in place of each such; ""
    and "null" are objects of none, and the client's messages are left as they were."""

    def call(arguments):
        return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}

    first = {"role": "assistant", "tool_calls": [call('{"a": 1}'), call(""), call(" null ")]}
    second = {"role": "assistant", "tool_calls": [call('{"b": 2}'), call("[1, 2]"), call("{oops")]}
    chat = [HISTORY[0], first, HISTORY[2], second]
    assert arguments_of_no_object(chat[:3]) is None
    assert arguments_of_no_object(chat) == "messages[3].tool_calls[1].function.arguments"
    shown = with_object_arguments(chat)
    assert shown[:3] == chat[:3]
    assert [c["function"]["arguments"] for c in shown[3]["tool_calls"]] == ['{"b": 2}', "{}", "{}"]
    assert arguments_of_no_object(shown) is None
    assert [c["function"]["arguments"] for c in second["tool_calls"]] == ['{"b": 2}', "[1, 2]", "{oops"]


@pytest.mark.parametrize("template", ["qwen3_coder", "olmo3"])
@pytest.mark.parametrize("empty", ["", " ", "null"])
def test_a_past_call_with_empty_arguments_is_a_call_of_none(template, empty):
    """A call of a tool without parameters sent back with `arguments: ""` (as some
    clients send it) reached the template as text, and the templates that read
    `arguments|items` refused the chat (a 400): it is an object of none, as vLLM takes it.
    So is `null`, which they read as None."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": empty}}
    history = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [call]}, HISTORY[2]]
    source, written = {
        "qwen3_coder": (QWEN3_CODER, "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"),
        "olmo3": (OLMO3, "<function_calls>get_time()</function_calls>"),
    }[template]
    rendered = with_template(source).apply_chat_template(
        chat_for_template(history, TOOLS, template, knows_tools=True), template_kwargs=None
    )
    assert written in rendered


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_olmo3_call_is_its_python_with_json_values_of_the_schema(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    weather = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["city", "days"],
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time"}},  # takes no arguments
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
    ]
    grammar = compiler.compile(tool_call_grammar("olmo3", tools, forced))

    def call(text):
        return f"<function_calls>{text}</function_calls>"

    assert admitted_by(grammar, call('get_weather(city="Rome", days=2, note="a \\"b\\" c")'))
    assert parse("olmo3", call('get_weather(city="Rome", days=2, note="a \\"b\\" c")')) == (
        "", [("get_weather", '{"city": "Rome", "days": 2, "note": "a \\"b\\" c"}')]
    )
    assert admitted_by(grammar, call('get_weather(city="Rome", days=2)'))  # note is optional
    assert not admitted_by(grammar, call('get_weather(city="Berlin", days=2)'))  # not of its enum
    assert not admitted_by(grammar, call("get_weather(days=2)"))  # city is required
    assert not admitted_by(grammar, call('get_weather(city="Rome", days="2")'))
    assert admitted_by(grammar, call("get_time()")) == (forced is None)
    assert not admitted_by(grammar, call("get_time(x=1)"))
    assert admitted_by(grammar, call('lookup(q="x", deep=true)')) == (forced is None)
    assert not admitted_by(grammar, "Sure. " + call('get_weather(city="Rome", days=2)'))


def test_a_forced_olmo3_call_takes_properties_whose_schemas_are_booleans():
    """JSON Schema lets a property's schema be `true` (any value) or `false` (none): the
    grammar spread each into a dict, and the request failed as a template bug."""
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    parameters = {"type": "object", "properties": {"q": True, "never": False}, "required": ["q"]}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": parameters}}]
    grammar = compiler.compile(tool_call_grammar("olmo3", tools, "lookup"))
    assert admitted_by(grammar, '<function_calls>lookup(q=[1, "x"])</function_calls>')
    assert admitted_by(grammar, '<function_calls>lookup(q="x")</function_calls>')
    assert not admitted_by(grammar, '<function_calls>lookup(q="x", never=1)</function_calls>')
    assert not admitted_by(grammar, "<function_calls>lookup()</function_calls>")


@pytest.mark.parametrize(
    ("parameters", "admitted", "refused"),
    [
        # Listing no properties, but not closed to others: any keys.
        ({"type": "object", "properties": {}}, ['q="x"', ""], []),
        # Closed to others, listing some, none required: each maybe.
        ({"type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": False}, ['q="x"', ""], ["r=1"]),
        ({"type": "object", "properties": {"never": False}}, [""], ["never=1"]),  # none can be given
        ({"type": "object", "properties": {"a-b": {}}}, ['q="x"'], ['a-b="x"']),  # no Python name: any keys
    ],
)
def test_a_forced_olmo3_call_takes_the_keys_its_parameters_allow(parameters, admitted, refused):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": parameters}}]
    grammar = compiler.compile(tool_call_grammar("olmo3", tools, "lookup"))
    for arguments in admitted:
        assert admitted_by(grammar, f"<function_calls>lookup({arguments})</function_calls>"), arguments
    for arguments in refused:
        assert not admitted_by(grammar, f"<function_calls>lookup({arguments})</function_calls>"), arguments


@pytest.mark.parametrize("parameters", [{"type": "object"}, {"type": "object", "properties": {"from": {}}}])
def test_a_forced_olmo3_call_takes_no_python_keyword_for_a_key(parameters):
    """`lookup(from="x")` is no Python call, so the parser reads it as text: the keys of
    a tool that lists none (or names one no call can take) admitted keywords, and a
    forced call could come out as no call."""
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": parameters}}]
    grammar = compiler.compile(tool_call_grammar("olmo3", tools, "lookup"))
    for word in ("from", "True", "lambda"):
        assert not admitted_by(grammar, f'<function_calls>lookup({word}="x")</function_calls>')
    for word in ("fromage", "Truest", "src"):  # a keyword's start is no keyword
        call = f'<function_calls>lookup({word}="x")</function_calls>'
        assert admitted_by(grammar, call)
        assert parse("olmo3", call) == ("", [("lookup", json.dumps({word: "x"}))])


def test_a_forced_olmo3_calls_tags_that_are_added_tokens_are_written_as_those_tokens():
    tokens = {"<function_calls>": 100, "</function_calls>": 101}
    source = tool_call_grammar("olmo3", TOOLS, None, control_tokens=tokens).source
    assert "<[100]>" in source and "<[101]>" in source and '"<function_calls>"' not in source


# LFM2: `<|tool_call_start|>` and a Python list of calls, its values Python's literals (or
# JSON's, as forced calls write them). Its published template (LFM2-1.2B's) writes the tool
# list in `<|tool_list_start|>` and each turn's content alone.
LFM2 = (TEMPLATE_DIR / "LiquidAI-LFM2-1.2B.jinja").read_text()
LFM2_CASES = [
    (
        '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>Checking the weather.',
        ("Checking the weather.", [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "Sure. <|tool_call_start|>[f(a=1, b=True, c=None), g(x=[1, 'two'], y=false)]<|tool_call_end|>",
        ("Sure. ", [("f", '{"a": 1, "b": true, "c": null}'), ("g", '{"x": [1, "two"], "y": false}')]),
    ),
    ("<|tool_call_start|>[]<|tool_call_end|>", ("<|tool_call_start|>[]<|tool_call_end|>", [])),  # no call
    ("<|tool_call_start|>[f(1)]<|tool_call_end|>", ("<|tool_call_start|>[f(1)]<|tool_call_end|>", [])),
    # Cut short (max_tokens): the text as written, no call.
    ('<|tool_call_start|>[get_weather(city="Par', ('<|tool_call_start|>[get_weather(city="Par', [])),
    ("It ends in <|tool_call", ("It ends in <|tool_call", [])),
    # The JSON list LFM2 writes where its system prompt asks for JSON (as llama.cpp reads it).
    (
        '<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Paris", "exact": true}}, '
        '{"name": "get_time", "arguments": {}}]<|tool_call_end|>Checking.',
        ("Checking.", [("get_weather", '{"city": "Paris", "exact": true}'), ("get_time", "{}")]),
    ),
    ('<|tool_call_start|>[{"name": "now", "arguments": "{\\"tz\\": 1}"}]<|tool_call_end|>', ("", [("now", '{"tz": 1}')])),
    # An item that is no call, or a list cut short: the text as written.
    ('<|tool_call_start|>[{"name": "now"}, 3]<|tool_call_end|>', ('<|tool_call_start|>[{"name": "now"}, 3]<|tool_call_end|>', [])),
    ("<|tool_call_start|>42<|tool_call_end|>", ("<|tool_call_start|>42<|tool_call_end|>", [])),  # JSON, but no list
    ('<|tool_call_start|>[{"name": "now"}, {"arguments": {}}]<|tool_call_end|>', ('<|tool_call_start|>[{"name": "now"}, {"arguments": {}}]<|tool_call_end|>', [])),
    ('<|tool_call_start|>[{"name": "now", "arguments": {"a', ('<|tool_call_start|>[{"name": "now", "arguments": {"a', [])),
]


@pytest.mark.parametrize(("text", "expected"), LFM2_CASES)
def test_lfm2_calls_are_the_same_whatever_the_split(text, expected):
    assert parse("lfm2", text) == expected
    for cut in range(1, len(text)):
        assert parse("lfm2", text, [cut]) == expected, cut
    assert parse("lfm2", text, range(1, len(text))) == expected


def test_the_lfm2_template_is_lfm2s_and_the_others_keep_theirs():
    assert tool_style_for(LFM2, "lfm2") == tool_style_for(LFM2, "llama") == "lfm2"
    assert template_knows_tools(LFM2)
    kept = {HERMES: "hermes", QWEN3: "hermes", QWEN3_CODER: "qwen3_coder", LLAMA3_JSON: "llama3_json",
            MISTRAL: "mistral", HARMONY: "harmony", GEMMA: "gemma", OLMO3: "olmo3"}
    assert {tool_style_for(t, "lfm2"): style for t, style in kept.items()} == {s: s for s in kept.values()}


def test_an_lfm2_history_renders_its_calls_as_its_python_list_before_the_turns_text():
    """Its template writes a turn's content alone: the calls were dropped, and a turn of
    calls with no text was written `null`."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "exact": true}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    history = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": calls}, HISTORY[2]]
    rendered = with_template(LFM2).apply_chat_template(
        chat_for_template(history, TOOLS, "lfm2", knows_tools=True), template_kwargs=None
    )
    written = '<|tool_call_start|>[get_weather(city="Paris", exact=true), get_time()]<|tool_call_end|>'
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in rendered and "null" not in rendered
    assert "<|tool_response_start|>sunny, 21 C<|tool_response_end|>" in rendered
    assert parse("lfm2", written) == ("", [("get_weather", '{"city": "Paris", "exact": true}'), ("get_time", "{}")])
    with_text = [HISTORY[0], {"role": "assistant", "content": "Checking.", "tool_calls": calls[:1]}]
    (_, said) = chat_for_template(with_text, TOOLS, "lfm2", knows_tools=True)
    assert said == {"role": "assistant", "content": written.replace(", get_time()", "") + "Checking."}


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_lfm2_call_is_its_python_list_with_json_values_of_the_schema(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    weather = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
        "required": ["city"],
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    grammar = compiler.compile(tool_call_grammar("lfm2", tools, forced))

    def call(text):
        return f"<|tool_call_start|>[{text}]<|tool_call_end|>"

    assert admitted_by(grammar, call('get_weather(city="Rome", days=2)'))
    assert parse("lfm2", call('get_weather(city="Rome", days=2)')) == ("", [("get_weather", '{"city": "Rome", "days": 2}')])
    assert not admitted_by(grammar, call('get_weather(city="Berlin")'))
    assert not admitted_by(grammar, call("get_weather(days=2)"))
    assert admitted_by(grammar, call("get_time()")) == (forced is None)
    assert not admitted_by(grammar, '<|tool_call_start|>get_weather(city="Rome")<|tool_call_end|>')  # no list
    tokens = {"<|tool_call_start|>": 100, "<|tool_call_end|>": 101}
    source = tool_call_grammar("lfm2", tools, forced, control_tokens=tokens).source
    assert "<[100]>" in source and "<[101]>" in source and '"<|tool_call_start|>"' not in source


# Granite 3.x: `<|tool_call|>` and a JSON list of calls, Mistral's list form after its own
# marker. Its published template (Granite 3.3 2B Instruct's, as llama.cpp keeps it).
GRANITE3 = (TEMPLATE_DIR / "ibm-granite-granite-3.3-2b-instruct.jinja").read_text()
# Granite 4.0's published template (as llama.cpp keeps it): Hermes's <tool_call> JSON in Granite's turns.
GRANITE4 = (TEMPLATE_DIR / "ibm-granite-granite-4.0.jinja").read_text()
GRANITE_CASES = [
    (
        'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"arguments": {"zone": "UTC"}, "name": "get_time"}]',
        ("Let me check.", [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "UTC"}')]),
    ),
    ('<|tool_call|> [{"name": "now", "arguments": {}}] Done.', (" Done.", [("now", "{}")])),
    # Mistral's named form is no Granite call, nor an object or a list of no calls.
    ('<|tool_call|>f[ARGS]{"a": 1}', ('<|tool_call|>f[ARGS]{"a": 1}', [])),
    ('<|tool_call|>{"name": "f", "arguments": {}}', ('<|tool_call|>{"name": "f", "arguments": {}}', [])),
    ('<|tool_call|>[1, 2]', ('<|tool_call|>[1, 2]', [])),
    ("No <|tool call here.", ("No <|tool call here.", [])),
    # Cut short (max_tokens): the text as written, no call.
    ('Sure.<|tool_call|>[{"name": "f", "arguments": {"a": "x', ('Sure.<|tool_call|>[{"name": "f", "arguments": {"a": "x', [])),
    ("It ends in <|tool_ca", ("It ends in <|tool_ca", [])),
    # Text after a marker is text up to the next marker, whose list is a call however split.
    (
        'Hm.<|tool_call|>let me see <|tool_call|>[{"name": "now", "arguments": {}}]',
        ("Hm.<|tool_call|>let me see ", [("now", "{}")]),
    ),
    ('<|tool_call|>so<|tool_call|>', ("<|tool_call|>so<|tool_call|>", [])),
    ('<|tool_call|><|tool_call|>[{"name": "now", "arguments": {}}]', ("<|tool_call|>", [("now", "{}")])),
]


@pytest.mark.parametrize(("text", "expected"), GRANITE_CASES)
def test_granite_calls_are_the_same_whatever_the_split(text, expected):
    assert parse("granite", text) == expected
    for cut in range(1, len(text)):
        assert parse("granite", text, [cut]) == expected, cut
    assert parse("granite", text, range(1, len(text))) == expected


@pytest.mark.parametrize(("style", "marker"), [("granite", "<|tool_call|>"), ("mistral", "[TOOL_CALLS]")])
def test_blank_tokens_after_a_list_marker_take_linear_time(style, marker):
    """The text after a marker was stripped of its blanks again at every token: a run
    of blank tokens there made a reply O(n^2) (80,000 of them: ~1 s)."""

    def seconds(size):
        parser = parser_for(style)
        started = time.perf_counter()
        events = parser.feed(marker)
        for _ in range(size):
            events += parser.feed("\n")
        events += parser.feed('[{"name": "now", "arguments": {}}]') + parser.finish()
        took = time.perf_counter() - started
        assert [e for e in events if isinstance(e, CallStart)] == [CallStart(0, "now")]
        return took

    small = min(seconds(10_000) for _ in range(3))
    assert seconds(80_000) < 20 * small + 0.3  # linear: 8 times; quadratic: 64


def test_the_granite_3_template_is_granites_and_the_others_keep_theirs():
    assert tool_style_for(GRANITE3, "granite") == tool_style_for(GRANITE3, "llama") == "granite"
    assert template_knows_tools(GRANITE3)
    assert tool_style_for(GRANITE4, "granitemoehybrid") == "hermes"  # Granite 4 writes <tool_call>
    kept = {HERMES: "hermes", QWEN3: "hermes", QWEN3_CODER: "qwen3_coder", LLAMA3_JSON: "llama3_json",
            MISTRAL: "mistral", HARMONY: "harmony", GEMMA: "gemma", OLMO3: "olmo3"}
    assert {tool_style_for(t, "granite"): style for t, style in kept.items()} == {s: s for s in kept.values()}


def test_a_granite_4_history_renders_hermes_calls_that_parse_back_and_results_as_tool_responses():
    """Granite 4.0 left Granite 3's `<|tool_call|>` list for Hermes's `<tool_call>` JSON,
    its results `<tool_response>`s in a user turn."""
    assert template_knows_tools(GRANITE4)
    history = [
        HISTORY[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]
    rendered = with_template(GRANITE4).apply_chat_template(
        chat_for_template(history, TOOLS, "hermes", knows_tools=True), template_kwargs=None
    )
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|start_of_role|>assistant<|end_of_role|>{written}<|end_of_text|>" in rendered
    assert "<|start_of_role|>user<|end_of_role|>\n<tool_response>\nsunny\n</tool_response><|end_of_text|>" in rendered
    assert parse("hermes", written)[1] == [("get_weather", '{"city": "Paris"}')]


def test_a_granite_history_shows_its_calls_as_it_writes_them_and_results_as_tool_responses():
    """Granite 3's templates write each turn's role and content alone: a past call was
    not shown at all (its null content broke the template) and a result was a `tool`
    turn, a role Granite was not taught."""
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
        for i, city in enumerate(("Paris", "Rome"))
    ]
    history = [
        HISTORY[0],
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]
    # The calls are the turn's content alone: a template reading `tool_calls` too would show them twice.
    assert not any("tool_calls" in turn for turn in chat_for_template(history, TOOLS, "granite", knows_tools=True))
    rendered = with_template(GRANITE3).apply_chat_template(
        chat_for_template(history, TOOLS, "granite", knows_tools=True), template_kwargs=None
    )
    written = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert f"<|start_of_role|>assistant<|end_of_role|>{written}<|end_of_text|>" in rendered
    assert "<|start_of_role|>tool_response<|end_of_role|>sunny<|end_of_text|>\n" in rendered
    assert "<|start_of_role|>tool_response<|end_of_role|>rainy<|end_of_text|>\n" in rendered
    assert parse("granite", written)[1] == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    # A template without tools is shown the same form.
    said = chat_for_template(history[:2], TOOLS, "granite", knows_tools=False)[1]
    assert said["content"] == written


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_granite_call_is_a_list_of_one_call_after_its_marker(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    grammar = compiler.compile(tool_call_grammar("granite", tools, forced))
    call = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert admitted_by(grammar, call)
    assert parse("granite", call) == ("", [("get_weather", '{"city": "Rome"}')])
    assert not admitted_by(grammar, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Berlin"}}]')
    assert not admitted_by(grammar, '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert admitted_by(grammar, '<|tool_call|>[{"name": "get_time", "arguments": {}}]') == (forced is None)
    assert not admitted_by(grammar, "Sure. " + call)
    source = tool_call_grammar("granite", tools, forced, control_tokens={"<|tool_call|>": 100}).source
    assert "<[100]>" in source and '"<|tool_call|>"' not in source


# Nemotron Nano v2: Granite's list form between `<TOOLCALL>` and `</TOOLCALL>`; its
# published template (tests/actors/templates/).
NEMOTRON_NANO_V2 = (TEMPLATE_DIR / "nvidia-NVIDIA-Nemotron-Nano-9B-v2.jinja").read_text()
NEMOTRON_CASES = [
    ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>', ("", [("get_weather", '{"city": "Paris"}')])),
    (
        'Let me check.\n\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]</TOOLCALL>',
        ("Let me check.\n\n", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC"}')]),
    ),
    ('<TOOLCALL>[{"name": "now", "arguments": {}}] </TOOLCALL>\nDone.', ("\nDone.", [("now", "{}")])),
    # Its closing tag left out (a stop string, max_tokens): the call stands.
    ('<TOOLCALL>[{"name": "now", "arguments": {}}]', ("", [("now", "{}")])),
    ('<TOOLCALL>[{"name": "now", "arguments": {}}]</TOOL', ("</TOOL", [("now", "{}")])),
    # No list of calls: the text as written, its tags too.
    ("<TOOLCALL>not a call</TOOLCALL>", ("<TOOLCALL>not a call</TOOLCALL>", [])),
    # Mistral's named form is none of Nemotron's.
    ('<TOOLCALL>now[ARGS]{"a": 1}</TOOLCALL>', ('<TOOLCALL>now[ARGS]{"a": 1}</TOOLCALL>', [])),
    ('Sure.<TOOLCALL>[{"name": "f", "arguments": {"a": "x', ('Sure.<TOOLCALL>[{"name": "f", "arguments": {"a": "x', [])),
    ("A </TOOLCALL> alone.", ("A </TOOLCALL> alone.", [])),
    # Only the closing tag right after the list (past blanks) is markup: a second one, or
    # one after text, is text.
    ('<TOOLCALL>[{"name": "now", "arguments": {}}]</TOOLCALL></TOOLCALL>', ("</TOOLCALL>", [("now", "{}")])),
    ('<TOOLCALL>[{"name": "now", "arguments": {}}] and </TOOLCALL>', (" and </TOOLCALL>", [("now", "{}")])),
]


@pytest.mark.parametrize(("text", "expected"), NEMOTRON_CASES)
def test_nemotron_calls_are_the_same_whatever_the_split(text, expected):
    assert parse("nemotron", text) == expected
    for cut in range(1, len(text)):
        assert parse("nemotron", text, [cut]) == expected, cut
    assert parse("nemotron", text, range(1, len(text))) == expected


def test_text_after_a_nemotron_call_list_goes_out_as_it_comes():
    parser = parser_for("nemotron")
    events = parser.feed('<TOOLCALL>[{"name": "now", "arguments": {}}]Done')
    assert events[-1] == Content("Done")  # not held for a closing tag it cannot begin
    assert parser.feed("</TOOL") == [Content("</TOOL")]


def test_the_nemotron_nano_v2_template_is_nemotrons_and_its_history_parses_back():
    """A past call (its content null, as clients send it: the template's `in` failed on
    it) is written as the model writes calls, and its result as a tool response."""
    assert tool_style_for(NEMOTRON_NANO_V2, "nemotron_h") == "nemotron"
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        HISTORY[0],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    rendered = with_template(NEMOTRON_NANO_V2).apply_chat_template(
        chat_for_template(history, TOOLS, "nemotron", knows_tools=True), template_kwargs={"tools": TOOLS}
    )
    written = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    assert f"<SPECIAL_11>Assistant\n{written}\n<SPECIAL_12>\n<SPECIAL_11>User\n<TOOL_RESPONSE>[sunny]</TOOL_RESPONSE>" in rendered
    assert parse("nemotron", written) == ("", [("get_weather", '{"city": "Paris"}')])


def test_a_nemotron_history_shown_as_text_writes_a_turns_calls_as_one_list_that_parses_back():
    """For a template without tools; a call whose arguments are JSON null has none."""
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate((("get_weather", '{"city": "Paris"}'), ("now", "null")))
    ]
    history = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": calls}]
    said = chat_for_template(history, TOOLS, "nemotron", knows_tools=False)[1]["content"]
    assert said == '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]</TOOLCALL>'
    assert parse("nemotron", said) == ("", [("get_weather", '{"city": "Paris"}'), ("now", "{}")])


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_nemotron_call_is_a_list_of_one_call_between_its_tags(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    grammar = compiler.compile(tool_call_grammar("nemotron", tools, forced))
    call = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</TOOLCALL>'
    assert admitted_by(grammar, call)
    assert parse("nemotron", call) == ("", [("get_weather", '{"city": "Rome"}')])
    assert not admitted_by(grammar, call.removesuffix("</TOOLCALL>") + "</tool_call>")
    assert admitted_by(grammar, '<TOOLCALL>[{"name": "get_time", "arguments": {}}]</TOOLCALL>') == (forced is None)


# GLM-4-0414 and GLM-Z1: a tool's name alone on the reply's first line, then the
# arguments' JSON object. GLM-Z1-9B-0414's published template.
GLM_Z1 = (TEMPLATE_DIR / "THUDM-GLM-Z1-9B-0414.jinja").read_text()
GLM_TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
GLM4_CASES = [
    ('get_weather\n{"city": "Paris", "days": 2}', ("", [("get_weather", '{"city": "Paris", "days": 2}')])),
    ('get_weather\n{"city": "Zürich"}', ("", [("get_weather", '{"city": "Zürich"}')])),  # not \\u-escaped
    ('\n get_time \n\n{"zone": "UTC"}\n', ("\n", [("get_time", '{"zone": "UTC"}')])),
    ("\nParis is sunny.", ("\nParis is sunny.", [])),  # the template's text form
    ("get the weather first", ("get the weather first", [])),
    ("get_weather", ("get_weather", [])),  # a name alone is no call
    ('get_weather\nIt is {"sunny": 1}', ('get_weather\nIt is {"sunny": 1}', [])),
    ('get_weather\n[1, 2]', ('get_weather\n[1, 2]', [])),
    ('lookup\n{"q": "x"}', ('lookup\n{"q": "x"}', [])),  # no tool of the request's
    ('get_weather\n{"city": NaN}', ('get_weather\n{"city": NaN}', [])),
    ('get_weather\n{"city": "Pa', ('get_weather\n{"city": "Pa', [])),  # cut short: text
    # A first line holding more than a name, its arguments too, is no call.
    ('get_weather now\n{"city": "Paris"}', ('get_weather now\n{"city": "Paris"}', [])),
    ('get_weather {"city": "Paris"}', ('get_weather {"city": "Paris"}', [])),
    ("\n \n", ("\n \n", [])),  # blanks alone are text too
    ("get_weather\n \n", ("get_weather\n \n", [])),  # a name and blanks, no arguments
]


@pytest.mark.parametrize(("text", "expected"), GLM4_CASES)
def test_glm4_calls_are_the_same_whatever_the_split(text, expected):
    assert parse("glm4", text, tools=GLM_TOOLS) == expected
    for cut in range(1, len(text)):
        assert parse("glm4", text, [cut], tools=GLM_TOOLS) == expected, cut
    assert parse("glm4", text, range(1, len(text)), tools=GLM_TOOLS) == expected


def test_glm4_text_that_cannot_become_a_tools_name_goes_out_at_once():
    parser = parser_for("glm4", tools=GLM_TOOLS)
    assert parser.feed("get_") == [] and parser.feed("wea") == []
    assert parser.feed("ry well") == [Content("get_weary well")]
    assert parser_for("glm4", tools=GLM_TOOLS).feed("Paris") == [Content("Paris")]
    # A whole first line naming no tool is text at once, not once more follows.
    assert parser_for("glm4", tools=GLM_TOOLS).feed("lookup\n") == [Content("lookup\n")]
    # So is a tool's name followed by what cannot begin its arguments' object.
    for after in ("It", "\n[1"):
        assert parser_for("glm4", tools=GLM_TOOLS).feed(f"get_weather\n{after}") == [Content(f"get_weather\n{after}")]


def test_a_glm4_call_fed_a_character_a_delta_is_scanned_once(monkeypatch):
    """The arguments' JSON is scanned from where the last delta stopped: scanning it
    again from its start at every delta made a long call O(n^2)."""
    scanned = []

    class Counted:
        def __init__(self, pattern):
            self.pattern = pattern

        def search(self, text, at):
            found = self.pattern.search(text, at)
            scanned.append((len(text) if found is None else found.end()) - at)
            return found

    monkeypatch.setattr(json_ends, "_IN_STRING", Counted(json_ends._IN_STRING))
    monkeypatch.setattr(json_ends, "_STRUCTURE", Counted(json_ends._STRUCTURE))
    arguments = json.dumps({"text": "x" * 300, "n": [1, 2]})
    text = f"get_weather\n{arguments}"
    assert parse("glm4", text, range(1, len(text)), tools=GLM_TOOLS) == ("", [("get_weather", arguments)])
    assert sum(scanned) <= 2 * len(arguments)


def test_glm4_tool_names_are_the_functions_string_names():
    tools = [{"type": "function", "function": "get_weather"}, {"function": {"name": 3}}, {}, *GLM_TOOLS]
    assert tool_names(tools) == {"get_weather", "get_time"}


@pytest.mark.parametrize("blank_at", ["before", "after_line"])
def test_glm4_blank_tokens_around_a_name_take_linear_time(blank_at):
    """The first line's blanks were stripped again, and those before the arguments
    walked again, at every token: a run of blank tokens made a reply O(n^2)."""

    def seconds(size):
        head, tail = {
            "before": ("", 'get_weather\n{"city": "Rome"}'),
            "after_line": ("get_weather\n", '{"city": "Rome"}'),
        }[blank_at]
        parser = parser_for("glm4", tools=GLM_TOOLS)
        started = time.perf_counter()
        events = parser.feed(head)
        for _ in range(size):
            events += parser.feed("\n")
        events += parser.feed(tail) + parser.finish()
        took = time.perf_counter() - started
        assert [e for e in events if isinstance(e, CallStart | CallArguments)] == [
            CallStart(0, "get_weather"), CallArguments(0, '{"city": "Rome"}')
        ]
        return took

    small = min(seconds(2_000) for _ in range(3))
    assert seconds(16_000) < 20 * small + 0.5  # linear: 8 times; quadratic: 64 (~1-10 s)


def test_a_glm_z1_call_after_its_thought_is_a_call_and_one_inside_it_reasoning():
    call = 'get_weather\n{"city": "Rome"}'
    parser = parser_for("glm4", think_tags=("<think>", "</think>"), tools=GLM_TOOLS)
    events = parser.feed(f"<think>\nMaybe {call}?\n</think>\n{call}") + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == f"Maybe {call}?"
    assert [e for e in events if isinstance(e, CallStart | CallArguments)] == [
        CallStart(0, "get_weather"), CallArguments(0, '{"city": "Rome"}')
    ]


def test_the_glm4_template_is_glm4s_and_the_others_keep_theirs():
    assert tool_style_for(GLM_Z1, "glm4") == tool_style_for(GLM_Z1, "llama") == "glm4"
    assert template_knows_tools(GLM_Z1)
    glm45 = "<|observation|>{% for c in m.tool_calls %}<tool_call>{{ c.name }}<arg_key>{% endfor %}"
    assert tool_style_for(glm45, "glm4_moe") == "glm45"  # GLM-4.5's key and value tags: no name-then-JSON
    # Key tags with no <tool_call> teach no GLM-4.5 call, which opens with it.
    assert tool_style_for(glm45.replace("<tool_call>", ""), "glm4_moe") == "glm4"
    kept = {HERMES: "hermes", QWEN3: "hermes", QWEN3_CODER: "qwen3_coder", LLAMA3_JSON: "llama3_json",
            MISTRAL: "mistral", HARMONY: "harmony", GEMMA: "gemma", OLMO3: "olmo3", GRANITE3: "granite"}
    assert {tool_style_for(t, "glm4"): style for t, style in kept.items()} == {s: s for s in kept.values()}


def test_a_glm4_history_is_assistant_turns_named_by_metadata_and_observation_turns():
    """The template writes neither `tool_calls` nor a `tool` turn: a past call and its
    result were dropped from the prompt."""
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
        for i, city in enumerate(("Paris", "Zürich"))
    ]
    history = [
        HISTORY[0],
        {"role": "assistant", "content": "Checking both.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]
    rendered = with_template(GLM_Z1).apply_chat_template(
        chat_for_template(history, TOOLS, "glm4", knows_tools=True), template_kwargs=None
    )
    # A turn of text alone stays as it is.
    plain = [HISTORY[0], {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks."}]
    assert chat_for_template(plain, TOOLS, "glm4", knows_tools=True)[1:] == plain[1:]
    assert rendered.endswith(
        "<|user|>\nWeather in Paris?<|assistant|>\nChecking both."
        '<|assistant|>get_weather\n{"city": "Paris"}<|assistant|>get_weather\n{"city": "Zürich"}'
        "<|observation|>\nsunny<|observation|>\nrainy<|assistant|>\n<think>"
    )
    # A template without tools is shown the same form, which parses back.
    said = chat_for_template(history[:2], TOOLS, "glm4", knows_tools=False)[1]["content"]
    assert said.startswith('Checking both.\nget_weather\n{"city": "Paris"}')
    assert parse("glm4", said.removeprefix("Checking both.\n").split("\nget_weather")[0], tools=GLM_TOOLS)[1] == [
        ("get_weather", '{"city": "Paris"}')
    ]


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_glm4_call_is_the_name_then_the_arguments_json(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    grammar = compiler.compile(tool_call_grammar("glm4", tools, forced))
    call = 'get_weather\n{"city": "Rome"}'
    assert admitted_by(grammar, call)
    assert parse("glm4", call, tools=tools) == ("", [("get_weather", '{"city": "Rome"}')])
    assert not admitted_by(grammar, 'get_weather\n{"city": "Berlin"}')
    assert admitted_by(grammar, "get_time\n{}") == (forced is None)
    assert not admitted_by(grammar, "\nSure.")


# GLM-4.5's, 4.6's and 4.7's calls: a name, then key and value tags (runtime/glm45_reply.py).
GLM46 = (TEMPLATE_DIR / "zai-org-GLM-4.6.jinja").read_text()


def glm(name, *pairs, newlines=True):
    """A call as GLM-4.5's and 4.6's templates write it, or (`newlines` False) GLM-4.7's."""
    sep = "\n" if newlines else ""
    written = "".join(f"{sep}<arg_key>{key}</arg_key>{sep}<arg_value>{value}</arg_value>" for key, value in pairs)
    return f"<tool_call>{name}{written}{sep}</tool_call>"


GLM45_CASES = [
    (
        "Let me check.\n" + glm("get_weather", ("city", "Paris"), ("days", "3")) + glm("get_time"),
        ("Let me check.\n", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]),
    ),
    (  # GLM-4.7's form, with no newlines; blanks between the tags
        glm("get_weather", ("city", "Rome"), ("hours", "[1, 2]"), newlines=False)
        + " <tool_call>get_time \n <arg_key> zone </arg_key>  <arg_value>UTC</arg_value> </tool_call> Done.",
        ("  Done.", [("get_weather", '{"city": "Rome", "hours": [1, 2]}'), ("get_time", '{"zone": "UTC"}')]),
    ),
    (  # a string value is its text as written; tags in it are its text
        glm("get_weather", ("city", "\n  Paris, <arg_key>France\n")),
        ("", [("get_weather", json.dumps({"city": "\n  Paris, <arg_key>France\n"}))]),
    ),
    (  # a key given twice keeps its first value; one with no name, or no value, is dropped
        glm("get_weather", ("city", "Rome"), ("city", "Oslo"), ("", "x"))
        .replace("</tool_call>", "<arg_key>days</arg_key> hmm <arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"),
        ("", [("get_weather", '{"city": "Rome", "days": 2}')]),
    ),
    (  # no name, or one with blanks in it: text as written
        "A <tool_call>\n<arg_key>a</arg_key></tool_call> and <tool_call>get time\n</tool_call>",
        ("A <tool_call>\n<arg_key>a</arg_key></tool_call> and <tool_call>get time\n</tool_call>", []),
    ),
    (  # Hermes JSON in the tags is no call of GLM's
        'A <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ('A <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),
    ),
    ("It ends in <tool_ca", ("It ends in <tool_ca", [])),  # held as a marker, then text
    ("It ends in <tool_call>get_ti", ("It ends in <tool_call>get_ti", [])),  # a name never ended
    (  # an empty key or value, each right at its tag (an empty key's pair dropped)
        glm("get_weather", ("", "x"), ("city", ""), ("days", "2")),
        ("", [("get_weather", '{"city": "", "days": 2}')]),
    ),
    (  # GLM-4.7's form with no name: text as written
        "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        ("<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", []),
    ),
    (  # stray text between pairs, one beginning with "<", one of a character, is dropped
        "<tool_call>get_weather\n<br> <arg_key>city</arg_key><arg_value>Rome</arg_value>x"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        ("", [("get_weather", '{"city": "Rome", "days": 2}')]),
    ),
    (  # keys with no value, one after another, are dropped
        "<tool_call>get_weather<arg_key>a</arg_key> <arg_key>b</arg_key>\n"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        ("", [("get_weather", '{"days": 2}')]),
    ),
    # A name of the limit's 256 characters is a call, one of 257 text.
    (glm("n" * 256, ("a", "1")), ("", [("n" * 256, '{"a": "1"}')])),
    (glm("n" * 257, ("a", "1")), (glm("n" * 257, ("a", "1")), [])),
]


@pytest.mark.parametrize(("text", "expected"), GLM45_CASES)
def test_glm45_calls_are_the_same_whatever_the_split(text, expected):
    assert parse("glm45", text, tools=XML_TOOLS) == expected
    for cut in range(1, len(text)):
        assert parse("glm45", text, [cut], tools=XML_TOOLS) == expected, cut
    assert parse("glm45", text, range(1, len(text)), tools=XML_TOOLS) == expected


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [("city", "3", "3"), ("days", "3", 3), ("metric", "true", True), ("where", '{"a": 1}', {"a": 1}),
     ("note", "null", None), ("code", "x1", "x1"), ("free", "3", "3"), ("place", '{"lat": 2}', {"lat": 2})],
)
def test_glm45_values_take_their_type_from_the_schema(key, text, value):
    _, [(_, arguments)] = parse("glm45", glm("get_weather", (key, text)), tools=XML_TOOLS)
    assert json.loads(arguments) == {key: value}


def test_glm45_streams_the_name_then_each_pair_as_its_value_closes():
    parser = parser_for("glm45", tools=XML_TOOLS)
    assert parser.feed("Sure.<tool_call>get_wea") == [Content("Sure.")]
    assert parser.feed("ther\n<arg_key>city</arg_key>\n<arg_value>Par") == [CallStart(0, "get_weather")]
    assert parser.feed("is</arg_value>\n<arg_key>days</arg_key><arg_value>3</arg_") == [
        CallArguments(0, '{"city": "Paris"')
    ]
    assert parser.feed("value>\n</tool_call>") == [CallArguments(0, ', "days": 3'), CallArguments(0, "}")]
    assert parser.finish() == []


def test_glm45_text_goes_out_as_it_comes_but_a_tail_that_may_begin_a_call():
    parser = parser_for("glm45", tools=XML_TOOLS)
    assert parser.feed("Paris is sunny <tool") == [Content("Paris is sunny ")]
    assert parser.feed("s") == [Content("<tools")]
    # A name ends at its line's end (GLM-4.5's) as at a tag (GLM-4.7's).
    assert parser_for("glm45", tools=XML_TOOLS).feed("<tool_call>get_time\n") == [CallStart(0, "get_time")]
    # A call's tag followed by a tag, no name, is text at once.
    events = parser_for("glm45", tools=XML_TOOLS).feed("<tool_call><arg_key>")
    assert "".join(e.text for e in events if isinstance(e, Content)) == "<tool_call><arg_key>"


def test_a_past_call_is_written_in_glm45s_tags():
    def body(arguments):
        return key_value_call("f", arguments).removeprefix("<tool_call>f").removesuffix("\n</tool_call>")

    assert body(None) == body("") == body({}) == ""
    assert body("not json") == "\nnot json"  # text a client sent goes in as written
    assert body([1]) == "\n[1]"
    assert body({"a": "Zürich", "b": ["Zürich"]}) == (
        "\n<arg_key>a</arg_key>\n<arg_value>Zürich</arg_value>\n<arg_key>b</arg_key>\n<arg_value>[\"Zürich\"]</arg_value>"
    )


def test_a_glm45_call_the_reply_ends_inside_of_is_cut_short_with_its_text():
    text = "A <tool_call>f\n<arg_key>a</arg_key>\n<arg_value>xy"
    for cut in range(len("A <tool_call>f\n"), len(text)):
        parser = parser_for("glm45")
        events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert events[-1] == CallCutShort(0, "f\n<arg_key>a</arg_key>\n<arg_value>xy"), cut
        assert [e for e in events if isinstance(e, CallStart)] == [CallStart(0, "f")]


def test_glm45_calls_after_a_thought_are_calls_and_in_it_reasoning():
    from runtime.think_reply import THINK_TAGS
    from runtime.tools import Reasoning

    parser = parser_for("glm45", think_tags=THINK_TAGS, tools=XML_TOOLS)
    events = parser.feed("<think>maybe " + glm("get_time") + "</think>" + glm("get_weather", ("days", "2")))
    events += parser.finish()
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "maybe " + glm("get_time")
    calls = [e for e in events if isinstance(e, CallStart | CallArguments)]
    assert calls == [CallStart(0, "get_weather"), CallArguments(0, '{"days": 2'), CallArguments(0, "}")]


def test_the_glm46_template_is_glm45s_tags_and_renders_a_history_that_parses_back():
    """GLM-4.6's published template writes `<tool_call>` and `<arg_key>`: it was read as
    Hermes' JSON, and its calls were content. Its history's calls read back as sent."""
    assert tool_style_for(GLM46, "glm4_moe") == "glm45" and template_knows_tools(GLM46)
    arguments = {"city": "Paris", "days": 3, "where": {"a": [1]}}
    history = [*HISTORY[:1], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": json.dumps(arguments)}}]}, HISTORY[2]]
    rendered = with_template(GLM46).apply_chat_template(
        chat_for_template(history, TOOLS, "glm45", knows_tools=True), template_kwargs=None
    )
    written = rendered[rendered.index("<tool_call>get_weather") : rendered.index("</tool_call><|observation|>") + 12]
    assert "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in written
    assert parse("glm45", written, tools=XML_TOOLS) == ("", [("get_weather", json.dumps(arguments))])
    assert "<|observation|>\n<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert rendered.endswith("<|assistant|>")  # thinking on: the model opens its own thought


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_glm45_call_is_its_tags_typed_by_the_schema(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    weather = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["city", "days"],
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}, *XML_TOOLS[1:]]
    grammar = compiler.compile(tool_call_grammar("glm45", tools, forced))
    call = glm("get_weather", ("city", "Rome"), ("days", "2"), ("note", "a <b> c"))
    assert admitted_by(grammar, call)
    assert parse("glm45", call, tools=tools) == ("", [("get_weather", '{"city": "Rome", "days": 2, "note": "a <b> c"}')])
    assert admitted_by(grammar, glm("get_weather", ("city", "Rome"), ("days", "2")))  # note is optional
    assert not admitted_by(grammar, glm("get_weather", ("city", "Berlin"), ("days", "2")))  # not of its enum
    assert not admitted_by(grammar, glm("get_weather", ("days", "2")))  # city is required
    assert not admitted_by(grammar, glm("get_weather", ("city", "Rome"), ("days", "two")))
    assert not admitted_by(grammar, glm("get_weather", ("city", "Rome"), ("days", "2"), ("note", "a</arg_value>b")))
    assert admitted_by(grammar, glm("get_time", ("any", "x"))) == (forced is None)
    assert not admitted_by(grammar, "Sure. " + call)


@pytest.mark.parametrize("odd", ["", " pad", "n" * 257, "a</arg_key>b"])
def test_a_forced_glm45_call_never_writes_a_key_that_reads_back_as_another(odd):
    """A key with blanks around it, none, over 256 characters or holding `</arg_key>` goes
    as any keys, as Qwen3-Coder's names do."""
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    parameters = {"type": "object", "properties": {odd: {"type": "string"}, "q": {"type": "string"}}, "required": [odd]}
    grammar = compiler.compile(tool_call_grammar("glm45", [{"type": "function", "function": {"name": "odd", "parameters": parameters}}], "odd"))
    assert not admitted_by(grammar, glm("odd", (odd, "v")))
    assert admitted_by(grammar, glm("odd", ("q", "v"), ("other", "w")))


@pytest.mark.parametrize("key", ["x", "a>b", "a</arg_key", "k" * 256])
def test_a_forced_glm45_calls_listed_keys_are_written_as_themselves(key):
    """Keys of 1 and 256 characters, a `>` and an unclosed `</arg_key` (no end of a GLM
    key) read back as themselves: closed to others, the call takes that key alone."""
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    parameters = {"type": "object", "properties": {key: {"type": "string"}}, "additionalProperties": False}
    grammar = compiler.compile(tool_call_grammar("glm45", [{"type": "function", "function": {"name": "f", "parameters": parameters}}], "f"))
    assert admitted_by(grammar, glm("f", (key, "v"))) and admitted_by(grammar, glm("f"))
    assert not admitted_by(grammar, glm("f", ("r", "1")))


@pytest.mark.parametrize("long", ["value", "key"])
def test_a_long_glm45_value_fed_a_few_characters_a_delta_takes_linear_time(long):
    """Each delta's text is searched once for `</arg_value>` (a key's for `</arg_key>`):
    searching the whole value again at every token would make a long one O(n^2)."""

    def seconds(size):
        key, value = ("x<" * size, "v") if long == "key" else ("city", "x<" * size)
        text = glm("get_weather", (key, value))
        parser, events = parser_for("glm45", tools=XML_TOOLS), []
        started = time.perf_counter()
        for at in range(0, len(text), 4):
            events += parser.feed(text[at : at + 4])
        took = time.perf_counter() - started
        arguments = "".join(e.fragment for e in events + parser.finish() if isinstance(e, CallArguments))
        assert json.loads(arguments) == {key: value}
        return took

    # The least of a few timings: one run slowed by a busy machine failed the check.
    small = min(seconds(20_000) for _ in range(3))
    assert min(seconds(160_000) for _ in range(2)) < 20 * small + 1.0  # linear: 8 times; quadratic: 64


# Seed-OSS's calls: Qwen3-Coder's XML in `<seed:tool_call>` blocks, its values inline.
SEED = (TEMPLATE_DIR / "ByteDance-Seed-Seed-OSS-36B-Instruct.jinja").read_text()
SEED_CALL = "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=days>3</parameter>\n</function>\n</seed:tool_call>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"Checking.\n{SEED_CALL}", ("Checking.\n", [("get_weather", '{"city": "Paris", "days": 3}')])),
        (SEED_CALL + SEED_CALL.replace("get_weather", "get_time"), ("", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"city": "Paris", "days": "3"}')])),
        (xml("get_weather", ("city", "Rome")), (xml("get_weather", ("city", "Rome")), [])),  # Qwen's blocks are text
    ],
    ids=["after-text", "two-blocks", "qwen-block"],
)
def test_seed_oss_calls_are_its_blocks_whatever_the_split(text, expected):
    """Seed-OSS's `<seed:tool_call>` blocks stayed content: its template's `<function=`
    made the style Qwen3-Coder's, whose blocks are `<tool_call>`."""
    assert parse("seed_oss", text, tools=XML_TOOLS) == expected
    assert parse("seed_oss", text, range(1, len(text)), tools=XML_TOOLS) == expected


def test_the_seed_oss_template_is_its_own_style_and_renders_a_history_that_parses_back():
    assert tool_style_for(SEED, "seed_oss") == "seed_oss" and template_knows_tools(SEED)
    arguments = {"city": "Paris", "days": 3, "metric": True}
    history = [*HISTORY[:1], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": json.dumps(arguments)}}]}, HISTORY[2]]
    rendered = with_template(SEED).apply_chat_template(
        chat_for_template(history, XML_TOOLS, "seed_oss", knows_tools=True), template_kwargs=None
    )
    written = rendered[rendered.index("<seed:tool_call>\n<function=get_weather>") : rendered.index("</seed:tool_call><seed:eos>") + 17]
    assert "<parameter=city>Paris</parameter>\n<parameter=days>3</parameter>\n" in written
    assert parse("seed_oss", written, tools=XML_TOOLS) == ("", [("get_weather", json.dumps(arguments))])


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_seed_oss_call_is_its_xml_in_its_own_block(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    grammar = compiler.compile(tool_call_grammar("seed_oss", XML_TOOLS, forced))
    call = xml("get_weather", ("city", "Rome"), ("days", "2"))
    assert not admitted_by(grammar, call)  # Qwen3-Coder's block
    seed_call = call.replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")
    assert admitted_by(grammar, seed_call)
    assert parse("seed_oss", seed_call, tools=XML_TOOLS) == ("", [("get_weather", '{"city": "Rome", "days": 2}')])


# Command R7B and Command A: a JSON list of {"tool_call_id", "tool_name", "parameters"}
# between `<|START_ACTION|>` and `<|END_ACTION|>`, an answer between `<|START_RESPONSE|>`
# and `<|END_RESPONSE|>`; R7B's published tool-use template (as llama.cpp keeps it).
COMMAND_R7B = (TEMPLATE_DIR / "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja").read_text()
R7B_CALL = '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}\n]<|END_ACTION|>'
COMMAND_R7B_CASES = [
    (R7B_CALL, ("", [("get_weather", '{"city": "Paris"}')])),
    (
        '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"tool_call_id": "1", "tool_name": "get_time", "parameters": {}}]<|END_ACTION|>',
        ("", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ),
    # The answer's tags are markup (control tokens, kept where tools are offered).
    ("<|START_RESPONSE|>It is sunny.<|END_RESPONSE|>", ("It is sunny.", [])),
    ("<|START_TEXT|>It is sunny.<|END_TEXT|>", ("It is sunny.", [])),  # Command A Reasoning's
    # Its closing tag left out (a stop string, max_tokens): the call stands.
    ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "now", "parameters": {}}]', ("", [("now", "{}")])),
    # No list of calls, or a list item naming no tool: the text as written.
    ("<|START_ACTION|>not a call<|END_ACTION|>", ("<|START_ACTION|>not a call<|END_ACTION|>", [])),
    ('<|START_ACTION|>[{"name": "now"}]<|END_ACTION|>', ('<|START_ACTION|>[{"name": "now"}]<|END_ACTION|>', [])),
    ('<|START_ACTION|>[{"tool_name": "f", "parameters": {"a": "x', ('<|START_ACTION|>[{"tool_name": "f", "parameters": {"a": "x', [])),
    ("A <|START_RESPONSE half.", ("A <|START_RESPONSE half.", [])),
    # Mistral's named form is no Command R7B call, and text between its markers does not
    # hide the list of calls that follows.
    (
        '<|START_ACTION|>get_weather[ARGS]{"city": "Paris"}<|END_ACTION|>',
        ('<|START_ACTION|>get_weather[ARGS]{"city": "Paris"}<|END_ACTION|>', []),
    ),
    ("<|START_ACTION|>oops<|END_ACTION|>" + R7B_CALL, ("<|START_ACTION|>oops<|END_ACTION|>", [("get_weather", '{"city": "Paris"}')])),
]


@pytest.mark.parametrize(("text", "expected"), COMMAND_R7B_CASES)
def test_command_r7b_calls_are_the_same_whatever_the_split(text, expected):
    """Its `<|START_ACTION|>` calls were content (the markers dropped as special tokens)."""
    assert parse("command_r7b", text) == expected
    for cut in range(1, len(text)):
        assert parse("command_r7b", text, [cut]) == expected, cut
    assert parse("command_r7b", text, range(1, len(text))) == expected


def test_the_command_r7b_template_renders_a_history_of_calls_and_results_that_parses_back():
    """Its template writes an assistant turn's `tool_calls` and the `tool` results itself,
    the calls numbered in order, each result under its call's number."""
    assert tool_style_for(COMMAND_R7B, "cohere2") == "command_r7b" and template_knows_tools(COMMAND_R7B)
    rendered = with_template(COMMAND_R7B).apply_chat_template(
        chat_for_template(HISTORY, TOOLS, "command_r7b", knows_tools=True), template_kwargs={"tools": TOOLS}
    )
    written = rendered[rendered.index("<|START_ACTION|>") : rendered.index("<|END_ACTION|>") + len("<|END_ACTION|>")]
    assert written == R7B_CALL  # as the model writes them
    assert '<|START_TOOL_RESULT|>[\n    {\n        "tool_call_id": "0",\n        "results": {\n            "0": "sunny, 21 C"' in rendered
    assert "<|START_THINKING|><|END_THINKING|><|START_ACTION|>" in rendered  # no plan sent: none shown
    assert parse("command_r7b", written) == ("", [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("arguments", ["null", ""])
def test_a_past_call_of_no_arguments_is_shown_to_a_template_without_tools_as_command_r7b_writes_it(arguments):
    """A call sent back with `arguments` of JSON null (or none at all) is a call of none:
    its parameters an empty object, as the model writes them, never `null`."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    history = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [call]}, HISTORY[2]]
    said = chat_for_template(history, TOOLS, "command_r7b", knows_tools=False)[1]["content"]
    assert said == '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_time", "parameters": {}}]<|END_ACTION|>'
    assert parse("command_r7b", said) == ("", [("get_time", "{}")])


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_a_forced_command_r7b_call_is_a_list_of_one_call_as_its_template_writes_it(forced):
    compiler = GrammarCompiler(DEMO, DEMO.vocab_size, DEMO.eos_token_ids)
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    grammar = compiler.compile(tool_call_grammar("command_r7b", tools, forced))
    assert admitted_by(grammar, R7B_CALL.replace("Paris", "Rome"))
    assert parse("command_r7b", R7B_CALL) == ("", [("get_weather", '{"city": "Paris"}')])
    assert not admitted_by(grammar, R7B_CALL.replace('"tool_name"', '"name"'))
    get_time = '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_time", "parameters": {}}\n]<|END_ACTION|>'
    assert admitted_by(grammar, get_time) == (forced is None)
    source = tool_call_grammar("command_r7b", tools, forced, control_tokens={"<|START_ACTION|>": 100}).source
    assert "<[100]>" in source and '"<|START_ACTION|>"' not in source
