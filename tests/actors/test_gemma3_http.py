"""`cadence serve` with a Gemma 3 checkpoint (the multimodal layout, vision tower
skipped) as a new user tries it: the official openai client against a real server."""

from runtime.config import load_config
from runtime.synth import make_tiny_checkpoint
from runtime.tokenizer import Tokenizer

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from tests.actors.test_http import in_thread, serving

PROMPT = "The for statement is used to iterate over the elements of a sequence, in order"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma-3-tiny-it")
    return make_tiny_checkpoint(path, "gemma3", num_layers=4, num_kv_heads=1, sliding_window=8)


async def test_gemma3_serves_chat_and_completions_past_its_window(gemma3):
    async with serving(gemma3, max_batch=4) as server:
        client = server.client()
        models = await in_thread(client.models.list)
        whole = await in_thread(
            client.chat.completions.create,
            model=server.model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=24,
        )

        def stream():
            chunks = client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=24,
                stream=True,
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        streamed = await in_thread(stream)
        completion = await in_thread(
            client.completions.create, model=server.model, prompt=PROMPT, max_tokens=24
        )
    assert [m.id for m in models.data] == [server.model]
    assert whole.usage.prompt_tokens > 8 and whole.choices[0].finish_reason == "length"
    assert streamed == whole.choices[0].message.content
    # The completion is mlx-lm's greedy continuation of the same tokens.
    tokenizer = Tokenizer.from_dir(gemma3)
    ids = tokenizer.encode(PROMPT)
    model, _ = mlx_lm.load(str(gemma3))
    want = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=24)]
    eos = set(load_config(gemma3).eos_token_ids) | tokenizer.eos_token_ids
    ends = [i for i, token in enumerate(want) if token in eos]
    if ends:  # cadence stops at the model's EOS; generate_step runs on
        want = want[: ends[0]]
    assert completion.usage.prompt_tokens == len(ids) > 8
    assert completion.usage.completion_tokens == len(want) + bool(ends)
    assert completion.choices[0].text == tokenizer.decode(want)
