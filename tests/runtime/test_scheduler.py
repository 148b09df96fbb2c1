"""The policy over a block pool, driven by hand: no trio, no engine."""

import random

from runtime.errors import CadenceError
from runtime.kv.blocks import BlockPool
from runtime.kv.layout import KVLayout
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

import pytest


def params(
    num_prompt_tokens: int, max_tokens: int | None = 8, first: int = 1, priority: int = 0
) -> SequenceParams:
    return SequenceParams(
        prompt_tokens=tuple(range(first, first + num_prompt_tokens)),
        max_tokens=max_tokens,
        priority=priority,
    )


def policy(
    max_batch=2, num_blocks=64, block_size=4, max_context=256, chunk=256, budget=512, solo=0
):
    """`budget` None: the policy's default."""
    pool = BlockPool(num_blocks, block_size)
    if budget is None:
        return FcfsScheduler(max_batch, pool, max_context, chunk, solo_prefill_tokens=solo)
    return FcfsScheduler(max_batch, pool, max_context, chunk, budget, solo)


def spans(plan):
    return [(s.request_id, s.start, s.num_new) for s in plan.spans]


def done(p, plan, tokens=None, finished=()):
    """Report `plan` done: each span that sampled yields `tokens[id]` (default 7), and
    finishes its request when named in `finished` or at its max_tokens."""
    results = []
    for s in plan.spans:
        request = p.running.get(s.request_id)
        if not s.samples or request is None:
            continue
        num_generated = len(request.tokens) - len(request.params.prompt_tokens) + 1
        is_last = num_generated >= (request.params.max_tokens or 10**9)
        token = (tokens or {}).get(s.request_id, 7)
        results.append((s.request_id, token, s.request_id in finished or is_last, False))
    p.on_step_done(plan.step, results)


def test_nothing_to_do_means_no_plan():
    p = policy()
    assert not p.has_work
    assert p.schedule() is None


def test_a_request_not_yet_scheduled_is_work():
    p = policy()
    p.add("a", params(3))
    assert p.has_work and not p.running


def test_a_short_prompt_prefills_and_samples_in_its_first_step():
    p = policy()
    p.add("a", params(5))
    plan = p.schedule()
    assert plan.opens == (("a", params(5), 0),)
    assert spans(plan) == [("a", 0, 5)]  # reaches the newest token: it samples
    assert plan.spans[0].blocks == (p.running["a"].blocks[0], p.running["a"].blocks[1])
    later = p.schedule()
    assert later.opens == () and spans(later) == [("a", 5, 1)]


def test_admits_in_arrival_order_up_to_max_batch():
    p = policy(max_batch=2)
    for name in "abc":
        p.add(name, params(3))
    plan = p.schedule()
    assert [o[0] for o in plan.opens] == ["a", "b"]
    assert p.num_waiting == 1
    done(p, plan, finished={"a"})
    assert [o[0] for o in p.schedule().opens] == ["c"]


def test_long_prompts_are_chunked_within_the_step_budget_beside_decoding_rows():
    p = policy(max_batch=3, chunk=6, budget=10)
    p.add("short", params(2))
    p.add("long", params(20))
    plan = p.schedule()
    assert spans(plan) == [("short", 0, 2), ("long", 0, 6)]
    plan = p.schedule()
    assert spans(plan) == [("short", 2, 1), ("long", 6, 6)]  # decode beside a chunk
    plan = p.schedule()
    assert spans(plan) == [("short", 3, 1), ("long", 12, 6)]
    plan = p.schedule()
    assert spans(plan) == [("short", 4, 1), ("long", 18, 2)]  # the last chunk samples
    assert p.running["long"].num_samples == 1


def test_with_no_row_decoding_a_step_takes_the_larger_solo_budget():
    p = policy(max_batch=3, chunk=6, budget=10, solo=16)
    p.add("long", params(40))
    assert spans(p.schedule()) == [("long", 0, 16)]  # nobody decodes: nobody to stall
    p.add("short", params(2))
    # Still nobody decoding; the prompt with fewer tokens left goes first.
    assert spans(p.schedule()) == [("short", 0, 2), ("long", 16, 14)]
    assert spans(p.schedule()) == [("short", 2, 1), ("long", 30, 6)]  # a row decodes: 6s
    p.add("x", params(12, first=100))  # no prefix in common with long
    # long has 4 tokens left, x 12: long's last chunk, then x's from what is left.
    assert spans(p.schedule()) == [("short", 3, 1), ("long", 36, 4), ("x", 0, 5)]


def test_a_short_prompt_behind_a_long_one_gets_its_first_token_within_two_steps():
    """... and equal prompts finish one by one, not all late together."""
    p = policy(max_batch=2, chunk=16, budget=18)
    p.add("long", params(400))
    p.schedule()
    p.add("short", params(8))
    first_token_step = next(
        i
        for i in range(1, 10)
        if any(s.request_id == "short" and s.samples for s in p.schedule().spans)
    )
    assert first_token_step <= 2  # FCFS would make it wait the long prompt's 25 chunks


