"""`cadence serve` with a Granite 4.0 hybrid (Mamba2 + attention, routed experts) as a
user tries it: the official openai client against a real server. Its Mamba2 layers keep
a recurrent state, so the same prompt twice resumes the second from a snapshot of it
(a prefix-cache hit), to mlx-lm's tokens."""

from runtime.synth import make_tiny_checkpoint

import pytest

from tests.actors.test_qwen3_5_http import assert_serves_twice_with_a_prefix_hit


@pytest.fixture(scope="module")
def granite4(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("Granite-4.0-H-tiny"), "granitemoehybrid", num_layers=4)


async def test_granite_4_hybrid_serves_completions_and_chat_with_a_prefix_hit(granite4):
    # 4 rows x 3 Mamba2 layers x (3 conv inputs x 192 channels + 8 heads x 16 x 16), float32.
    await assert_serves_twice_with_a_prefix_hit(granite4, 4 * 3 * (3 * 192 + 8 * 16 * 16) * 4)
