"""Replies that think in `<think>` tags, or Mistral's `[THINK]` -> reasoning, then
content or calls, in any split."""

import json
import time
from pathlib import Path

from runtime.think_reply import (
    COHERE_THINK_TAGS,
    GRANITE_THINKING,
    MISTRAL_THINK_TAGS,
    SEED_THINK_TAGS,
    THINK_CLOSE,
    THINK_OPEN,
    THINK_TAGS,
    ThinkTags,
    closes_thought,
    opens_thought,
    prompt_closes_thought,
    prompt_opens_thought,
    think_tags,
)
from runtime.tool_prompts import tool_style_for
from runtime.tools import CallArguments, CallCutShort, CallStart, Content, Reasoning, parser_for

import pytest

SPLITS = [1, 2, 3, 5, 7, 11, 1000]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parsed(text, split, parses_calls=False, style="hermes", tags=THINK_TAGS, answer_tags=()):
    """(reasoning, content, [(name, arguments)], cut) from `text` fed `split` characters at a time."""
    parser = parser_for(style, parses_calls, think_tags=tags, answer_tags=answer_tags)
    events = [e for i in range(0, len(text), split) for e in parser.feed(text[i : i + split])]
    events += parser.finish()
    assert all(e.text for e in events if isinstance(e, Reasoning | Content))  # no empty events
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [[e.name, ""] for e in events if isinstance(e, CallStart)]
    for e in events:
        if isinstance(e, CallArguments):
            calls[e.index][1] += e.fragment
    cut = [e.index for e in events if isinstance(e, CallCutShort)]
    return reasoning, content, [(n, json.loads(a)) for n, a in calls if not cut], cut


@pytest.mark.parametrize("split", SPLITS)
def test_the_thought_is_reasoning_and_the_rest_content_in_any_split(split):
    """Qwen3's form: the blanks around the thought and before the answer are no text of
    either (as llama.cpp returns them, and as Qwen3's template reads them back)."""
    text = f"{THINK_OPEN}\nThe user asks.\n\nTwo  lines. \n{THINK_CLOSE}\n\nParis is sunny.\n"
    assert parsed(text, split)[:2] == ("The user asks.\n\nTwo  lines.", "Paris is sunny.\n")


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("Paris is sunny.", "", "Paris is sunny."),  # no thought (enable_thinking false): content
        ("\n  Paris <think> is", "", "\n  Paris <think> is"),  # a tag past the start is text
        (f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\nParis.", "", "Paris."),  # an empty thought
        (f"{THINK_OPEN}\nStill thinking when max_tokens came", "Still thinking when max_tokens came", ""),
        (f"{THINK_OPEN}{THINK_OPEN}\nrepeated tag{THINK_CLOSE}x", "repeated tag", "x"),
        (f"{THINK_OPEN}a < b and a </thin{THINK_CLOSE}ok", "a < b and a </thin", "ok"),
        (f"{THINK_OPEN}x{THINK_CLOSE}a{THINK_CLOSE}b", "x", f"a{THINK_CLOSE}b"),
        (f"{THINK_OPEN}x{THINK_CLOSE}a {THINK_OPEN}b", "x", f"a {THINK_OPEN}b"),  # no second thought
        ("<thin", "", "<thin"),  # a tag only begun, at the end: content as written
        ("  \n", "", "  \n"),
        (f"{THINK_OPEN}  \n ", "", ""),
    ],
)
def test_edge_cases(text, reasoning, content, split):
    assert parsed(text, split)[:2] == (reasoning, content)


@pytest.mark.parametrize("split", SPLITS)
def test_a_call_after_the_thought_is_parsed_and_one_inside_it_is_reasoning(split):
    """Qwen3 thinks, then calls: the Hermes parser sees the answer alone."""
    text = f"{THINK_OPEN}\nMaybe {CALL}?\n{THINK_CLOSE}\n\nChecking.\n{CALL}"
    reasoning, content, calls, _ = parsed(text, split, parses_calls=True)
    assert reasoning == f"Maybe {CALL}?"
    assert content == "Checking.\n"
    assert calls == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("split", [1, 3, 1000])
def test_a_call_cut_short_after_the_thought_is_reported_as_the_content_parser_does(split):
    text = f"{THINK_OPEN}hm{THINK_CLOSE}" + CALL[:62]
    reasoning, _, _, cut = parsed(text, split, parses_calls=True)
    assert reasoning == "hm" and cut == [0]


