"""`cadence serve` with a Qwen3.5 checkpoint (the multimodal layout as Qwen releases it,
vision tower and MTP head skipped) as a user tries it: the official openai client
against a real server. Its prefix caching is off (a cached prefix has no recurrent
state), so the same prompt twice is computed twice, to the same tokens."""

from typing import Any

from runtime.config import load_config
from runtime.synth import make_tiny_checkpoint
from runtime.tokenizer import Tokenizer

import attrs
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from structlog.testing import capture_logs

import actors
from tests.actors.test_http import in_thread, serving
from tests.actors.test_metrics import samples, scrape

PROMPT = "The for statement is used to iterate over the elements of a sequence, in order"


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("Qwen3.5-tiny"), "qwen3_5", num_layers=4)


def mlx_lm_completion(path, tokenizer, ids, n):
    model, _ = mlx_lm.load(str(path))
    want = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]
    eos = set(load_config(path).eos_token_ids) | tokenizer.eos_token_ids
    ends = [i for i, token in enumerate(want) if token in eos]
    return want[: ends[0]] if ends else want, bool(ends)


@attrs.frozen
class Served:
    """What `serve_twice_and_chat` got back: the server's log events, the same completion
    twice, one chat streamed and whole, and (where asked) a `/metrics` scrape after them."""

    logs: list[dict[str, Any]]
    first: Any
    second: Any
    streamed: str
    whole: Any
    metrics: tuple[int, Any, str] | None


async def serve_twice_and_chat(path, *, scrape_metrics=False) -> Served:
    """A checkpoint as a user tries it, with the official openai client: the same
    completion twice, then one chat streamed and whole."""
    with capture_logs() as logs:
        async with serving(path, max_batch=4) as server:
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
            metrics = await in_thread(scrape, server.url) if scrape_metrics else None
    return Served(logs, first, second, streamed, whole, metrics)


def assert_mlx_lm_completions(path, served: Served) -> None:
    """Both completions are mlx-lm's greedy tokens; the chat streamed is the chat whole."""
    tokenizer = Tokenizer.from_dir(path)
    want, ended = mlx_lm_completion(path, tokenizer, tokenizer.encode(PROMPT * 3), 16)
    for completion in (served.first, served.second):
        assert completion.choices[0].text == tokenizer.decode(want)
        assert completion.usage.completion_tokens == len(want) + ended
    assert served.whole.choices[0].message.content and served.streamed == served.whole.choices[0].message.content


async def assert_serves_twice_with_prefix_caching_off(path, recurrent_state_bytes):
    """A hybrid checkpoint: its same prompt computed twice (prefix caching off), to
    mlx-lm's tokens."""
    served = await serve_twice_and_chat(path)
    assert any(e["event"] == "prefix_cache_off" for e in served.logs)
    (pool,) = [e for e in served.logs if e["event"] == "kv_pool"]
    assert pool["prefix_cache"] is False and pool["recurrent_state_bytes"] == recurrent_state_bytes
    assert_mlx_lm_completions(path, served)


async def test_qwen3_5_serves_the_same_prompt_twice_with_prefix_caching_off(qwen3_5):
    served = await serve_twice_and_chat(qwen3_5, scrape_metrics=True)
    assert any(e["event"] == "prefix_cache_off" for e in served.logs)
    (pool,) = [e for e in served.logs if e["event"] == "kv_pool"]
    assert pool["prefix_cache"] is False and pool["recurrent_state_bytes"] > 0
    assert_mlx_lm_completions(qwen3_5, served)
    assert served.metrics is not None
    status, _, body = served.metrics
    assert status == 200
    metrics = {name: value for (name, _), value in samples(body).items()}
    assert metrics["cadence:prefix_cache_hits_total"] == 0
    assert metrics["cadence:prefix_cache_queries_total"] > 0
    details = served.second.usage.prompt_tokens_details
    assert details is None or details.cached_tokens == 0


async def test_no_prefix_cache_off_line_when_the_operator_turned_it_off(qwen3_5):
    """The line says the model turned caching off: with --no-prefix-cache nothing did."""
    with capture_logs() as logs:
        async with actors.open_llm(qwen3_5, max_batch=2, prefix_cache=False):
            pass
    assert not [e for e in logs if e["event"] == "prefix_cache_off"]
    (pool,) = [e for e in logs if e["event"] == "kv_pool"]
    assert pool["prefix_cache"] is False and pool["recurrent_state_bytes"] > 0
