"""`cadence serve` with a DeepSeek-V2 checkpoint (MLA, routed and shared experts) as a user
tries it: the official openai client against a real server, to mlx-lm's tokens, the
second request reading the first's prompt from the prefix cache."""

from runtime.synth import make_tiny_checkpoint
from runtime.tokenizer import Tokenizer

import pytest
from structlog.testing import capture_logs

from tests.actors.test_http import in_thread, serving
from tests.actors.test_qwen3_5_http import PROMPT, mlx_lm_completion


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("DeepSeek-V2-tiny"), "deepseek_v2", num_layers=3)


async def test_deepseek_v2_serves_completions_and_chat(deepseek):
    with capture_logs() as logs:
        async with serving(deepseek, max_batch=4) as server:
            client = server.client()

            def complete():
                return client.completions.create(model=server.model, prompt=PROMPT * 3, max_tokens=16)

            first, second = await in_thread(complete), await in_thread(complete)

            def stream():
                chunks = client.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, stream=True
                )
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

            streamed = await in_thread(stream)
            whole = await in_thread(
                client.chat.completions.create,
                model=server.model,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=12,
            )
    (pool,) = [e for e in logs if e["event"] == "kv_pool"]
    assert pool["prefix_cache"] is True
    tokenizer = Tokenizer.from_dir(deepseek)
    ids = tokenizer.encode(PROMPT * 3)
    want, ended = mlx_lm_completion(deepseek, tokenizer, ids, 16)
    for completion in (first, second):
        assert completion.choices[0].text == tokenizer.decode(want)
        assert completion.usage.completion_tokens == len(want) + ended
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # its K/V read back from the pool
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