def test_the_budget_is_shared_oldest_first():
    p = policy(max_batch=3, chunk=8, budget=10)
    p.add("a", params(9))
    p.add("b", params(9, first=100))  # unrelated prompts: neither waits for the other's blocks
    assert spans(p.schedule()) == [("a", 0, 8), ("b", 0, 2)]


def test_no_span_samples_past_max_tokens_or_the_context_bound():
    p = policy(max_context=12)
    p.add("capped", params(4, max_tokens=2))
    p.add("context", params(9, max_tokens=None, first=100))
    plans = [p.schedule() for _ in range(6)]
    capped = [s for plan in plans if plan for s in plan.spans if s.request_id == "capped"]
    context = [s for plan in plans if plan for s in plan.spans if s.request_id == "context"]
    assert [(s.start, s.num_new) for s in capped] == [(0, 4), (4, 1)]  # 2 samples
    assert max(s.start + s.num_new for s in context) == 11  # samples the 12th token, no more
    assert p.running["context"].num_samples == 3


def test_abort_while_waiting_and_while_running_reports_closes_once_and_frees_blocks():
    p = policy(max_batch=1)
    p.add("a", params(3))
    p.add("b", params(3))
    p.schedule()
    assert p.pool.num_used_blocks == 1
    assert p.abort("b") == "waiting"
    assert p.abort("a") == "running"
    assert p.abort("a") is None
    assert p.pool.num_used_blocks == 0
    plan = p.schedule()
    assert sorted(plan.closes) == ["a", "b"] and plan.spans == ()
    assert p.schedule() is None


def test_finish_frees_the_row_and_its_blocks():
    p = policy()
    p.add("a", params(3, max_tokens=1))
    plan = p.schedule()
    assert p.schedule() is None  # its one token is planned: nothing more to do
    done(p, plan, finished={"a"})
    assert not p.has_work and p.pool.num_used_blocks == 0


def test_full_blocks_are_published_once_computed_and_a_later_prompt_hits_them():
    p = policy(max_batch=2, block_size=4)
    p.add("a", params(10, max_tokens=4))
    plan = p.schedule()
    assert p.pool.by_hash == {}  # not computed yet: nothing to hit
    done(p, plan)
    assert len(p.pool.by_hash) == 2  # positions 0-7: two full blocks of known tokens
    p.add("b", params(13))  # shares a's first 10 tokens
    plan = p.schedule()
    assert plan.opens == (("b", params(13), 8),)
    assert spans(plan)[-1] == ("b", 8, 5)
    assert p.running["b"].blocks[:2] == p.running["a"].blocks[:2]
    assert p.pool.refcount[p.running["a"].blocks[0]] == 2


def test_admission_counts_only_the_blocks_a_cache_hit_does_not_already_hold():
    p = policy(max_batch=3, num_blocks=10, block_size=4)
    p.add("long", params(4, max_tokens=100, first=500))
    p.add("a", params(16, max_tokens=1))
    done(p, p.schedule())  # a's four full blocks are cached and free; long holds two
    assert "a" not in p.running and len(p.pool.cached) == 4
    # c needs 6 blocks. Its 4 hits are cached blocks it takes as they are, leaving 4 of
    # the 8 free or cached ones; it needs 2 of those (and long 1 to grow): it fits.
    p.add("c", params(20))
    plan = p.schedule()
    assert plan.opens == (("c", params(20), 16),) and "long" in p.running
    assert spans(plan)[-1] == ("c", 16, 4)


def test_a_failed_rows_blocks_are_never_offered_to_the_cache():
    p = policy(block_size=4)
    p.add("a", params(10, max_tokens=4))
    plan = p.schedule()
    p.on_step_done(plan.step, [("a", None, True, False)])  # its step failed: K/V may be garbage
    assert p.pool.by_hash == {} and p.pool.num_used_blocks == 0
    p.add("b", params(10))
    assert p.schedule().opens[0][2] == 0


def test_a_hit_always_leaves_the_last_token_to_compute():
    p = policy(block_size=4)
    p.add("a", params(8, max_tokens=1))
    plan = p.schedule()
    done(p, plan, finished={"a"})
    p.add("b", params(8))  # the same 8 tokens: two full cached blocks
    plan = p.schedule()
    assert plan.opens[0][2] == 4 and spans(plan) == [("b", 4, 4)]


def test_generated_tokens_are_published_too():
    p = policy(block_size=4)
    p.add("a", params(3, max_tokens=8))
    for _ in range(3):
        done(p, p.schedule(), tokens={"a": 50})
    # prompt 1, 2, 3 + generated 50, 50, 50; K/V computed for positions 0-4: block 0 full
    assert len(p.pool.by_hash) == 1
    done(p, p.schedule(), tokens={"a": 50})
    p.add("b", SequenceParams(prompt_tokens=(1, 2, 3, 50, 50, 50, 50, 9, 9), max_tokens=2))
    assert p.schedule().opens[0][2] == 8 - 4  # block 0 was published; block 1 not yet full


