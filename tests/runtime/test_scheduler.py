"""The FCFS continuous-batching policy, driven by hand: no trio, no engine."""

from runtime.scheduler import FcfsScheduler
from runtime.sequence import PrefillPiece, SequenceParams

import pytest


def params(num_prompt_tokens: int, max_tokens: int = 8) -> SequenceParams:
    return SequenceParams(
        prompt_tokens=tuple(range(1, num_prompt_tokens + 1)), max_tokens=max_tokens
    )


def test_nothing_to_do_means_no_plan():
    policy = FcfsScheduler(max_batch=2)
    assert not policy.has_work
    assert policy.schedule() is None


def test_short_prompt_prefills_and_decodes_in_its_first_step():
    policy = FcfsScheduler(max_batch=2)
    policy.add("a", params(5))
    plan = policy.schedule()
    assert plan.opens == (("a", params(5)),)
    # Pieces run before the decode forward, so the first token comes in the same step.
    assert plan.prefill == (("a", PrefillPiece(0, 4)),)
    assert plan.decode == ("a",)
    later = policy.schedule()
    assert later.opens == () and later.prefill == () and later.decode == ("a",)


def test_one_token_prompt_needs_no_prefill():
    policy = FcfsScheduler(max_batch=1)
    policy.add("a", params(1))
    plan = policy.schedule()
    assert plan.prefill == () and plan.decode == ("a",)


def test_admits_in_arrival_order_up_to_max_batch():
    policy = FcfsScheduler(max_batch=2)
    for request_id in "abc":
        policy.add(request_id, params(1))
    plan = policy.schedule()
    assert [r for r, _ in plan.opens] == ["a", "b"]
    assert policy.num_waiting == 1
    policy.finish("a")  # a free row is taken at the next step
    plan = policy.schedule()
    assert [r for r, _ in plan.opens] == ["c"]
    assert plan.decode == ("b", "c")


def test_long_prompts_are_chunked_within_the_step_budget():
    policy = FcfsScheduler(max_batch=4, prefill_chunk=4, max_prefill_tokens=6)
    policy.add("long", params(11))  # 10 tokens to prefill
    policy.add("short", params(4))  # 3 tokens to prefill
    policy.add("decoding", params(1))
    pieces = []
    for _ in range(4):
        plan = policy.schedule()
        assert plan.num_prefill_tokens <= 6
        assert "decoding" in plan.decode  # a long prompt never stalls decoding rows
        pieces.append(plan.prefill)
    assert pieces[0] == (("long", PrefillPiece(0, 4)), ("short", PrefillPiece(0, 2)))
    assert pieces[1] == (("long", PrefillPiece(4, 4)), ("short", PrefillPiece(2, 1)))
    assert pieces[2] == (("long", PrefillPiece(8, 2)),)
    assert pieces[3] == ()


def test_a_row_decodes_only_once_its_prompt_is_in():
    policy = FcfsScheduler(max_batch=1, prefill_chunk=3, max_prefill_tokens=3)
    policy.add("a", params(8))  # 7 to prefill: 3 + 3 + 1
    decodes = [policy.schedule().decode for _ in range(3)]
    assert decodes == [(), (), ("a",)]


def test_abort_while_waiting_and_while_running_reports_closes_once():
    policy = FcfsScheduler(max_batch=1)
    policy.add("running", params(1))
    policy.add("waiting", params(1))
    policy.schedule()
    assert policy.abort("waiting") == "waiting"
    assert policy.abort("running") == "running"
    assert policy.abort("running") is None  # idempotent
    assert policy.abort("unknown") is None
    plan = policy.schedule()
    assert plan.closes == ("waiting", "running")
    assert plan.decode == () and plan.opens == ()
    assert policy.schedule() is None


def test_abort_mid_prefill_stops_further_pieces():
    policy = FcfsScheduler(max_batch=1, prefill_chunk=2, max_prefill_tokens=2)
    policy.add("a", params(10))
    assert policy.schedule().prefill == (("a", PrefillPiece(0, 2)),)
    policy.abort("a")
    plan = policy.schedule()
    assert plan.closes == ("a",) and plan.prefill == ()


def test_finish_frees_the_row_without_a_close():
    policy = FcfsScheduler(max_batch=1)
    policy.add("a", params(1))
    policy.schedule()
    policy.finish("a")  # the GPU actor closes finished rows itself
    assert not policy.has_work


def test_duplicate_ids_are_refused():
    policy = FcfsScheduler(max_batch=1)
    policy.add("a", params(1))
    with pytest.raises(ValueError, match="already scheduled"):
        policy.add("a", params(1))


def test_steps_are_numbered():
    policy = FcfsScheduler(max_batch=1)
    policy.add("a", params(1))
    assert [policy.schedule().step for _ in range(3)] == [1, 2, 3]
