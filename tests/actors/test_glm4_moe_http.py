"""`cadence serve` with a GLM-4.5 checkpoint (`glm4_moe`: GQA with half of each head
rotated, routed and shared experts) as a user tries it: the official openai client
against a real server, to mlx-lm's tokens, streamed chat the same as whole."""

from runtime.synth import make_tiny_checkpoint

import pytest

from tests.actors.test_qwen3_5_http import assert_mlx_lm_completions, serve_twice_and_chat


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("GLM-4.5-tiny"), "glm4_moe", num_layers=3, quantize=(32, 4))


async def test_glm4_moe_serves_completions_and_chat(glm4_moe):
    served = await serve_twice_and_chat(glm4_moe)
    assert_mlx_lm_completions(glm4_moe, served)
    assert served.second.usage.prompt_tokens_details.cached_tokens > 0  # its K/V read back from the pool
