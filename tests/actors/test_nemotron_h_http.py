"""`cadence serve` with a Nemotron 3 Nano-like hybrid (Mamba2, attention and routed-expert
blocks) as a user tries it: the official openai client against a real server. Its Mamba2
blocks keep a recurrent state, so prefix caching is off and the same prompt twice is
computed twice, to mlx-lm's tokens."""

from runtime.synth import make_tiny_checkpoint
from runtime.tokenizer import Tokenizer

import pytest
from structlog.testing import capture_logs

from tests.actors.test_http import in_thread, serving
from tests.actors.test_qwen3_5_http import PROMPT, mlx_lm_completion


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    path = tmp_path_factory.mktemp("Nemotron-3-Nano")
    return make_tiny_checkpoint(path, "nemotron_h", num_layers=5, nemotron={"hybrid_override_pattern": "MEM*E"})


async def test_a_nemotron_h_hybrid_serves_completions_and_chat_with_prefix_caching_off(nemotron):
    with capture_logs() as logs:
        async with serving(nemotron, max_batch=4) as server:
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
    assert any(e["event"] == "prefix_cache_off" for e in logs)
    (pool,) = [e for e in logs if e["event"] == "kv_pool"]
    # 4 rows x 2 Mamba2 layers x (3 conv inputs x 192 channels + 8 heads x 16 x 16), float32.
    assert pool["prefix_cache"] is False and pool["recurrent_state_bytes"] == 4 * 2 * (3 * 192 + 8 * 16 * 16) * 4
    tokenizer = Tokenizer.from_dir(nemotron)
    ids = tokenizer.encode(PROMPT * 3)
    want, ended = mlx_lm_completion(nemotron, tokenizer, ids, 16)
    for completion in (first, second):
        assert completion.choices[0].text == tokenizer.decode(want)
        assert completion.usage.completion_tokens == len(want) + ended
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
