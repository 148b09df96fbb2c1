"""Lifecycle and step events, as structlog's capture_logs sees them."""

import io
import json

from runtime.runner import Launched
from runtime.step_plan import StepPlan

import pytest
import structlog
import trio
from structlog.testing import capture_logs

from actors.gpu import GpuActor
from actors.tracing import configure_logging
from tests.actors.test_pipeline import collect

SECRET = "a prompt that must never reach the logs"


async def test_lifecycle_events_carry_the_request_id_and_timings(pipeline, autojump_clock):
    with capture_logs() as logs:
        async with pipeline() as (llm, engine), llm.generate(SECRET, max_tokens=3) as generation:
            async for _ in generation:
                pass
    mine = [e for e in logs if e.get("request_id") == generation.request_id]
    assert [e["event"] for e in mine] == ["admitted", "first_token", "finished"]
    admitted, first_token, finished = mine
    assert admitted["prompt_tokens"] > 0 and admitted["max_tokens"] == 3
    assert first_token["ttft_ms"] > 0
    assert finished["reason"] == "length" and finished["cause"] == "length"
    assert (finished["prompt_tokens"], finished["completion_tokens"]) == (
        admitted["prompt_tokens"],
        3,
    )
    assert 0 < finished["ttft_ms"] <= finished["e2e_ms"]
    steps = [e for e in logs if e["event"] == "step"]
    assert steps and all(e["log_level"] == "debug" for e in steps)
    assert {"rows", "tokens", "prefill_rows", "free_blocks", "prefix_hit_rate", "step_ms"} <= set(
        steps[0]
    )
    assert finished["cached_tokens"] == 0
    assert SECRET not in repr(logs)


async def test_an_abort_is_logged_with_its_request_id_and_cause(pipeline, autojump_clock):
    with capture_logs() as logs:
        async with pipeline(max_context=10_000) as (llm, engine):
            with trio.CancelScope() as scope:
                async with llm.generate(SECRET, max_tokens=5000) as generation:
                    async for _ in generation:
                        scope.cancel()
    (aborted,) = [e for e in logs if e["event"] == "aborted"]
    assert aborted["request_id"] == generation.request_id
    # The caller's aclose and the streamer's own notice of the closed channel race to the
    # scheduler: the first names the cause, and either is the reader leaving.
    assert aborted["cause"] in ("cancelled", "disconnected") and aborted["stage"] == "running"
    assert SECRET not in repr(logs)


TERMINAL = {"finished", "aborted", "failed", "rejected"}


@pytest.mark.parametrize("left_after", [1, 2, 3, 4, 5, 6])
async def test_a_request_left_as_its_last_token_is_computed_logs_one_end(
    pipeline, autojump_clock, left_after
):
    """The reader leaves after `left_after` of 6 tokens, while the next step (maybe the
    last, in flight under lookahead) runs: the scheduler logged `aborted` while the
    streamer logged `finished` for the same request, and /metrics counted a success."""
    with capture_logs() as logs:
        async with pipeline() as (llm, engine):
            generation = llm.generate([1], max_tokens=6)
            await generation.start()
            num_tokens = 0
            async for delta in generation:
                num_tokens += len(delta.text) > 0
                if num_tokens >= left_after:
                    break
            await generation.aclose()
            await trio.sleep(1)  # the in-flight steps report
    ends = [e["event"] for e in logs if e.get("request_id") == generation.request_id]
    assert len([e for e in ends if e in TERMINAL]) == 1, ends
    counted = [llm.metrics.success.labels(llm.metrics.model_name, r) for r in ("length", "abort")]
    assert sum(c._value.get() for c in counted) == 1  # as the log says: one end, one count


async def test_a_stop_string_ends_a_request_without_an_aborted_event(
    pipeline, demo_tokenizer, autojump_clock
):
    with capture_logs() as logs:
        async with pipeline(max_context=10_000) as (llm, engine):
            stop = demo_tokenizer.decode([engine.token] * 2)
            async with llm.generate([1], max_tokens=100, stop=stop) as generation:
                async for _ in generation:
                    pass
    assert generation.finish_reason == "stop"
    events = [e["event"] for e in logs if e.get("request_id") == generation.request_id]
    assert "finished" in events and "aborted" not in events


