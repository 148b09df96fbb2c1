"""A forward that raises is retried in halves: only the rows at fault fail, the rest keep
their greedy tokens; the retries are bounded; the CADENCE_FAULT_TOKEN hook drives it."""

from runtime.checkpoint import load_model
from runtime.engine import FAULT_ENV, Engine, _fault_from_env
from runtime.errors import CadenceError
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import FinishCause, SequenceParams

import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

FAULT_TOKEN = 999
PROMPT = [11, 305, 42, 977, 5, 1203, 64, 88, 300, 7, 1500, 19]
HEALTHY = {
    "a": PROMPT,
    "b": PROMPT[:3],
    "c": [7, 8, 9, 10, 11, 12, 13, 14],
    "d": [900, 5, 6],
}
FAULTY = [21, FAULT_TOKEN, 33, 44, 55]


def policy_for(engine):
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    return FcfsScheduler(engine.max_batch, pool, engine.max_context, 256, 512, 0)


def requests(prompts, max_tokens=12):
    return {
        rid: SequenceParams(tuple(p), max_tokens=max_tokens, ignore_eos=True, request_id=rid)
        for rid, p in prompts.items()
    }


def run(engine, prompts, lookahead=1):
    policy = policy_for(engine)
    got = run_offline(engine, policy, requests(prompts), lookahead=lookahead)
    assert policy.pool.num_used_blocks == 0 and engine.num_open == 0
    return got


@pytest.mark.parametrize(("fault", "lookahead"), [("", 1), (":0", 2), (":3", 1), (":3", 2)])
def test_an_injected_fault_fails_its_row_alone(make_checkpoint, monkeypatch, fault, lookahead):
    """K=0 fails the row in its (batched) prefill, K=3 in a decode step beside four rows."""
    monkeypatch.setenv(FAULT_ENV, f"{FAULT_TOKEN}{fault}")
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=5)
    alone = run(engine, HEALTHY, lookahead)
    with capture_logs() as logs:
        got = run(engine, {**HEALTHY, "faulty": FAULTY}, lookahead)
    assert got["faulty"].finish is FinishCause.ERROR
    assert got["faulty"].error.startswith("InjectedFault: ")
    # Its samples still queued when it failed are dropped, as any past a finish.
    assert len(got["faulty"].tokens) == max(int(fault.lstrip(":") or 0) - lookahead, 0)
    for rid in HEALTHY:
        assert got[rid].tokens == alone[rid].tokens and got[rid].finish is FinishCause.LENGTH, rid
    retries = [e for e in logs if e["event"] == "forward failed, retrying in halves"]
    assert retries and retries[0]["num_spans"] == 5  # it was the batched forward that raised
    isolated = [e for e in logs if e["event"] == "row failed alone in the forward"]
    assert [e["request_id"] for e in isolated] == ["faulty"]


def test_a_model_error_mid_forward_fails_only_its_row(make_checkpoint, monkeypatch):
    """The model raises after every layer queued its K/V writes: the retries rewrite them."""
    engine = Engine(load_model(make_checkpoint("qwen3", head_dim=32)), max_batch=5, block_size=4)
    alone = run(engine, HEALTHY)
    hidden, forward = type(engine.model).hidden, engine.kv.forward
    seen = []

    def recording_forward(spans, epoch, *recurrent):
        seen[:] = [engine._rows[s.seq_id] for s in spans]
        return forward(spans, epoch, *recurrent)

    def failing_hidden(model, tokens, kv=None, keep=None):
        h = hidden(model, tokens, kv, keep)
        if any(r.params.request_id == "faulty" and r.num_generated >= 2 for r in seen):
            raise ValueError("model blew up")
        return h

    monkeypatch.setattr(engine.kv, "forward", recording_forward)
    monkeypatch.setattr(type(engine.model), "hidden", failing_hidden)
    got = run(engine, {"faulty": FAULTY, **HEALTHY})
    faulty = got["faulty"]
    assert (faulty.finish, faulty.error) == (FinishCause.ERROR, "ValueError: model blew up")
    assert len(faulty.tokens) == 2
    for rid in HEALTHY:
        assert got[rid].tokens == alone[rid].tokens and got[rid].finish is FinishCause.LENGTH, rid


