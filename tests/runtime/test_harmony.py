"""gpt-oss's harmony replies (runtime/harmony.py): reasoning, content and tool calls,
the same events however the text is split."""

from __future__ import annotations

import json

from runtime.harmony import HarmonyParser
from runtime.tools import CallArguments, CallCutShort, CallStart, Content, Reasoning, parser_for

import pytest

THINK_THEN_ANSWER = (
    "<|channel|>analysis<|message|>The user wants the capital.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris is the capital."
)
CALL_AFTER_CHANNEL = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
CALL_BEFORE_CHANNEL = (
    '<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather'
    '<|channel|>commentary json<|message|>{"city": "Paris", "unit": "c"}'
)

RECIPIENT_FIRST = ' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}'


def summary(events):
    """(reasoning, content, [(call name, arguments)], cut-short indexes) of `events`."""
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStart):
            calls[event.index] = [event.name, ""]
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.fragment
    cut = [e.index for e in events if isinstance(e, CallCutShort)]
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], cut


def parse(text, pieces=None, parses_calls=True):
    parser = HarmonyParser(parses_calls)
    events = []
    for piece in pieces or [text]:
        events += parser.feed(piece)
    return events + parser.finish()


def every_split(text):
    """The text cut in two at every position, and cut character by character."""
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    yield list(text)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (THINK_THEN_ANSWER, ("The user wants the capital.", "Paris is the capital.", [], [])),
        (CALL_AFTER_CHANNEL, ("Need the weather tool.", "", [("get_weather", '{"city": "Paris"}')], [])),
        (
            CALL_BEFORE_CHANNEL,
            ("Look it up.", "", [("get_weather", '{"city": "Paris", "unit": "c"}')], []),
        ),
        # No role, the recipient first: " to" alone may come before "=functions".
        (RECIPIENT_FIRST, ("", "", [("get_time", '{"tz": "UTC"}')], [])),
    ],
    ids=["reasoning-then-answer", "recipient-after-channel", "recipient-before-channel", "recipient-first"],
)
def test_each_message_goes_to_its_channel_however_the_text_is_split(text, want):
    assert summary(parse(text)) == want
    for pieces in every_split(text):
        assert summary(parse(text, pieces)) == want, pieces


def test_reasoning_and_content_stream_as_they_are_written():
    parser = HarmonyParser()
    assert parser.feed("<|channel|>analysis<|message|>Let me") == [Reasoning("Let me")]
    assert parser.feed(" think.<|end|><|start|>assistant") == [Reasoning(" think.")]
    assert parser.feed("<|channel|>final<|message|>Hel") == [Content("Hel")]
    assert parser.feed("lo") == [Content("lo")]
    assert parser.finish() == []


def test_a_call_streams_its_arguments_and_its_name_first():
    parser = HarmonyParser()
    header = "<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
    assert parser.feed(header) == [CallStart(0, "search")]
    assert parser.feed('{"q": ') == [CallArguments(0, '{"q": ')]
    assert parser.feed('"mlx"}') == [CallArguments(0, '"mlx"}')]
    assert parser.finish() == []


def test_a_call_the_reply_ended_inside_of_is_cut_short():
    text = '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": "ml'
    reasoning, content, calls, cut = summary(parse(text))
    assert calls == [("search", '{"q": "ml')] and cut == [0]


@pytest.mark.parametrize(
    "body", ["NaN", "5", "[1]", '"x"', '{"a": Infinity}', '{"a": 1e999}', '{"a": -NaN}', "[" * 100_000]
)
def test_a_call_whose_body_is_no_json_object_is_cut_short(body):
    """OpenAI's arguments are an object, and NaN, Infinity or a float past a float's range
    would reach the client as JSON that strict readers refuse."""
    text = f"<|channel|>commentary to=functions.search <|constrain|>json<|message|>{body}<|call|>"
    assert summary(parse(text)) == ("", "", [("search", body)], [0])
    assert summary(parse(text + "<|end|>"))[3] == [0]  # cut short once, not again at a later marker
    assert summary(parse(text.replace(body, '{"a": 1e99}')))[3] == []


@pytest.mark.parametrize(
    ("body", "end"),
    [("null", "<|call|>"), (" null\n", "<|end|>"), ("null", ""), (" null\n", ""), ("", "<|call|>"), ("  ", "<|end|>")],
)
def test_a_call_of_no_arguments_goes_out_as_an_empty_object_in_any_split(body, end):
    """A client reads "null" as None, which no function takes as its arguments; the JSON
    styles send {} for it too. <|call|> is an EOS token, so the reply may end without it."""
    text = f"<|channel|>commentary to=functions.now <|constrain|>json<|message|>{body}{end}"
    for pieces in every_split(text):
        assert summary(parse(text, pieces)) == ("", "", [("now", "{}")], []), pieces


@pytest.mark.parametrize("body", ["", "  "])
def test_a_body_of_nothing_at_the_replys_end_is_a_call_cut_short(body):
    """max_tokens may end a reply right after the header: no arguments were written yet."""
    text = f"<|channel|>commentary to=functions.now <|constrain|>json<|message|>{body}"
    for pieces in every_split(text):
        assert summary(parse(text, pieces)) == ("", "", [("now", body)], [0]), pieces


