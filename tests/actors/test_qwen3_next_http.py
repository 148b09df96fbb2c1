"""`cadence serve` with a Qwen3-Next checkpoint (Hugging Face's original layout: fused
linear-attention projections, experts one tensor each, MTP head skipped) as a user tries
it: the official openai client against a real server. The same prompt twice is a
prefix-cache hit (from a snapshot of its recurrent state), and a forced tool call comes back in Hermes JSON, which Qwen's templates write
(Qwen3's published one here: Qwen3-Next's Instruct and Thinking write the same calls)."""

import json
import pathlib

from runtime.synth import make_tiny_checkpoint
from runtime.tokenizer import Tokenizer

import pytest
from structlog.testing import capture_logs

from tests.actors.test_http import in_thread, serving
from tests.actors.test_qwen3_5_http import PROMPT, mlx_lm_completion
from tests.actors.tool_templates import with_template

QWEN3 = (pathlib.Path(__file__).parent / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    made = make_tiny_checkpoint(tmp_path_factory.mktemp("Qwen3-Next-tiny"), "qwen3_next", num_layers=4)
    return with_template(made, tmp_path_factory.mktemp("templated") / "Qwen3-Next", QWEN3)


async def test_qwen3_next_serves_completions_as_mlx_lm_and_a_forced_hermes_call(qwen3_next):
    with capture_logs() as logs:
        async with serving(qwen3_next, max_batch=4) as server:
            client = server.client()

            def complete():
                return client.completions.create(model=server.model, prompt=PROMPT * 3, max_tokens=16)

            first, second = await in_thread(complete), await in_thread(complete)
            called = await in_thread(
                client.chat.completions.create,
                model=server.model,
                messages=[{"role": "user", "content": "What time is it?"}],
                tools=TOOLS,
                tool_choice="required",
                max_tokens=60,
            )
            style = server.llm.tool_style
    (pool,) = [e for e in logs if e["event"] == "kv_pool"]
    assert pool["prefix_cache"] is True and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the snapshot resumed
    tokenizer = Tokenizer.from_dir(qwen3_next)
    want, ended = mlx_lm_completion(qwen3_next, tokenizer, tokenizer.encode(PROMPT * 3), 16)
    for completion in (first, second):
        assert completion.choices[0].text == tokenizer.decode(want)
        assert completion.usage.completion_tokens == len(want) + ended
    assert style == "hermes"
    assert called.choices[0].finish_reason == "tool_calls"
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
