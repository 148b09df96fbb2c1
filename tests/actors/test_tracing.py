"""Lifecycle and step events, as structlog's capture_logs sees them."""

import io
import json

import structlog
import trio
from structlog.testing import capture_logs

from actors.tracing import configure_logging

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
    assert aborted["cause"] == "cancelled" and aborted["stage"] == "running"
    assert SECRET not in repr(logs)


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
