"""The HTTP front against a real Hypercorn on a loopback port, with the official `openai`
client (run on worker threads: it is synchronous) and raw `http.client` requests."""

import collections
import concurrent.futures
import contextlib
import functools
import http.client
import json
import time
import types
import urllib.parse

import attrs
import openai
import pytest
import trio
from structlog.testing import capture_logs

import actors
from actors.choices import DEFAULT_MAX_N
from actors.http_app import ServerState, create_app
from actors.http_server import serving_on_loopback
from tests.actors.test_llm import fail_row


@attrs.frozen
class Server:
    url: str
    llm: actors.LLM
    state: ServerState

    @property
    def model(self) -> str:
        return self.llm.name

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)


@contextlib.asynccontextmanager
async def serving(
    checkpoint,
    *,
    max_body_bytes=1 << 20,
    response_timeout=None,
    api_keys=(),
    max_n=DEFAULT_MAX_N,
    **llm_args,
):
    state = ServerState()
    app = create_app(state, max_body_bytes=max_body_bytes, api_keys=api_keys, max_n=max_n)
    if response_timeout is not None:
        app.config["RESPONSE_TIMEOUT"] = response_timeout
    async with (
        serving_on_loopback(app, graceful_timeout=0.1) as url,
        actors.open_llm(checkpoint, **llm_args) as llm,
    ):
        state.llm = llm
        yield Server(url, llm, state)


