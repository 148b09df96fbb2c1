"""/metrics through real HTTP: vLLM's metric names under `cadence:`, moved by the
requests a client made, as a Prometheus scrape parses them."""

import http.client
import urllib.parse

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import actors
from tests.actors.test_http import in_thread, request, serving, slow_down

LONG_PROMPT = list(range(1, 65))  # four full 16-token KV blocks
SHORT_PROMPT = [7, 8, 9, 10, 11]


def scrape(url, headers=None):
    """(status, content type, body) of GET /metrics."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request("GET", "/metrics", headers=headers or {})
    response = connection.getresponse()
    body = response.read().decode()
    connection.close()
    return response.status, response.getheader("Content-Type"), body


def samples(text):
    """{(sample name, sorted labels): value} of a scrape."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def complete(server, prompt, max_tokens):
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    status, _, response = request(server.url, "POST", "/v1/completions", body)
    assert status == 200, response
    return response["usage"], response["choices"][0]["finish_reason"]


def complete_streaming(server, prompt, max_tokens):
    stream = server.client().completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return chunks[-1].usage.model_dump(), finish[0]


async def test_metrics_count_what_the_requests_did(tiny):
    async with serving(tiny) as server:
        results = [
            await in_thread(complete, server, LONG_PROMPT, 4),
            await in_thread(complete, server, LONG_PROMPT, 3),  # its prefix is cached now
            await in_thread(complete_streaming, server, SHORT_PROMPT, 5),
        ]
        with trio.fail_after(10):  # the scheduler hears of the last finish after the client
            while True:
                status, content_type, text = await in_thread(scrape, server.url)
                got = samples(text)
                model = (("model_name", server.model),)
                if got[("cadence:num_requests_running", model)] == 0:
                    break
                await trio.sleep(0.01)
    assert status == 200 and content_type.startswith("text/plain")
    usages = [usage for usage, _ in results]
    assert [finish for _, finish in results] == ["length"] * 3
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    assert completion_tokens == 4 + 3 + 5

    def value(name, **labels):
        return got[(name, tuple(sorted({"model_name": server.model, **labels}.items())))]

    assert value("cadence:prompt_tokens_total") == prompt_tokens
    assert value("cadence:generation_tokens_total") == completion_tokens
    assert value("cadence:request_success_total", finished_reason="length") == 3
    assert value("cadence:request_success_total", finished_reason="stop") == 0
    assert value("cadence:time_to_first_token_seconds_count") == 3
    assert value("cadence:e2e_request_latency_seconds_count") == 3
    assert value("cadence:request_queue_time_seconds_count") == 3
    # Every token but each request's first follows another.
    assert value("cadence:inter_token_latency_seconds_count") == completion_tokens - 3
    # A request's latency is its time to first token and then the gaps between its tokens.
    ttft, gaps, e2e = (
        value(f"cadence:{name}_seconds_sum")
        for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency")
    )
    assert ttft > 0 and gaps > 0
    assert e2e == pytest.approx(ttft + gaps, abs=1e-3)
    assert value("cadence:num_requests_waiting") == 0
    assert value("cadence:kv_cache_usage_perc") == 0  # nothing runs: cached blocks are free
    # The repeat found its first three blocks (its last is computed again, for its logits).
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 48
    assert value("cadence:prefix_cache_hits_total") == 48  # tokens, not blocks
    # Every prompt token is a query, as vLLM counts them, though only the full blocks
    # before a prompt's last token can hit.
    assert value("cadence:prefix_cache_queries_total") == prompt_tokens
    assert value("cadence:num_preemptions_total") == 0


async def test_metrics_need_the_key_when_the_server_has_keys(tiny):
    async with serving(tiny, api_keys=("secret",)) as server:
        refused, _, _ = await in_thread(scrape, server.url)
        status, _, text = await in_thread(scrape, server.url, {"Authorization": "Bearer secret"})
    assert refused == 401
    assert status == 200 and "cadence:num_requests_running" in text


