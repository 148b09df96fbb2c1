"""gpt-oss's harmony replies through real HTTP, read by the official openai client: the
reasoning apart from the answer (as `reasoning` and `reasoning_content`), tool calls
addressed to functions, `reasoning_effort`, and reasoning replayed in a history.

The checkpoint's tokenizer holds harmony's markers as special tokens, as gpt-oss's
does, and its template writes harmony (tests/actors/tool_templates.py). Random weights
write no harmony of their own, so a grammar writes the reply, its markers as the
tokenizer's own tokens (llguidance's `<[id]>`).
"""

import json

from runtime.harmony import MARKERS
from runtime.tokenizer import Tokenizer

import jsonschema
import pytest

from tests.actors import tool_templates
from tests.actors.test_http import in_thread, request, serving
from tests.actors.test_http_tools import ASK, SCHEMAS, TOOLS, whole
from tests.actors.tool_templates import HARMONY, with_markers


@pytest.fixture(scope="module")
def harmony(make_checkpoint, tmp_path_factory):
    """A tiny checkpoint speaking harmony: its markers special tokens, `<|return|>` and
    `<|call|>` among its EOS tokens (gpt-oss's generation_config)."""
    size = Tokenizer.from_dir(make_checkpoint("llama")).vocab_size
    out = tmp_path_factory.mktemp("harmony") / "gpt-oss-like"
    return with_markers(make_checkpoint("llama", vocab_size=size + 8), out, HARMONY, MARKERS, ("<|return|>", "<|call|>"))


def written(checkpoint, *parts):
    return tool_templates.written(checkpoint, MARKERS, *parts)


REASONING = ("<|channel|>", "analysis", "<|message|>", "The user asks about Paris.", "<|end|>")
ANSWER = ("<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Sunny in Paris.")
CALL = (
    "<|start|>", "assistant", "<|channel|>", "commentary to=functions.get_weather ",
    "<|constrain|>", "json", "<|message|>", '{"city": "Paris", "days": 2}',
)


def streamed(server, **body):
    """(reasoning, content, calls as [name, arguments], finish_reason, reasoning under
    its other name) from the deltas."""
    reasoning, content, calls, finish, other = "", "", {}, None, ""
    for chunk in server.client().chat.completions.create(model=server.model, stream=True, **body):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning") or ""
            other += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, list(calls.values()), finish, other


async def test_reasoning_leaves_apart_from_the_answer_whole_and_streamed(harmony):
    body = dict(messages=ASK, max_tokens=80, extra_body={"guided_grammar": written(harmony, *REASONING, *ANSWER)})
    async with serving(harmony) as server:
        assert server.llm.tool_style == "harmony"
        done = await in_thread(whole, server, **body)
        reasoning, content, calls, finish, other = await in_thread(streamed, server, **body)
    message = done.choices[0].message
    assert message.content == "Sunny in Paris." and done.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == REASONING[3]
    assert (reasoning, content, calls, finish) == (REASONING[3], "Sunny in Paris.", [], "stop")
    assert other == reasoning


async def test_stop_strings_match_the_messages_not_their_headers_or_markers(harmony):
    """"assistant", "final" and "message" are all in the headers and markers between the
    reasoning and the answer; the stop string in the answer is the one that ends it."""
    stop = ["assistant", "final", "message", " in Paris"]
    body = dict(messages=ASK, max_tokens=80, stop=stop, extra_body={"guided_grammar": written(harmony, *REASONING, *ANSWER)})
    async with serving(harmony) as server:
        done = await in_thread(whole, server, **body)
        reasoning, content, _, finish, _ = await in_thread(streamed, server, **body)
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == ("Sunny", "stop")
    assert (reasoning, content, finish) == (REASONING[3], "Sunny", "stop")


async def test_a_call_to_a_function_is_a_tool_call_after_its_reasoning(harmony):
    body = dict(
        messages=ASK, tools=TOOLS, max_tokens=80, extra_body={"guided_grammar": written(harmony, *REASONING, *CALL)}
    )
    async with serving(harmony) as server:
        done = await in_thread(whole, server, **body)
        reasoning, content, calls, finish, _ = await in_thread(streamed, server, **body)
        untooled = await in_thread(whole, server, **{k: v for k, v in body.items() if k != "tools"})
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert choice.message.model_extra["reasoning"] == REASONING[3]
    assert (reasoning, content, finish) == (REASONING[3], "", "tool_calls")
    assert calls == [["get_weather", call.function.arguments]]
    # Offered no tools, the message to a function is the answer's text.
    assert untooled.choices[0].message.tool_calls is None
    assert untooled.choices[0].message.content == CALL[-1]


