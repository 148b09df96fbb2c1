"""The embedding API end to end, on a real tiny checkpoint and the real Engine."""

import asyncio
import functools
import gc
import threading
import time

from runtime.errors import CadenceError, RequestError
from runtime.grammar import GrammarSpec
from runtime.tokenizer import Tokenizer
from runtime.warm_up import DECODE_STEPS

import pytest
import trio
from structlog.testing import capture_logs

import actors
from actors import GenerationError

PROMPTS = ["The quick brown fox", "def main():", "Hello", "1, 2, 3, 4"]


async def complete(llm, prompt, **kwargs):
    text = ""
    async with llm.generate(prompt, **kwargs) as generation:
        async for delta in generation:
            text += delta.text
    return text, generation


def fail_row(engine, prompt_tokens, *, after):
    """Make the engine raise for the row of `prompt_tokens` once it generated `after`
    tokens, as a fault in one row's input would: the other rows must go on."""
    row_input = engine._row_input

    def faulty_row_input(row, span):
        if list(row.params.prompt_tokens) == prompt_tokens and row.num_generated >= after:
            raise RuntimeError("injected fault")
        return row_input(row, span)

    engine._row_input = faulty_row_input


async def wait_for_no_open_rows(llm, timeout=10):
    with trio.fail_after(timeout):
        while (await llm.engine_stats()).num_open:
            await trio.sleep(0.005)


async def cancel_once(scope, predicate):
    while not predicate():
        await trio.sleep(0.001)
    scope.cancel()


async def test_concurrent_greedy_streams_equal_their_single_runs(tiny):
    async with actors.open_llm(tiny, max_batch=4) as llm:
        singles = {p: (await complete(llm, p, max_tokens=24, ignore_eos=True))[0] for p in PROMPTS}
        results = {}

        async def one(i, prompt):
            results[i] = (await complete(llm, prompt, max_tokens=24, ignore_eos=True))[0]

        async with trio.open_nursery() as nursery:  # 12 requests through 4 rows: joins and leaves
            for i in range(12):
                nursery.start_soon(one, i, PROMPTS[i % 4])
    assert all(results[i] == singles[PROMPTS[i % 4]] for i in range(12))


async def test_chat_messages_go_through_the_template(tiny):
    messages = [{"role": "user", "content": "hi"}]
    async with (
        actors.open_llm(tiny) as llm,
        llm.generate(messages=messages, max_tokens=4, ignore_eos=True) as generation,
    ):
        deltas = [d async for d in generation]
    expected = len(Tokenizer.from_dir(tiny).encode_chat(messages))
    assert generation.num_prompt_tokens == deltas[-1].usage.prompt_tokens == expected
    assert deltas[-1].usage.completion_tokens == 4


