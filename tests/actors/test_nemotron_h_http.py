"""`cadence serve` with a Nemotron 3 Nano-like hybrid (Mamba2, attention and routed-expert
blocks) as a user tries it: the official openai client against a real server. Its Mamba2
blocks keep a recurrent state, so the same prompt twice resumes the second from a
snapshot of it (a prefix-cache hit), to mlx-lm's tokens. Nemotron Nano v2's published chat template: its
thought switch and its `<TOOLCALL>` calls."""

import json
import pathlib

from runtime.synth import make_tiny_checkpoint
from runtime.tokenizer import Tokenizer

import pytest

from tests.actors import tool_templates
from tests.actors.test_http import in_thread, serving
from tests.actors.test_http_think import no_tags, split_of
from tests.actors.test_http_tools import ASK, TOOLS, whole
from tests.actors.test_http_tools import streamed as tools_streamed
from tests.actors.test_qwen3_5_http import assert_serves_twice_with_a_prefix_hit


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    path = tmp_path_factory.mktemp("Nemotron-3-Nano")
    return make_tiny_checkpoint(path, "nemotron_h", num_layers=5, nemotron={"hybrid_override_pattern": "MEM*E"})


async def test_a_nemotron_h_hybrid_serves_completions_and_chat_with_a_prefix_hit(nemotron):
    # 4 rows x 2 Mamba2 layers x (3 conv inputs x 192 channels + 8 heads x 16 x 16), float32.
    await assert_serves_twice_with_a_prefix_hit(nemotron, 4 * 2 * (3 * 192 + 8 * 16 * 16) * 4)


# NVIDIA-Nemotron-Nano-9B-v2's published template: a `/think` or `/no_think` in a system or
# user turn switches the thought the generation prompt opens (`<think>\n`) or closes empty
# (`<think></think>`); calls are `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`.
NANO_V2 = (pathlib.Path(__file__).parent / "templates" / "nvidia-NVIDIA-Nemotron-Nano-9B-v2.jinja").read_text()
NANO_MARKERS = ("<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>")  # special tokens in its tokenizer


@pytest.fixture(scope="module")
def nano_v2(make_checkpoint, tmp_path_factory):
    """A tiny checkpoint shipping Nano v2's template, its tags as special added tokens."""
    size = Tokenizer.from_dir(make_checkpoint("llama")).vocab_size
    out = tmp_path_factory.mktemp("nano-v2") / "nano-v2"
    return tool_templates.with_markers(make_checkpoint("llama", vocab_size=size + 8), out, NANO_V2, NANO_MARKERS)


async def test_nano_v2_thinks_unless_told_no_think_and_its_toolcall_replies_are_calls(nano_v2):
    no_think = [{"role": "system", "content": "/no_think"}, *ASK]
    sampled = dict(max_tokens=8, temperature=0, logit_bias=no_tags(nano_v2))
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    grammar = tool_templates.written(nano_v2, NANO_MARKERS, "<TOOLCALL>", call, "</TOOLCALL>")
    async with serving(nano_v2) as server:
        assert server.llm.thinks and server.llm.tool_style == "nemotron"
        thinking = await in_thread(whole, server, messages=ASK, **sampled)
        answering = await in_thread(whole, server, messages=no_think, **sampled)
        calling = await in_thread(
            whole, server, messages=no_think, tools=TOOLS, max_tokens=60, extra_body={"guided_grammar": grammar}
        )
        streamed = await in_thread(
            tools_streamed, server, messages=no_think, tools=TOOLS, max_tokens=60, extra_body={"guided_grammar": grammar}
        )
    reasoning, _, content = split_of(thinking.choices[0].message)
    assert reasoning and not content and thinking.choices[0].finish_reason == "length"
    reasoning, _, content = split_of(answering.choices[0].message)
    assert reasoning is None and content
    message = calling.choices[0].message
    assert not message.content and calling.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    content, calls, finish = streamed
    assert not content and finish == "tool_calls"
    assert [(name, json.loads(arguments)) for _, name, arguments in calls.values()] == [("get_weather", {"city": "Paris"})]
