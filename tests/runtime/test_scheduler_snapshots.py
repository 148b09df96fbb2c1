"""A hybrid model's prefix cache in the policy (runtime/kv/snapshots.py): where spans save
their row's recurrent state, which cached prefix a row resumes from (the longest whose
last block has a snapshot), and when snapshots go (eviction, capacity, a failed row)."""

from runtime.kv.blocks import BlockPool
from runtime.kv.snapshots import SnapshotBook
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

from tests.runtime.test_scheduler import done, params, spans


def hybrid_policy(*, num_blocks=64, capacity=4, chunk=256, max_batch=2, caching=True):
    pool = BlockPool(num_blocks, 4, is_caching=caching)
    book = SnapshotBook(capacity) if caching else None
    return FcfsScheduler(max_batch, pool, 256, chunk, 512, 0, snapshots=book)


def saves(plan):
    return [(s.request_id, s.start + s.num_new) for s in plan.spans if s.save_as is not None]


def run_until_done(p):
    plans = []
    while p.has_work:
        plan = p.schedule()
        plans.append(plan)
        done(p, plan)
    return plans


def test_a_prompt_chunk_ends_at_its_last_full_block_to_save_the_state_there():
    p = hybrid_policy()
    p.add("a", params(15, max_tokens=6))  # save point 12: blocks 0-2, the 15th token computed after
    first = p.schedule()
    assert spans(first) == [("a", 0, 12)] and saves(first) == [("a", 12)]
    done(p, first)
    second = p.schedule()
    assert spans(second) == [("a", 12, 3)] and saves(second) == []
    done(p, second)
    plans = run_until_done(p)
    # Decoding, at each block boundary: positions 16 and 20 (the 20th token is the 5th sampled).
    assert [s for plan in plans for s in saves(plan)] == [("a", 16), ("a", 20)]


def test_the_same_prompt_again_resumes_from_the_snapshot_and_counts_as_a_hit():
    p = hybrid_policy()
    p.add("a", params(15, max_tokens=2))
    run_until_done(p)
    p.add("b", params(15, max_tokens=2))
    plan = p.schedule()
    assert plan.opens[0][2] == 12 and spans(plan) == [("b", 12, 3)]
    ((rid, snapshot),) = plan.restores
    assert rid == "b" and snapshot == p.snapshots.named[p.running["b"].block_hashes[2]]
    assert p.pool.num_hit_blocks == 3


def test_a_cached_prefix_with_no_snapshot_at_its_end_is_cut_back_to_one_that_has():
    p = hybrid_policy()
    p.add("a", params(15, max_tokens=2))
    run_until_done(p)  # a's tokens: 1-15, then 7, 7; snapshots after 12 (prompt) and 16 (decoded)
    p.snapshots.named.popitem()  # the one after 16 went (least recently used, say)
    b = SequenceParams((*range(1, 16), 7, *range(100, 110)), max_tokens=2)
    p.add("b", b)
    plan = p.schedule()
    # Its 4 first blocks are cached, but only after the 3rd is there a state to resume from.
    assert len(p.pool.match_prefix(p.running["b"].block_hashes)) == 4
    assert plan.opens[0][2] == 12 and spans(plan)[0][:2] == ("b", 12) and plan.restores
    assert p.pool.num_hit_blocks == 3


def test_no_snapshot_no_hit_however_many_blocks_are_cached():
    p = hybrid_policy()
    p.add("a", params(15, max_tokens=2))
    run_until_done(p)
    p.snapshots.named.clear()
    p.add("b", params(15, max_tokens=2))
    plan = p.schedule()
    assert plan.opens[0][2] == 0 and spans(plan)[0][:2] == ("b", 0) and not plan.restores
    assert p.pool.num_hit_blocks == 0