def test_a_generated_block_is_cached_under_everything_before_it():
    """Its hash chains on the prompt's blocks: a prompt that merely starts with the same
    tokens has different K/V (other positions, another past) and must not hit it."""
    p = policy(block_size=4)
    p.add("a", params(4, max_tokens=6))  # prompt 1-4: one full block
    for _ in range(6):
        done(p, p.schedule(), tokens={"a": 50})
    assert len(p.pool.by_hash) == 2  # 1-4, then 50 x 4 after it
    p.add("b", SequenceParams(prompt_tokens=(50, 50, 50, 50, 9), max_tokens=1))
    assert p.schedule().opens[0][2] == 0
    p.add("c", SequenceParams(prompt_tokens=(1, 2, 3, 4, 50, 50, 50, 50, 9), max_tokens=1))
    assert p.schedule().opens[0][2] == 8


def test_without_blocks_a_request_waits_and_is_admitted_when_blocks_free():
    p = policy(max_batch=4, num_blocks=4, block_size=4)
    p.add("a", params(9, max_tokens=2))  # 3 blocks with its first sample
    p.add("b", params(6, max_tokens=2))
    plan = p.schedule()
    assert [o[0] for o in plan.opens] == ["a"]
    done(p, plan)
    done(p, p.schedule(), finished={"a"})
    assert [o[0] for o in p.schedule().opens] == ["b"]


def test_a_request_that_does_not_fit_yet_holds_back_the_smaller_ones_behind_it():
    """Admission goes by rank and stops at the first that does not fit: letting the
    smaller ones behind it in would starve a large request for ever."""
    p = policy(max_batch=4, num_blocks=6, block_size=4)
    p.add("a", params(9, max_tokens=2))  # 3 blocks with its first sample
    done(p, p.schedule())
    p.add("big", params(13, first=50))  # 4 blocks: 3 are free
    p.add("small", params(2, first=90))  # 1 block
    plan = p.schedule()
    assert plan.opens == () and [r.request_id for r in p.waiting] == ["big", "small"]
    done(p, plan, finished={"a"})
    assert [o[0] for o in p.schedule().opens] == ["big", "small"]


def test_the_default_budget_leaves_a_whole_chunk_beside_every_decoding_row():
    p = policy(max_batch=4, chunk=8, budget=None)
    assert p.max_num_batched_tokens == 4 + 8
    for name in "abc":
        p.add(name, params(2, max_tokens=20, first=ord(name)))
    done(p, p.schedule())
    p.add("long", params(40, first=200))
    plan = p.schedule()
    assert spans(plan)[-1] == ("long", 0, 8) and len(plan.spans) == 4


@pytest.mark.parametrize(("max_batch", "chunk"), [(0, 8), (2, 0), (-1, 8)])
def test_a_row_cap_or_chunk_below_one_is_refused(max_batch, chunk):
    with pytest.raises(CadenceError, match="must be positive"):
        policy(max_batch=max_batch, chunk=chunk, budget=None)


def test_when_no_row_can_grow_and_nothing_is_in_flight_the_newest_is_preempted():
    p = policy(max_batch=2, num_blocks=3, block_size=4, max_context=12)
    p.add("a", params(3, max_tokens=9))  # 12 tokens: the whole pool, alone
    p.add("b", params(3, max_tokens=9, first=50))
    plan = p.schedule()
    assert [o[0] for o in plan.opens] == ["a", "b"]
    seen_b_requeued = False
    for _ in range(60):
        if plan is None:
            break
        done(p, plan)
        p.pool.check()
        seen_b_requeued |= any(r.request_id == "b" and r.is_open for r in p.waiting)
        plan = p.schedule()
    assert not p.has_work and p.pool.num_used_blocks == 0
    assert p.num_preemptions >= 1 and seen_b_requeued
    assert p.num_steps < 60


def test_the_prefix_cache_counts_each_prompts_first_lookup_not_a_resumptions():
    """cadence:prefix_cache_queries is prompt tokens looked up: a preempted row's
    resumption (prompt and output again) counted as more prompts, and skewed the rate."""
    p = policy(max_batch=2, num_blocks=6, block_size=4, max_context=16)
    p.add("a", params(9, max_tokens=7))  # 2 full blocks before the last token, each
    p.add("b", params(9, max_tokens=7, first=50))
    for _, _plan in planned_steps(p, check_pool=True):
        pass
    assert p.num_preemptions >= 1 and not p.has_work
    assert p.pool.num_lookup_blocks == 2 + 2
    assert p.pool.num_query_tokens == 9 + 9  # every prompt token, as vLLM counts queries


def test_a_preempted_request_resumes_by_prefilling_prompt_and_generated_tokens():
    p = policy(max_batch=2, num_blocks=3, block_size=4, max_context=12)
    p.add("a", params(3, max_tokens=9))
    p.add("b", params(3, max_tokens=9, first=50))
    plan = p.schedule()
    while p.num_preemptions == 0:
        done(p, plan, tokens={"b": 60})
        plan = p.schedule()
    b = p.waiting[0]
    assert b.num_computed == 0 and b.tokens[3:] == [60] * b.num_samples
    while not any(s.request_id == "b" for s in (plan.spans if plan else ())):
        done(p, plan)
        plan = p.schedule()
    (span,) = [s for s in plan.spans if s.request_id == "b"]
    assert span.start == 0 and span.num_new == len(b.tokens) and span.samples