async def test_chat_messages_follow_the_rules_http_follows(tiny):
    """Embedded, any role reached the template as a turn of its own, and text parts or
    a null content (an assistant turn of tool calls) were refused; over HTTP the roles
    are a closed set and both of the others are accepted."""
    as_text = [{"role": "user", "content": "hi there"}]
    as_parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        }
    ]
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    with_a_call = [
        *as_text,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    async with actors.open_llm(tiny) as llm:
        with pytest.raises(RequestError) as raised:
            llm.generate(messages=[{"role": "robot", "content": "hi"}])
        assert raised.value.param == "messages[0].role"
        assert "must be one of system, user, assistant, tool, developer" in str(raised.value)
        with pytest.raises(RequestError) as raised:
            llm.generate(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
        assert raised.value.param == "messages[0].content"
        replies = []
        for messages in (as_text, as_parts, with_a_call):
            async with llm.generate(messages=messages, max_tokens=4, ignore_eos=True) as generation:
                replies.append(("".join([d.text async for d in generation]), generation))
    (text, plain), (parts_text, parts) = replies[:2]
    assert (parts_text, parts.num_prompt_tokens) == (text, plain.num_prompt_tokens)
    assert replies[2][1].num_prompt_tokens > plain.num_prompt_tokens


async def test_every_engine_call_runs_on_the_one_mlx_thread(tiny):
    idents = set()
    async with actors.open_llm(tiny) as llm:
        engine = llm._engine
        for name in ("open", "submit", "collect", "close"):
            method = getattr(engine, name)

            def spy(*args, _method=method):
                idents.add(threading.get_ident())
                return _method(*args)

            setattr(engine, name, spy)
        await complete(llm, "hello", max_tokens=8)
    assert len(idents) == 1 and threading.get_ident() not in idents


async def test_a_cancelled_consumer_frees_its_row_and_the_rest_go_on(tiny):
    async with actors.open_llm(tiny, max_batch=2) as llm:
        with trio.move_on_after(5):
            async with llm.generate("Once", max_tokens=900, ignore_eos=True) as generation:
                async for _ in generation:
                    if generation.num_prompt_tokens:  # got a token: leave now
                        break
        await wait_for_no_open_rows(llm)
        text, after = await complete(llm, "again", max_tokens=5)
        assert after.finish_reason == "length"


async def test_a_generation_dropped_mid_stream_unclosed_is_aborted_once_collected(tiny):
    async with actors.open_llm(tiny, max_batch=2) as llm:
        with capture_logs() as logs:
            generation = llm.generate("Once", ignore_eos=True)  # runs to the context's end
            request_id = generation.request_id
            async for _ in generation:
                break  # no `async with`, no aclose(): only garbage collection is left
            del generation
            gc.collect()
            # The engine closes the row before its release reaches the streamer, which
            # logs the end then: under load the log line came after the row had gone.
            with trio.move_on_after(30):
                while not (ends := [e for e in logs if e["event"] in ("aborted", "finished")]):
                    await trio.sleep(0.01)
            await wait_for_no_open_rows(llm)
        assert [(e["event"], e["request_id"]) for e in ends] == [("aborted", request_id)]
        assert llm.num_active == 0


async def test_a_dropped_generation_whose_tokens_make_no_text_is_aborted_too(tiny):
    """Token 1 decodes to nothing: the streamer asked whether the reader was still there
    only when it had text to send, so the row ran on to max_tokens for nobody."""
    async with actors.open_llm(tiny, max_batch=2) as llm:
        with capture_logs() as logs:
            generation = llm.generate(
                [100, 200, 300], max_tokens=400, ignore_eos=True, logit_bias={1: 100.0}
            )
            request_id = generation.request_id
            await generation.start()
            del generation
            gc.collect()
            with trio.fail_after(60):  # a hang guard: 400 tokens take a few seconds
                while not (ends := [e for e in logs if e["event"] in ("aborted", "finished")]):
                    await trio.sleep(0.01)
            await wait_for_no_open_rows(llm)
        (end,) = ends
        assert (end["event"], end["request_id"], end["cause"]) == (
            "aborted",
            request_id,
            "disconnected",
        )


async def test_an_abort_during_prefill_stops_it_and_frees_the_row(tiny):
    pieces = []
    async with actors.open_llm(tiny, max_batch=2, prefill_chunk=8, max_num_batched_tokens=10) as llm:
        engine = llm._engine
        submit = engine.submit

        def slow_submit(batch):
            pieces.extend(s for s in batch.spans if s.num_new > 1)
            time.sleep(0.005)  # make the 75-piece prefill last long enough to interrupt
            return submit(batch)

        engine.submit = slow_submit
        prompt = list(range(10, 610))
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_once, scope, lambda: len(pieces) >= 3)
                async with llm.generate(prompt, max_tokens=5) as generation:
                    async for _ in generation:
                        pytest.fail("the prompt was not supposed to finish prefilling")
        await wait_for_no_open_rows(llm)
        assert 0 < len(pieces) < 75
        text, after = await complete(llm, "again", max_tokens=5)
        assert after.finish_reason == "length"


@pytest.mark.parametrize(("budget", "largest_step"), [(None, 300), (40, 40)])
async def test_a_prompt_alone_grows_its_step_but_never_past_an_explicit_budget(
    tiny, budget, largest_step
):
    steps = []
    async with actors.open_llm(tiny, max_batch=2, max_num_batched_tokens=budget) as llm:
        engine = llm._engine
        submit = engine.submit

        def recording_submit(batch):
            steps.append(sum(s.num_new for s in batch.spans))
            return submit(batch)

        engine.submit = recording_submit
        await complete(llm, list(range(10, 310)), max_tokens=2)  # 300 prompt tokens, alone
    assert max(steps) == largest_step


async def test_a_warm_up_runs_the_step_shapes_and_leaves_no_trace(tiny):
    """On a GPU the first step of each shape compiles kernels (43 s for a 4-bit model's
    first 256-token prompt on an H200): the server runs them before its first request,
    on dummy prompts whose blocks, cache entries and tokens nobody sees."""
    prompt = list(range(10, 60))
    with capture_logs() as logs:
        async with actors.open_llm(tiny, max_batch=4) as llm:  # on a CPU: none by default
            cold, _ = await complete(llm, prompt, max_tokens=12, ignore_eos=True)
    assert not [e for e in logs if e["event"] == "warm_up"]
    heard: list[str] = []
    with capture_logs() as logs:
        async with actors.open_llm(tiny, max_batch=4, warm_up=True, on_progress=heard.append) as llm:
            policy = llm._policy
            assert policy.pool.num_free_blocks == policy.pool.num_blocks
            assert (policy.num_steps, policy.waiting, policy.running) == (0, [], {})
            warm, generation = await complete(llm, prompt, max_tokens=12, ignore_eos=True)
            assert generation.usage.cached_tokens == 0  # no dummy prompt was cached
    assert warm == cold
    (event,) = [e for e in logs if e["event"] == "warm_up"]
    # a prompt of the most a step takes alone, then all 4 rows prefilling in one step;
    # each run's first step gives its first token, and the rest decode
    assert (event["most_tokens"], event["most_rows"]) == (512, 4)
    assert event["steps"] == 2 * DECODE_STEPS
    assert heard[-1].startswith("warming up on Device(cpu, 0)")  # said before it begins


async def test_an_engine_fault_in_one_row_leaves_the_others_streaming(tiny):
    async with actors.open_llm(tiny, max_batch=4) as llm:
        clean = [(await complete(llm, p, max_tokens=16, ignore_eos=True))[0] for p in PROMPTS[:3]]
        engine = llm._engine
        marker = [7, 7, 7, 7]
        fail_row(engine, marker, after=2)
        results, errors = {}, []

        async def one(prompt):
            try:
                results[str(prompt)] = (
                    await complete(llm, prompt, max_tokens=16, ignore_eos=True)
                )[0]
            except GenerationError as error:
                errors.append(str(error))

        async with trio.open_nursery() as nursery:
            for prompt in [*PROMPTS[:3], marker]:
                nursery.start_soon(one, prompt)
        assert len(errors) == 1 and "injected fault" in errors[0]
        assert [results[p] for p in PROMPTS[:3]] == clean
        await wait_for_no_open_rows(llm)


async def test_an_unexpected_error_opening_a_row_fails_that_request_only(tiny):
    async with actors.open_llm(tiny, max_batch=4) as llm:
        engine = llm._engine
        engine_open = engine.open

        def open_that_raises(params):
            if list(params.prompt_tokens) == [7, 7, 7]:
                raise TypeError("not a CadenceError")  # what mx.random.key(-1) raised
            return engine_open(params)

        engine.open = open_that_raises
        with pytest.raises(GenerationError, match="not a CadenceError"):
            await complete(llm, [7, 7, 7], max_tokens=4)
        text, after = await complete(llm, "still serving", max_tokens=4, ignore_eos=True)
        assert after.finish_reason == "length" and after.usage.completion_tokens == 4


async def test_a_disconnected_request_leaves_the_real_engine_within_one_step(tiny):
    async with actors.open_llm(tiny, max_batch=2) as llm:
        engine = llm._engine
        submit = engine.submit
        steps: list[set[str]] = []  # request ids in each submitted step
        depth, deepest = [0], [0]
        collect_step = engine.collect

        def recording_submit(batch):
            steps.append({engine._rows[s.seq_id].params.request_id for s in batch.spans
                          if s.seq_id in engine._rows})
            depth[0] += 1
            deepest[0] = max(deepest[0], depth[0])
            time.sleep(0.002)  # let the consumer's cancel land mid-stream
            return submit(batch)

        def recording_collect():
            depth[0] -= 1
            return collect_step()

        engine.submit, engine.collect = recording_submit, recording_collect
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(complete, llm, "stays", max_tokens=120, ignore_eos=True)
            )
            leaver = llm.generate("leaves", max_tokens=900, ignore_eos=True)
            async with leaver:
                async for _ in leaver:
                    if len(steps) > 10:
                        break  # the consumer goes away mid-stream
            left_at = len(steps)
        later = [i for i, ids in enumerate(steps) if leaver.request_id in ids and i >= left_at]
        assert len(later) <= 1  # at most the step already queued when it left
        assert len(steps) > left_at + 20  # the other request kept the engine stepping
        assert deepest[0] == 2  # open_llm's default lookahead: one step queued, not two


