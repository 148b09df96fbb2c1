"""PlanRunner: a plan's rejects, refused opens and engine errors become per-row results."""

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import PlanRunner, run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import FinishCause, SamplingParams
from runtime.step_plan import StepPlan

import attrs
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
    assert (got["huge"].tokens, got["huge"].num_cached_tokens) == ((), 0)
    assert len(got["ok"].tokens) == 4 and engine.num_open == 0


def test_a_request_the_engine_refuses_fails_alone_with_the_engines_own_reason(engine):
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(2, pool, 1024, 256, 512, 0)  # a policy that thinks rows fit 1024
    got = run_offline(engine, policy, {"long": params(range(1, 41), 4), "ok": params(PROMPT, 4)})
    assert got["long"].finish is FinishCause.ERROR
    assert got["long"].error.startswith("this model's maximum context length is 32 tokens")
    assert len(got["ok"].tokens) == 4 and engine.num_open == 0


def test_a_row_the_engine_refuses_is_left_out_of_the_steps_rows(engine):
    """The step event counts `row_ids`: a row that never opened is not in its step."""
    policy = FcfsScheduler(2, BlockPool(engine.kv.num_blocks, engine.kv.block_size), 1024, 256, 512, 0)
    policy.add("long", params(range(1, 41), 4))
    policy.add("ok", params(PROMPT, 4))
    plan = policy.schedule()
    assert {s.request_id for s in plan.spans} == {"long", "ok"}
    launched = PlanRunner(engine).launch(plan)
    assert launched.row_ids == ("ok",) and [r.request_id for r in launched.failed] == ["long"]


def test_an_unexpected_error_opening_a_row_fails_that_request_as_an_engine_error(
    engine, monkeypatch
):
    """Not a CadenceError (a bug, not a bad value): logged, and its request alone fails."""
    open_row = engine.open

    def open_failing_bad(params):
        if params.request_id == "bad":
            raise ValueError("a bug")
        return open_row(params)

    monkeypatch.setattr(engine, "open", open_failing_bad)
    requests = {"bad": params(PROMPT, 4, request_id="bad"), "ok": params(PROMPT, 4)}
    with capture_logs() as logs:
        got = run_offline(engine, policy_for(engine), requests)
    assert (got["bad"].finish, got["bad"].error) == (FinishCause.ERROR, "engine error: a bug")
    assert got["bad"].tokens == () and len(got["ok"].tokens) == 4 and engine.num_open == 0
    errors = [(e["event"], e["request_id"]) for e in logs if e["log_level"] == "error"]
    assert errors == [("open failed", "bad")]


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
    with capture_logs() as logs:
        assert_step_2_failed(engine)
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["collect failed"]


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
    with capture_logs() as logs:
        got = run_offline(StartFails(engine), policy_for(engine), {"a": params(PROMPT, 6)})["a"]
    assert got.tokens == expected and got.finish is FinishCause.LENGTH
    assert {e["event"] for e in logs if e["log_level"] == "error"} == {"start failed"}


def test_run_offline_tells_the_prompt_tokens_taken_from_the_prefix_cache(engine):
    policy, prompt = policy_for(engine), (PROMPT * 2)[:20]  # a full 16-token block and 4
    first = run_offline(engine, policy, {"a": params(prompt, 2)})["a"]
    again = run_offline(engine, policy, {"b": params(prompt, 2)})["b"]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 16)
    assert again.tokens == first.tokens


def test_run_offline_returns_one_logprob_per_token_only_to_the_rows_that_ask(engine):
    asks = attrs.evolve(params(PROMPT, 5), sampling=SamplingParams(logprobs=2))
    got = run_offline(engine, policy_for(engine), {"asks": asks, "not": params(PROMPT, 5)})
    assert len(got["asks"].logprobs) == len(got["asks"].tokens) == 5
    assert [len(lp.top) for lp in got["asks"].logprobs] == [2] * 5
    assert got["not"].logprobs == () and len(got["not"].tokens) == 5


def test_close_all_leaves_the_engine_no_open_row(engine):
    """What the GPU actor does at shutdown: every row the runner opened is closed."""
    runner = PlanRunner(engine)
    opens = tuple((rid, params(PROMPT, 4), 0) for rid in ("a", "b"))
    runner.collect(runner.launch(StepPlan(step=1, opens=opens)))
    assert engine.num_open == 2
    runner.close_all()
    assert engine.num_open == 0 and runner.rows == {}