async def in_thread(fn, *args, **kwargs):
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def request(url, method, path, body=None, headers=None):
    """Raw HTTP: returns (status, headers, parsed JSON body)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(
        method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(payload)


async def wait_for_no_open_rows(llm, timeout=10):
    with trio.fail_after(timeout):
        while (await llm.engine_stats()).num_open:
            await trio.sleep(0.005)


def slow_down(engine, seconds, record=None):
    """Make every engine step take at least `seconds` (it runs on the MLX thread)."""
    submit = engine.submit

    def slow_submit(batch):
        if record is not None:
            record.extend(s for s in batch.spans if s.num_new > 1)
        time.sleep(seconds)
        return submit(batch)

    engine.submit = slow_submit


CHAT = [{"role": "user", "content": "Tell me about Python."}]


async def test_models_and_health(tiny):
    started = int(time.time())
    async with serving(tiny) as server:
        models = await in_thread(server.client().models.list)
        assert [m.id for m in models.data] == [server.model]
        model = await in_thread(server.client().models.retrieve, server.model)
        assert (model.id, model.object) == (server.model, "model")
        # When it was loaded, in Unix seconds, as OpenAI's; it was 0.
        assert started <= model.created == models.data[0].created <= time.time()
        with pytest.raises(openai.NotFoundError) as raised:
            await in_thread(server.client().models.retrieve, "org/other-model")
        # OpenAI's type and code for an unknown model (its type was not_found_error).
        error = (raised.value.type, raised.value.code)
        assert error == ("invalid_request_error", "model_not_found")
        assert (await in_thread(request, server.url, "GET", "/health"))[0] == 200
        server.state.is_draining = True
        status, _, body = await in_thread(request, server.url, "GET", "/health")
        assert (status, body) == (503, {"status": "draining"})
        # Draining, it takes no new work; its metrics are still worth watching.
        status, headers, body = await in_thread(
            request, server.url, "POST", "/v1/completions", {"model": server.model, "prompt": "x"}
        )
        assert status == 503 and body["error"]["code"] == "unavailable"
        assert "draining" in body["error"]["message"]
        assert headers["retry-after"] == "1"  # a client's cue to come back, as for a full queue
        assert (await in_thread(request, server.url, "GET", "/v1/models"))[0] == 503
        assert (await in_thread(request, server.url, "GET", "/v1/cadence/stats"))[0] == 200


async def test_text_modalities_and_null_unsupported_fields_are_accepted(tiny):
    """What SDKs send for an unset field (null) and for text output is no error."""
    async with serving(tiny) as server:
        reply = await in_thread(
            lambda: server.client().chat.completions.create(
                model=server.model,
                messages=CHAT,
                max_tokens=3,
                modalities=["text"],
                audio=None,
                reasoning_effort=None,
                extra_body={"ignore_eos": True},
            )
        )
    assert reply.choices[0].finish_reason == "length"


async def test_health_is_503_while_loading():
    async with serving_on_loopback(create_app(ServerState()), graceful_timeout=0.1) as url:
        status, _, body = await in_thread(request, url, "GET", "/health")
        assert (status, body) == (503, {"status": "loading"})
        status, _, body = await in_thread(
            request, url, "POST", "/v1/completions", {"model": "x", "prompt": "hi"}
        )
        assert status == 503 and body["error"]["code"] == "unavailable"
        for path in ("/metrics", "/v1/cadence/stats"):
            status, _, body = await in_thread(request, url, "GET", path)
            assert status == 503 and "loading" in body["error"]["message"], path


async def test_chat_streaming_and_not_agree_and_chunks_follow_openai(tiny):
    async with serving(tiny) as server:
        client = server.client()
        whole = await in_thread(
            client.chat.completions.create, model=server.model, messages=CHAT, max_tokens=12
        )

        def stream():
            return list(
                client.chat.completions.create(
                    model=server.model,
                    messages=CHAT,
                    max_tokens=12,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )

        chunks = await in_thread(stream)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.id.startswith("chatcmpl-") and chunks[0].id.startswith("chatcmpl-")
    assert len({(c.id, c.created) for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


async def test_fields_openai_defines_as_without_effect_are_accepted_and_change_nothing(tiny):
    async with serving(tiny) as server:
        client = server.client()
        create = functools.partial(
            client.chat.completions.create, model=server.model, messages=CHAT, max_tokens=8
        )
        plain = await in_thread(create)
        tagged = await in_thread(
            create,
            user="alice",
            safety_identifier="u-1",
            # OpenAI's limits, each at its most: 16 pairs, keys of 64, values of 512 characters.
            metadata={f"{i:064}": "v" * 512 for i in range(16)},
            service_tier="auto",
            prompt_cache_key="k",
            store=False,
            # Newer than some openai clients: as extra fields, which every client sends.
            extra_body={"prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "1h"}},
        )
    assert tagged.choices[0].message.content == plain.choices[0].message.content


async def test_completions_streaming_and_not_agree(tiny):
    async with serving(tiny) as server:
        client = server.client()
        kwargs = dict(model=server.model, prompt="def fib(n):", max_tokens=10)
        whole = await in_thread(client.completions.create, **kwargs)
        raw = await in_thread(
            lambda: client.completions.with_raw_response.create(**kwargs, stream=True)
        )
        chunks = await in_thread(lambda: list(raw.parse()))
    # A stream must not be cached or buffered by anything between the server and the client.
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["cache-control"] == "no-cache"
    assert whole.object == "text_completion"
    assert whole.id.startswith("cmpl-") and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.usage.completion_tokens <= 10


async def test_completions_without_max_tokens_stop_at_16_as_openais_and_chat_does_not(tiny):
    """OpenAI's and vLLM's legacy completions default to 16 tokens: a script leaving it
    out got the whole context (1,021 tokens of the demo), a row held for minutes on a
    long-context model. Where the context leaves less, it is what is left, not a 400."""
    async with serving(tiny) as server:
        client = server.client()
        body = dict(model=server.model, extra_body={"ignore_eos": True})
        short = await in_thread(client.completions.create, **body, prompt="Once upon a time")
        room = server.llm.max_context - 5
        tight = await in_thread(client.completions.create, **body, prompt=[7] * room)
        chat = await in_thread(
            client.chat.completions.create,
            **body,
            messages=[{"role": "user", "content": "Once upon a time"}],
        )
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (16, "length")
    assert (tight.usage.completion_tokens, tight.choices[0].finish_reason) == (5, "length")
    assert chat.usage.completion_tokens > 16  # chat: what the context leaves, as vLLM's


async def test_max_tokens_and_stop_strings(tiny):
    async with serving(tiny) as server:
        client = server.client()
        base = dict(model=server.model, prompt="Once upon a time", extra_body={"ignore_eos": True})
        full = await in_thread(client.completions.create, **base, max_tokens=40)
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 40
        text = full.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = await in_thread(client.completions.create, **base, max_tokens=40, stop=[stop, "\x00"])
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        await wait_for_no_open_rows(server.llm)


async def test_32_concurrent_streams_each_equal_the_single_request(tiny):
    prompts = [f"Request number {i} says" for i in range(4)]
    async with serving(tiny, max_batch=16) as server:
        client = server.client()

        def run(prompt, stream):
            kwargs = dict(
                model=server.model, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True}
            )
            if not stream:
                return client.completions.create(**kwargs).choices[0].text
            return "".join(
                c.choices[0].text for c in client.completions.create(**kwargs, stream=True)
            )

        singles = {p: await in_thread(run, p, False) for p in prompts}

        def concurrently():
            with concurrent.futures.ThreadPoolExecutor(32) as pool:
                return list(pool.map(lambda i: run(prompts[i % 4], True), range(32)))

        texts = await in_thread(concurrently)
    assert texts == [singles[prompts[i % 4]] for i in range(32)]


async def test_streams_cut_by_preemption_resume_with_no_gap_and_no_duplicate(tiny):
    prompts = [f"Request number {i} says" for i in range(4)]
    # 24 blocks of 4 tokens (512 bytes a token): four 50-token streams can't all fit.
    async with serving(tiny, max_batch=4, kv_budget=24 * 4 * 512, block_size=4) as server:
        client = server.client()

        def run(prompt, priority=0, stream=False):
            kwargs = dict(
                model=server.model,
                prompt=prompt,
                max_tokens=40,
                stream=stream,
                extra_body={"ignore_eos": True, "priority": priority},
            )
            if not stream:
                return client.completions.create(**kwargs).choices[0].text
            return "".join(c.choices[0].text for c in client.completions.create(**kwargs))

        singles = [await in_thread(run, p) for p in prompts]

        def concurrently():
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda i: run(prompts[i], i, True), range(4)))

        preemptions_before = server.llm.num_preemptions
        texts = await in_thread(concurrently)
        assert server.llm.num_preemptions > preemptions_before
    assert texts == singles


def open_stream(url, path, body):
    """(connection, response) of a JSON POST answered 200, read raw by the caller."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request(
        "POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    return connection, response