async def test_streams_cut_by_preemption_resume_with_no_gap_and_no_duplicate(tiny):
    # 24 blocks of 4 tokens (512 bytes a token): four 50-token streams can't all fit.
    async with actors.open_llm(tiny, max_batch=4, kv_budget=24 * 4 * 512, block_size=4) as llm:
        alone = {p: (await complete(llm, p, max_tokens=40, ignore_eos=True))[0] for p in PROMPTS}
        together = {}

        async def one(prompt, priority):
            text, _ = await complete(llm, prompt, max_tokens=40, ignore_eos=True, priority=priority)
            together[prompt] = text

        with capture_logs() as logs:
            async with trio.open_nursery() as nursery:
                for priority, prompt in enumerate(PROMPTS):
                    nursery.start_soon(one, prompt, priority)
        labels = {"model_name": llm.name}
        counted = llm.metrics.registry.get_sample_value("cadence:num_preemptions_total", labels)
    assert together == alone
    preempted = [e for e in logs if e["event"] == "preempted"]
    assert counted == llm.num_preemptions == len(preempted)
    assert preempted and all(e["cause"] == "kv_pool_full" for e in preempted)
    assert PROMPTS[0] not in {e["request_id"] for e in preempted} or len(preempted) > 3


async def test_a_lower_priority_value_is_scheduled_first(tiny):
    order = []
    async with actors.open_llm(tiny, max_batch=1) as llm:

        async def one(name, priority, max_tokens=4):
            await complete(llm, "Hello", max_tokens=max_tokens, priority=priority, ignore_eos=True)
            order.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "first", 0, 150)  # takes the only row for a while
            with trio.fail_after(30):  # a broken count fails here rather than hanging
                while llm.num_waiting or not (await llm.engine_stats()).num_open:
                    await trio.sleep(0.001)
                nursery.start_soon(one, "background", 10)
                while llm.num_waiting < 1:
                    await trio.sleep(0.001)
            nursery.start_soon(one, "urgent", -10)
    assert order == ["first", "urgent", "background"]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"max_batch": 1.5}, "max_batch"),  # was std::bad_cast from mlx
        ({"max_batch": 0}, "max_batch"),
        ({"max_context": 1.5}, "max_context"),
        ({"block_size": 0}, "block_size"),  # was ZeroDivisionError
        ({"block_size": 4096}, "block_size"),
        ({"max_waiting": 0}, "max_waiting"),  # served, and refused every request
        ({"drain_timeout": -1}, "drain_timeout"),  # failed only at exit
        ({"drain_timeout": float("nan")}, "drain_timeout"),
        ({"lookahead": True}, "lookahead"),
        ({"model": 5}, "model"),
        ({"model": ""}, "model must not be empty"),  # was "./config.json: file not found"
        ({"model": " "}, "model must not be empty"),
        ({"kv_budget": "8GiB"}, "kv_budget"),  # these two were a ValueError once loaded
        ({"kv_budget": 1.5}, "kv_budget"),
        ({"cpu_quantize": 4}, "cpu_quantize"),
        ({"prefix_cache": "no"}, "prefix_cache"),  # these were read by their truth
        ({"batch_ladder": "x"}, "batch_ladder"),
        ({"warm_up": "yes"}, "warm_up"),
        ({"offline": 1}, "offline"),
        ({"keep_dtype": None}, "keep_dtype"),
        ({"on_progress": "x"}, "on_progress"),  # a TypeError once loading began
    ],
)
async def test_a_bad_setting_is_a_cadence_error_naming_it_before_anything_loads(setting, named):
    loads = []
    with pytest.raises(CadenceError) as raised:
        async with actors.open_llm(**{"on_progress": loads.append, **setting}):
            pass
    assert named in str(raised.value) and loads == []