def test_the_cli_configuration_writes_iso_utc_json_lines():
    stream = io.StringIO()
    try:
        configure_logging("json", "info", stream)
        with structlog.contextvars.bound_contextvars(request_id="r1"):
            structlog.get_logger("cadence.test").info("finished", ttft_ms=1.5)
        structlog.get_logger("cadence.test").debug("step")  # below the level
    finally:
        structlog.reset_defaults()
    (line,) = stream.getvalue().splitlines()
    event = json.loads(line)
    assert event["event"] == "finished" and event["request_id"] == "r1"
    assert event["level"] == "info" and event["timestamp"].endswith("Z")


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_a_logged_traceback_shows_no_locals_so_no_prompt_text(log_format):
    def prepare(prompt):
        raise ValueError("the template failed")

    prompt = "tpmorp terces"[::-1]  # reversed: the traceback shows source lines, not values
    stream = io.StringIO()
    try:
        configure_logging(log_format, "info", stream)
        try:
            prepare(prompt)
        except ValueError:
            structlog.get_logger("cadence.test").exception("prepare failed")
    finally:
        structlog.reset_defaults()
    written = stream.getvalue()
    assert "the template failed" in written and "prepare" in written
    assert "secret prompt" not in written


def test_an_unknown_log_format_is_refused_not_rendered_as_console():
    try:
        with pytest.raises(ValueError, match="unknown log format 'xml'"):
            configure_logging("xml", "info", io.StringIO())
    finally:
        structlog.reset_defaults()


def reporting_gpu() -> GpuActor:
    """A GPU actor with only its reporting side: `_report` logs a step and sends it on."""
    to_streamer, _ = trio.open_memory_channel(4)
    to_scheduler, _ = trio.open_memory_channel(4)
    return GpuActor(None, None, None, to_streamer, to_scheduler)  # type: ignore[arg-type]


async def test_a_steps_time_starts_when_the_step_before_it_was_collected():
    """Under lookahead step 2 is submitted while step 1 runs: its step_ms is its own run,
    from step 1's collection, not the time it waited behind step 1."""
    gpu = reporting_gpu()
    with capture_logs() as logs:
        for step, submitted_at, collected_at in ((1, 0.0, 1.0), (2, 0.1, 1.5)):
            launched = Launched(StepPlan(step), (), (), True, submitted_at, collected_at)
            await gpu._report(launched, ())
    assert [e["step_ms"] for e in logs if e["event"] == "step"] == [1000.0, 500.0]


async def test_step_events_count_prefill_rows_cached_tokens_and_preemptions(pipeline):
    """What `cadence trace timeline` draws: prefill versus decode rows, the tokens a
    prompt took from the prefix cache, and the rows each step preempted. On the real
    clock: under autojump, virtual steps run while admission's worker thread works,
    and the decoding row could end before the repeat joins it."""
    prompt = list(range(1, 13))  # three whole blocks of 4
    with capture_logs() as logs:
        async with pipeline() as (llm, engine):
            await collect(llm.generate(prompt, max_tokens=2))
            async with llm.generate([7, 8, 9], max_tokens=30) as decoding:
                await decoding.__anext__()  # it decodes now: the repeat joins its steps
                await collect(llm.generate(prompt, max_tokens=2))
                async for _ in decoding:
                    pass
    steps = [e for e in logs if e["event"] == "step"]
    finished = [e for e in logs if e["event"] == "finished"]
    # The repeat's two blocks (its last block is computed again, for its logits).
    assert sorted(e["cached_tokens"] for e in finished) == [0, 0, 8]
    assert sum(e["cached_tokens"] for e in steps) == 8
    for e in steps:
        assert e["prefill_rows"] + e["decode_rows"] == e["rows"], e
        assert e["prefill_tokens"] + e["decode_rows"] == e["tokens"], e
    assert any(e["prefill_rows"] and e["decode_rows"] for e in steps)  # a mixed step
    assert all(e["preempted"] == 0 for e in steps)


async def test_a_step_event_counts_the_rows_its_plan_preempted():
    gpu = reporting_gpu()
    plan = StepPlan(3, preempted=("a", "b"), num_free_blocks=17, hit_rate=0.25)
    with capture_logs() as logs:
        await gpu._report(Launched(plan, (), (), True, 0.0, 1.0), ())
    (step,) = [e for e in logs if e["event"] == "step"]
    assert step["preempted"] == 2
    assert (step["free_blocks"], step["prefix_hit_rate"]) == (17, 0.25)