def test_a_snapshot_goes_with_its_block_when_the_block_is_evicted():
    p = hybrid_policy(num_blocks=8)
    p.add("a", params(15, max_tokens=2))
    run_until_done(p)
    named = dict(p.snapshots.named)
    assert named
    p.add("b", params(29, first=500, max_tokens=1))  # needs every block: a's cached ones are evicted
    plans = run_until_done(p)
    dropped = {sid for plan in plans for sid in plan.snapshot_drops}
    assert set(named.values()) <= dropped and not set(named) & set(p.snapshots.named)


def test_past_the_capacity_the_least_recently_used_snapshot_is_dropped():
    p = hybrid_policy(capacity=1)
    p.add("a", params(15, max_tokens=1))
    run_until_done(p)
    (a_snapshot,) = p.snapshots.named.values()
    p.add("b", params(15, first=100, max_tokens=1))
    plans = run_until_done(p)
    assert len(p.snapshots.named) == 1 and a_snapshot not in p.snapshots.named.values()
    assert a_snapshot in {sid for plan in plans for sid in plan.snapshot_drops}


def test_a_failed_rows_save_is_dropped_not_named():
    p = hybrid_policy()
    p.add("a", params(15, max_tokens=4))
    first = p.schedule()
    (save,) = [s.save_as for s in first.spans]
    p.on_step_done(first.step, [("a", None, True, False)])  # its forward raised
    assert not p.snapshots.named
    p.add("b", params(3, first=100))
    assert save is not None and save in p.schedule().snapshot_drops


def test_a_preempted_row_resumes_from_its_own_snapshot():
    p = hybrid_policy(num_blocks=15, max_batch=2)  # a (35 tokens) and b (29) don't both fit
    p.add("a", params(15, max_tokens=20))
    p.add("b", params(9, first=300, max_tokens=20))
    resumed = []
    while p.has_work:
        plan = p.schedule()
        resumed += [(rid, s) for rid, s in plan.restores]
        for span in plan.spans:  # a resumed row's first span starts where it was restored
            if any(rid == span.request_id for rid, _ in plan.restores):
                assert span.start > 0
        done(p, plan)
    assert p.num_preemptions > 0 and resumed


def test_a_model_without_recurrent_state_plans_no_saves_and_no_cut_chunks():
    p = FcfsScheduler(2, BlockPool(64, 4), 256, 256, 512, 0)
    p.add("a", params(15, max_tokens=6))
    plans = run_until_done(p)
    assert spans(plans[0]) == [("a", 0, 15)]
    assert not any(saves(plan) or plan.restores or plan.snapshot_drops for plan in plans)


def test_choices_of_a_prompt_longer_than_a_chunk_wait_for_its_snapshot_and_share_it():
    """Its first blocks are cached a chunk at a time, but usable only once the state
    after its last full block is kept: the other choices wait for that, not just a block."""
    p = hybrid_policy(chunk=16, max_batch=4)
    for name in ("c0", "c1", "c2"):
        p.add(name, params(41))  # ten full blocks and a token: saved after 40
    opened = {}
    while len(opened) < 3:
        plan = p.schedule()
        opened.update((rid, cached) for rid, _, cached in plan.opens)
        done(p, plan)
    assert opened == {"c0": 0, "c1": 40, "c2": 40}


def test_a_prompt_sharing_cached_blocks_with_no_snapshot_keeps_its_state_where_they_end():
    """Two prompts with one system prompt: the second computes it again (the first kept no
    state there) and keeps the state where the shared blocks end, so a third resumes there."""
    system = tuple(range(1, 21))  # five blocks
    p = hybrid_policy()
    p.add("a", SequenceParams((*system, 100, 101, 102, 103, 104, 105), max_tokens=1))  # kept after 24
    run_until_done(p)
    p.add("b", SequenceParams((*system, 200, 201, 202, 203, 204), max_tokens=1))
    first = p.schedule()
    assert first.opens[0][2] == 0 and spans(first) == [("b", 0, 20)] and saves(first) == [("b", 20)]
    done(p, first)
    run_until_done(p)
    p.add("c", SequenceParams((*system, 300, 301), max_tokens=1))
    plan = p.schedule()
    assert plan.opens[0][2] == 20 and spans(plan) == [("c", 20, 2)] and plan.restores