def test_a_request_that_can_never_fit_the_pool_is_rejected_not_left_waiting():
    p = policy(num_blocks=4, block_size=4)
    p.add("huge", params(16))  # 16 tokens and its first sample need 5 blocks
    p.add("fits", params(3))
    plan = p.schedule()
    assert [rid for rid, _ in plan.rejects] == ["huge"] and "never fit" in plan.rejects[0][1]
    assert [o[0] for o in plan.opens] == ["fits"]
    assert p.schedule().rejects == ()


def test_duplicate_ids_are_refused():
    p = policy()
    p.add("a", params(3))
    with pytest.raises(ValueError):
        p.add("a", params(3))


def test_steps_are_numbered():
    p = policy()
    p.add("a", params(3, max_tokens=100))
    assert [p.schedule().step for _ in range(3)] == [1, 2, 3]


def decoding_rows(p):
    """Rows that have sampled, are not at their bounds, and whose K/V is caught up."""
    return {
        rid
        for rid, r in p.running.items()
        if not r.is_prefilling and r.num_samples < (r.params.max_tokens or 10**9)
    }


def planned_steps(p, *, check_pool=False, max_steps=2000):
    """(decoding rows before the plan, the plan) for each step until the policy is idle;
    each step is done after the caller's checks (and the pool checked, if asked)."""
    for _ in range(max_steps):
        decoding = decoding_rows(p)
        if (plan := p.schedule()) is None:
            return
        yield decoding, plan
        done(p, plan)
        if check_pool:
            p.pool.check()


def test_the_token_budget_and_the_row_cap_hold_and_decoding_rows_are_never_skipped():
    rng = random.Random(7)
    p = policy(max_batch=5, num_blocks=400, chunk=12, budget=20, solo=32)
    for i in range(30):
        p.add(f"r{i}", params(rng.randrange(1, 90), max_tokens=rng.randrange(1, 12), first=i * 7))
    for decoding, plan in planned_steps(p):
        rows = [s.request_id for s in plan.spans]
        prefill = [s for s in plan.spans if s.request_id not in decoding]
        assert plan.num_tokens <= (20 if decoding else 32)
        assert len(set(rows)) == len(rows) <= 5
        assert all(s.num_new <= (12 if decoding else 32) for s in prefill)
        assert decoding <= set(rows)  # every decoding row, every step, prompts or not
    assert not p.has_work


def test_decoding_rows_come_first_and_prompt_chunks_fill_what_the_budget_leaves():
    p = policy(max_batch=4, chunk=16, budget=10)
    for name in ("a", "b", "c"):
        p.add(name, params(2, max_tokens=50, first=ord(name)))
    done(p, p.schedule())  # all three prefill and sample
    p.add("long", params(40))
    for _ in range(5):
        plan = p.schedule()
        assert spans(plan)[:3] == [(n, p.running[n].num_computed - 1, 1) for n in "abc"]
        assert spans(plan)[3][0] == "long" and spans(plan)[3][2] == 10 - 3
        done(p, plan)


def test_lower_priority_values_are_admitted_first_then_first_come_first_served():
    p = policy(max_batch=1)
    p.add("late-low", params(2, max_tokens=1, priority=5))
    p.add("urgent", params(2, max_tokens=1, priority=-1))
    p.add("normal-1", params(2, max_tokens=1))
    p.add("normal-2", params(2, max_tokens=1))
    order = []
    while (plan := p.schedule()) is not None:
        order += [o[0] for o in plan.opens]
        done(p, plan)
    assert order == ["urgent", "normal-1", "normal-2", "late-low"]


def test_among_running_prompts_priority_orders_the_chunks_before_tokens_left():
    p = policy(max_batch=2, chunk=8, budget=10)
    p.add("short-background", params(9, priority=5))
    p.add("long-urgent", params(40, first=100, priority=-1))
    # Both are admitted; the urgent prompt takes the chunk although it has more left.
    assert spans(p.schedule()) == [("long-urgent", 0, 8), ("short-background", 0, 2)]


def test_preemption_takes_the_lowest_priority_then_the_newest_and_readmits_it():
    p = policy(max_batch=3, num_blocks=6, block_size=4, max_context=24)
    p.add("old", params(3, max_tokens=20, priority=0))
    p.add("background", params(3, max_tokens=20, first=40, priority=9))
    p.add("new", params(3, max_tokens=20, first=80, priority=0))
    plan = p.schedule()
    assert [o[0] for o in plan.opens] == ["old", "new", "background"]
    victims = []
    for _ in range(200):
        if plan is None:
            break
        victims += plan.preempted
        done(p, plan)
        p.pool.check()
        plan = p.schedule()
    assert victims[0] == "background" and "old" not in victims
    assert p.num_preemptions == len(victims)
    assert not p.has_work and p.pool.num_used_blocks == 0  # everyone finished


def test_a_budget_below_the_row_cap_is_refused():
    with pytest.raises(CadenceError, match="max_num_batched_tokens"):
        policy(max_batch=8, budget=4)


