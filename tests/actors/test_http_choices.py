"""`n` choices over HTTP, with the official openai client against a real server."""

import collections
import functools

import trio
from structlog.testing import capture_logs

from actors import http_app
from tests.actors.test_http import (
    CHAT,
    in_thread,
    read_some_then_disconnect,
    request,
    serving,
    slow_down,
    wait_for_no_open_rows,
)

SAMPLED = {"temperature": 1.0, "seed": 7}


def chat(server, **fields):
    return in_thread(
        server.client().chat.completions.create, model=server.model, messages=CHAT, **fields
    )


def streamed_chat(server, **fields):
    """(each choice's text, finish reasons, usage, the order of the content chunks' indexes)."""

    def read():
        texts, finishes, order, usage = collections.defaultdict(str), {}, [], None
        stream = server.client().chat.completions.create(
            model=server.model,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **fields,
        )
        for chunk in stream:
            if chunk.usage is not None:
                assert usage is None and chunk.choices == []  # once, last
                usage = chunk.usage
            for choice in chunk.choices:
                assert choice.index not in finishes  # nothing after a choice's finish
                if choice.delta.content:
                    texts[choice.index] += choice.delta.content
                    order.append(choice.index)
                if choice.finish_reason is not None:
                    finishes[choice.index] = choice.finish_reason
        return dict(texts), finishes, usage, order

    return in_thread(read)


async def test_greedy_choices_are_identical_and_usage_counts_the_prompt_once(tiny):
    async with serving(tiny) as server:
        one = await chat(server, max_tokens=10)
        three = await chat(server, max_tokens=10, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == one.usage.prompt_tokens + 3 * one.usage.completion_tokens


async def test_seeded_choices_are_distinct_and_reproducible(tiny):
    async with serving(tiny) as server:
        first = await chat(server, max_tokens=12, n=3, **SAMPLED)
        again = await chat(server, max_tokens=12, n=3, **SAMPLED)
        alone = await chat(server, max_tokens=12, **SAMPLED)
        next_seed = await chat(server, max_tokens=12, temperature=1.0, seed=8)
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) == 3
    assert [c.message.content for c in again.choices] == texts
    # Choice i samples with seed + i: choice 0 is the n=1 answer, choice 1 seed 8's.
    assert texts[0] == alone.choices[0].message.content
    assert texts[1] == next_seed.choices[0].message.content


async def test_a_negative_seed_is_an_int64_seed_like_any_other(tiny):
    """OpenAI's and vLLM's seeds are int64: -1 (llama.cpp's "random") was a 400 here."""
    async with serving(tiny) as server:
        first = await chat(server, max_tokens=12, n=2, temperature=1.0, seed=-1)
        again = await chat(server, max_tokens=12, temperature=1.0, seed=-1)
        zero = await chat(server, max_tokens=12, temperature=1.0, seed=0)
    texts = [c.message.content for c in first.choices]
    assert again.choices[0].message.content == texts[0]
    assert texts[1] == zero.choices[0].message.content  # choice 1 samples with -1 + 1


async def test_streamed_choices_interleave_and_reassemble_to_the_whole_ones(tiny):
    async with serving(tiny) as server:
        slow_down(server.llm._engine, 0.01)  # a delta per step: the choices interleave
        for fields in ({}, SAMPLED):
            whole = await chat(server, max_tokens=16, n=3, **fields)
            texts, finishes, usage, order = await streamed_chat(
                server, max_tokens=16, n=3, **fields
            )
            assert texts == {c.index: c.message.content for c in whole.choices}
            assert finishes == {c.index: c.finish_reason for c in whole.choices}
            assert usage.completion_tokens == whole.usage.completion_tokens
            assert usage.prompt_tokens == whole.usage.prompt_tokens
            assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # 1 before 0 ends


async def test_completions_choices_each_carry_their_own_logprobs(tiny):
    async with serving(tiny) as server:
        client = server.client()
        whole = await in_thread(
            client.completions.create,
            model=server.model,
            prompt="The for statement",
            max_tokens=6,
            n=2,
            logprobs=2,
            extra_body={"ignore_eos": True},
            **SAMPLED,
        )
        pieces = collections.defaultdict(list)
        stream = await in_thread(
            client.completions.create,
            model=server.model,
            prompt="The for statement",
            max_tokens=6,
            n=2,
            logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
            **SAMPLED,
        )
        for chunk in await in_thread(list, stream):
            for choice in chunk.choices:
                pieces[choice.index].append(choice)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6  # one per token
        assert logprobs.text_offset[0] == 0  # each choice counts from its own start
        streamed = [p for p in pieces[choice.index] if p.logprobs is not None]
        assert sum((p.logprobs.tokens for p in streamed), []) == logprobs.tokens
        assert sum((p.logprobs.text_offset for p in streamed), []) == logprobs.text_offset
        assert "".join(p.text for p in pieces[choice.index]) == choice.text


