"""`cadence serve` with a Qwen3-VL checkpoint (the multimodal layout as Qwen releases
it, vision tower skipped) as a user tries it for text: the official openai client
against a real server. The tokenizer ships Qwen3-VL-4B-Instruct's published chat
template (templates/), and holds `<think>`, `</think>`, `<tool_call>` and `</tool_call>`
as added tokens, not special, as Qwen3-VL's does."""

import pathlib

from runtime.config import load_config
from runtime.synth import make_tiny_checkpoint
from runtime.think_reply import THINK_TAGS
from runtime.tokenizer import Tokenizer
from runtime.tools import HERMES_TAGS

import mlx.core as mx
import mlx_lm
import openai
import pytest
from mlx_lm.generate import generate_step

from tests.actors import tool_templates
from tests.actors.test_http import in_thread, serving
from tests.actors.test_http_tools import ASK, TOOLS, whole
from tests.actors.tool_templates import with_markers

PROMPT = "The for statement is used to iterate over the elements of a sequence, in order"
MARKERS = (*THINK_TAGS, *HERMES_TAGS)
INSTRUCT = (pathlib.Path(__file__).parent / "templates" / "Qwen-Qwen3-VL-4B-Instruct.jinja").read_text()
# Qwen3-VL-*-Thinking's generation prompt opens the thought, as Qwen3-*-Thinking-2507's.
THINKING_PROMPT = "{{- '<|im_start|>assistant\\n<think>\\n' }}"


def qwen3_vl(out, template):
    checkpoint = make_tiny_checkpoint(out / "source", "qwen3_vl", num_layers=2, head_dim=32, vocab_size=1 << 13)
    return with_markers(checkpoint, out / "Qwen3-VL-tiny", template, MARKERS, plain=MARKERS)


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    return qwen3_vl(tmp_path_factory.mktemp("instruct"), INSTRUCT)


def mlx_lm_completion(path, tokenizer, ids, n):
    model, _ = mlx_lm.load(str(path))
    want = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]
    eos = set(load_config(path).eos_token_ids) | tokenizer.eos_token_ids
    ends = [i for i, token in enumerate(want) if token in eos]
    return want[: ends[0]] if ends else want, bool(ends)


async def test_qwen3_vl_serves_text_and_refuses_an_image_part_alone(instruct):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    async with serving(instruct, max_batch=4) as server:
        client = server.client()
        assert server.llm.tool_style == "hermes" and not server.llm.thinks
        completion = await in_thread(client.completions.create, model=server.model, prompt=PROMPT, max_tokens=16)
        with pytest.raises(openai.BadRequestError) as raised:
            await in_thread(
                client.chat.completions.create,
                model=server.model,
                messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
                max_tokens=8,
            )
        chat = await in_thread(
            client.chat.completions.create,
            model=server.model,
            messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            max_tokens=12,
        )
    error = raised.value.body
    assert (raised.value.status_code, error["type"], error["param"]) == (400, "invalid_request_error", "messages[0].content")
    assert "text" in error["message"]
    tokenizer = Tokenizer.from_dir(instruct)
    want, ended = mlx_lm_completion(instruct, tokenizer, tokenizer.encode(PROMPT), 16)
    assert completion.choices[0].text == tokenizer.decode(want)
    assert completion.usage.completion_tokens == len(want) + ended
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.prompt_tokens > len(tokenizer.encode(PROMPT))


async def test_a_thinking_template_makes_the_replies_think(tmp_path):
    thinking = INSTRUCT.replace("{{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n", THINKING_PROMPT + "\n{%- endif %}\n")
    assert thinking != INSTRUCT
    async with serving(qwen3_vl(tmp_path, thinking), max_batch=2) as server:
        assert server.llm.thinks and server.llm.tool_style == "hermes"


async def test_a_call_written_in_qwen3_vls_format_is_a_tool_call(instruct):
    """Its template lists the tools (`<tools>`) and asks for Hermes' `<tool_call>` JSON;
    a reply so written (a grammar writes it: random weights call nothing) is the call."""
    call = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    grammar = tool_templates.written(instruct, MARKERS, "<tool_call>", call, "</tool_call>")
    async with serving(instruct, max_batch=2) as server:
        done = await in_thread(
            whole, server, messages=ASK, tools=TOOLS, max_tokens=60, extra_body={"guided_grammar": grammar}
        )
    (choice,) = done.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (tool_call,) = choice.message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("get_weather", '{"city": "Paris"}')