@pytest.mark.parametrize("split", [1, 3, 1000])
@pytest.mark.parametrize("parses_calls", [False, True])
def test_a_reply_cut_short_keeps_what_it_held_back_for_a_tag(split, parses_calls):
    """A tail held as a tag's possible beginning comes out at the end, whatever parses the content."""
    cut_in_thought = f"{THINK_OPEN}hm </thi"
    assert parsed(cut_in_thought, split, parses_calls)[:2] == ("hm </thi", "")
    assert parsed("<thin", split, parses_calls)[:2] == ("", "<thin")


@pytest.mark.parametrize("split", [1, 1000])
def test_offered_no_tools_a_call_after_the_thought_is_content(split):
    text = f"{THINK_OPEN}hm{THINK_CLOSE}{CALL}"
    assert parsed(text, split)[:3] == ("hm", CALL, [])


def test_a_prompt_opens_the_thought_when_it_ends_in_the_tag_but_blanks():
    def decode(ids):
        return "".join({7: "\n", 3: "x", 101: "</think>"}[i] for i in ids)

    assert opens_thought([5, 9, 100], (100, 101), decode)
    assert opens_thought([5, 9, 100, 7], (100, 101), decode)
    assert not opens_thought([100, 101, 7, 7], (100, 101), decode)  # Qwen3's empty thought
    assert not opens_thought([100, 3], (100, 101), decode)
    assert not opens_thought([7], (100, 101), decode)
    assert not opens_thought([100, *[7] * 9], (100, 101), decode)  # past the few blanks a template writes
    assert opens_thought([5, 100, *[7] * 4], (100, 101), decode)  # as many blanks as a template may write
    assert not opens_thought([5, 100, *[7] * 5], (100, 101), decode)  # one more
    # A closing tag the decoder spells as nothing (a special token skipped) closes it all the same.
    assert not opens_thought([100, 7, 101, 7], (100, 101), lambda ids: "\n" * len(ids))


def test_a_prompt_closes_the_thought_when_it_ends_in_the_closing_tag_but_blanks():
    def decode(ids):
        return "".join({7: "\n", 3: "x", 100: "<think>", 101: "</think>"}[i] for i in ids)

    assert closes_thought([5, 100, 7, 101, 7, 7], (100, 101), decode)  # Qwen3's empty thought
    assert closes_thought([5, 101], (100, 101), decode)
    assert not closes_thought([5, 100, 7], (100, 101), decode)  # open: QwQ's
    assert not closes_thought([101, 7, 3], (100, 101), decode)  # text after it
    assert not closes_thought([101, 7, 100], (100, 101), decode)  # a thought opened again
    assert not closes_thought([101, *[7] * 9], (100, 101), decode)  # past the few blanks a template writes
    assert closes_thought([5, 101, 7], (100, 101), decode)
    assert closes_thought([5, 101, *[7] * 4], (100, 101), decode)  # as many blanks as a template may write
    assert not closes_thought([5, 101, *[7] * 5], (100, 101), decode)  # one more


class _Tokenizer:
    def __init__(self, added, template, tool_use_template=None):
        self.added, self.chat_template_source = added, template
        self.tool_use_template_source = template if tool_use_template is None else tool_use_template

    def added_token_id(self, text):
        return self.added.get(text)


def test_a_checkpoint_thinks_when_both_tags_are_added_tokens_and_its_template_writes_one():
    tags = {THINK_OPEN: 10, THINK_CLOSE: 11}
    assert think_tags(_Tokenizer(tags, "{{ '<think>\\n' }}")) == ThinkTags(THINK_OPEN, THINK_CLOSE, 10, 11)
    assert think_tags(_Tokenizer(tags, "{{ messages }}")) is None  # the template never thinks
    assert think_tags(_Tokenizer({THINK_OPEN: 10}, "<think>")) is None
    assert think_tags(_Tokenizer({}, "<think>")) is None  # spelled out, not a token
    found = think_tags(_Tokenizer(tags, "<think>"))
    assert found is not None and found.ids == (10, 11) and found.spellings == (THINK_OPEN, THINK_CLOSE)
    # Either template writing it will do: a checkpoint's separate "tool_use" one need not.
    assert think_tags(_Tokenizer(tags, "<think>", tool_use_template="{{ tools }}")) is not None
    assert think_tags(_Tokenizer(tags, "{{ messages }}", tool_use_template="<think>")) is not None