async def test_n_above_max_n_is_a_400_naming_n(tiny):
    async with serving(tiny, max_n=2) as server:
        body = {"model": server.model, "messages": CHAT, "n": 3}
        status, _, reply = await in_thread(
            request, server.url, "POST", "/v1/chat/completions", body
        )
        assert status == 400 and reply["error"]["param"] == "n"
        assert "[1, 2]" in reply["error"]["message"]
        body["n"] = 2
        status, _, reply = await in_thread(
            request, server.url, "POST", "/v1/chat/completions", body
        )
        assert status == 200 and len(reply["choices"]) == 2


async def test_n_choices_take_n_waiting_slots_and_a_full_queue_refuses_them_all(tiny):
    async with serving(tiny, max_batch=1, max_waiting=3) as server:
        body = {"model": server.model, "prompt": "c", "n": 4}
        status, _, reply = await in_thread(request, server.url, "POST", "/v1/completions", body)
        assert status == 400 and reply["error"]["param"] == "n"  # more than the queue holds
        running = server.llm.generate("a", max_tokens=900, ignore_eos=True)
        waiting = server.llm.generate("b", max_tokens=5)
        async with running, waiting:
            await running.__anext__()  # one row runs, one request waits: two slots free
            body["n"] = 3
            status, headers, reply = await in_thread(
                request, server.url, "POST", "/v1/completions", body
            )
            assert status == 503 and headers["retry-after"] == "1"
            assert server.llm.num_waiting == 1  # nothing of the refused request was queued
            assert (await server.llm.engine_stats()).num_open == 1


async def test_a_disconnect_aborts_every_choice(tiny):
    async with serving(tiny) as server:
        body = {
            "model": server.model,
            "prompt": "Hello",
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
            "n": 3,
        }
        slow_down(server.llm._engine, 0.01)  # running to the end would take over 10 s
        with capture_logs() as logs:
            lines = await in_thread(
                read_some_then_disconnect, server.url, "/v1/completions", body, 6
            )
            await wait_for_no_open_rows(server.llm, timeout=5)
            with trio.move_on_after(5):  # the streamer logs each as the step's release says
                while sum(e["event"] == "aborted" for e in logs) < 3:
                    await trio.sleep(0.01)
        assert lines[0].startswith(b"data: {")
        aborted = {e["request_id"] for e in logs if e["event"] == "aborted"}
        assert sorted(request_id[-2:] for request_id in aborted) == ["-0", "-1", "-2"]
        # A choice's reader cancelled by the disconnect says so too (it said "cancelled").
        assert {e["cause"] for e in logs if e["event"] == "aborted"} == {"disconnected"}


async def test_the_choices_share_the_prompts_kv_blocks(tiny):
    prompt = list(range(10, 410))  # 400 tokens: 25 blocks of 16
    async with serving(tiny, max_batch=4) as server:
        pool = server.llm._policy.pool
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, pool.num_used_blocks)
                await trio.sleep(0)

        async def ask(n):
            return await in_thread(
                server.client().completions.create,
                model=server.model,
                prompt=prompt,
                max_tokens=8,
                n=n,
                extra_body={"ignore_eos": True},
            )

        slow_down(server.llm._engine, 0.005)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            reply = await ask(4)
            nursery.cancel_scope.cancel()
    assert len(reply.choices) == 4
    # One prompt's 26 blocks (400 + 8 tokens), a tail block for each other choice, not 4 x 26.
    assert 26 <= peak <= 26 + 3 * 2
    assert pool.num_hit_blocks >= 3 * 24  # the others took the prompt's full blocks