async def test_a_call_of_null_arguments_is_an_empty_object_whole_and_streamed(harmony):
    """A client reads "null" as None, no arguments to call a function with."""
    call = (*CALL[:-1], "null")
    body = dict(messages=ASK, tools=TOOLS, max_tokens=80, extra_body={"guided_grammar": written(harmony, *call)})
    async with serving(harmony) as server:
        done = await in_thread(whole, server, **body)
        _, content, calls, finish, _ = await in_thread(streamed, server, **body)
    (whole_call,) = done.choices[0].message.tool_calls
    assert (whole_call.function.name, whole_call.function.arguments) == ("get_weather", "{}")
    assert done.choices[0].finish_reason == "tool_calls"
    assert (content, calls, finish) == ("", [["get_weather", "{}"]], "tool_calls")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_a_forced_call_is_written_in_harmony_with_its_markers_as_tokens(harmony, choice):
    body = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60, logprobs=True)
    async with serving(harmony) as server:
        done = await in_thread(whole, server, **body)
        reasoning, content, calls, finish, _ = await in_thread(streamed, server, **body)
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    (call,) = choice_.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    tokens = [entry.token for entry in choice_.logprobs.content]
    assert tokens[0] == "<|channel|>" and "<|constrain|>" in tokens and "<|message|>" in tokens
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    assert calls == [[call.function.name, call.function.arguments]]


async def test_reasoning_effort_reaches_the_template_and_is_checked(harmony):
    async with serving(harmony) as server:
        low = await in_thread(whole, server, messages=ASK, max_tokens=1, reasoning_effort="low")
        medium = await in_thread(whole, server, messages=ASK, max_tokens=1)  # the template's default
        high = await in_thread(
            whole, server, messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}
        )
        status, _, answer = await in_thread(
            request, server.url, "POST", "/v1/chat/completions",
            {"model": server.model, "messages": ASK, "chat_template_kwargs": {"reasoning_effort": "extreme"}},
        )
        top_status, _, top_answer = await in_thread(
            request, server.url, "POST", "/v1/chat/completions",
            {"model": server.model, "messages": ASK, "reasoning_effort": 5},
        )
    tokenizer = Tokenizer.from_dir(harmony)
    size = {
        level: len(tokenizer.encode(f"<|start|>system<|message|>Reasoning: {level}<|end|>", add_special_tokens=False))
        for level in ("low", "medium", "high")
    }
    base = low.usage.prompt_tokens - size["low"]
    assert (medium.usage.prompt_tokens, high.usage.prompt_tokens) == (base + size["medium"], base + size["high"])
    assert size["low"] != size["medium"] or size["medium"] != size["high"]  # the check can tell them apart
    assert status == 400 and "low, medium, high" in answer["error"]["message"]
    assert answer["error"]["param"] == "chat_template_kwargs.reasoning_effort"
    assert top_status == 400 and top_answer["error"]["param"] == "reasoning_effort"  # the field sent


async def test_reasoning_replayed_in_a_history_reaches_the_template(harmony):
    reply = {"role": "assistant", "content": "Sunny."}
    follow = {"role": "user", "content": "And tomorrow?"}
    async with serving(harmony) as server:
        plain = await in_thread(whole, server, messages=[*ASK, reply, follow], max_tokens=1)
        replayed = [
            await in_thread(whole, server, messages=[*ASK, {**reply, name: "Look it up."}, follow], max_tokens=1)
            for name in ("reasoning", "reasoning_content")
        ]
        status, _, answer = await in_thread(
            request, server.url, "POST", "/v1/chat/completions",
            {"model": server.model, "messages": [*ASK, {**reply, "reasoning": 5}], "max_tokens": 1},
        )
    assert replayed[0].usage.prompt_tokens == replayed[1].usage.prompt_tokens > plain.usage.prompt_tokens
    assert status == 400 and answer["error"]["param"] == "messages[1].reasoning"


async def test_completions_are_raw_text_with_no_reasoning_split(harmony):
    """/v1/completions runs no template and no parser: the text is what the model wrote,
    its markers dropped as special tokens are in any completion."""
    grammar = written(harmony, *REASONING, *ANSWER)
    async with serving(harmony) as server:
        done = await in_thread(
            lambda: server.client().completions.create(
                model=server.model, prompt="Hi", max_tokens=80, extra_body={"guided_grammar": grammar}
            )
        )
    assert done.choices[0].text == "analysisThe user asks about Paris.assistantfinalSunny in Paris."


async def test_reasoning_cut_short_by_max_tokens_is_kept_to_its_last_token(harmony):
    """The final delta carries the reply's last text: here reasoning, never an answer."""
    thought = "Paris is in France, and its weather in spring is mild and often sunny. " * 3
    grammar = written(harmony, "<|channel|>", "analysis", "<|message|>", thought)
    body = dict(messages=ASK, max_tokens=30, extra_body={"guided_grammar": grammar})
    async with serving(harmony) as server:
        done = await in_thread(whole, server, **body)
        reasoning, content, calls, finish, _ = await in_thread(streamed, server, **body)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == finish == "length"
    assert message.content == content == ""
    cut = message.model_extra["reasoning"]
    assert reasoning == cut and thought.startswith(cut) and len(cut) > 40