def read_some_then_disconnect(url, path, body, num_lines, until=lambda: True):
    connection, response = open_stream(url, path, body)
    lines = [response.readline() for _ in range(num_lines)]
    while not until():
        time.sleep(0.001)
    connection.sock.shutdown(2)
    connection.close()
    return lines


async def test_a_client_disconnect_mid_stream_frees_the_row(tiny):
    async with serving(tiny) as server:
        body = {
            "model": server.model,
            "prompt": "Hello",
            "max_tokens": 900,
            "stream": True,
            "ignore_eos": True,
        }
        slow_down(server.llm._engine, 0.002)
        lines = await in_thread(read_some_then_disconnect, server.url, "/v1/completions", body, 6)
        assert lines[0].startswith(b"data: {")
        await wait_for_no_open_rows(server.llm)
        again = await in_thread(
            server.client().completions.create, model=server.model, prompt="Hi", max_tokens=3
        )
        assert again.choices[0].finish_reason in ("length", "stop")


async def test_a_client_disconnect_mid_prefill_frees_the_row(tiny):
    pieces = []
    async with serving(tiny, prefill_chunk=8, max_num_batched_tokens=24) as server:
        slow_down(server.llm._engine, 0.005, record=pieces)
        body = {
            "model": server.model,
            "prompt": list(range(10, 610)),
            "max_tokens": 5,
            "stream": True,
        }
        # Headers arrive once admitted; the first data line would need the whole prefill.
        until = lambda: len(pieces) >= 3  # noqa: E731
        await in_thread(read_some_then_disconnect, server.url, "/v1/completions", body, 0, until)
        await wait_for_no_open_rows(server.llm)
        assert 0 < len(pieces) < 75
        again = await in_thread(
            server.client().completions.create, model=server.model, prompt="Hi", max_tokens=3
        )
        assert again.usage.completion_tokens <= 3