def test_equal_prompts_finish_their_prefill_one_by_one_in_arrival_order():
    p = policy(max_batch=3, chunk=16, budget=19)
    for name in "abc":
        p.add(name, params(32, first=ord(name)))
    first_samples = []
    while len(first_samples) < 3:
        plan = p.schedule()
        first_samples += [s.request_id for s in plan.spans if s.samples and s.num_new > 1]
        done(p, plan)
    assert first_samples == ["a", "b", "c"] and p.num_steps <= 6


def test_a_prefill_chunk_below_one_is_refused():
    with pytest.raises(CadenceError, match="prefill_chunk"):
        policy(chunk=0)


def test_a_budget_of_exactly_one_token_per_row_is_accepted():
    p = policy(max_batch=4, chunk=2, budget=4)
    p.add("a", params(2))
    assert spans(p.schedule()) == [("a", 0, 2)] and p.max_num_batched_tokens == 4


def test_a_decoding_row_that_cannot_grow_is_preempted_never_skipped_in_a_tight_pool():
    rng = random.Random(3)
    p = policy(max_batch=4, num_blocks=12, block_size=4, max_context=48, chunk=6, budget=10, solo=16)
    for i in range(12):
        p.add(f"r{i}", params(rng.randrange(1, 20), max_tokens=rng.randrange(4, 24), first=i * 50))
    for decoding, plan in planned_steps(p, check_pool=True):
        assert decoding - set(plan.preempted) <= {s.request_id for s in plan.spans}
    assert not p.has_work and p.num_preemptions > 0


def test_a_row_that_cannot_grow_waits_for_the_queued_steps_before_anyone_is_preempted():
    """Lookahead's queued steps keep their blocks: preemption waits until they are done."""
    p = policy(max_batch=2, num_blocks=3, block_size=4, max_context=12)
    p.add("a", params(3, max_tokens=9))
    p.add("b", params(3, max_tokens=9, first=50))
    queued = []
    while (plan := p.schedule()) is not None:  # plan ahead without any step reported done
        queued.append(plan)
    assert len(queued) == 2 and p.num_preemptions == 0 and set(p.running) == {"a", "b"}
    for plan in queued:
        done(p, plan)
    assert p.schedule().preempted == ("b",)


def test_aborting_a_preempted_request_reports_it_as_running_and_closes_its_row():
    """It left the queue for a row once: admission's reservation went back then, and the
    GPU still holds its row."""
    p = policy(max_batch=2, num_blocks=3, block_size=4, max_context=12)
    p.add("a", params(3, max_tokens=9))
    p.add("b", params(3, max_tokens=9, first=50))
    plan = p.schedule()
    while p.num_preemptions == 0:
        done(p, plan)
        plan = p.schedule()
    assert [r.request_id for r in p.waiting] == ["b"]
    assert p.abort("b") == "running"
    assert not p.waiting and p.schedule().closes == ("b",)


def test_admission_reserves_the_block_a_running_rows_first_sample_needs():
    p = policy(max_batch=2, num_blocks=2, block_size=4)
    p.add("a", params(4))  # a full block of prompt: its first sample's K/V needs a second
    p.add("b", params(3, first=50))
    assert [o[0] for o in p.schedule().opens] == ["a"]


def test_a_prompt_chunk_shrinks_to_the_blocks_the_pool_has_left():
    p = policy(max_batch=2, num_blocks=6, block_size=4, chunk=8, budget=9)
    p.add("a", params(3, max_tokens=30))
    p.add("b", params(17, first=50))
    plans = []
    for _ in range(3):
        plans.append(p.schedule())
        done(p, plans[-1])
    assert spans(plans[0]) == [("a", 0, 3), ("b", 0, 6)]
    assert spans(plans[1]) == [("a", 3, 1), ("b", 6, 8)]
    # a's next token takes the last free block: of b's 3 tokens left, the 2 its blocks hold.
    assert spans(plans[2]) == [("a", 4, 1), ("b", 14, 2)] and p.pool.num_free_blocks == 0
    assert not plans[2].spans[1].samples


def test_a_prompt_with_one_token_left_after_a_cache_hit_is_still_prefilling():
    """Its one-token span does not count as a decoding row: a long prompt beside it still
    gets the solo budget."""
    p = policy(max_batch=3, block_size=4, chunk=4, budget=6, solo=16)
    p.add("a", params(8, max_tokens=1))
    done(p, p.schedule(), finished={"a"})
    p.add("b", params(9))  # a's 8 tokens, cached, and one more
    p.add("c", params(40, first=100))
    plan = p.schedule()
    assert plan.opens[0] == ("b", params(9), 8)
    assert spans(plan) == [("b", 8, 1), ("c", 0, 15)]
    # ... nor in the step's account: the step event's decode_rows and prefill_tokens.
    assert (plan.num_prefill_rows, plan.num_prefill_tokens) == (2, 16)
    decoding = p.schedule()
    assert spans(decoding)[0] == ("b", 9, 1) and decoding.num_prefill_rows == 1  # c alone
    assert decoding.num_prefill_tokens == decoding.num_tokens - 1  # b's decoded token is not


