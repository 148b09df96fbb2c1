"""Replies that think in `<think>` tags (Qwen3, QwQ, DeepSeek-R1's distills), or in
Mistral's `[THINK]` control tokens (Magistral), through real HTTP, read by the
official openai client: the thought as `reasoning_content` and `reasoning`, the answer
as `content`, calls after the thought, stop strings, a template that opens the thought
itself, a grammar that shapes what follows the thought, and reasoning replayed in a
history.

The checkpoints' tokenizers hold `<think>`, `</think>`, `<tool_call>` and `</tool_call>`
as added tokens (not special, as Qwen3's; special in one variant), and their templates
are Qwen3's (`enable_thinking`) and QwQ's (the generation prompt opens `<think>`) in
small. Random weights think of nothing, so a grammar writes the reply, the tags as the
tokenizer's own tokens (llguidance's `<[id]>`; a grammar that writes `<think>` itself
shapes the thought too), or a bias keeps the tags out of it, or biases write them.
OLMo 3 Think's tags are text (its tokenizer holds neither), its template published.
Seed-OSS's `<seed:think>` tags are special added tokens, kept in the reply's text.
Granite 3.3's `<think>` and `<response>` tags are text, its template published, and it
thinks only where a request passes `thinking: true`.
"""

import json
import pathlib
import re
import shutil

from runtime.think_reply import THINK_TAGS
from runtime.tokenizer import Tokenizer
from runtime.tools import HERMES_TAGS

import pytest

from tests.actors import tool_templates
from tests.actors.test_http import in_thread, request, serving
from tests.actors.test_http_tools import ASK, TOOLS, whole
from tests.actors.tool_templates import with_markers

MARKERS = (*THINK_TAGS, *HERMES_TAGS)
_TURNS = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.role == 'assistant' and message.reasoning_content %}"
    "<think>\n{{ message.reasoning_content }}\n</think>\n\n{%- endif %}"
    "{{ message.content }}<|im_end|>\n{%- endfor %}"
)
# Qwen3's: the model opens its thought, unless `enable_thinking` false wrote an empty one.
QWEN3 = _TURNS + (
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}"
)
# QwQ's and DeepSeek-R1's: the generation prompt opens the thought.
QWQ = _TURNS + "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"

THOUGHT = "The user asks about Paris."
REPLY = ("<think>", "\n" + THOUGHT + "\n", "</think>", "\n\nSunny in Paris.")


def with_tags(make_checkpoint, out, template, special):
    """The think tags and Hermes' call tags as added tokens, the think tags special if
    `special` (the call tags never are)."""
    size = Tokenizer.from_dir(make_checkpoint("llama")).vocab_size
    plain = HERMES_TAGS if special else MARKERS
    return with_markers(make_checkpoint("llama", vocab_size=size + 8), out, template, MARKERS, plain=plain)


