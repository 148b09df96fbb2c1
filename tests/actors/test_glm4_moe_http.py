"""`cadence serve` with a GLM-4.5 checkpoint (`glm4_moe`: GQA with half of each head
rotated, routed and shared experts) as a user tries it: the official openai client
against a real server, to mlx-lm's tokens, streamed chat the same as whole."""

from runtime.synth import make_tiny_checkpoint
from runtime.tokenizer import Tokenizer

import pytest

from tests.actors.test_http import in_thread, serving
from tests.actors.test_qwen3_5_http import PROMPT, mlx_lm_completion


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("GLM-4.5-tiny"), "glm4_moe", num_layers=3, quantize=(32, 4))


async def test_glm4_moe_serves_completions_and_chat(glm4_moe):
    async with serving(glm4_moe, max_batch=4) as server:
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
    tokenizer = Tokenizer.from_dir(glm4_moe)
    want, ended = mlx_lm_completion(glm4_moe, tokenizer, tokenizer.encode(PROMPT * 3), 16)
    for completion in (first, second):
        assert completion.choices[0].text == tokenizer.decode(want)
        assert completion.usage.completion_tokens == len(want) + ended
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # its K/V read back from the pool
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