def test_a_forward_that_always_raises_fails_every_row_after_bounded_retries(
    make_checkpoint, monkeypatch
):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=5)
    calls = []

    def broken_hidden(model, tokens, kv=None, keep=None):
        calls.append(tokens.shape[1])
        raise RuntimeError("broken")

    monkeypatch.setattr(type(engine.model), "hidden", broken_hidden)
    got = run(engine, {**HEALTHY, "e": FAULTY})
    assert {(r.finish, r.error, r.tokens) for r in got.values()} == {
        (FinishCause.ERROR, "RuntimeError: broken", ())
    }
    assert len(calls) == 2 * 5 - 1  # one step of 5 spans: every node of the bisection, once


def test_the_hook_is_inert_when_unset(make_checkpoint, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=5)

    def never(self, plan):
        raise AssertionError("the fault hook ran with CADENCE_FAULT_TOKEN unset")

    monkeypatch.setattr(Engine, "_inject_fault", never)
    got = run(engine, {**HEALTHY, "faulty": FAULTY})
    assert all(r.finish is FinishCause.LENGTH and len(r.tokens) == 12 for r in got.values())


@pytest.mark.parametrize(("value", "fault"), [("999", (999, 0)), (" 999:3 ", (999, 3)), ("", None)])
def test_the_hook_value_names_a_token_and_the_samples_it_faults_at(monkeypatch, value, fault):
    """N alone faults the row's prefill (K = 0)."""
    monkeypatch.setenv(FAULT_ENV, value)
    assert _fault_from_env() == fault


def test_a_malformed_hook_value_is_a_start_up_error(make_checkpoint, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "999:x")
    with pytest.raises(CadenceError, match=FAULT_ENV):
        Engine(load_model(make_checkpoint("llama")), max_batch=1)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_row_failed_mid_prompt_is_left_out_of_the_steps_queued_behind_it(
    make_checkpoint, monkeypatch, lookahead
):
    """Its next prompt chunks were planned before its failure was read: they are dropped,
    not run (and failed) again."""
    monkeypatch.setenv(FAULT_ENV, str(FAULT_TOKEN))
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=2)
    policy = FcfsScheduler(2, BlockPool(engine.kv.num_blocks, engine.kv.block_size), 1024, 8, 10, 0)
    with capture_logs() as logs:
        got = run_offline(engine, policy, requests({"faulty": FAULTY * 8, "a": PROMPT}), lookahead=lookahead)
    assert got["faulty"].finish is FinishCause.ERROR and got["a"].finish is FinishCause.LENGTH
    isolated = [e for e in logs if e["event"] == "row failed alone in the forward"]
    assert [e["request_id"] for e in isolated] == ["faulty"]


@pytest.mark.parametrize("path", ["fast", "gather"])
def test_a_row_whose_kv_overflows_fails_alone_and_leaves_nothing_in_its_blocks(
    make_checkpoint, monkeypatch, path
):
    """An inf embedding stands in for an fp16 overflow: its row fails with non-finite
    logits, and its K/V stay in its blocks. The fast path reads whole blocks, masked
    slots too, and a masked score times a NaN is NaN. It padded block tables with block
    0, so a failing row holding block 0 failed the shorter rows beside it; and it read
    the unwritten tails of blocks, so the rows given a failed row's blocks failed next."""
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    loaded = load_model(make_checkpoint("llama"))
    embed = loaded.model.model.embed_tokens
    weight = np.array(embed.weight)
    weight[FAULT_TOKEN] = np.inf
    embed.weight = mx.array(weight)
    engine = Engine(loaded, max_batch=6, block_size=16)
    healthy = {**HEALTHY, "long": list(range(200, 240))}  # three blocks: the rest are padded
    alone = run(engine, healthy)
    # The shortest prompt's blocks are taken first: it holds block 0.
    beside = run(engine, {"overflowing": [FAULT_TOKEN, 7], **healthy})
    # The longest prompt's are taken last; each run's pool gives blocks from 0 on, so the
    # next run's rows get them.
    last = run(engine, {"overflowing": [FAULT_TOKEN, *range(100, 160)], **HEALTHY})
    after = run(engine, healthy)
    for got in beside, last:
        assert got["overflowing"].finish is FinishCause.ERROR
        assert "non-finite" in got["overflowing"].error
    for rid in healthy:
        assert beside[rid].tokens == alone[rid].tokens == after[rid].tokens, rid
        assert beside[rid].finish is after[rid].finish is FinishCause.LENGTH, rid
    assert all(last[rid].tokens == alone[rid].tokens for rid in HEALTHY)
