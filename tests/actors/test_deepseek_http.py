"""`cadence serve` with a DeepSeek-V2 checkpoint (MLA, routed and shared experts) as a user
tries it: the official openai client against a real server, to mlx-lm's tokens, the
second request reading the first's prompt from the prefix cache."""

from runtime.synth import make_tiny_checkpoint

import pytest

from tests.actors.test_qwen3_5_http import assert_mlx_lm_completions, serve_twice_and_chat


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("DeepSeek-V2-tiny"), "deepseek_v2", num_layers=3)


async def test_deepseek_v2_serves_completions_and_chat(deepseek):
    served = await serve_twice_and_chat(deepseek)
    (pool,) = [e for e in served.logs if e["event"] == "kv_pool"]
    assert pool["prefix_cache"] is True
    assert_mlx_lm_completions(deepseek, served)
    assert served.first.usage.prompt_tokens_details.cached_tokens == 0
    assert served.second.usage.prompt_tokens_details.cached_tokens > 0  # its K/V read back from the pool