async def test_a_kv_budget_beyond_the_memory_there_is_says_so(tiny):
    """2**60 bytes went on to mlx: std::bad_cast or an OverflowError, from deep inside."""
    with pytest.raises(CadenceError, match="--kv-budget"):
        async with actors.open_llm(tiny, kv_budget=2**60):
            pass


def test_opening_it_under_asyncio_names_the_asyncio_bridge():
    """Trio's own error ("must be called from async context", in an async function)
    came from the MLX thread's hand-off and named no way out."""

    async def main():
        async with actors.open_llm():
            pass

    with pytest.raises(RuntimeError, match="open_llm_asyncio"):
        asyncio.run(main())


async def test_a_bad_drain_timeout_is_refused_saying_what_it_takes_and_nothing_drains(tiny):
    """One of the wrong type fell through to `timeout >= 0`: "'>=' not supported between
    instances of 'str' and 'int'", naming neither the argument nor what it takes."""
    async with actors.open_llm(tiny) as llm:
        for timeout in (-1, float("nan"), "1", True, [1]):
            with pytest.raises((TypeError, ValueError), match="drain timeout must be None or seconds"):
                await llm.drain(timeout)
        text, _ = await complete(llm, "hi", max_tokens=2)
    assert text


async def test_leaving_the_block_does_not_wait_for_an_answer_nobody_reads(tiny):
    """A generation started and then neither read nor closed kept drain, and so the
    block's exit, waiting forever, though the engine had finished it long before."""
    with trio.fail_after(20):
        async with actors.open_llm(tiny) as llm:
            generation = llm.generate("Hello", max_tokens=4, ignore_eos=True)
            await generation.start()
            await wait_for_no_open_rows(llm)
    # Nothing is lost: the whole answer is still there to read.
    text = "".join([delta.text async for delta in generation])
    assert generation.finish_reason == "length" and generation.usage.completion_tokens == 4
    assert text == (await _complete_alone(tiny, "Hello", max_tokens=4, ignore_eos=True))


