"""`cadence serve` with an LFM2 checkpoint as a user tries it: the official openai client
against a real server. Its conv layers keep a recurrent state, so the same prompt twice
resumes the second from a snapshot of it (a prefix-cache hit), to mlx-lm's tokens."""

from runtime.synth import make_tiny_checkpoint

import pytest

from tests.actors.test_qwen3_5_http import assert_serves_twice_with_a_prefix_hit


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("LFM2-tiny"), "lfm2", num_layers=4)


async def test_lfm2_serves_completions_and_chat_with_a_prefix_hit(lfm2):
    await assert_serves_twice_with_a_prefix_hit(lfm2, 4 * 3 * 2 * 64 * 4)