def test_a_preempted_request_requeues_by_its_rank_behind_better_priorities():
    p = policy(max_batch=2, num_blocks=3, block_size=4, max_context=12)
    p.add("a", params(3, max_tokens=9))
    p.add("background", params(3, max_tokens=9, first=50, priority=5))
    plan = p.schedule()
    p.add("c", params(3, max_tokens=9, first=90, priority=1))  # no row for it
    while not plan.preempted:
        done(p, plan)
        plan = p.schedule()
    # Its row goes to c, which outranks it in the queue.
    assert plan.preempted == ("background",) and [o[0] for o in plan.opens] == ["c"]
    assert [r.request_id for r in p.waiting] == ["background"]


def test_a_windowed_rows_reservation_covers_its_window_and_the_solo_span():
    """Every layer windowed (8 tokens): a row holds at most the blocks its window and its
    longest span touch, and that span is the solo prefill's 16 tokens, not the 4-token chunk."""
    pool = BlockPool(10, 4, layout=KVLayout.for_layers(1, (8,)))
    p = FcfsScheduler(2, pool, 1000, prefill_chunk=4, max_num_batched_tokens=6, solo_prefill_tokens=16)
    p.add("a", params(40))
    p.add("b", params(40, first=100))
    assert [o[0] for o in p.schedule().opens] == ["a"]  # 7 blocks each: b waits for a


def all_windowed(num_blocks, window=8, solo=512):
    """Every layer slides over `window` tokens, in blocks of 4; chunks as the server's."""
    pool = BlockPool(num_blocks, 4, layout=KVLayout.for_layers(1, (window,)))
    return FcfsScheduler(
        4, pool, 1000, prefill_chunk=160, max_num_batched_tokens=164, solo_prefill_tokens=solo
    )


def test_every_layer_sliding_a_prompt_longer_than_the_pool_runs_in_smaller_chunks():
    """The context is not capped when every layer slides: a 100-token prompt in a pool of
    80 tokens holds a window and a chunk at a time. It was refused as "can never fit",
    sized by a 512-token chunk no pool this small could hold (a 500 over HTTP)."""
    p = all_windowed(num_blocks=20)
    p.add("long", params(100, max_tokens=10))
    steps = list(planned_steps(p, check_pool=True))
    assert all(plan.rejects == () for _, plan in steps)
    assert sum(s.num_new for _, plan in steps for s in plan.spans) == 100 + 10 - 1
    assert p.pool.num_used_blocks == 0 and not p.has_work


def test_every_layer_sliding_a_decoding_row_reserves_its_window_not_a_chunk():
    """A decoding row computes one token a step: it was charged a whole 512-token
    chunk's blocks (129 of 100 for a 600-token row), so a later arrival waited for it
    to end with the pool all but empty."""
    p = all_windowed(num_blocks=100)
    p.add("long", params(5, max_tokens=700))
    for _ in range(600):  # ~600 tokens in: never more than 3 blocks held
        done(p, p.schedule())
    assert p.pool.num_free_blocks >= 97
    p.add("late", params(5, first=50))
    assert [o[0] for o in p.schedule().opens] == ["late"]


def test_every_layer_sliding_a_row_that_cannot_hold_one_token_at_a_time_is_refused():
    p = all_windowed(num_blocks=2, window=16)  # a window spans 4-5 blocks of 4
    p.add("any", params(30))
    plan = p.schedule()
    assert [rid for rid, _ in plan.rejects] == ["any"] and "never fit" in plan.rejects[0][1]


@pytest.mark.parametrize("windows", [(None,), (None, 4), (4,), (8, 4)], ids=str)
def test_random_workloads_finish_with_the_pool_intact_in_every_layout(windows):
    """Tight pools, shared prefixes, priorities, aborts and two steps in flight: every
    request finishes or is aborted, none waits forever. (4,) and (8, 4) slide on every
    layer: group 0 is windowed too, and may be smaller than one row's window."""
    rng = random.Random(11)
    for _ in range(150):
        block_size, max_batch = rng.choice([2, 4]), rng.randrange(1, 5)
        chunk = rng.randrange(1, 10)
        base = KVLayout.for_layers(len(windows), windows)
        # Group 0 from the budget, the context bounded by it as the engine bounds it; the
        # others hold max_batch rows' windows and a chunk, as PagedKV sizes them (for
        # chunks of SIZING_CHUNK: a block or more past a decoding row's window).
        sizing_chunk = chunk + block_size
        sizes = [rng.randrange(2, 24)] + [
            max_batch * base.row_blocks(g, 1 << 40, block_size, sizing_chunk)
            for g in range(1, base.num_groups)
        ]
        layout = KVLayout(base.group_windows, base.group_layers, base.group_of_layer, tuple(sizes))
        pool = BlockPool(sizes[0], block_size, layout=layout, is_caching=rng.random() < 0.8)
        max_context = layout.max_row_tokens(sizes[0], block_size)
        p = FcfsScheduler(max_batch, pool, max_context, chunk, max(max_batch, 12), 0)
        shared = [rng.randrange(100) for _ in range(rng.randrange(12))]
        for i in range(8):
            prompt = shared * (rng.random() < 0.5)
            prompt += [rng.randrange(100) for _ in range(rng.randrange(1, 16))]
            # The engine refuses a request past the context (runtime/sequence.py).
            max_tokens = min(rng.randrange(1, 20), max_context - len(prompt))
            if max_tokens > 0:
                p.add(f"r{i}", SequenceParams(tuple(prompt), max_tokens, priority=rng.randrange(2)))
        queued = []
        for _ in range(2000):
            if p.running and rng.random() < 0.02:
                p.abort(rng.choice(list(p.running)))
            plan = p.schedule() if len(queued) < 2 else None
            queued += [plan] if plan is not None else []
            if not queued:
                break
            if plan is None or rng.random() < 0.5:
                oldest = queued.pop(0)
                done(p, oldest, tokens={s.request_id: rng.randrange(100) for s in oldest.spans})
                pool.check()
        assert not p.has_work and not queued
        assert pool.num_used_blocks == 0