def test_a_mistral_checkpoint_thinks_in_its_control_tokens_where_its_template_writes_them():
    """Magistral's tokenizer holds `[THINK]` and `[/THINK]` (special), and its template
    writes them around a `thinking` chunk; Mistral Small 3.2's template has none."""
    tags = {"[THINK]": 34, "[/THINK]": 35, "[TOOL_CALLS]": 9}
    magistral = "{%- elif block['type'] == 'thinking' %}{{- '[THINK]' + block['thinking'] + '[/THINK]' }}"
    assert think_tags(_Tokenizer(tags, magistral)) == ThinkTags("[THINK]", "[/THINK]", 34, 35)
    assert think_tags(_Tokenizer(tags, "[INST]{{ message.content }}[/INST]")) is None
    assert think_tags(_Tokenizer({"[THINK]": 34}, magistral)) is None
    # A template writing one pair's tag thinks in that pair, whichever tokens there are besides.
    both = {**tags, THINK_OPEN: 10, THINK_CLOSE: 11}
    assert think_tags(_Tokenizer(both, magistral)) == ThinkTags("[THINK]", "[/THINK]", 34, 35)


def test_olmo3_think_thinks_in_text_tags_where_no_tag_is_a_token():
    """OLMo 3 Think's template writes `<think>` (its generation prompt ends in it) and
    its tokenizer holds no tag: the tags are text. Any other family with such a template
    (a system prompt may mention `<think>`), OLMo 3 Instruct's template, or a tokenizer
    holding a tag as a token is not taken for it."""
    olmo3_think = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>' }}{% endif %}"
    assert think_tags(_Tokenizer({}, olmo3_think), "olmo3") == ThinkTags(THINK_OPEN, THINK_CLOSE)
    assert think_tags(_Tokenizer({}, olmo3_think), "olmo3").ids is None
    assert think_tags(_Tokenizer({}, olmo3_think), "llama") is None
    assert think_tags(_Tokenizer({}, olmo3_think)) is None
    assert think_tags(_Tokenizer({}, "<|im_start|>assistant\n"), "olmo3") is None  # Instruct's
    assert think_tags(_Tokenizer({THINK_OPEN: 10}, olmo3_think), "olmo3") is None
    assert think_tags(_Tokenizer({THINK_CLOSE: 11}, olmo3_think), "olmo3") is None
    # Both tags as tokens: the token tags, whatever the family.
    tags = {THINK_OPEN: 10, THINK_CLOSE: 11}
    assert think_tags(_Tokenizer(tags, olmo3_think), "olmo3") == ThinkTags(THINK_OPEN, THINK_CLOSE, 10, 11)


def test_think_tags_have_ids_only_when_both_tags_have_one():
    assert ThinkTags(THINK_OPEN, THINK_CLOSE, 10, 11).ids == (10, 11)
    assert ThinkTags(THINK_OPEN, THINK_CLOSE, 10, None).ids is None
    assert ThinkTags(THINK_OPEN, THINK_CLOSE, None, 11).ids is None


# Text tags spelled across tokens, as a BPE vocabulary writes them.
_PIECES = {1: "assistant", 2: "\n", 3: "<", 4: "think", 5: ">", 6: "</", 7: "x", 8: "<th", 9: "ink>", 10: " "}


def _decode(ids):
    return "".join(_PIECES[i] for i in ids)


@pytest.mark.parametrize(
    ("prompt", "opens", "closes"),
    [
        ([1, 2, 3, 4, 5], True, False),  # OLMo 3 Think's generation prompt: `<think>`
        ([1, 2, 8, 9], True, False),  # the tag in another split
        ([1, 2, 3, 4, 5, 2, 10], True, False),  # blanks past it
        ([1, 2, 3, 4, 5, 7], False, False),  # text past it
        ([1, 2, 3, 4, 5, 7, 6, 4, 5, 2], False, True),  # a thought closed
        ([1, 2, 7, 3, 4], False, False),  # a tag only begun
        ([1, 2], False, False),
    ],
)
def test_a_prompt_opens_or_closes_a_thought_in_text_tags_by_its_decoded_end(prompt, opens, closes):
    text_tags = ThinkTags(THINK_OPEN, THINK_CLOSE)
    assert prompt_opens_thought(prompt, text_tags, _decode) is opens
    assert prompt_closes_thought(prompt, text_tags, _decode) is closes


