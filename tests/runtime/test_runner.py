"""PlanRunner: a plan's rejects, refused opens and engine errors become per-row results."""

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import PlanRunner, run_offline
from runtime.scheduler import FcfsScheduler, StepPlan
from runtime.sequence import FinishCause

import pytest
from structlog.testing import capture_logs

from tests.runtime.test_engine import PROMPT, params, policy_for


@pytest.fixture
def engine(make_checkpoint):
    return Engine(load_model(make_checkpoint("llama")), max_batch=2, max_context=32)


def test_a_request_the_policy_rejects_finishes_with_its_reason(engine):
    policy = policy_for(engine, num_blocks=2)  # 32 tokens of 16-token blocks
    got = run_offline(engine, policy, {"huge": params(range(1, 41), 4), "ok": params(PROMPT, 4)})
    assert got["huge"].finish is FinishCause.ERROR and "can never fit" in got["huge"].error
    assert len(got["ok"].tokens) == 4 and engine.num_open == 0


def test_a_request_the_engine_refuses_fails_alone_with_the_engines_own_reason(engine):
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(2, pool, 1024, 256, 512, 0)  # a policy that thinks rows fit 1024
    got = run_offline(engine, policy, {"long": params(range(1, 41), 4), "ok": params(PROMPT, 4)})
    assert got["long"].finish is FinishCause.ERROR
    assert got["long"].error.startswith("this model's maximum context length is 32 tokens")
    assert len(got["ok"].tokens) == 4 and engine.num_open == 0


def test_a_step_the_engine_cannot_queue_fails_its_rows_and_the_rest_go_on(engine, monkeypatch):
    submit, calls = engine.submit, []

    def submit_failing_step_2(batch):
        calls.append(batch)
        if len(calls) == 2:  # a and b's first decode step
            raise RuntimeError("boom")
        submit(batch)

    monkeypatch.setattr(engine, "submit", submit_failing_step_2)
    with capture_logs() as logs:
        assert_step_2_failed(engine)
    # Nothing was queued for it: the runner does not read the engine's queue for it.
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["submit failed"]


def test_a_step_that_fails_when_read_fails_its_rows_and_the_rest_go_on(engine, monkeypatch):
    collect, calls = engine.collect, []

    def collect_failing_step_2():
        outcomes = collect()  # the step is taken off the queue, then evaluating it raises
        calls.append(outcomes)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return outcomes

    monkeypatch.setattr(engine, "collect", collect_failing_step_2)
    assert_step_2_failed(engine)


def assert_step_2_failed(engine):
    """a and b fail with step 2 (the step's rows, not the runner); `later` then runs."""
    policy = policy_for(engine)
    requests = {"a": params(PROMPT, 6), "b": params(PROMPT[:5], 6), "later": params(PROMPT[:3], 6)}
    got = run_offline(engine, policy, requests)
    for result in (got["a"], got["b"]):
        assert (result.finish, result.error) == (FinishCause.ERROR, "engine error: boom")
        assert len(result.tokens) <= 1
    assert got["later"].finish is FinishCause.LENGTH and len(got["later"].tokens) == 6
    assert engine.num_open == 0 and policy.pool.num_used_blocks == 0


class StartFails:
    """The engine, but the runner's `start_queued` raises (its own calls inside `submit` don't)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def start_queued(self):
        raise RuntimeError("boom")


def test_a_failure_to_start_the_queued_steps_is_left_to_their_collect(engine):
    """Starting is an optimisation (Engine.defers_start): collect evaluates the step anyway."""
    expected = run_offline(engine, policy_for(engine), {"a": params(PROMPT, 6)})["a"].tokens
    got = run_offline(StartFails(engine), policy_for(engine), {"a": params(PROMPT, 6)})["a"]
    assert got.tokens == expected and got.finish is FinishCause.LENGTH


def test_run_offline_tells_the_prompt_tokens_taken_from_the_prefix_cache(engine):
    policy, prompt = policy_for(engine), (PROMPT * 2)[:20]  # a full 16-token block and 4
    first = run_offline(engine, policy, {"a": params(prompt, 2)})["a"]
    again = run_offline(engine, policy, {"b": params(prompt, 2)})["b"]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 16)
    assert again.tokens == first.tokens


def test_close_all_leaves_the_engine_no_open_row(engine):
    """What the GPU actor does at shutdown: every row the runner opened is closed."""
    runner = PlanRunner(engine)
    opens = tuple((rid, params(PROMPT, 4), 0) for rid in ("a", "b"))
    runner.collect(runner.launch(StepPlan(step=1, opens=opens)))
    assert engine.num_open == 2
    runner.close_all()
    assert engine.num_open == 0 and runner.rows == {}