class Watched:
    """The engine, recording how many steps are queued at each collect, and the calls."""

    def __init__(self, engine):
        self.engine, self.calls, self.queued_at_collect = engine, [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, batch):
        self.calls.append("submit")
        self.engine.submit(batch)

    def collect(self):
        self.calls.append("collect")
        self.queued_at_collect.append(self.engine.num_pending)
        return self.engine.collect()

    def start_queued(self):
        self.calls.append("start")
        self.engine.start_queued()


@pytest.mark.parametrize("lookahead", [None, 2])
def test_run_offline_reads_a_step_only_with_lookahead_steps_queued_behind_it(engine, lookahead):
    """As the GPU actor does: step N+1 (N+2 ...) is submitted before step N is read, and
    the steps held back behind a read one are started right after it (by default one)."""
    watched, plans = Watched(engine), []
    kwargs = {} if lookahead is None else {"lookahead": lookahead}
    requests = {"a": params(PROMPT, 8)}
    got = run_offline(watched, policy_for(engine), requests, on_step=plans.append, **kwargs)["a"]
    assert len(got.tokens) == 8 and got.finish is FinishCause.LENGTH
    assert [plan.step for plan in plans] == list(range(1, watched.calls.count("submit") + 1))
    depth = 1 + (lookahead or 1)  # the step read and those queued behind it
    # Until the last steps drain, each read finds `depth` steps queued.
    assert watched.queued_at_collect[:4] == [depth] * 4
    assert watched.calls[: depth + 1] == ["submit"] * depth + ["collect"]
    assert watched.calls.count("start") == watched.calls.count("collect")
    starts = [i for i, call in enumerate(watched.calls) if call == "start"]
    assert all(watched.calls[i - 1] == "collect" for i in starts)


def test_collect_stamps_when_the_step_was_read_after_it_was_submitted(engine):
    """The GPU actor's step_ms is collected_at minus when the step began."""
    runner = PlanRunner(engine)
    launched = runner.launch(StepPlan(step=1, opens=(("a", params(PROMPT, 4), 0),)))
    assert launched.collected_at == 0.0
    runner.collect(launched)
    assert launched.collected_at >= launched.submitted_at > 0


@pytest.mark.parametrize("fails", [False, True], ids=["running", "failed in the step"])
def test_a_row_aborted_after_its_step_was_queued_is_closed_and_left_out_of_that_step(
    engine, monkeypatch, fails
):
    """Its outcome in the queued step (a token, or the failure the engine found while
    building the step) is no one's by the time the step is read."""
    if fails:
        monkeypatch.setattr(engine, "_fault", (999, 0))  # a's prompt raises in its forward
    runner, policy = PlanRunner(engine), policy_for(engine)
    policy.add("a", params([*PROMPT, 999] if fails else PROMPT, 8))
    policy.add("b", params(PROMPT[:5], 8))
    first = runner.launch(policy.schedule())  # both prompts; a's and b's first tokens
    assert policy.abort("a") is not None
    second = runner.launch(policy.schedule())  # closes a, whose token is still queued
    assert second.plan.closes == ("a",) and engine.num_open == 1 and list(runner.rows) == ["b"]
    assert [r.request_id for r in runner.collect(first)] == ["b"]
    assert [r.request_id for r in runner.collect(second)] == ["b"]
    runner.close_all()


def test_a_plan_closing_a_request_that_has_no_row_closes_nothing(engine):
    """An abort of a request that never got a row, or whose row already finished."""
    runner = PlanRunner(engine)
    runner.collect(runner.launch(StepPlan(step=1, opens=(("a", params(PROMPT, 4), 0),))))
    runner.collect(runner.launch(StepPlan(step=2, closes=("never-opened",))))
    assert engine.num_open == 1 and list(runner.rows) == ["a"]
    runner.close_all()


class PlansNothing:
    """A policy with work that never plans it: a bug run_offline must not return on."""

    has_work = True

    def add(self, request_id, params):
        pass

    def schedule(self):
        return None


def test_run_offline_refuses_to_end_while_the_policy_still_has_work(engine):
    with pytest.raises(RuntimeError, match="has work but plans nothing"):
        run_offline(engine, PlansNothing(), {"a": params(PROMPT, 4)})  # type: ignore[arg-type]