async def test_an_error_mid_stream_is_an_error_event_and_the_others_go_on(tiny):
    marker = [7, 7, 7, 7]
    async with serving(tiny) as server:
        engine = server.llm._engine
        fail_row(engine, marker, after=3)
        client = server.client()

        def failing():
            received = []
            with pytest.raises(openai.APIError, match="injected fault"):
                for chunk in client.completions.create(
                    model=server.model,
                    prompt=marker,
                    max_tokens=50,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    received.append(chunk)
            return received

        def healthy():
            return list(
                client.completions.create(
                    model=server.model,
                    prompt="fine",
                    max_tokens=30,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bad, good = pool.submit(failing), pool.submit(healthy)
            received, chunks = await in_thread(bad.result), await in_thread(good.result)
    assert len(received) >= 1
    assert chunks[-1].choices[0].finish_reason == "length"


def sse_data(url, path, body):
    """A whole stream's `data:` payloads, read raw: the events as they are on the wire."""
    connection, response = open_stream(url, path, body)
    events = response.read().decode().split("\n\n")
    connection.close()
    assert events[-1] == ""
    assert all(event.startswith("data: ") for event in events[:-1]), events
    return [event.removeprefix("data: ") for event in events[:-1]]


async def test_a_stream_ends_in_done_after_its_finish_or_an_error_event(tiny):
    """Clients that read the SSE themselves stop at `data: [DONE]`; without it they wait
    for the connection to close. Every chunk before the finish carries text: none is empty."""
    marker = [7, 7, 7, 7]
    async with serving(tiny) as server:
        engine = server.llm._engine
        fail_row(engine, marker, after=3)
        fields = {"model": server.model, "max_tokens": 12, "stream": True, "ignore_eos": True}
        fine = await in_thread(sse_data, server.url, "/v1/completions", {**fields, "prompt": "Go"})
        failed = await in_thread(
            sse_data, server.url, "/v1/completions", {**fields, "prompt": marker}
        )
        greedy = {**fields, "prompt": "Go", "temperature": 0}
        first = json.loads((await in_thread(sse_data, server.url, "/v1/completions", greedy))[0])
        stop = first["choices"][0]["text"]  # the first token's: the stream stops at once
        stopped = await in_thread(
            sse_data, server.url, "/v1/completions", {**greedy, "stop": [stop]}
        )
    *chunks, finish, done = fine
    assert done == "[DONE]"
    assert json.loads(finish)["choices"][0]["finish_reason"] == "length"
    assert all(json.loads(chunk)["choices"][0]["text"] for chunk in chunks)
    finish, done = stopped  # no empty text chunk before the finish
    assert json.loads(finish)["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert done == "[DONE]"
    *_, error, done = failed
    assert done == "[DONE]" and "injected fault" in json.loads(error)["error"]["message"]


async def test_long_streams_outlive_the_response_timeout(tiny):
    async with serving(tiny, response_timeout=0.2) as server:
        slow_down(server.llm._engine, 0.003)
        client = server.client()
        chunks = await in_thread(
            lambda: list(
                client.completions.create(
                    model=server.model,
                    prompt="Go",
                    max_tokens=150,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
            )
        )
    assert chunks[-1].usage.completion_tokens == 150


async def test_a_full_queue_gets_503_with_retry_after(tiny):
    async with serving(tiny, max_batch=1, max_waiting=1) as server:
        running = server.llm.generate("a", max_tokens=900, ignore_eos=True)
        waiting = server.llm.generate("b", max_tokens=5)
        async with running, waiting:
            await running.__anext__()
            status, headers, body = await in_thread(
                request,
                server.url,
                "POST",
                "/v1/completions",
                {"model": server.model, "prompt": "c"},
            )
        assert status == 503 and headers["retry-after"] == "1"
        assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "server_error"


async def test_every_refusal_is_logged_once_under_the_clients_request_id(tiny):
    """A bad field, an unknown model or a full queue left no line at all: an operator
    handed the client's x-request-id found nothing. What admission refuses (a prompt
    past the context) it logs itself, and is not logged twice."""
    cases = {
        "bad-field": ({"model": "M", "prompt": "x", "max_tokens": -5}, 400),
        "no-model": ({"model": "nope", "prompt": "x"}, 404),
        "too-long": ({"model": "M", "prompt": list(range(1100))}, 400),
        "fine": ({"model": "M", "prompt": "x", "max_tokens": 2}, 200),
    }
    async with serving(tiny, max_batch=1, max_waiting=1) as server:
        with capture_logs() as logs:
            for rid, (body, status) in cases.items():
                body = {k: server.model if v == "M" else v for k, v in body.items()}
                got = await in_thread(
                    request, server.url, "POST", "/v1/completions", body, {"x-request-id": rid}
                )
                assert got[0] == status, (rid, got)
            running = server.llm.generate("a", max_tokens=900, ignore_eos=True)
            waiting = server.llm.generate("b", max_tokens=5)
            async with running, waiting:
                await running.__anext__()
                full = await in_thread(
                    request,
                    server.url,
                    "POST",
                    "/v1/completions",
                    {"model": server.model, "prompt": "c"},
                    {"x-request-id": "full-queue"},
                )
            assert full[0] == 503
    rejected = collections.Counter(
        e["request_id"].rsplit("-", 1)[0] for e in logs if e["event"] == "rejected"
    )
    assert rejected == {"bad-field": 1, "no-model": 1, "too-long": 1, "full-queue": 1}


async def test_a_request_failing_after_admission_is_logged_once_by_the_pipeline(tiny):
    """Admitted, a request's end is the pipeline's to log, a failure's too: the handler
    that turns it into the 500 does not log it again as a refusal."""
    marker = [7, 7, 7, 7]
    async with serving(tiny) as server:
        engine = server.llm._engine
        fail_row(engine, marker, after=2)
        body = {"model": server.model, "prompt": marker, "max_tokens": 8, "ignore_eos": True}
        with capture_logs() as logs:
            status, _, reply = await in_thread(
                request, server.url, "POST", "/v1/completions", body, {"x-request-id": "fault"}
            )
    assert status == 500 and "injected fault" in reply["error"]["message"]
    about_it = [e["event"] for e in logs if e.get("request_id", "").startswith("fault-")]
    assert "rejected" not in about_it and about_it.count("failed") == 1, about_it


async def test_a_request_cut_short_by_the_servers_shutdown_is_a_503_not_a_fault(tiny):
    """Aborted by the drain's timeout, it is no failure of the request's: a 503 with
    Retry-After tells a client or a balancer to try again (elsewhere), a 500 did not."""
    body = {"model": "M", "prompt": "a", "max_tokens": 900, "ignore_eos": True}
    answers = []

    async def post(url):
        answers.append(await in_thread(request, url, "POST", "/v1/completions", body))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery, serving(tiny, drain_timeout=0) as server:
            slow_down(server.llm._engine, 0.01)  # 900 tokens: ~9 s, far past the drain
            body["model"] = server.model
            nursery.start_soon(post, server.url)
            while not (await server.llm.engine_stats()).num_open:
                await trio.sleep(0.005)
    [(status, headers, answer)] = answers
    assert status == 503 and headers["retry-after"] == "1"
    assert answer["error"]["code"] == "unavailable"
    assert "shutting down" in answer["error"]["message"]


ERROR_CASES = {
    "malformed JSON": (b'{"model": ', 400, None, None),
    "invalid UTF-8": (b'{"model": "\xff\xfe"}', 400, None, None),
    "NaN": (b'{"model": "M", "prompt": "x", "temperature": NaN}', 400, None, None),
    "Infinity": (b'{"model": "M", "prompt": "x", "top_p": -Infinity}', 400, None, None),
    "not an object": (b"[1, 2]", 400, None, None),
    "wrong type": ({"model": "M", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    "unknown field": (
        {"model": "M", "prompt": "x", "reasoning_effort": "high"},
        400,
        "reasoning_effort",
        "unknown_field",
    ),
    "a chat feature this server lacks": (
        {"model": "M", "messages": CHAT, "audio": {"voice": "alloy", "format": "mp3"}},
        400,
        "audio",
        None,
    ),
    "audio output asked": (
        {"model": "M", "messages": CHAT, "modalities": ["text", "audio"]},
        400,
        "modalities",
        None,
    ),
    "chat field on completions": (
        {"model": "M", "prompt": "x", "messages": []},
        400,
        "messages",
        "unknown_field",
    ),
    "an ignorable field of the wrong type": (
        {"model": "M", "prompt": "x", "user": 5},
        400,
        "user",
        None,
    ),
    "include_usage not a boolean": (
        {"model": "M", "prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
        None,
    ),
    "priority not an integer": (
        {"model": "M", "prompt": "x", "priority": 1.5},
        400,
        "priority",
        None,
    ),
    "priority out of range": (
        {"model": "M", "prompt": "x", "priority": 2**40},
        400,
        "priority",
        None,
    ),
    "store": ({"model": "M", "prompt": "x", "store": True}, 400, "store", None),
    # OpenAI's metadata maps strings to strings, within its limits; anything was accepted.
    "metadata value not a string": (
        {"model": "M", "prompt": "x", "metadata": {"team": "a", "n": 5}},
        400,
        "metadata.n",
        None,
    ),
    "metadata value an object": (
        {"model": "M", "messages": CHAT, "metadata": {"tags": {"a": "b"}}},
        400,
        "metadata.tags",
        None,
    ),
    "metadata of 17 pairs": (
        {"model": "M", "prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
        400,
        "metadata",
        "object_above_max_properties",
    ),
    "metadata key of 65 characters": (
        {"model": "M", "prompt": "x", "metadata": {"k" * 65: "v"}},
        400,
        "metadata",
        "string_above_max_length",
    ),
    "metadata value of 513 characters": (
        {"model": "M", "prompt": "x", "metadata": {"k": "v" * 513}},
        400,
        "metadata.k",
        "string_above_max_length",
    ),
    "wrong type in a message": (
        {"model": "M", "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        None,
    ),
    "temperature out of range": (
        {"model": "M", "prompt": "x", "temperature": 2.5},
        400,
        "temperature",
        None,
    ),
    "top_p out of range": ({"model": "M", "prompt": "x", "top_p": 0}, 400, "top_p", None),
    "negative max_tokens": (
        {"model": "M", "prompt": "x", "max_tokens": -1},
        400,
        "max_tokens",
        None,
    ),
    "empty prompt": ({"model": "M", "prompt": ""}, 400, "prompt", None),
    "empty messages": ({"model": "M", "messages": []}, 400, "messages", None),
    "missing model": ({"prompt": "x"}, 400, "model", None),
    "n above --max-n": ({"model": "M", "prompt": "x", "n": 9}, 400, "n", None),
    "n of 0": ({"model": "M", "messages": CHAT, "n": 0}, 400, "n", None),
    "seed below int64": ({"model": "M", "prompt": "x", "seed": -(2**63) - 1}, 400, "seed", None),
    "tool_choice without tools": (
        {"model": "M", "messages": CHAT, "tool_choice": "auto"},
        400,
        "tool_choice",
        None,
    ),
    "chat_template_kwargs outside the allowlist": (
        {"model": "M", "messages": CHAT, "chat_template_kwargs": {"tools_in_system": True}},
        400,
        "chat_template_kwargs.tools_in_system",
        None,
    ),
    "guided_json not a schema": (
        {"model": "M", "prompt": "x", "guided_json": 5},
        400,
        "guided_json",
        None,
    ),
    "best_of 2": ({"model": "M", "prompt": "x", "best_of": 2}, 400, "best_of", None),
    "response_format without a type": (
        {"model": "M", "prompt": "x", "response_format": {}},
        400,
        "response_format.type",
        None,
    ),
    "stream_options without stream": (
        {"model": "M", "prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
    ),
    "a 5,000-byte stop string": (
        {"model": "M", "prompt": "x", "stop": "s" * 5000},
        400,
        "stop",
        None,
    ),
    "logit_bias key --5": (
        {"model": "M", "prompt": "x", "logit_bias": {"--5": 1}},
        400,
        "logit_bias",
        None,
    ),
    "logit_bias naming a token twice": (
        {"model": "M", "prompt": "x", "logit_bias": {"5": 1, "05": -1}},
        400,
        "logit_bias",
        None,
    ),
    "logit_bias key ²": (
        {"model": "M", "prompt": "x", "logit_bias": {"²": 1}},
        400,
        "logit_bias",
        None,
    ),
    "logit_bias key ١": (
        {"model": "M", "prompt": "x", "logit_bias": {"١": 1}},
        400,
        "logit_bias",
        None,
    ),
    "logit_bias key of 5,000 digits": (
        {"model": "M", "prompt": "x", "logit_bias": {"9" * 5000: 1}},
        400,
        "logit_bias",
        None,
    ),
    "a 5,000-digit integer": (
        b'{"model": "M", "prompt": "x", "seed": ' + b"7" * 5000 + b"}",
        400,
        None,
        None,
    ),
    "a lone surrogate in model": (b'{"model": "\\ud800", "prompt": "x"}', 400, None, None),
    "seed of 2**64": ({"model": "M", "prompt": "x", "seed": 2**64}, 400, "seed", None),
    "seed below int64 in a chat": (
        {"model": "M", "messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1},
        400,
        "seed",
        None,
    ),
    "unknown model": ({"model": "gpt-4o", "prompt": "x"}, 404, "model", "model_not_found"),
    "context too long": (
        {"model": "M", "prompt": "x", "max_tokens": 5000},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    # Named as the client named it: the chat SDKs send only the newer name.
    "max_completion_tokens past the context": (
        {"model": "M", "messages": CHAT, "max_completion_tokens": 5000},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    "prompt too long": (
        {"model": "M", "prompt": list(range(1100))},
        400,
        "prompt",
        "context_length_exceeded",
    ),
}


async def test_grammars_chaining_thousands_of_rules_or_refs_leave_the_server_serving(tiny):
    """A 70 kB guided_grammar of 3,000 chained rules (or a schema of 3,000 chained $refs)
    overflowed llguidance's stack as it compiled: a segmentation fault ended the server.
    The rules now compile; the $refs are past the limit, a 400."""
    rules = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(3000)) + '\nr3000: "z"'
    defs = {f"l{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/l{i + 1}"}}} for i in range(3000)}
    schema = {"$defs": {**defs, "l3000": {"type": "string"}}, "$ref": "#/$defs/l0"}
    response_format = {"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}}
    async with serving(tiny) as server:
        body = {"model": server.model, "prompt": "x", "max_tokens": 2, "guided_grammar": rules}
        chained = await in_thread(request, server.url, "POST", "/v1/completions", body)
        body = {"model": server.model, "messages": CHAT, "max_tokens": 2, "response_format": response_format}
        referred = await in_thread(request, server.url, "POST", "/v1/chat/completions", body)
        served = await in_thread(server.client().completions.create, model=server.model, prompt="x", max_tokens=2)
    text = chained[2]["choices"][0]["text"]
    assert chained[0] == 200 and text and set(text.removesuffix("b")) <= {"a"}  # the grammar's
    assert (referred[0], referred[2]["error"]["param"]) == (400, "response_format.json_schema.schema")
    assert "at most 2000" in referred[2]["error"]["message"]
    assert served.choices[0].finish_reason == "length"


async def test_every_bad_request_gets_an_openai_error_object(tiny):
    async with serving(tiny, max_body_bytes=16384) as server:
        for name, (body, status, param, code) in ERROR_CASES.items():
            if isinstance(body, dict):
                body = {k: server.model if v == "M" else v for k, v in body.items()}
                path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            else:
                body, path = (
                    body.replace(b'"M"', json.dumps(server.model).encode()),
                    "/v1/completions",
                )
            got_status, _, got = await in_thread(request, server.url, "POST", path, body)
            assert got_status == status, name
            assert set(got) == {"error"} and set(got["error"]) == {
                "message",
                "type",
                "param",
                "code",
            }, name
            assert (got["error"]["param"], got["error"]["code"]) == (param, code), name
            assert got["error"]["type"] == "invalid_request_error", name  # OpenAI's, for any 4xx
            assert got["error"]["message"], name
        too_large = json.dumps({"model": server.model, "prompt": "x" * 20000}).encode()
        status, _, got = await in_thread(
            request, server.url, "POST", "/v1/completions", b"[" * 8000 + b"]" * 8000
        )
        assert status == 400 and "nested too deeply" in got["error"]["message"]
        status, _, got = await in_thread(request, server.url, "POST", "/v1/completions", too_large)
        assert status == 413 and got["error"]["type"] == "invalid_request_error"
        for content_type in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/jsonx",
        ):
            status, _, got = await in_thread(
                request,
                server.url,
                "POST",
                "/v1/chat/completions",
                {"model": server.model, "messages": CHAT, "seed": -1},
                {"Content-Type": content_type},
            )
            assert status == 415 and got["error"]["type"] == "invalid_request_error", content_type
        status, _, got = await in_thread(
            request,
            server.url,
            "POST",
            "/v1/completions",
            {"model": server.model, "prompt": "x", "max_tokens": 2},
            {"Content-Type": "application/json; charset=utf-8"},
        )
        assert status == 200, got
        status, _, got = await in_thread(request, server.url, "GET", "/v1/nowhere")
        # OpenAI's answer to a path it does not serve: its type was not_found_error.
        assert (status, got["error"]) == (
            404,
            {
                "message": "Invalid URL (GET /v1/nowhere)",
                "type": "invalid_request_error",
                "param": None,
                "code": "unknown_url",
            },
        )
        status, _, got = await in_thread(request, server.url, "GET", "/v1/completions")
        assert status == 405 and got["error"]["type"] == "invalid_request_error"
        for method, doubled in (("POST", "/v1//chat/completions"), ("GET", "/v1/models//x")):
            status, headers, got = await in_thread(request, server.url, method, doubled, {})
            assert (status, got["error"]["code"]) == (404, "unknown_url"), doubled  # not a 308 in HTML
            assert headers["content-type"] == "application/json"
        # None of the above took the server down: a plain request still completes.
        done = await in_thread(
            server.client().completions.create, model=server.model, prompt="x", max_tokens=3, seed=7
        )
        assert done.usage.completion_tokens >= 1
        await wait_for_no_open_rows(server.llm)


async def test_a_shared_prompt_prefix_reports_cached_tokens_and_the_same_text(tiny):
    system = "You answer questions about Python's standard library. " * 20
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me."}]
    async with serving(tiny, prefix_cache=False) as server:
        cold = await in_thread(
            server.client().chat.completions.create,
            model=server.model,
            messages=messages,
            max_tokens=12,
        )
    async with serving(tiny) as server:
        create = functools.partial(
            server.client().chat.completions.create, model=server.model, max_tokens=12
        )
        first = await in_thread(create, messages=messages)
        second = await in_thread(create, messages=messages)

        def streamed_usage():  # read the stream on the worker thread, not on trio's
            stream = create(messages=messages, stream=True, stream_options={"include_usage": True})
            return [chunk.usage for chunk in stream if chunk.usage is not None][-1]

        usage = await in_thread(streamed_usage)
    assert cold.usage.prompt_tokens > 200
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cold.usage.prompt_tokens - 16 <= cached < cold.usage.prompt_tokens  # whole blocks
    assert second.choices[0].message.content == cold.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens == cached


async def test_a_request_that_could_never_fit_the_kv_budget_is_a_400_naming_it(tiny):
    # 4 blocks of 16 tokens: 64 tokens of KV in all, less than the model's context.
    bytes_per_block = 2 * 2 * 2 * 16 * 16 * 4  # K and V, layers, KV heads, block, head dim, fp32
    async with serving(tiny, kv_budget=4 * bytes_per_block) as server:
        assert server.llm.max_context == 64
        status, _, body = await in_thread(
            request,
            server.url,
            "POST",
            "/v1/completions",
            {"model": server.model, "prompt": list(range(1, 41)), "max_tokens": 30},
        )
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert "KV budget" in body["error"]["message"]
        done = await in_thread(
            server.client().completions.create,
            model=server.model,
            prompt=list(range(1, 41)),
            max_tokens=20,
        )
        assert done.usage.completion_tokens >= 1


async def test_every_response_carries_an_x_request_id_and_a_clients_own_is_echoed(tiny):
    async with serving(tiny) as server:
        body = {"model": server.model, "prompt": "x", "max_tokens": 2}
        with capture_logs() as logs:
            status, headers, got = await in_thread(
                request, server.url, "POST", "/v1/completions", body, {"x-request-id": "trace-42.a"}
            )
        assert status == 200 and headers["x-request-id"] == "trace-42.a"
        assert got["id"].startswith("cmpl-trace-42.a-")  # the same id as in the logs
        mine = [e["event"] for e in logs if e.get("request_id") == got["id"].removeprefix("cmpl-")]
        assert mine == ["admitted", "first_token", "finished"]
        twice = await in_thread(
            request, server.url, "POST", "/v1/completions", body, {"x-request-id": "trace-42.a"}
        )
        assert twice[0] == 200 and twice[2]["id"] != got["id"]  # reused: still unique inside
        status, headers, _ = await in_thread(request, server.url, "GET", "/v1/nowhere")
        assert status == 404 and len(headers["x-request-id"]) == 32
        longest = {"x-request-id": "a" * 64}
        status, headers, _ = await in_thread(
            request, server.url, "POST", "/v1/completions", body, longest
        )
        assert status == 200 and headers["x-request-id"] == "a" * 64
        too_long = {"x-request-id": "a" * 65}  # not echoed: it would bloat every log line
        status, headers, _ = await in_thread(
            request, server.url, "POST", "/v1/completions", body, too_long
        )
        assert status == 200 and headers["x-request-id"] != too_long["x-request-id"]
        bad = {"x-request-id": "has spaces and {braces}"}
        status, headers, got = await in_thread(
            request, server.url, "POST", "/v1/completions", body, bad
        )
        assert headers["x-request-id"] != bad["x-request-id"]
        assert got["id"] == "cmpl-" + headers["x-request-id"]


async def test_with_api_keys_every_route_but_health_needs_a_valid_bearer_token(tiny):
    async with serving(tiny, api_keys=("key-one", "key-two")) as server:
        body = {"model": server.model, "prompt": "x", "max_tokens": 2}
        for headers in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": "key-one"},
            {"Authorization": "Basic key-one"},
            {"Authorization": "Bearer key-oneX"},  # the whole key, not a prefix, must match
            {"Authorization": "Bearer key-"},
            {"Authorization": "Bearer key-three"},
        ):
            status, got_headers, got = await in_thread(
                request, server.url, "POST", "/v1/completions", body, headers
            )
            assert status == 401, headers
            assert got["error"]["type"] == "invalid_request_error"  # OpenAI's, with the code below
            assert got["error"]["code"] == "invalid_api_key" and "x-request-id" in got_headers
        status, _, _ = await in_thread(request, server.url, "GET", "/v1/models")
        assert status == 401
        assert (await in_thread(request, server.url, "GET", "/health"))[0] == 200
        for key in ("key-one", "key-two"):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
            done = await in_thread(
                client.completions.create, model=server.model, prompt="x", max_tokens=2
            )
            assert done.usage.completion_tokens >= 1
        # The scheme is case-insensitive (RFC 9110), the key is not.
        status, _, _ = await in_thread(
            request, server.url, "GET", "/v1/models", None, {"Authorization": "bearer key-two"}
        )
        assert status == 200
        status, _, _ = await in_thread(
            request, server.url, "GET", "/v1/models", None, {"Authorization": "Bearer  key-two"}
        )
        assert status == 200  # the space around the key is not part of it
        status, _, _ = await in_thread(
            request, server.url, "GET", "/v1/models", None, {"Authorization": "Bearer KEY-TWO"}
        )
        assert status == 401
        with pytest.raises(openai.AuthenticationError):
            await in_thread(server.client().models.list)  # api_key="unused"


async def test_an_unhandled_error_is_a_500_openai_error_object_that_reveals_nothing():
    """A bug in a route (here: a served LLM without metrics) is OpenAI's server_error,
    with the request id, and logged with its traceback, not sent to the client."""
    state = ServerState(llm=types.SimpleNamespace(name="broken"))  # type: ignore[arg-type]
    async with serving_on_loopback(create_app(state), graceful_timeout=0.1) as url:
        with capture_logs() as logs:
            status, headers, body = await in_thread(request, url, "GET", "/v1/cadence/stats")
    assert status == 500 and len(headers["x-request-id"]) == 32
    assert body == {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert [e["event"] for e in logs] == ["unhandled error"]


async def test_a_large_body_is_parsed_off_the_event_loop_so_other_requests_are_answered(
    tiny, monkeypatch
):
    """A 3 MB batch of token-id prompts held the event loop ~1 s while it was read and
    checked: every stream and /health stood still. Its parse is held here until /health
    has been answered, which it can be only if the parse is not on the loop."""
    import threading

    from actors import http_app

    started, release, released = threading.Event(), threading.Event(), []
    real_parse = http_app.parse_completion

    def held_parse(body, **options):
        started.set()
        released.append(release.wait(timeout=10))
        return real_parse(body, **options)

    monkeypatch.setattr(http_app, "parse_completion", held_parse)
    async with serving(tiny, max_body_bytes=4 << 20, max_waiting=4) as server:
        big = {"model": server.model, "prompt": [[1]] * 200_000, "max_tokens": 1}
        async with trio.open_nursery() as nursery:
            answers = []

            async def send_big():
                answers.append(await in_thread(request, server.url, "POST", "/v1/completions", big))

            nursery.start_soon(send_big)
            await trio.to_thread.run_sync(started.wait, 10)
            health = await in_thread(request, server.url, "GET", "/health")
            release.set()
        assert health[0] == 200
        assert released == [True]  # freed by the answer, not by the wait's timeout
        status, _, error = answers[0]  # errors raised on the thread still reach the client
        assert status == 400 and error["error"]["param"] == "prompt"
        assert "200000 prompts of n=1 choices" in error["error"]["message"]
        # Past the size, a body that is no JSON is still an OpenAI-shaped 400.
        status, _, error = await in_thread(
            request, server.url, "POST", "/v1/completions", b"[" + b"1," * 200_000
        )
        assert status == 400 and "not valid JSON" in error["error"]["message"]