def test_a_prompt_of_whole_blocks_saves_after_its_last_block_but_one_for_a_repeat_to_resume():
    p = hybrid_policy()
    p.add("a", params(16, max_tokens=1))  # a repeat looks up 3 blocks: its 16th token computes
    plans = run_until_done(p)
    assert spans(plans[0]) == [("a", 0, 12)] and saves(plans[0]) == [("a", 12)]
    assert saves(plans[1]) == [("a", 16)]  # and after the whole prompt, ending on a block
    p.add("b", params(16, max_tokens=1))
    plan = p.schedule()
    assert plan.opens[0][2] == 12 and spans(plan) == [("b", 12, 4)] and plan.restores


def test_a_prompt_ending_on_a_block_that_has_its_snapshot_plans_no_save_there():
    p = hybrid_policy()
    p.add("a", params(15, max_tokens=2))
    run_until_done(p)  # a's tokens 1-15, 7, 7: snapshots after 12 and 16
    p.add("b", SequenceParams((*range(1, 16), 7), max_tokens=1))  # resumed at 12 (it looks up 3 blocks)
    plans = run_until_done(p)
    assert spans(plans[0]) == [("b", 12, 4)] and plans[0].restores
    assert [s for plan in plans for s in saves(plan)] == []  # the state after 16 is kept already
    assert len(p.snapshots.named) == 2


def test_a_decoding_rows_cached_blocks_without_a_snapshot_do_not_hold_back_a_prompt_sharing_them():
    """Published blocks are cached: a prompt sharing them past the last snapshot computes
    that part itself at once, rather than waiting on a row that will never save there."""
    p = hybrid_policy(max_batch=2)
    p.add("a", params(15, max_tokens=40))
    plans = [p.schedule()]
    done(p, plans[0])
    while len(p.running["a"].tokens) < 27:  # decoded to 27: boundaries 16, 20, 24 passed
        plans.append(p.schedule())
        done(p, plans[-1])
    a_tokens = p.running["a"].tokens
    assert p.running["a"].num_published >= 5
    p.add("b", SequenceParams((*a_tokens[:20], 900, 901, 902), max_tokens=2))
    plan = p.schedule()
    # Blocks 0-4 are cached; only after 12 (its prompt) and 24 (its newest) does a keep a state.
    assert ("b", 12) in [(rid, cached) for rid, _, cached in plan.opens]


def test_a_finished_or_preempted_row_leaves_no_decode_boundary_of_its_own_in_the_book():
    """Its newest boundary stays as any snapshot; the book forgets whose it was, so it
    grows with no request (a server's thousands), and a preempted row starts afresh."""
    p = hybrid_policy(num_blocks=15, max_batch=2)  # a (35 tokens) and b (29) don't both fit
    p.add("a", params(15, max_tokens=20))
    p.add("b", params(9, first=300, max_tokens=20))
    run_until_done(p)
    assert p.num_preemptions > 0 and not p.snapshots.newest_decoded


def test_a_failed_rows_save_is_dropped_even_where_another_row_cached_its_block():
    """Its state after the failed span is no state at all: never named, though the block
    its save ends at is cached (by a row that got there first)."""
    p = hybrid_policy(chunk=8)
    p.add("a", params(15, max_tokens=1))
    run_until_done(p)
    p.snapshots.named.clear()  # a's blocks stay cached, their snapshot gone (capacity, say)
    p.add("b", params(15, max_tokens=1))
    first = p.schedule()
    assert spans(first) == [("b", 0, 8)] and saves(first) == []
    done(p, first)  # b publishes its first two blocks
    second = p.schedule()
    assert saves(second) == [("b", 12)]
    (save,) = [s.save_as for s in second.spans]
    p.on_step_done(second.step, [("b", None, True, False)])  # its forward raised
    assert not p.snapshots.named
    p.add("c", params(3, first=100))
    assert save in p.schedule().snapshot_drops