def test_arguments_are_held_only_while_they_may_still_read_null():
    parser = HarmonyParser()
    assert parser.feed("<|channel|>commentary to=functions.f <|message|>") == [CallStart(0, "f")]
    assert parser.feed(" nu") == []
    assert parser.feed("mber") == [CallArguments(0, " number")]  # not null after all: all of it
    assert parser.finish() == [CallCutShort(0, " number")]
    parser = HarmonyParser()
    parser.feed("<|channel|>commentary to=functions.f <|message|>")
    assert parser.feed('\n{"a"') == [CallArguments(0, '\n{"a"')]  # at once, blanks and all
    assert parser.feed(": null}") == [CallArguments(0, ": null}")]
    assert parser.finish() == []


@pytest.mark.parametrize("body", ["nu", "nullx", "null null"])
def test_what_only_begins_like_null_is_sent_as_written_and_cut_short(body):
    text = f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{body}"
    for pieces in every_split(text):
        assert summary(parse(text, pieces)) == ("", "", [("f", body)], [0]), pieces


def test_text_held_as_a_possible_header_is_released_once_it_cannot_be_one():
    """A reply's first word may begin a role or a recipient ("a", "t"): it waits only
    until the text shows it does not."""
    parser = HarmonyParser()
    assert parser.feed("a") == []
    assert parser.feed(" quick") == [Content("a quick")]
    assert parser.feed(" fox") == [Content(" fox")]
    parser = HarmonyParser()
    assert parser.feed(" t") == [] and parser.feed("he") == [Content(" the")]


def test_without_tools_a_message_to_a_function_is_content():
    reasoning, content, calls, _ = summary(parse(CALL_AFTER_CHANNEL, parses_calls=False))
    assert (reasoning, content, calls) == ("Need the weather tool.", '{"city": "Paris"}', [])


def test_each_call_of_a_reply_has_its_own_arguments():
    header = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
    text = header.format("f") + '{"a": 1}<|end|>' + header.format("g") + '{"b": 2'
    assert summary(parse(text)) == ("", "", [("f", '{"a": 1}'), ("g", '{"b": 2')], [1])
    assert parse(text)[-1] == CallCutShort(1, '{"b": 2')


def test_a_message_to_a_recipient_other_than_a_function_is_no_call():
    """gpt-oss's built-in tools (`to=browser.search`, `to=python`) are no function the
    request offered: only `functions.NAME` is a call."""
    for recipient in ("browser.search", "python"):
        text = f"<|channel|>commentary to={recipient} <|constrain|>json<|message|>{{}}<|call|>"
        assert summary(parse(text)) == ("", "{}", [], []), recipient


def test_a_stray_marker_opening_in_content_waits_only_as_long_as_a_marker_is():
    """"<|" in the answer is held as a marker's start only while a marker could still be
    what follows: the longest one's length, not the rest of the reply."""
    parser = HarmonyParser()
    assert parser.feed("<|channel|>final<|message|>x <|") == [Content("x ")]
    assert parser.feed("y" * 20) == [Content("<|" + "y" * 20)]


def test_a_channel_named_after_a_blank_is_that_channel():
    assert summary(parse("<|channel|> analysis<|message|>Hm.<|end|>")) == ("Hm.", "", [], [])


def test_commentary_to_the_user_and_unknown_channels_are_content():
    text = (
        "<|channel|>commentary<|message|>Checking now.<|end|>"
        "<|start|>assistant<|channel|>final<|message|> Done."
    )
    assert summary(parse(text)) == ("", "Checking now. Done.", [], [])


@pytest.mark.parametrize("text", ['{"answer": 42}', "Plain words, no header.", "[1, 2]"])
def test_a_reply_with_no_header_is_content_from_its_first_character(text):
    parser = HarmonyParser()
    assert parser.feed(text) == [Content(text)]
    assert parser.finish() == []


def test_a_header_cut_short_is_no_content_but_plain_text_is_kept():
    assert summary(parse("<|channel|>analy")) == ("", "", [], [])
    assert summary(parse("assum")) == ("", "assum", [], [])  # read as a role, then it was not
    assert summary(parse("<|channel|>final<|message|>a <")) == ("", "a <", [], [])  # held as a marker
    assert summary(parse("<|channel|>final<|message|>a <|x")) == ("", "a <|x", [], [])
    for held in ("assist", " to", "a"):  # a reply that ends while it may still be a header
        assert summary(parse(held)) == ("", held, [], []), held


def test_markup_between_messages_and_a_stray_marker_in_a_body_are_handled():
    text = (
        "<|channel|>final<|message|>a <|constrain|> b<|end|>ignored"
        "<|start|>assistant<|channel|>final<|message|> c"
    )
    assert summary(parse(text)) == ("", "a <|constrain|> b c", [], [])


def test_the_tool_parser_registry_hands_out_harmony_with_or_without_calls():
    assert parser_for("harmony").parses_calls
    assert not parser_for("harmony", parses_calls=False).parses_calls
    arguments = summary(parse(CALL_AFTER_CHANNEL))[2][0][1]
    assert json.loads(arguments) == {"city": "Paris"}