def test_blocks_of_generated_tokens_are_cached_under_the_hashes_a_prompt_of_them_gets():
    """A follow-up whose prompt is the first request's prompt and reply hits every full
    block of both (chained on the one before, as a prompt's hashes are)."""
    p = policy(block_size=4)
    p.add("a", params(4, max_tokens=9))
    while p.has_work:
        done(p, p.schedule())
    p.add("b", SequenceParams(tuple(range(1, 5)) + (7,) * 9 + (99,), max_tokens=1))
    assert p.schedule().opens[0][2] == 12  # the prompt's block and two of the reply's


def two_groups(windowed_blocks, *, num_blocks=64, max_batch=2, chunk=4, budget=6):
    """Full layers in group 0, layers sliding over 8 tokens in group 1 (blocks of 4), whose
    pool holds `windowed_blocks`: a pool smaller than PagedKV sizes (for 512-token chunks)."""
    base = KVLayout.for_layers(2, (None, 8))
    sizes = (num_blocks, windowed_blocks)
    layout = KVLayout(base.group_windows, base.group_layers, base.group_of_layer, sizes)
    pool = BlockPool(num_blocks, 4, layout=layout)
    return FcfsScheduler(max_batch, pool, 256, chunk, budget, 0)


def test_a_span_carries_group_0s_table_as_its_blocks_and_the_other_groups_beside_it():
    p = two_groups(windowed_blocks=8)
    p.add("a", params(20))
    for _ in range(4):  # chunks of 4: the window's first blocks went back
        (span,) = p.schedule().spans
    full, windowed = p.running["a"].tables
    assert span.blocks == tuple(full) and span.group_tables == (tuple(windowed),)
    assert full != windowed  # [-1, 1, 2, 3] beside [0, 1, 2, 3]: a swap would show


def test_with_no_row_given_a_token_and_nothing_in_flight_the_newest_row_is_preempted():
    """The last resort: no row can take a windowed block (each prompt chunk leaves one per
    row free) until the newest gives its row back; c, queued ahead of it and too large
    for the pool's rest, keeps it from being readmitted at once."""
    p = two_groups(windowed_blocks=3, num_blocks=6)
    p.add("a", params(5, priority=1))
    p.add("b", params(5, first=50, priority=1))
    plan = p.schedule()
    assert [o[0] for o in plan.opens] == ["a", "b"]
    assert spans(plan) == [("a", 0, 4)]  # of the 3 windowed blocks, 2 stay free
    done(p, plan)
    p.add("c", params(17, first=100, priority=0))
    plan = p.schedule()  # neither a nor b can take a block now
    assert plan.preempted == ("b",) and spans(plan) == [("a", 4, 1)]
    assert [r.request_id for r in p.waiting] == ["c", "b"]


def test_a_plan_carries_its_opens_even_when_no_row_gets_a_token():
    """The engine must learn of every row the policy opened, spans or not."""
    p = two_groups(windowed_blocks=2)
    p.add("a", params(5))
    p.add("b", params(5, first=50))
    plan = p.schedule()
    assert [o[0] for o in plan.opens] == ["a", "b"] and plan.spans == ()


def test_a_prompt_chunk_leaves_each_row_a_windowed_block_for_its_next_token():
    """A 32-token chunk wants more windowed blocks than the pool has: it takes all but one
    per row, so the decoding row still grows every step; a decoding row keeps none back."""
    p = two_groups(windowed_blocks=8, chunk=32, budget=40)
    p.add("d", params(3, max_tokens=60))
    done(p, p.schedule())
    p.add("long", params(80, first=100))
    for decoding, plan in planned_steps(p, check_pool=True):
        assert decoding <= {s.request_id for s in plan.spans}
    assert not p.has_work


def test_a_result_for_a_row_aborted_while_its_step_ran_is_ignored():
    p = policy()
    p.add("a", params(3))
    p.add("b", params(3, first=50))
    plan = p.schedule()
    assert p.abort("a") == "running"
    p.on_step_done(plan.step, [("a", 9, False, False), ("b", 8, False, False)])
    assert "a" not in p.running and p.running["b"].tokens[-1] == 8


