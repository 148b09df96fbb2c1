"""`cadence serve` with a Falcon-H1 (attention and Mamba2 in every layer) as a user tries
it: the official openai client against a real server. Its Mamba2 mixers keep a recurrent
state, so the same prompt twice resumes the second from a snapshot of it (a prefix-cache
hit), to mlx-lm's tokens."""

from runtime.synth import make_tiny_checkpoint
from runtime.tokenizer import Tokenizer

import pytest
from structlog.testing import capture_logs

from tests.actors.test_http import in_thread, serving
from tests.actors.test_qwen3_5_http import PROMPT, mlx_lm_completion


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("Falcon-H1"), "falcon_h1", num_layers=3, hf_original=False)


async def test_falcon_h1_serves_completions_and_chat_with_a_prefix_hit(falcon):
    with capture_logs() as logs:
        async with serving(falcon, max_batch=4) as server:
            client = server.client()

            def complete():
                return client.completions.create(model=server.model, prompt=PROMPT * 3, max_tokens=16)

            first, second = await in_thread(complete), await in_thread(complete)
            chat = await in_thread(
                client.chat.completions.create,
                model=server.model,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=12,
            )
    (pool,) = [e for e in logs if e["event"] == "kv_pool"]
    # 4 rows x 3 layers x (3 conv inputs x 160 channels + 8 heads x 16 x 16), float32.
    assert pool["prefix_cache"] is True and pool["recurrent_state_bytes"] == 4 * 3 * (3 * 160 + 8 * 16 * 16) * 4
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the snapshot resumed
    tokenizer = Tokenizer.from_dir(falcon)
    want, ended = mlx_lm_completion(falcon, tokenizer, tokenizer.encode(PROMPT * 3), 16)
    for completion in (first, second):
        assert completion.choices[0].text == tokenizer.decode(want)
        assert completion.usage.completion_tokens == len(want) + ended
    assert chat.choices[0].message.content