def test_token_tags_still_tell_the_prompt_by_their_ids():
    """Token tags read ids, not text: `<think>` spelled out of text tokens opens nothing."""
    pieces = {**_PIECES, 100: "<think>", 101: "</think>"}
    token_tags = ThinkTags(THINK_OPEN, THINK_CLOSE, 100, 101)

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    assert prompt_opens_thought([1, 2, 100, 2], token_tags, decode)
    assert not prompt_opens_thought([1, 2, 3, 4, 5], token_tags, decode)
    assert prompt_closes_thought([100, 101, 2], token_tags, decode)
    assert not prompt_closes_thought([100, 6, 4, 5], token_tags, decode)


OLMO3_CALL = '<function_calls>get_weather(city="Paris")</function_calls>'


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        # OLMo 3 Think's reply: its prompt opened `<think>`, which begins the text.
        (f"{THINK_OPEN}The user asks.{THINK_CLOSE}\n\nParis is sunny.", "The user asks.", "Paris is sunny."),
        (f"{THINK_OPEN}a </thin and <th{THINK_CLOSE}ok", "a </thin and <th", "ok"),
        (f"{THINK_OPEN}cut by max_tokens </thi", "cut by max_tokens </thi", ""),
        (f"{THINK_OPEN}{THINK_OPEN}again{THINK_CLOSE}ok", "again", "ok"),
    ],
)
def test_an_olmo3_think_reply_splits_in_any_split(text, reasoning, content, split):
    """Text tags arrive in any split: only a tail that may begin `</think>` is held."""
    assert parsed(text, split, style="olmo3")[:2] == (reasoning, content)


@pytest.mark.parametrize("split", SPLITS)
def test_an_olmo3_call_after_a_text_thought_is_parsed_and_one_inside_it_is_reasoning(split):
    text = f"{THINK_OPEN}Maybe {OLMO3_CALL}?{THINK_CLOSE}\n\nChecking.{OLMO3_CALL}"
    reasoning, content, calls, _ = parsed(text, split, True, "olmo3")
    assert (reasoning, content) == (f"Maybe {OLMO3_CALL}?", "Checking.")
    assert calls == [("get_weather", {"city": "Paris"})]


MISTRAL_OPEN, MISTRAL_CLOSE = MISTRAL_THINK_TAGS
MISTRAL_CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        # Magistral's form: no blanks around the tags.
        (f"{MISTRAL_OPEN}The user asks.{MISTRAL_CLOSE}Paris is sunny.", "The user asks.", "Paris is sunny."),
        ("Paris is sunny.", "", "Paris is sunny."),  # no thought (reasoning_effort none)
        (f"{MISTRAL_OPEN}Still thinking", "Still thinking", ""),  # cut by max_tokens
        (f"{MISTRAL_OPEN}a [/THIN and <think>x</think>{MISTRAL_CLOSE}ok", "a [/THIN and <think>x</think>", "ok"),
        (f"{THINK_OPEN}x{THINK_CLOSE}y", "", f"{THINK_OPEN}x{THINK_CLOSE}y"),  # the other pair is text
        ("[THIN", "", "[THIN"),
    ],
)
def test_a_mistral_thought_is_reasoning_in_any_split(text, reasoning, content, split):
    assert parsed(text, split, tags=MISTRAL_THINK_TAGS)[:2] == (reasoning, content)


@pytest.mark.parametrize("split", SPLITS)
def test_a_mistral_call_after_the_thought_is_parsed_and_one_inside_it_is_reasoning(split):
    """Magistral thinks, then calls: the Mistral parser sees the answer alone."""
    text = f"{MISTRAL_OPEN}Maybe {MISTRAL_CALL}?{MISTRAL_CLOSE}Checking.{MISTRAL_CALL}"
    reasoning, content, calls, _ = parsed(text, split, True, "mistral", MISTRAL_THINK_TAGS)
    assert reasoning == f"Maybe {MISTRAL_CALL}?"
    assert content == "Checking."
    assert calls == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "reply",
    [
        lambda blanks: blanks + "Hi",  # before a reply that turns out to be the answer
        lambda blanks: "<think>" + blanks + "x" + blanks + "y</think>Hi",  # in a thought
    ],
    ids=["before-the-answer", "in-a-thought"],
)
def test_a_long_run_of_blank_tokens_takes_linear_time(reply):
    """Held blanks were copied at every token: 160,000 blank tokens took seconds, time
    growing with the square of their number (a degenerate model writes such runs)."""

    def seconds(num_blanks):
        text = reply(" " * num_blanks)
        started = time.perf_counter()
        assert parsed(text, 1)[:2] in (("", text), ("x" + " " * num_blanks + "y", "Hi"))
        return time.perf_counter() - started

    assert seconds(160_000) < 40 * seconds(10_000) + 0.5