async def _complete_alone(checkpoint, prompt, **kwargs):
    async with actors.open_llm(checkpoint) as llm:
        return (await complete(llm, prompt, **kwargs))[0]


async def test_cancelling_start_up_does_not_wait_for_the_kv_pool_to_fill(tiny, monkeypatch):
    """A signal while a large pool was being filled logged "stopping now" and then
    waited for the whole allocation (44 s for 12 GiB) before it stopped."""
    import actors.service

    real_engine = actors.service.Engine

    def slow_engine(*args, **kwargs):
        time.sleep(8)  # a pool that takes long to fill, on the MLX thread
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(actors.service, "Engine", slow_engine)
    started = trio.current_time()
    with trio.move_on_after(0.5):
        async with actors.open_llm(tiny):
            pass
    assert trio.current_time() - started < 4
    await actors.service.shared_mlx_thread().run(lambda: None)  # the next test's thread is free


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"prompt": 5}, "prompt"),  # was a TypeError
        ({"prompt": b"abc"}, "prompt"),  # was generated from, as if text
        ({"prompt": {"a": 1}}, "prompt"),  # failed in admission, with a logged traceback
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": "hi", "grammar": "{}"}, "grammar"),
        # a schema as a dict, not its JSON text: "could not prepare the prompt: unhashable
        # type: 'dict'" at start(), logged as a fault of the server's
        ({"prompt": "hi", "grammar": GrammarSpec("json_schema", {}, "grammar")}, "grammar"),
        ({"prompt": "hi", "grammar": GrammarSpec("choice", ["a"], "grammar")}, "grammar"),
        ({"prompt": "hi", "logit_bias": {1.5: 1.0}}, "logit_bias"),  # was token 1's
        ({"prompt": "hi", "logit_bias": [(3, 1.0), (3, -1.0)]}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": 5}, "logit_bias"),  # named no parameter (None)
        ({"prompt": "hi", "logit_bias": [(3,)]}, "logit_bias"),
        ({"messages": "hi"}, "messages"),  # was "messages[0] must be an object"
        ({"prompt": "hi", "logit_bias": {3: True}}, "logit_bias"),  # was a bias of 1
        ({"prompt": "hi", "temperature": 10**400}, "temperature"),  # was an OverflowError
        ({"prompt": "hi", "top_k": -2}, "top_k"),
    ],
)
async def test_a_bad_argument_to_generate_is_a_request_error_naming_it(tiny, arguments, named):
    async with actors.open_llm(tiny) as llm:
        with pytest.raises(RequestError) as raised:
            llm.generate(**arguments)
        assert raised.value.param == named
        # An unset stop (None, as OpenAI's clients send) is no stop, not a TypeError.
        assert (await complete(llm, "hi", stop=None, max_tokens=2, ignore_eos=True))[0]



