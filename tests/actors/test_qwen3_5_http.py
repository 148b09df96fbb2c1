"""`cadence serve` with a Qwen3.5 checkpoint (the multimodal layout as Qwen releases it,
vision tower and MTP head skipped) as a user tries it: the official openai client
against a real server. A cached prefix resumes from a snapshot of the recurrent state
(runtime/kv/snapshots.py): the same prompt twice, and a chat's second turn, hit the
prefix cache, to the tokens computed from scratch."""

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


def assert_prefix_cached(served: Served, recurrent_state_bytes: int | None = None) -> None:
    """A hybrid checkpoint's prefix caching is on, its states' snapshots reserved, and the
    second of the same completion resumed its prompt from the first's snapshot."""
    (pool,) = [e for e in served.logs if e["event"] == "kv_pool"]
    assert pool["prefix_cache"] is True and pool["state_snapshots"] == 4
    assert pool["state_snapshot_bytes"] == pool["recurrent_state_bytes"] > 0  # 4 rows' worth
    assert recurrent_state_bytes is None or pool["recurrent_state_bytes"] == recurrent_state_bytes
    assert served.first.usage.prompt_tokens_details.cached_tokens == 0
    assert served.second.usage.prompt_tokens_details.cached_tokens > 0


async def assert_serves_twice_with_a_prefix_hit(path, recurrent_state_bytes):
    """A hybrid checkpoint: its same prompt twice, the second a prefix hit, to mlx-lm's tokens."""
    served = await serve_twice_and_chat(path)
    assert_prefix_cached(served, recurrent_state_bytes)
    assert_mlx_lm_completions(path, served)


async def test_qwen3_5_serves_the_same_prompt_twice_the_second_from_the_prefix_cache(qwen3_5):
    served = await serve_twice_and_chat(qwen3_5, scrape_metrics=True)
    assert_prefix_cached(served)
    assert_mlx_lm_completions(qwen3_5, served)
    assert served.metrics is not None
    status, _, body = served.metrics
    assert status == 200
    metrics = {name: value for (name, _), value in samples(body).items()}
    cached = served.second.usage.prompt_tokens_details.cached_tokens
    assert metrics["cadence:prefix_cache_hits_total"] >= cached > 0
    assert metrics["cadence:prefix_cache_queries_total"] > 0


async def chat_twice(path, **llm_args) -> tuple[list[str], list[int], dict[str, float]]:
    """A two-turn chat: each turn's reply, its cached prompt tokens, then /metrics."""
    async with serving(path, max_batch=4, **llm_args) as server:
        client = server.client()
        messages: list[dict[str, str]] = [{"role": "user", "content": PROMPT}]
        replies, cached = [], []
        for follow_up in ("Say it again, in other words.", None):
            reply = await in_thread(
                client.chat.completions.create, model=server.model, messages=messages, max_tokens=24
            )
            replies.append(reply.choices[0].message.content)
            details = reply.usage.prompt_tokens_details
            cached.append(0 if details is None else details.cached_tokens)
            if follow_up is not None:
                messages += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": follow_up}]
        _, _, body = await in_thread(scrape, server.url)
    return replies, cached, {name: value for (name, _), value in samples(body).items()}


async def test_a_chats_second_turn_hits_the_prefix_cache_to_the_uncached_servers_text(qwen3_5):
    replies, cached, metrics = await chat_twice(qwen3_5)
    uncached_replies, uncached, uncached_metrics = await chat_twice(qwen3_5, prefix_cache=False)
    assert replies == uncached_replies and all(replies)
    assert cached[0] == 0 and cached[1] > 0 and uncached == [0, 0]
    assert metrics["cadence:prefix_cache_hits_total"] == cached[1]
    assert uncached_metrics["cadence:prefix_cache_hits_total"] == 0


async def test_with_no_prefix_cache_no_snapshots_are_reserved_or_hit(qwen3_5):
    with capture_logs() as logs:
        async with actors.open_llm(qwen3_5, max_batch=2, prefix_cache=False):
            pass
    (pool,) = [e for e in logs if e["event"] == "kv_pool"]
    assert pool["prefix_cache"] is False and pool["recurrent_state_bytes"] > 0
    assert pool["state_snapshots"] == 0 and pool["state_snapshot_bytes"] == 0