SEED_OPEN, SEED_CLOSE = "<seed:think>", "</seed:think>"  # spelled as its tokenizer holds them
# Seed-OSS-36B-Instruct's template names its tags in variables and writes its calls so.
SEED_TEMPLATE = (
    "{%- set think_begin_token = '<seed:think>' -%}{%- set think_end_token = '</seed:think>' -%}"
    "{{ '<seed:tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{ '<parameter=' + arg_name + '>' }}"
)
SEED_CALL = "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>"


def test_a_seed_oss_checkpoint_thinks_in_its_added_tokens_where_its_template_writes_them():
    tags = {SEED_OPEN: 7, SEED_CLOSE: 8, THINK_OPEN: 10, THINK_CLOSE: 11}
    assert think_tags(_Tokenizer(tags, SEED_TEMPLATE)) == ThinkTags(SEED_OPEN, SEED_CLOSE, 7, 8)
    assert think_tags(_Tokenizer({SEED_OPEN: 7}, SEED_TEMPLATE)) is None


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        (f"{SEED_OPEN}The user asks.{SEED_CLOSE}Paris is sunny.", "The user asks.", "Paris is sunny."),
        # Its thinking budget's notes are part of the thought.
        (f"{SEED_OPEN}a<seed:cot_budget_reflect>12 used</seed:cot_budget_reflect>b{SEED_CLOSE}ok",
         "a<seed:cot_budget_reflect>12 used</seed:cot_budget_reflect>b", "ok"),
        (f"{SEED_OPEN}Still thinking", "Still thinking", ""),  # cut by max_tokens
        (f"{THINK_OPEN}x{THINK_CLOSE}y", "", f"{THINK_OPEN}x{THINK_CLOSE}y"),  # the other pair is text
    ],
)
def test_a_seed_oss_thought_is_reasoning_in_any_split(text, reasoning, content, split):
    assert parsed(text, split, tags=SEED_THINK_TAGS)[:2] == (reasoning, content)


@pytest.mark.parametrize("split", SPLITS)
def test_a_seed_oss_call_after_its_thought_is_a_call(split):
    """Its `<seed:tool_call>` blocks stayed the reply's text: its template's `<function=`
    made the style Qwen3-Coder's, whose blocks are `<tool_call>`. Its own style reads them."""
    assert tool_style_for(SEED_TEMPLATE, "seed_oss") == "seed_oss"
    text = f"{SEED_OPEN}Maybe.{SEED_CLOSE}Checking.\n{SEED_CALL}"
    reasoning, content, calls, cut = parsed(text, split, True, "seed_oss", SEED_THINK_TAGS)
    assert (reasoning, content, calls, cut) == ("Maybe.", "Checking.\n", [("get_weather", {"city": "Paris"})], [])


COHERE_OPEN, COHERE_CLOSE = "<|START_THINKING|>", "<|END_THINKING|>"  # spelled as its tokenizer holds them
# Command R7B's template writes an assistant turn's calls after its plan so.
R7B_TEMPLATE = (
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% if message.tool_calls %}<|START_THINKING|>"
    "{{message.reasoning_content}}<|END_THINKING|><|START_ACTION|>[...]<|END_ACTION|>{% endif %}"
)


def test_a_command_r7b_checkpoint_thinks_in_its_control_tokens_where_its_template_writes_them():
    tags = {COHERE_OPEN: 255019, COHERE_CLOSE: 255020}
    assert think_tags(_Tokenizer(tags, R7B_TEMPLATE)) == ThinkTags(COHERE_OPEN, COHERE_CLOSE, 255019, 255020)
    assert think_tags(_Tokenizer(tags, "<|START_OF_TURN_TOKEN|>{{ messages }}")) is None  # Command-R's never plans


@pytest.mark.parametrize("split", SPLITS)
def test_a_command_r7b_plan_is_reasoning_and_its_action_a_call(split):
    """Its `<|START_ACTION|>` calls stayed the reply's text: no style read them."""
    action = '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {}}]<|END_ACTION|>'
    text = f"{COHERE_OPEN}I will look the weather up.{COHERE_CLOSE}{action}"
    expected = ("I will look the weather up.", "", [("get_weather", {})], [])
    assert parsed(text, split, True, "command_r7b", COHERE_THINK_TAGS) == expected