@pytest.mark.parametrize("value", [0.5, None])  # None was dropped as "unset", unchecked
async def test_a_misspelt_sampling_argument_is_a_request_error_naming_generate_and_it(
    tiny, value
):
    """It read "SamplingParams.__init__() got an unexpected keyword argument", a class
    the caller never named."""
    async with actors.open_llm(tiny) as llm:
        with pytest.raises(RequestError) as raised:
            llm.generate("hi", temprature=value)
        message = str(raised.value)
        assert message.startswith("generate() got an unexpected keyword argument 'temprature'")
        assert "temperature" in message and "SamplingParams" not in message
        assert "\n" not in message and raised.value.param == "temprature"


async def test_sampling_arguments_mean_what_the_same_http_fields_mean(tiny):
    """top_k -1 (off over HTTP) was refused embedded, and so was None for a field (null,
    its default, over HTTP: priority and ignore_eos too); an empty stop string is no
    stop, as over HTTP."""
    async with actors.open_llm(tiny) as llm:
        plain, _ = await complete(llm, "hi", max_tokens=6)
        as_http, generation = await complete(
            llm,
            "hi",
            max_tokens=6,
            ignore_eos=None,
            priority=None,
            top_k=-1,
            temperature=None,
            top_p=None,
            logit_bias=None,
            stop="",
        )
    assert as_http == plain and generation.finish_reason == "length"


async def test_a_second_reader_of_one_generation_is_told_so(tiny):
    """It got GenerationError("the service stopped") when the first took the last delta."""
    async with actors.open_llm(tiny) as llm:
        async with llm.generate("Hello", max_tokens=16, ignore_eos=True) as generation:
            errors = []

            async def read():
                try:
                    async for _ in generation:
                        pass
                except RuntimeError as error:
                    errors.append(str(error))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                nursery.start_soon(read)
        assert errors == ["another task is already reading this generation"]
        assert generation.finish_reason == "length"  # the first reader got it all


async def test_a_prompt_past_the_models_context_is_not_blamed_on_the_kv_budget(tiny):
    """With one row the default pool holds exactly the model's context; `cadence
    generate` (which has no --kv-budget) said to raise the KV budget."""
    async with actors.open_llm(tiny, max_batch=1) as llm:
        with pytest.raises(RequestError) as raised:
            await complete(llm, "word " * (llm.max_context + 10), max_tokens=4)
    assert "maximum context length" in str(raised.value)
    assert "kv-budget" not in str(raised.value)