@pytest.mark.timeout(10)
def test_a_lone_row_that_cannot_grow_is_neither_preempted_nor_spun_on():
    """Only a context past the pool (the engine caps it to the pool) gets here: the row
    waits, and `schedule` returns rather than preempting it or looping."""
    p = policy(max_batch=1, num_blocks=2, block_size=4, max_context=100)
    p.add("a", params(3, max_tokens=None))
    while (plan := p.schedule()) is not None:
        done(p, plan)
    assert p.running["a"].num_computed == 8 and p.num_preemptions == 0 and not plan


def test_a_prompt_out_of_blocks_does_not_preempt_while_the_decoding_rows_fit():
    """Only a decoding row's next token makes room by preemption; a prompt waits."""
    p = policy(max_batch=2, num_blocks=6, block_size=4, chunk=8, budget=9)
    p.add("a", params(3, max_tokens=30))
    p.add("b", params(17, first=50))
    for _ in range(3):
        done(p, p.schedule())
    assert p.pool.num_free_blocks == 0 and p.running["b"].num_computed == 16
    plan = p.schedule()  # b's last token needs a block; a's next fits its own
    assert spans(plan) == [("a", 5, 1)] and plan.preempted == ()


def test_a_constrained_row_skips_lookahead_until_its_sample_is_in():
    """Its next mask needs the token it sampled, so it is planned no further."""
    grammar = object()  # the policy only asks whether there is one
    p = policy()
    p.add("g", SequenceParams(prompt_tokens=(1, 2, 3), max_tokens=8, grammar=grammar))
    p.add("free", params(3, first=50))
    first = p.schedule()
    assert spans(first) == [("g", 0, 3), ("free", 0, 3)]
    assert spans(p.schedule()) == [("free", 3, 1)]  # g's sample is not in: g waits
    done(p, first)
    assert spans(p.schedule())[0] == ("g", 3, 1)


def test_the_budget_once_spent_gives_the_later_prompts_no_span():
    p = policy(max_batch=3, chunk=8, budget=10)
    for name, first in (("a", 1), ("b", 100), ("c", 200)):
        p.add(name, params(9, first=first))
    assert spans(p.schedule()) == [("a", 0, 8), ("b", 0, 2)]
    assert p.running["c"].num_computed == 0


def test_every_layer_sliding_a_decoding_row_reserves_only_the_blocks_its_window_needs():
    """8-token window, blocks of 4: a decoding row holds 2 or 3 blocks, so it reserves 3
    at most; with 2 held, a 2-block prompt fits a pool of 5 beside it."""
    p = all_windowed(num_blocks=5)
    p.add("long", params(5, max_tokens=100))
    done(p, p.schedule())
    while p.pool.num_held(p.running["long"].tables) != 2 or p.running["long"].num_samples < 8:
        done(p, p.schedule())
    p.add("late", params(5, first=50))
    assert [o[0] for o in p.schedule().opens] == ["late"]


def test_a_decoding_row_takes_the_last_windowed_block():
    """A windowed pool of exactly the 3 blocks an 8-token window touches: a row alone
    decodes to its end, taking the one block free each time it crosses into a new one."""
    p = two_groups(windowed_blocks=3)
    p.add("a", params(3, max_tokens=30))
    for _ in planned_steps(p, check_pool=True):
        pass
    assert not p.has_work


def test_every_layer_sliding_a_row_whose_next_block_frees_one_is_not_short():
    """A 9-token window in blocks of 4: a row's first block falls out of it just as the
    next begins, so two rows of 3 blocks fill a pool of 6 and trade, never preempting."""
    p = all_windowed(num_blocks=6, window=9)
    p.add("a", params(5, max_tokens=30))
    p.add("b", params(5, max_tokens=30, first=50))
    for _ in planned_steps(p, check_pool=True):
        pass
    assert not p.has_work and p.num_preemptions == 0


def test_a_row_at_its_max_tokens_needs_no_block_for_a_next_token():
    """a's last token is queued at a block's end and the pool is full: b's lookahead still
    plans, not held up as if a had to grow."""
    p = policy(max_batch=2, num_blocks=2, block_size=4)
    p.add("a", params(3, max_tokens=2))
    p.add("b", params(1, max_tokens=8, first=50))
    assert spans(p.schedule()) == [("b", 0, 1), ("a", 0, 3)]
    assert spans(p.schedule()) == [("a", 3, 1), ("b", 1, 1)]  # a's last sample
    assert p.pool.num_free_blocks == 0 and spans(p.schedule()) == [("b", 2, 1)]


def test_a_decoding_row_finding_no_windowed_block_waits_for_one():
    """Two rows cross into a new block together with one windowed block free: one takes
    it and the other waits a few tokens for the first's oldest block to leave the window."""
    p = two_groups(windowed_blocks=5)
    p.add("a", params(3, max_tokens=30))
    p.add("b", params(3, max_tokens=30, first=50))
    for _ in planned_steps(p, check_pool=True):
        pass
    assert not p.has_work