@pytest.mark.parametrize("split", SPLITS)
def test_a_command_r7b_answer_after_its_plan_is_content_without_its_tags(split):
    text = f"{COHERE_OPEN}Nothing to look up.{COHERE_CLOSE}<|START_RESPONSE|>Hello!<|END_RESPONSE|>"
    assert parsed(text, split, True, "command_r7b", COHERE_THINK_TAGS) == ("Nothing to look up.", "Hello!", [], [])


# Granite 3.3's published template, and 3.2's in its shape: 3.3's with 3.2's thinking
# instruction (its phrases), as 3.2's template writes it under `thinking`.
GRANITE_33 = (Path(__file__).resolve().parents[1] / "actors" / "templates" / "ibm-granite-granite-3.3-2b-instruct.jinja").read_text()
GRANITE_32 = GRANITE_33.replace(
    "Write your thoughts between <think></think> and write your response between <response></response>",
    "Write your thoughts after 'Here is my thought process:' and write your response after 'Here is my response:'",
)
(GRANITE_33_TAGS, RESPONSE_TAGS), (GRANITE_32_TAGS, _) = GRANITE_THINKING


def test_granite_3_2_and_3_3_think_in_text_where_their_template_reads_thinking():
    """Their thinking was never split: the thought came back as the answer's text."""
    assert GRANITE_32 != GRANITE_33
    expected_33 = ThinkTags(*GRANITE_33_TAGS, answer=RESPONSE_TAGS, switch="thinking")
    assert think_tags(_Tokenizer({}, GRANITE_33), "granite") == expected_33
    assert think_tags(_Tokenizer({}, GRANITE_32), "granite") == ThinkTags(*GRANITE_32_TAGS, switch="thinking")
    assert think_tags(_Tokenizer({}, GRANITE_33), "llama") is None  # another family's mention of <think>
    assert think_tags(_Tokenizer({}, "<think>{{ messages }}"), "granite") is None  # no `thinking` switch
    # A tokenizer holding `<think>` as a token of its own is not read for text tags.
    assert think_tags(_Tokenizer({THINK_OPEN: 10}, GRANITE_33), "granite") is None
    assert think_tags(_Tokenizer({THINK_OPEN: 10}, GRANITE_32), "granite") is None
    # Only a request passing `thinking: true` thinks; without it nothing is split.
    assert expected_33.thinks_with({"thinking": True}) and not expected_33.thinks_with({})
    assert not expected_33.thinks_with({"thinking": False}) and ThinkTags(*THINK_TAGS).thinks_with({})


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>The user asks.</think><response>Paris is sunny.</response>", "The user asks.", "Paris is sunny."),
        ("<think>\nThe user asks.\n</think>\n<response>\nParis is sunny.\n</response>", "The user asks.", "\nParis is sunny.\n"),
        ("<think>Still thinking", "Still thinking", ""),  # cut by max_tokens
        ("<response>Paris is sunny.</response>", "", "Paris is sunny."),  # no thought
        ("Paris is sunny.", "", "Paris is sunny."),
    ],
)
def test_a_granite_3_3_thought_is_reasoning_and_its_response_tags_no_content(text, reasoning, content, split):
    assert parsed(text, split, tags=GRANITE_33_TAGS, answer_tags=RESPONSE_TAGS)[:2] == (reasoning, content)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("Here is my thought process:\nThe user asks.\n\nHere is my response:\nParis is sunny.", "The user asks.", "Paris is sunny."),
        ("Here is my thought process: still", "still", ""),
        ("Here is Paris.", "", "Here is Paris."),  # the phrase only begun: content as written
    ],
)
def test_a_granite_3_2_thought_is_reasoning_between_its_phrases(text, reasoning, content, split):
    assert parsed(text, split, tags=GRANITE_32_TAGS)[:2] == (reasoning, content)


@pytest.mark.parametrize("split", SPLITS)
def test_a_granite_call_after_the_thought_is_a_call(split):
    text = '<think>Look it up.</think><response><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</response>'
    expected = ("Look it up.", "", [("get_weather", {"city": "Paris"})], [])
    assert parsed(text, split, True, "granite", GRANITE_33_TAGS, RESPONSE_TAGS) == expected