async def test_ignore_eos_runs_past_an_end_of_sequence_token_to_max_tokens(tiny):
    async with actors.open_llm(tiny) as llm:
        eos = min(llm._engine.eos_ids)
        forced = {"max_tokens": 6, "logit_bias": {eos: 100.0}}  # greedy: EOS every time
        _, stopped = await complete(llm, "Hello", **forced)
        _, ignored = await complete(llm, "Hello", ignore_eos=True, **forced)
    assert (stopped.finish_reason, stopped.usage.completion_tokens) == ("stop", 1)
    assert (ignored.finish_reason, ignored.usage.completion_tokens) == ("length", 6)


async def test_a_drain_timeout_of_zero_aborts_what_runs_at_the_blocks_exit(tiny):
    async with actors.open_llm(tiny, drain_timeout=0) as llm:
        generation = llm.generate("Hello", max_tokens=900, ignore_eos=True)
        await generation.start()
    with pytest.raises(actors.ServiceClosedError, match="shutting down: the request was aborted"):
        async for _ in generation:
            pass


def leaves(error):
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


async def test_the_blocks_own_error_is_raised_though_a_reader_outside_it_fails_as_it_stops(tiny):
    """A reader in an outer nursery fails as the actors stop; its failure cancelled the
    outer nursery while they wound down, and the block's own error (a Ctrl-C too) was
    lost: only "the service stopped" came out."""

    async def read(llm):
        async with llm.generate("Hi", max_tokens=900, ignore_eos=True) as generation:
            async for _ in generation:
                pass

    with pytest.raises(BaseException) as caught:
        async with trio.open_nursery() as outer, actors.open_llm(tiny) as llm:
            outer.start_soon(read, llm)
            with trio.fail_after(30):
                while llm.num_active == 0:
                    await trio.sleep(0.01)
            raise ValueError("the block's own")
    assert any(isinstance(e, ValueError) for e in leaves(caught.value)), repr(caught.value)


async def test_unset_sizes_are_the_documented_defaults(tiny):
    async with actors.open_llm(tiny) as llm:
        assert (llm.max_batch, llm.max_waiting) == (16, 64)
        assert llm.vocab_size == Tokenizer.from_dir(tiny).vocab_size


async def test_start_up_logs_the_kv_pool_and_no_line_for_what_was_not_done(tiny):
    """What an operator reads at start-up: the pool as built, and no ladder, window or
    capped-context line for a model served at its full context with none of them."""
    with capture_logs() as logs:
        async with actors.open_llm(tiny, prefix_cache=False) as llm:
            pass
    events = {e["event"]: e for e in logs}
    pool = events["kv_pool"]
    assert (pool["block_size"], pool["prefix_cache"]) == (16, False)
    assert pool["num_blocks"] > 0 and pool["bytes"] > 0 and pool["tokens"] >= llm.max_context
    assert not {"batch_ladder", "kv_windows", "context_capped_by_kv_budget"} & events.keys()


async def test_a_kv_budget_that_caps_the_context_is_warned_of(tiny):
    with capture_logs() as logs:
        async with actors.open_llm(tiny, kv_budget=24 * 4 * 512, block_size=4) as llm:
            pass
    (capped,) = [e for e in logs if e["event"] == "context_capped_by_kv_budget"]
    assert capped["log_level"] == "warning"
    assert capped["max_context"] == llm.max_context < capped["asked"] == 1024


async def test_a_windowed_model_logs_what_its_windows_save(make_checkpoint):
    with capture_logs() as logs:
        async with actors.open_llm(make_checkpoint("gemma3")) as llm:
            pass
    (windows,) = [e for e in logs if e["event"] == "kv_windows"]
    assert windows["row_tokens"] == llm.max_context
    assert 0 < windows["row_bytes"] < windows["row_bytes_all_layers_full"]