async def test_running_and_waiting_show_the_requests_in_flight(tiny):
    async with serving(tiny, max_batch=1) as server:
        slow_down(server.llm._engine, 0.02)
        model = (("model_name", server.model),)
        async with trio.open_nursery() as nursery:
            for _ in range(2):  # one runs, the other waits for the only row
                nursery.start_soon(in_thread, complete, server, SHORT_PROMPT, 40)
            with trio.fail_after(10):
                while True:
                    got = samples((await in_thread(scrape, server.url))[2])
                    running = got[("cadence:num_requests_running", model)]
                    waiting = got[("cadence:num_requests_waiting", model)]
                    if (running, waiting) == (1, 1):
                        break
                    await trio.sleep(0.01)
            # The running request holds blocks of the pool.
            assert 0 < got[("cadence:kv_cache_usage_perc", model)] < 1


async def test_only_a_request_that_was_scheduled_observes_its_queue_time(tiny):
    """One that leaves the queue before it gets a row (here: its caller gave up) waited
    for nothing: the histogram counts the scheduled one only."""
    async with actors.open_llm(tiny, max_batch=1) as llm:
        running = llm.generate("a", max_tokens=400, ignore_eos=True)
        async with running:
            await running.__anext__()  # it holds the one row
            waiting = llm.generate("b", max_tokens=5)
            await waiting.start()  # queued behind it
            await waiting.aclose()  # and gone before it was scheduled
        labels = {"model_name": llm.name}
        with trio.fail_after(10):  # the scheduler hears of both leaving
            while llm.metrics.registry.get_sample_value("cadence:num_requests_waiting", labels):
                await trio.sleep(0.01)
        count = llm.metrics.registry.get_sample_value(
            "cadence:request_queue_time_seconds_count", labels
        )
        seconds = llm.metrics.registry.get_sample_value(
            "cadence:request_queue_time_seconds_sum", labels
        )
    assert count == 1
    assert 0 <= seconds < 10  # the time it waited, not a reading of trio's clock


async def test_each_finish_is_counted_under_its_own_reason(tiny):
    async with actors.open_llm(tiny) as llm:
        eos = min(llm._engine.eos_ids)
        for bias in (100.0, None):  # greedy: EOS first ("stop"), then no EOS ("length")
            generation = llm.generate(
                "Hello", max_tokens=3, logit_bias={eos: bias} if bias else None
            )
            async with generation:
                async for _ in generation:
                    pass
        finishes = {
            reason: llm.metrics.registry.get_sample_value(
                "cadence:request_success_total",
                {"model_name": llm.name, "finished_reason": reason},
            )
            for reason in ("stop", "length")
        }
    assert finishes == {"stop": 1, "length": 1}


def test_a_failure_and_an_abort_each_count_under_their_own_reason():
    metrics = actors.metrics.Metrics("m")
    metrics.on_failed()
    metrics.on_aborted()
    metrics.on_aborted()
    counts = {
        reason: metrics.registry.get_sample_value(
            "cadence:request_success_total", {"model_name": "m", "finished_reason": reason}
        )
        for reason in ("error", "abort")
    }
    assert counts == {"error": 1, "abort": 2}


def test_a_request_scheduled_again_after_a_preemption_observes_its_queue_time_once():
    """Its first wait is the queue time; the bookkeeping of it is gone once observed."""
    metrics = actors.metrics.Metrics("m")
    metrics.on_queued("r", 1.0)
    metrics.on_dequeued("r", 3.0, is_scheduled=True)
    metrics.on_dequeued("r", 9.0, is_scheduled=True)  # rescheduled after a preemption
    labels = {"model_name": "m"}
    get = metrics.registry.get_sample_value
    assert get("cadence:request_queue_time_seconds_count", labels) == 1
    assert get("cadence:request_queue_time_seconds_sum", labels) == 2.0
    assert metrics._queued_at == {}
