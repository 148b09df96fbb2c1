"""A hybrid model's prefix cache end to end (runtime/kv/snapshots.py): a row resumes a
cached prefix from a snapshot of its recurrent state, and its greedy tokens are the ones
it computes from scratch, for a Gated DeltaNet model (Qwen3.5) and a Mamba2 one
(Granite 4.0-H): a second turn of a chat, choices of one prompt, mixed steps, lookahead,
a preempted row."""

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.kv.snapshots import SnapshotBook
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import FinishCause, SequenceParams

import mlx.core as mx
import pytest

BLOCK = 4
TURN_1 = [11, 305, 42, 977, 5, 1203, 64, 88, 300, 7, 1500, 19, 23, 99, 410]  # 15 tokens
OTHER = [900, 5, 6, 31, 77, 2, 18, 260, 13, 45, 61]
FAMILIES = {"qwen3_5_text": {}, "granitemoehybrid": {"granite4": None}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def loaded(request, make_checkpoint):
    return load_model(make_checkpoint(request.param, num_layers=4, **FAMILIES[request.param]))


def setup(loaded, *, caching=True, chunk=256, budget=512, num_blocks=None, max_batch=4, num_snapshots=None):
    engine = Engine(
        loaded, max_batch=max_batch, block_size=BLOCK, kv_budget=1 << 22,
        num_snapshots=num_snapshots if caching else 0,
    )
    pool = BlockPool(num_blocks or engine.kv.num_blocks, BLOCK, is_caching=caching, layout=engine.kv.layout)
    book = SnapshotBook(engine.num_snapshots) if caching else None
    return engine, FcfsScheduler(max_batch, pool, engine.max_context, chunk, budget, 0, snapshots=book)


def params(prompt, max_tokens=10):
    return SequenceParams(tuple(prompt), max_tokens=max_tokens, ignore_eos=True)


def uncached(loaded, requests):
    engine, policy = setup(loaded, caching=False)
    return {rid: run_offline(engine, policy, {rid: p})[rid].tokens for rid, p in requests.items()}


def assert_holds_what_the_book_counts(engine, policy):
    """The engine keeps exactly the snapshots the policy names or has yet to drop, each a
    row of its own (never a step's batch of every row)."""
    book = policy.snapshots
    assert set(engine._snapshots) == set(book.named.values()) | set(book.drops)
    assert all(h.batch.shape[0] == 1 for s in engine._snapshots.values() for h in (*s.conv, *s.delta))


@pytest.mark.parametrize(("chunk", "budget"), [(256, 512), (3, 6)], ids=["whole-prompts", "small-chunks"])
def test_a_second_turn_resumes_after_the_first_turns_reply_to_the_same_tokens(loaded, chunk, budget):
    engine, policy = setup(loaded, chunk=chunk, budget=budget)
    first = run_offline(engine, policy, {"t1": params(TURN_1)})["t1"]
    turn_2 = [*TURN_1, *first.tokens, 5, 6, 7, 8, 9]  # 15 + 10 + 5 tokens
    second = run_offline(engine, policy, {"t2": params(turn_2)})["t2"]
    want = uncached(loaded, {"t1": params(TURN_1), "t2": params(turn_2)})
    assert (first.tokens, second.tokens) == (want["t1"], want["t2"])
    # Resumed after its 24th token: the first turn's last block boundary, mid-reply.
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 24
    assert policy.pool.num_hit_blocks == 6
    assert_holds_what_the_book_counts(engine, policy)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_rows_in_mixed_steps_some_resuming_match_their_uncached_tokens(loaded, lookahead):
    requests = {
        "a": params(TURN_1),
        "b": params(OTHER),
        "a-again": params(TURN_1),  # held for a's blocks, then resumes from a's prompt snapshot
        "a-longer": params([*TURN_1, 3, 1, 4, 1, 5, 9, 2, 6]),
    }
    # Room for a's and b's prompt and newest reply snapshots (by default max_batch: 2).
    engine, policy = setup(loaded, chunk=3, budget=6, max_batch=2, num_snapshots=4)
    kinds, restored = [], []

    def note(plan):
        prefill = [span.is_prefill for span in plan.spans]
        kinds.append(any(prefill) and not all(prefill))
        restored.extend(rid for rid, _ in plan.restores)

    got = run_offline(engine, policy, requests, lookahead=lookahead, on_step=note)
    assert {rid: r.tokens for rid, r in got.items()} == uncached(loaded, requests)
    assert any(kinds) and {"a-again", "a-longer"} <= set(restored)
    assert got["a-again"].num_cached_tokens == 12 and got["a-longer"].num_cached_tokens >= 12
    assert_holds_what_the_book_counts(engine, policy)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_preempted_row_resumes_from_a_snapshot_to_the_same_tokens(loaded, lookahead):
    requests = {"a": params(TURN_1, 24), "c": params(OTHER[:9], 24)}
    engine, policy = setup(loaded, chunk=4, budget=8, num_blocks=17)  # too few for both rows
    preempted, resumed_at = set(), {}

    def note(plan):
        preempted.update(plan.preempted)
        restored = {rid for rid, _ in plan.restores}
        for span in plan.spans:
            if span.request_id in preempted & restored:
                resumed_at[span.request_id] = span.start

    got = run_offline(engine, policy, requests, lookahead=lookahead, on_step=note)
    assert policy.num_preemptions > 0 and resumed_at and all(start > 0 for start in resumed_at.values())
    assert {rid: r.tokens for rid, r in got.items()} == uncached(loaded, requests)


def test_prompts_sharing_a_system_prompt_resume_where_it_ends_from_the_third_on(loaded):
    system = [(i * 37 + 11) % 1500 + 3 for i in range(22)]  # five full blocks and two tokens
    requests = {f"user-{i}": params([*system, 600 + i, 700 + i, 800 + i, 900 + i]) for i in range(4)}
    engine, policy = setup(loaded, chunk=8, budget=16, max_batch=1, num_snapshots=8)  # one after another
    got = run_offline(engine, policy, requests)
    assert {rid: r.tokens for rid, r in got.items()} == uncached(loaded, requests)
    # The first kept no state after the system prompt's blocks; the second computes them
    # again and keeps it; the others resume there.
    assert [r.num_cached_tokens for r in got.values()] == [0, 0, 20, 20]


def test_a_snapshot_the_engine_lacks_fails_the_row_resuming_from_it_alone(loaded):
    engine, policy = setup(loaded)
    run_offline(engine, policy, {"t1": params(TURN_1)})
    engine.drop_snapshots(tuple(engine._snapshots))  # as if lost: the policy still names them
    got = run_offline(engine, policy, {"again": params(TURN_1), "other": params(OTHER)})
    assert got["again"].finish is FinishCause.ERROR and "no recurrent-state snapshot" in got["again"].error
    assert got["other"].tokens == uncached(loaded, {"other": params(OTHER)})["other"]
    assert engine.num_open == 0


def test_without_prefix_caching_nothing_is_saved_or_reserved(loaded):
    engine, policy = setup(loaded, caching=False)
    assert engine.num_snapshots == 0 and engine.snapshot_bytes == 0
    run_offline(engine, policy, {"t1": params(TURN_1)})
    again = run_offline(engine, policy, {"t1": params(TURN_1)})["t1"]
    assert again.num_cached_tokens == 0 and engine.num_snapshots_held == 0


@pytest.mark.parametrize("chunk", [256, 4], ids=["sampling-steps", "prefill-chunks"])
def test_a_snapshot_is_evaluated_with_the_step_that_saves_it(loaded, chunk, monkeypatch):
    """Left lazy, a row's copy would keep the step's batch of every row's state alive
    until the snapshot is next read (a restore, maybe never)."""
    evaluated = set()
    for name in ("eval", "async_eval"):
        original = getattr(mx, name)

        def recording(*arrays, original=original):
            evaluated.update(id(a) for a in arrays)
            return original(*arrays)

        monkeypatch.setattr(mx, name, recording)
    engine, policy = setup(loaded, chunk=chunk, budget=2 * chunk)
    run_offline(engine, policy, {"a": params(TURN_1, max_tokens=6), "b": params(OTHER, max_tokens=6)})
    held = [h.batch for s in engine._snapshots.values() for h in (*s.conv, *s.delta)]
    assert held and all(id(batch) in evaluated for batch in held)