async def test_a_batch_of_prompts_answers_each_as_alone_numbered_prompt_by_choice(tiny):
    """OpenAI's completions take a list of prompts (LangChain's OpenAI.batch and litellm
    send one): prompt i's choice j is index i * n + j, its text what the prompt gets
    alone, and the usage counts each prompt once. It was a 400."""
    prompts = ["The for statement", "Hello", [5, 6, 7]]
    fields = {"max_tokens": 5, "extra_body": {"ignore_eos": True}}
    async with serving(tiny) as server:
        client = server.client()
        create = functools.partial(client.completions.create, model=server.model, **fields)
        alone = [await in_thread(create, prompt=prompt) for prompt in prompts]
        batch = await in_thread(create, prompt=prompts, n=2)
        stream = await in_thread(
            create, prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}
        )
        texts, usage = collections.defaultdict(str), None
        for chunk in await in_thread(list, stream):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        body = {"model": server.model, "prompt": ["a"] * 33, "n": 2}  # 66 > 64 queued
        status, _, reply = await in_thread(request, server.url, "POST", "/v1/completions", body)
        refusals = [
            await in_thread(
                request,
                server.url,
                "POST",
                "/v1/completions",
                {"model": server.model, "prompt": ["a", "b", refused], "n": 2},
            )
            for refused in ([5, 999999], "a" * 5000)
        ]
    expected = [a.choices[0].text for a in alone for _ in range(2)]
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == expected
    assert [texts[i] for i in range(6)] == expected
    prompt_tokens = sum(a.usage.prompt_tokens for a in alone)
    for whole in (batch.usage, usage):
        assert (whole.prompt_tokens, whole.completion_tokens) == (prompt_tokens, 6 * 5)
    assert status == 400 and reply["error"]["param"] == "prompt"
    # Which of the batch's prompts admission refused is named: the third, as choices 4 and 5.
    for status, _, reply in refusals:
        assert status == 400 and reply["error"]["param"] == "prompt[2]"
        assert reply["error"]["message"].startswith("prompt[2]: ")
    assert refusals[1][2]["error"]["code"] == "context_length_exceeded"


async def test_a_batchs_first_prompt_is_named_prompt_0_when_refused_even_alone(tiny):
    """The first prompt is checked while parsing, the others in admission: a refusal
    of `[""]` or `["", "a"]` named `prompt`, as though the whole batch were at fault."""
    cases = [
        ([""], "prompt[0]"),
        (["", "a"], "prompt[0]"),
        ([[]], "prompt[0]"),
        ([[-1], "a"], "prompt[0]"),
        (["a", [1.5]], "prompt[1]"),
        ([list(range(2000))], "prompt[0]"),  # past the context: refused in admission
        ("", "prompt"),  # not a batch
        ([], "prompt"),
    ]
    async with serving(tiny) as server:
        replies = [
            await in_thread(
                request,
                server.url,
                "POST",
                "/v1/completions",
                {"model": server.model, "prompt": prompt, "max_tokens": 2},
            )
            for prompt, _ in cases
        ]
    for (prompt, param), (status, _, reply) in zip(cases, replies, strict=True):
        assert (status, reply["error"]["param"]) == (400, param), prompt
        assert param in reply["error"]["message"], prompt


async def test_a_batch_refused_for_one_prompt_runs_none_of_the_others(tiny):
    """Each prompt was submitted as soon as it was prepared: "a" ran a step, and its
    abort was logged as a client's disconnect, for a request answered with a 400."""
    async with serving(tiny) as server:
        body = {"model": server.model, "prompt": ["a", "b", "a" * 5000], "max_tokens": 4}
        with capture_logs() as logs:
            status, _, reply = await in_thread(request, server.url, "POST", "/v1/completions", body)
            steps = server.llm._policy.num_steps
    assert status == 400 and reply["error"]["param"] == "prompt[2]"
    ends = sorted((e["request_id"][-2:], e["event"], e.get("code"), e.get("param")) for e in logs if "request_id" in e)
    assert ends == [
        ("-0", "rejected", None, None),
        ("-1", "rejected", None, None),
        ("-2", "rejected", "context_length_exceeded", "prompt"),
    ]
    assert steps == 0  # nothing was scheduled


async def test_a_batch_of_prompts_as_large_as_the_queue_is_served(tiny):
    """Past the queue's size a batch could never be admitted (a 400); at it, it fits."""
    async with serving(tiny, max_waiting=4) as server:
        body = {"model": server.model, "prompt": ["a", "b"], "n": 2, "max_tokens": 2}
        status, _, reply = await in_thread(request, server.url, "POST", "/v1/completions", body)
        assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
        body["prompt"] = ["a", "b", "c"]
        status, _, reply = await in_thread(request, server.url, "POST", "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert "more than this server queues (4)" in reply["error"]["message"]


async def test_a_batch_past_the_queue_is_refused_before_a_request_is_built_for_each_prompt(
    tiny, monkeypatch
):
    """A 4 MB body of a million one-token prompts built a seeded request per prompt and
    choice on the event loop before this refusal: every stream and /health stood still
    for 19 s on the 2-core box."""
    built = []

    def choice_requests(request, n):
        built.append(request)
        return [request] * n

    monkeypatch.setattr(http_app, "choice_requests", choice_requests)
    async with serving(tiny, max_waiting=4) as server:
        body = {"model": server.model, "prompt": [[1]] * 100_000, "n": 2, "seed": 1}
        status, _, reply = await in_thread(request, server.url, "POST", "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert "100000 prompts of n=2 choices are 200000 requests" in reply["error"]["message"]
    assert built == []