@pytest.fixture(scope="module", params=[False, True], ids=["plain-tags", "special-tags"])
def qwen3(request, make_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("think") / "qwen3-like"
    return with_tags(make_checkpoint, out, QWEN3, special=request.param)


@pytest.fixture(scope="module")
def qwq(make_checkpoint, tmp_path_factory):
    return with_tags(make_checkpoint, tmp_path_factory.mktemp("think") / "qwq-like", QWQ, special=False)


def written(checkpoint, *parts):
    return tool_templates.written(checkpoint, MARKERS, *parts)


def streamed(server, **body):
    """Per choice: (reasoning, content, calls as [name, arguments], finish_reason,
    reasoning under its other name), and the usage, from the deltas."""
    choices, usage = {}, None
    stream = server.client().chat.completions.create(
        model=server.model, stream=True, stream_options={"include_usage": True}, **body
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning, content, calls, finish, other = choices.setdefault(choice.index, ["", "", {}, None, ""])
            extra = choice.delta.model_extra or {}
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
            choices[choice.index] = [
                reasoning + (extra.get("reasoning") or ""),
                content + (choice.delta.content or ""),
                calls,
                choice.finish_reason or finish,
                other + (extra.get("reasoning_content") or ""),
            ]
    return [(r, c, list(calls.values()), f, o) for r, c, calls, f, o in (choices[i] for i in sorted(choices))], usage


def split_of(message):
    """(reasoning, reasoning_content, content) of a whole message."""
    extra = message.model_extra or {}
    return extra.get("reasoning"), extra.get("reasoning_content"), message.content


async def test_the_thought_is_reasoning_and_the_answer_content_whole_and_streamed(qwen3):
    body = dict(messages=ASK, max_tokens=80, n=2, logprobs=True, extra_body={"guided_grammar": written(qwen3, *REPLY)})
    async with serving(qwen3) as server:
        assert server.llm.thinks and server.llm.tool_style == "hermes"
        done = await in_thread(whole, server, **body)
        choices, usage = await in_thread(streamed, server, **body)
    for choice in done.choices:
        assert split_of(choice.message) == (THOUGHT, THOUGHT, "Sunny in Paris.")
        assert choice.finish_reason == "stop"
        # Logprobs are the tokens', the tags' included: the split is of the text alone.
        tokens = [entry.token for entry in choice.logprobs.content]
        assert tokens[0] == "<think>" and "</think>" in tokens
        assert "".join(tokens) == "".join(REPLY)
    assert choices == [(THOUGHT, "Sunny in Paris.", [], "stop", THOUGHT)] * 2
    assert (usage.prompt_tokens, usage.completion_tokens) == (done.usage.prompt_tokens, done.usage.completion_tokens)


CALL_ARGUMENTS = '{"city": "Paris", "days": 2}'


async def test_a_call_after_the_thought_is_a_call_and_one_inside_it_is_reasoning(qwen3):
    reply = (
        "<think>", "\nMaybe ", "<tool_call>", "?\n", "</think>", "\n\nChecking.\n",
        "<tool_call>", f'\n{{"name": "get_weather", "arguments": {CALL_ARGUMENTS}}}\n', "</tool_call>",
    )
    await a_call_after_the_thought(qwen3, written(qwen3, *reply), "Maybe <tool_call>?")


async def a_call_after_the_thought(thinker, grammar, thought):
    """The reply `grammar` writes thinks `thought` (a call's marker in it), says
    "Checking." and calls get_weather with CALL_ARGUMENTS: whole and streamed alike."""
    body = dict(messages=ASK, tools=TOOLS, max_tokens=80, extra_body={"guided_grammar": grammar})
    async with serving(thinker) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert split_of(choice.message) == (thought, thought, "Checking.")
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", CALL_ARGUMENTS)
    assert choices == [(thought, "Checking.", [["get_weather", CALL_ARGUMENTS]], "tool_calls", thought)]


@pytest.mark.parametrize(
    ("stop", "split", "finish"),
    [
        (["think", " in Paris"], (THOUGHT, "Sunny"), "stop"),  # the tags are no text to a stop
        ([" about"], ("The user asks", ""), "stop"),  # a stop in the thought ends the reply there
    ],
)
async def test_stop_strings_read_the_thought_and_the_answer_not_the_tags(qwen3, stop, split, finish):
    body = dict(messages=ASK, max_tokens=80, stop=stop, extra_body={"guided_grammar": written(qwen3, *REPLY)})
    async with serving(qwen3) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    reasoning, _, content = split_of(done.choices[0].message)
    assert ((reasoning, content), done.choices[0].finish_reason) == (split, finish)
    ((r, c, _, f, _),) = choices
    assert (r, c, f) == (*split, finish)


def no_tags(checkpoint):
    """A logit_bias keeping the thinking tags out of a random reply."""
    tokenizer = Tokenizer.from_dir(checkpoint)
    return {str(tokenizer.added_token_id(tag)): -100 for tag in THINK_TAGS}


def completed(server, checkpoint, messages, **kwargs):
    """The raw text the model writes after the chat's prompt (a completion of its tokens)."""
    prompt = Tokenizer.from_dir(checkpoint).encode_chat(messages, template_kwargs=kwargs)
    text = server.client().completions.create(
        model=server.model, prompt=prompt, max_tokens=8, temperature=0, logit_bias=no_tags(checkpoint)
    )
    return text.choices[0].text


async def test_a_prompt_that_opens_the_thought_makes_the_reply_reasoning_until_it_closes(qwq):
    """QwQ's and R1's templates open `<think>` themselves: the reply starts inside the
    thought, with no tag of its own; cut by max_tokens before it closes, all of it is
    reasoning, and content is null."""
    body = dict(messages=ASK, max_tokens=8, temperature=0, logit_bias=no_tags(qwq))
    async with serving(qwq) as server:
        done = await in_thread(whole, server, **body)
        choices, usage = await in_thread(streamed, server, **body)
        raw = await in_thread(completed, server, qwq, ASK)
        shaped = await in_thread(whole, server, **body, response_format={"type": "json_object"})
    thought = raw.strip()
    assert thought and done.choices[0].finish_reason == "length"
    assert split_of(done.choices[0].message) == (thought, thought, "")  # no answer: empty
    assert choices == [(thought, "", [], "length", thought)]
    assert usage.completion_tokens == done.usage.completion_tokens == 8
    # A grammar waits for the thought to end: one that never closes is no answer.
    assert split_of(shaped.choices[0].message) == (thought, thought, "")


async def test_enable_thinking_false_makes_the_reply_the_answer(qwen3):
    """Qwen3's template writes an empty thought into the prompt: the reply is content."""
    kwargs = {"enable_thinking": False}
    body = dict(messages=ASK, max_tokens=8, temperature=0, logit_bias=no_tags(qwen3))
    async with serving(qwen3) as server:
        done = await in_thread(whole, server, **body, extra_body={"chat_template_kwargs": kwargs})
        raw = await in_thread(completed, server, qwen3, ASK, **kwargs)
    assert split_of(done.choices[0].message) == (None, None, raw)


async def test_reasoning_content_replayed_in_a_history_reaches_the_template(qwen3):
    reply = {"role": "assistant", "content": "Sunny."}
    follow = {"role": "user", "content": "And tomorrow?"}
    async with serving(qwen3) as server:
        plain = await in_thread(whole, server, messages=[*ASK, reply, follow], max_tokens=1)
        replayed = [
            await in_thread(whole, server, messages=[*ASK, {**reply, name: THOUGHT}, follow], max_tokens=1)
            for name in ("reasoning", "reasoning_content")
        ]
    tokenizer = Tokenizer.from_dir(qwen3)
    rendered = tokenizer.encode_chat([*ASK, {**reply, "reasoning_content": THOUGHT}, follow])
    assert len(rendered) > plain.usage.prompt_tokens
    assert replayed[0].usage.prompt_tokens == replayed[1].usage.prompt_tokens == len(rendered)


async def test_completions_are_the_raw_text_with_no_split(qwen3):
    """/v1/completions runs no parser: the text is what the model wrote, the tags as
    any added token (dropped where special, as any special token in a completion)."""
    grammar = written(qwen3, *REPLY)
    is_special = Tokenizer.from_dir(qwen3).added_token_id("<think>") in Tokenizer.from_dir(qwen3).control_spellings
    async with serving(qwen3) as server:
        status, _, answer = await in_thread(
            request, server.url, "POST", "/v1/completions",
            {"model": server.model, "prompt": "Hi", "max_tokens": 80, "guided_grammar": grammar},
        )
    text = "".join(part for part in REPLY if not (is_special and part in THINK_TAGS))
    assert status == 200 and answer["choices"][0]["text"] == text


async def test_with_the_split_off_the_thought_stays_in_content(qwen3):
    """`think_split=False` (`--no-think-split`): the reply is content as the model wrote it."""
    body = dict(messages=ASK, max_tokens=80, extra_body={"guided_grammar": written(qwen3, *REPLY)})
    is_special = Tokenizer.from_dir(qwen3).added_token_id("<think>") in Tokenizer.from_dir(qwen3).control_spellings
    async with serving(qwen3, think_split=False) as server:
        assert not server.llm.thinks
        done = await in_thread(whole, server, **body)
    text = "".join(part for part in REPLY if not (is_special and part in THINK_TAGS))
    assert split_of(done.choices[0].message) == (None, None, text)


async def test_a_forced_call_with_no_thought_is_the_answer_from_its_first_token(qwen3):
    """Where the prompt opened no thought, a first token that opens none starts the
    grammar: the forced call, with no reasoning."""
    body = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, logit_bias=no_tags(qwen3))
    async with serving(qwen3) as server:
        assert server.llm.thinks
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and split_of(choice.message) == (None, None, None)
    (call,) = choice.message.tool_calls
    assert choices == [("", "", [[call.function.name, call.function.arguments]], "tool_calls", "")]


def thinking_first(checkpoint):
    """Sampling that writes `<think>` (where the prompt did not), one word, `</think>`,
    then what the grammar allows: biases 20 and more apart, and a repetition penalty that
    takes two thirds of a used (or prompted) token's logit. The word is `</tool_call>`,
    which neither a JSON answer nor a call's arguments can hold."""
    tokenizer = Tokenizer.from_dir(checkpoint)
    ids = [tokenizer.added_token_id(tag) for tag in ("<think>", "</tool_call>", "</think>")]
    return dict(
        logit_bias={str(token): bias for token, bias in zip(ids, (100, 75, 55), strict=True)},
        extra_body={"repetition_penalty": 3.0},
        seed=7,
    )


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"], "additionalProperties": False}


async def test_a_json_schema_shapes_the_answer_after_the_thought(qwen3):
    """The grammar waits for `</think>` (vLLM's and SGLang's with a reasoning parser):
    the thought, which a JSON grammar would refuse, is reasoning, and the JSON content."""
    await json_after_the_thought(qwen3)


async def test_a_json_schema_shapes_the_answer_after_the_thought_the_prompt_opened(qwq):
    await json_after_the_thought(qwq)


async def json_after_the_thought(thinker):
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    body = dict(messages=ASK, max_tokens=40, n=2, logprobs=True, response_format=schema, **thinking_first(thinker))
    async with serving(thinker) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    for choice in done.choices:
        assert split_of(choice.message) == ("</tool_call>", "</tool_call>", '{"city": "Paris"}')
        assert choice.finish_reason == "stop"
        # Logprobs are every token's, the thought's and its tags' included.
        tokens = [entry.token for entry in choice.logprobs.content]
        thought = tokens[: tokens.index("</think>") + 1]
        assert thought[-2:] == ["</tool_call>", "</think>"] and thought[0] in ("<think>", "</tool_call>")
        assert "".join(tokens[len(thought) :]).strip() == '{"city": "Paris"}'
    assert choices == [("</tool_call>", '{"city": "Paris"}', [], "stop", "</tool_call>")] * 2


async def test_enable_thinking_false_shapes_the_reply_from_its_first_token(qwen3):
    """Qwen3's template closed an empty thought: the reply answers at once, and the
    grammar allows no `<think>` (as vLLM's reasoning parser reads that prompt)."""
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    body = dict(messages=ASK, max_tokens=40, logprobs=True, response_format=schema, **thinking_first(qwen3))
    body["extra_body"] = {**body["extra_body"], **kwargs}
    async with serving(qwen3) as server:
        done = await in_thread(whole, server, **body)
    (choice,) = done.choices
    assert split_of(choice.message) == (None, None, '{"city": "Paris"}')
    assert "".join(entry.token for entry in choice.logprobs.content) == '{"city": "Paris"}'


async def test_a_forced_named_call_follows_the_thought(qwen3):
    await named_call_after_the_thought(qwen3)


async def test_a_forced_named_call_follows_the_thought_the_prompt_opened(qwq):
    await named_call_after_the_thought(qwq)


async def named_call_after_the_thought(thinker):
    body = dict(
        messages=ASK, tools=TOOLS, max_tokens=80, **thinking_first(thinker),
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    async with serving(thinker) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert split_of(choice.message) == ("</tool_call>", "</tool_call>", None)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert choices == [("</tool_call>", "", [["get_weather", call.function.arguments]], "tool_calls", "</tool_call>")]


def streamed_logprobs(server, **body):
    """Per streamed chunk of choice 0: (reasoning, content, calls, its entries' tokens)."""
    chunks = []
    stream = server.client().chat.completions.create(model=server.model, stream=True, **body)
    for chunk in stream:
        for choice in chunk.choices:
            reasoning = (choice.delta.model_extra or {}).get("reasoning")
            tokens = [entry.token for entry in (choice.logprobs.content or [])] if choice.logprobs else []
            chunks.append((reasoning, choice.delta.content, choice.delta.tool_calls, "".join(tokens)))
    return chunks


async def test_streamed_logprobs_leave_with_the_reasoning_and_the_calls_their_tokens_made(qwen3):
    """Each chunk carries the entries of its tokens: a thought's and a call's left in
    chunks of their own, `content: ""`, after the reasoning or the call they made."""
    call = ("<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>")
    reply = (*REPLY[:3], "\n\n", *call)
    body = dict(messages=ASK, tools=TOOLS, max_tokens=80, logprobs=True, extra_body={"guided_grammar": written(qwen3, *reply)})
    async with serving(qwen3) as server:
        chunks = await in_thread(streamed_logprobs, server, **body)
    thought = [(reasoning, tokens) for reasoning, _, _, tokens in chunks if reasoning]
    assert "".join(reasoning for reasoning, _ in thought) == THOUGHT
    assert all(tokens.strip() == reasoning.strip() for reasoning, tokens in thought), thought
    calls = [tokens for _, _, calls, tokens in chunks if calls]
    assert calls and all(calls), calls  # each call chunk with the tokens that made it
    assert "".join(tokens for *_, tokens in chunks) == "".join(reply)  # each entry once


# Magistral's (2507, 2509), in small: `[THINK]` and `[/THINK]` are control tokens (special,
# as tekken's converted tokenizer.json holds them), written around an assistant turn's
# `thinking` chunk; the prompt ends in `[/INST]`, so the reply opens its own thought.
MAGISTRAL = (
    "{{ bos_token }}{%- if messages[0].role == 'system' %}"
    "[SYSTEM_PROMPT]{{ messages[0].content }}[/SYSTEM_PROMPT]{%- set turns = messages[1:] %}"
    "{%- else %}{%- set turns = messages %}{%- endif %}"
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in turns %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' %}"
    "{%- if message.content is string %}{{ message.content }}"
    "{%- elif message.content %}{%- for block in message.content %}"
    "{%- if block.type == 'thinking' %}{{ '[THINK]' + block.thinking + '[/THINK]' }}"
    "{%- else %}{{ block.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}[TOOL_CALLS]{{ call.function.name }}[ARGS]"
    "{{ call.function.arguments | tojson }}{%- endfor %}{{ eos_token }}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)
MISTRAL_MARKERS = ("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]")
MAGISTRAL_REPLY = ("[THINK]", THOUGHT, "[/THINK]", "Sunny in Paris.")


def with_mistral_tags(make_checkpoint, out, template):
    """Mistral's markers as control tokens, and `Hmm` as a plain added token (a word a
    thought may hold that no JSON answer can)."""
    size = Tokenizer.from_dir(make_checkpoint("llama")).vocab_size
    checkpoint = make_checkpoint("llama", vocab_size=size + 8)
    return with_markers(checkpoint, out, template, (*MISTRAL_MARKERS, "Hmm"), plain=("Hmm",))


@pytest.fixture(scope="module")
def magistral(make_checkpoint, tmp_path_factory):
    return with_mistral_tags(make_checkpoint, tmp_path_factory.mktemp("think") / "magistral-like", MAGISTRAL)


async def test_a_magistral_thought_is_reasoning_and_the_answer_content_whole_and_streamed(magistral):
    """`[THINK]...[/THINK]` is the thought (vLLM's `mistral` reasoning parser, llama.cpp's
    Magistral format); the tags, special tokens, are no text of either."""
    grammar = tool_templates.written(magistral, MISTRAL_MARKERS, *MAGISTRAL_REPLY)
    body = dict(messages=ASK, max_tokens=80, n=2, logprobs=True, extra_body={"guided_grammar": grammar})
    async with serving(magistral) as server:
        assert server.llm.thinks and server.llm.tool_style == "mistral"
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    for choice in done.choices:
        assert split_of(choice.message) == (THOUGHT, THOUGHT, "Sunny in Paris.")
        tokens = [entry.token for entry in choice.logprobs.content]
        assert tokens[0] == "[THINK]" and "[/THINK]" in tokens
    assert choices == [(THOUGHT, "Sunny in Paris.", [], "stop", THOUGHT)] * 2


async def test_stop_strings_read_the_magistral_thought_and_answer_not_its_tags(magistral):
    grammar = tool_templates.written(magistral, MISTRAL_MARKERS, *MAGISTRAL_REPLY)
    body = dict(messages=ASK, max_tokens=80, stop=["THINK", " in Paris"], extra_body={"guided_grammar": grammar})
    async with serving(magistral) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    assert split_of(done.choices[0].message) == (THOUGHT, THOUGHT, "Sunny")
    assert choices == [(THOUGHT, "Sunny", [], "stop", THOUGHT)]


async def test_a_magistral_call_after_the_thought_is_a_call_and_one_inside_it_is_reasoning(magistral):
    reply = (
        "[THINK]", "Maybe ", "[TOOL_CALLS]", "?", "[/THINK]", "Checking.",
        "[TOOL_CALLS]", "get_weather", "[ARGS]", CALL_ARGUMENTS,
    )
    grammar = tool_templates.written(magistral, MISTRAL_MARKERS, *reply)
    await a_call_after_the_thought(magistral, grammar, "Maybe [TOOL_CALLS]?")


async def test_a_json_schema_shapes_the_magistral_answer_after_the_thought(magistral):
    """The grammar waits for `[/THINK]`: the first token may open the thought, which is
    free (`Hmm`, which the JSON could not hold), and the JSON is the content."""
    tokenizer = Tokenizer.from_dir(magistral)
    ids = [tokenizer.added_token_id(tag) for tag in ("[THINK]", "Hmm", "[/THINK]")]
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    body = dict(
        messages=ASK, max_tokens=40, response_format=schema, seed=7,
        logit_bias={str(token): bias for token, bias in zip(ids, (100, 75, 55), strict=True)},
        extra_body={"repetition_penalty": 3.0},
    )
    async with serving(magistral) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    assert split_of(done.choices[0].message) == ("Hmm", "Hmm", '{"city": "Paris"}')
    assert choices == [("Hmm", '{"city": "Paris"}', [], "stop", "Hmm")]


async def test_with_the_split_off_or_a_template_that_never_thinks_a_magistral_reply_is_content(
    magistral, make_checkpoint, tmp_path
):
    """`--no-think-split`, or a Mistral tokenizer holding the tags beside a template that
    never writes them (Mistral Small 3.2's): the reply is content, the special tags
    dropped as any control token."""
    grammar = tool_templates.written(magistral, MISTRAL_MARKERS, *MAGISTRAL_REPLY)
    body = dict(messages=ASK, max_tokens=80, extra_body={"guided_grammar": grammar})
    no_thinking = with_mistral_tags(make_checkpoint, tmp_path / "mistral-like", MAGISTRAL.replace("[THINK]", ""))
    async with serving(magistral, think_split=False) as server:
        assert not server.llm.thinks
        split_off = await in_thread(whole, server, **body)
    async with serving(no_thinking) as server:
        assert not server.llm.thinks and server.llm.tool_style == "mistral"
        never = await in_thread(whole, server, **body)
    text = THOUGHT + "Sunny in Paris."
    assert split_of(split_off.choices[0].message) == split_of(never.choices[0].message) == (None, None, text)


@pytest.fixture(scope="module")
def qwen3_5(make_checkpoint, tmp_path_factory):
    """Qwen3.5's published template: its generation prompt opens the thought, and its
    calls are XML."""
    template = (pathlib.Path(__file__).parent / "templates" / "Qwen-Qwen3.5-4B.jinja").read_text()
    return with_tags(make_checkpoint, tmp_path_factory.mktemp("think") / "qwen3.5", template, special=False)


async def test_a_forced_qwen3_5_call_follows_the_thought_in_its_xml(qwen3_5):
    """The prompt opened the thought: the reply thinks (a letter, which biases write: its
    template's tool prompt holds the call tags, which the repetition penalty takes down)
    and then calls, in Qwen3.5's XML; the thought is reasoning, the call the call."""
    tokenizer = Tokenizer.from_dir(qwen3_5)
    (word,) = tokenizer.encode("H", add_special_tokens=False)
    closing = tokenizer.added_token_id("</think>")
    body = dict(
        messages=ASK, tools=TOOLS, max_tokens=80, seed=7,
        logit_bias={str(word): 100, str(closing): 75}, extra_body={"repetition_penalty": 3.0},
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    async with serving(qwen3_5) as server:
        assert server.llm.thinks and server.llm.tool_style == "qwen3_coder"
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert split_of(choice.message) == ("H", "H", None)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["days"], int)
    assert choices == [("H", "", [["get_weather", call.function.arguments]], "tool_calls", "H")]


# OLMo 3 Think's published template (open-instruct's `olmo_thinker`, which
# allenai/Olmo-3-7B-Think ships): its generation prompt ends in `<think>`, written as
# text. Its tokenizer holds no tag as a token (the demo tokenizer spells `</think>` in six).
OLMO3_THINK = (pathlib.Path(__file__).parent / "templates" / "allenai-Olmo-3-7B-Think.jinja").read_text()


@pytest.fixture(scope="module")
def olmo3_think(make_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("think") / "olmo3-think"
    return tool_templates.with_template(make_checkpoint("olmo3"), out, OLMO3_THINK)


def no_text_tags(checkpoint):
    """A logit_bias keeping `<` (which every tag begins with) out of a random reply."""
    (less_than,) = Tokenizer.from_dir(checkpoint).encode("<")
    return {str(less_than): -100}


async def test_an_olmo3_think_reply_is_reasoning_until_its_text_tag_closes(olmo3_think):
    """The prompt opened `<think>` as text: the reply is the thought, cut here by
    max_tokens before it closes, so all reasoning, whole and streamed alike."""
    body = dict(messages=ASK, max_tokens=8, temperature=0, logit_bias=no_text_tags(olmo3_think))
    async with serving(olmo3_think) as server:
        assert server.llm.thinks and server.llm.think_tags.ids is None
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
        prompt = Tokenizer.from_dir(olmo3_think).encode_chat(ASK)
        raw = await in_thread(
            lambda: server.client().completions.create(
                model=server.model, prompt=prompt, max_tokens=8, temperature=0, logit_bias=no_text_tags(olmo3_think)
            )
        )
    thought = raw.choices[0].text.strip()
    assert thought and done.choices[0].finish_reason == "length"
    assert split_of(done.choices[0].message) == (thought, thought, "")
    assert choices == [(thought, "", [], "length", thought)]


@pytest.fixture(scope="module")
def olmo3_think_flat(olmo3_think, tmp_path_factory):
    """`olmo3_think` with its every logit 0 (lm_head zeroed): biases alone pick a token."""
    import mlx.core as mx

    out = tmp_path_factory.mktemp("think") / "olmo3-think-flat"
    shutil.copytree(olmo3_think, out)
    weights = mx.load(str(out / "model.safetensors"))
    weights["lm_head.weight"] = mx.zeros_like(weights["lm_head.weight"])
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def thinking_in_text(checkpoint):
    """Sampling that writes a word, then `</think>` token by token, then what the grammar
    allows, on a checkpoint whose logits are all 0: biases 0.5 apart and presence and
    frequency penalties that take 4 from a written token (the prompt holds the tags'
    tokens, which a repetition penalty would take from at once)."""
    tokenizer = Tokenizer.from_dir(checkpoint)
    word = tokenizer.encode(" Well")
    tokens = [*word, *tokenizer.encode("</think>")]
    assert len(set(tokens)) == len(tokens)
    bias = {str(token): 100 - 0.5 * i for i, token in enumerate(tokens)}
    return dict(logit_bias=bias, presence_penalty=2.0, frequency_penalty=2.0, temperature=0), tokenizer.decode(word)


async def test_a_json_schema_shapes_what_follows_an_olmo3_think_thought(olmo3_think_flat):
    """Text tags: the grammar holds the thought as free text up to `</think>`, then
    shapes the answer; the thought is reasoning, the JSON content."""
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    sampling, word = thinking_in_text(olmo3_think_flat)
    body = dict(messages=ASK, max_tokens=40, n=2, response_format=schema, **sampling)
    async with serving(olmo3_think_flat) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    for choice in done.choices:
        assert split_of(choice.message) == (word.strip(), word.strip(), '{"city": "Paris"}')
    assert choices == [(word.strip(), '{"city": "Paris"}', [], "stop", word.strip())] * 2


async def test_text_tags_split_across_tokens_split_the_reply_whole_and_streamed(olmo3_think_flat):
    """`</think>` written in six tokens (its prompt opened the thought): the thought is
    reasoning, the rest (here a grammar's) content, whole and streamed alike; logprobs
    are every token's, the tag's included."""
    sampling, word = thinking_in_text(olmo3_think_flat)
    grammar = 'start: "Sunny in Paris."'
    body = dict(messages=ASK, max_tokens=40, n=2, logprobs=True, extra_body={"guided_grammar": grammar}, **sampling)
    async with serving(olmo3_think_flat) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    for choice in done.choices:
        assert split_of(choice.message) == (word.strip(), word.strip(), "Sunny in Paris.")
        tokens = [entry.token for entry in choice.logprobs.content]
        assert "</think>" not in tokens and "".join(tokens).startswith(word + "</think>")
    assert choices == [(word.strip(), "Sunny in Paris.", [], "stop", word.strip())] * 2


async def test_stop_strings_read_text_tags_as_text(olmo3_think_flat):
    """A stop string matches in `</think>` where it is text (as vLLM's): the reply ends
    there, inside its thought."""
    sampling, word = thinking_in_text(olmo3_think_flat)
    body = dict(messages=ASK, max_tokens=40, stop=["think"], **sampling)
    async with serving(olmo3_think_flat) as server:
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    thought = word.strip() + "</"
    assert (split_of(done.choices[0].message), done.choices[0].finish_reason) == ((thought, thought, ""), "stop")
    assert choices == [(thought, "", [], "stop", thought)]


async def test_a_json_schema_waits_for_an_olmo3_think_thought_that_never_closes(olmo3_think):
    """Cut by max_tokens inside the thought, a shaped reply is all reasoning: the
    grammar never applied (its thought is free text, so valid UTF-8 text: a token that
    would break a character is not drawn there)."""
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    body = dict(messages=ASK, max_tokens=8, temperature=0, logit_bias=no_text_tags(olmo3_think))
    async with serving(olmo3_think) as server:
        shaped = await in_thread(whole, server, **body, response_format=schema)
    (choice,) = shaped.choices
    reasoning, _, content = split_of(choice.message)
    assert reasoning and content == "" and choice.finish_reason == "length"
    assert shaped.usage.completion_tokens == 8


async def test_with_the_split_off_an_olmo3_think_reply_is_content(olmo3_think):
    """`--no-think-split`: the thought, its `</think>` and the answer are content, and a
    grammar shapes the reply from its first token (as vLLM's without a reasoning parser)."""
    reply = f"{THOUGHT}</think>\n\nSunny in Paris."
    body = dict(messages=ASK, max_tokens=80, extra_body={"guided_grammar": f"start: {json.dumps(reply)}"})
    async with serving(olmo3_think, think_split=False) as server:
        assert not server.llm.thinks
        done = await in_thread(whole, server, **body)
    assert split_of(done.choices[0].message) == (None, None, reply)


async def test_olmo3_instruct_does_not_think(make_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("think") / "olmo3-instruct"
    async with serving(tool_templates.with_template(make_checkpoint("olmo3"), out, tool_templates.OLMO3)) as server:
        assert not server.llm.thinks


# Seed-OSS's template in small: its tags special added tokens, the model opening its thought.
SEED = (
    "{%- set think_begin_token = '<seed:think>' -%}{%- set think_end_token = '</seed:think>' -%}"
    "{%- for message in messages %}<seed:bos>{{ message.role }}\n{{ message.content }}<seed:eos>{%- endfor %}"
    "{%- if add_generation_prompt %}<seed:bos>assistant\n{%- endif %}"
)
SEED_TAGS = ("<seed:think>", "</seed:think>")


async def test_a_seed_oss_thought_is_reasoning_whole_and_streamed(make_checkpoint, tmp_path_factory):
    size = Tokenizer.from_dir(make_checkpoint("seed_oss")).vocab_size
    out = tmp_path_factory.mktemp("think") / "seed-oss-like"
    checkpoint = with_markers(make_checkpoint("seed_oss", vocab_size=size + 8), out, SEED, SEED_TAGS)
    reply = tool_templates.written(checkpoint, SEED_TAGS, SEED_TAGS[0], THOUGHT, SEED_TAGS[1], "Sunny in Paris.")
    body = dict(messages=ASK, max_tokens=80, extra_body={"guided_grammar": reply})
    async with serving(checkpoint) as server:
        assert server.llm.thinks
        done = await in_thread(whole, server, **body)
        choices, _ = await in_thread(streamed, server, **body)
    assert split_of(done.choices[0].message) == (THOUGHT, THOUGHT, "Sunny in Paris.")
    assert choices[0][:2] == (THOUGHT, "Sunny in Paris.")


@pytest.fixture(scope="module")
def granite_3_3_flat(make_checkpoint, tmp_path_factory):
    """A Granite checkpoint with Granite 3.3's published template, its every logit 0
    (lm_head zeroed): biases alone pick a token."""
    import mlx.core as mx

    out = tmp_path_factory.mktemp("think") / "granite-3.3-flat"
    tool_templates.with_template(make_checkpoint("granite"), out, tool_templates.GRANITE)
    weights = mx.load(str(out / "model.safetensors"))
    weights["lm_head.weight"] = mx.zeros_like(weights["lm_head.weight"])
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def granite_thinking(checkpoint):
    """Sampling that writes `<think> Well</think>` token by token, then what the grammar
    allows, on a checkpoint whose logits are all 0: biases 0.2 to 0.5 apart, and presence
    and frequency penalties that take 4 from a written token and 6 from one written twice
    (the tags share their tokens: `<`, `think`'s and `>` are written twice, in order)."""
    tokenizer = Tokenizer.from_dir(checkpoint)
    less, slash, think, more = (tokenizer.encode(text) for text in ("<", "/", "think", ">"))
    assert tokenizer.encode("<think>") == [*less, *think, *more] and tokenizer.encode("</think>") == [*less, *slash, *think, *more]
    tag = [*less, *think, *more]
    bias = {str(token): 100 - 0.4 * i for i, token in enumerate(tag)}
    word = tokenizer.encode(" Well")
    bias |= {str(token): bias[str(tag[-1])] - 0.5 - 0.2 * i for i, token in enumerate(word)}
    bias[str(slash[0])] = 95.8  # under `<` once written (96), over it twice written (94) and over `think`'s first (95.6)
    assert len(bias) == len(tag) + len(word) + 1
    return dict(logit_bias=bias, presence_penalty=2.0, frequency_penalty=2.0, temperature=0), tokenizer.decode(word).strip()


async def test_a_granite_thought_is_reasoning_only_where_the_request_turns_thinking_on(granite_3_3_flat):
    """Granite 3.3 thinks in `<think>` and answers in `<response>`, both text, when a
    request passes `thinking: true`: the thought came back as content, tags and all. Now
    it is reasoning and the answer content, whole and streamed; without the switch the
    same text is content as written, as before."""
    answer = "<response>Sunny in Paris.</response>"
    sampling, word = granite_thinking(granite_3_3_flat)
    on = {"guided_regex": re.escape(answer), "chat_template_kwargs": {"thinking": True}}
    body = dict(messages=ASK, max_tokens=40, **sampling)
    async with serving(granite_3_3_flat) as server:
        assert server.llm.thinks and server.llm.think_tags.ids is None
        done = await in_thread(whole, server, **body, extra_body=on)
        choices, usage = await in_thread(streamed, server, **body, extra_body=on)
        plain = await in_thread(whole, server, messages=ASK, max_tokens=40, temperature=0, extra_body={"guided_regex": re.escape(answer)})
    assert split_of(done.choices[0].message) == (word, word, "Sunny in Paris.")
    assert choices == [(word, "Sunny in Paris.", [], "stop", word)]
    assert split_of(plain.choices[0].message) == (None, None, answer)  # thinking off: as written
    assert usage.prompt_tokens > plain.usage.prompt_tokens  # its template taught the form
