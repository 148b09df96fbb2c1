"""Prefix caching end to end: the policy's block pool and the engine's paged storage."""

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

import pytest

SHARED = [(i * 37 + 11) % 2000 + 3 for i in range(1000)]  # a 1,000-token system prompt


def params(prompt, max_tokens=8):
    return SequenceParams(prompt_tokens=tuple(prompt), max_tokens=max_tokens, ignore_eos=True)


def policy_for(engine, *, num_blocks=None, caching=True, max_batch=4):
    pool = BlockPool(num_blocks or engine.kv.num_blocks, engine.kv.block_size, is_caching=caching)
    return FcfsScheduler(max_batch, pool, engine.max_context, 256, 512)


@pytest.fixture(scope="module")
def engine(make_checkpoint):
    return Engine(load_model(make_checkpoint("llama")), max_batch=4)


@pytest.fixture(scope="module")
def cold(make_checkpoint):
    """The reference runs, caching off, on an engine of their own: sharing `engine`'s
    storage, their blocks were the cached ones a test then hit, rewritten with the same
    prefix, so a hit that read a block some other request had overwritten went unseen."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=4)

    def run(prompt, max_tokens=8):
        policy = policy_for(engine, caching=False)
        return run_offline(engine, policy, {"x": params(prompt, max_tokens)})["x"]

    return run


def test_a_shared_1000_token_prefix_is_reused_with_the_tokens_of_a_cold_run(engine, cold):
    first = SHARED + [5, 6, 7]
    second = SHARED + [900, 901, 902, 903]
    reference = cold(second)
    policy = policy_for(engine)
    run_offline(engine, policy, {"a": params(first)})
    warm = run_offline(engine, policy, {"b": params(second)})["b"]
    assert warm.num_cached_tokens >= 960
    assert warm.tokens == reference.tokens and reference.num_cached_tokens == 0
    assert policy.pool.hit_rate > 0


def test_concurrent_requests_share_blocks_of_a_prefix_computed_earlier(engine, cold):
    policy = policy_for(engine)
    run_offline(engine, policy, {"warmup": params(SHARED[:200], 1)})
    prompts = {str(i): SHARED[:200] + [i + 3] * (i + 1) for i in range(4)}
    reference = {k: cold(p).tokens for k, p in prompts.items()}
    shared_counts = []

    def note(plan):
        if plan.opens:
            shared_counts.append(max(policy.pool.refcount))

    got = run_offline(engine, policy, {k: params(p) for k, p in prompts.items()}, on_step=note)
    assert {k: r.tokens for k, r in got.items()} == reference
    assert all(r.num_cached_tokens == 192 for r in got.values())  # 12 blocks of 16
    assert max(shared_counts) == 4  # one block held by all four rows at once


def test_eviction_under_a_tiny_budget_stays_correct(engine, cold):
    """Five distinct 60-token prompts through a 12-block pool: blocks are evicted and
    reused, and every request still gets the tokens of a cold run."""
    prompts = {str(i): [(i * 101 + j * 7) % 1900 + 3 for j in range(60)] for i in range(5)}
    reference = {k: cold(p).tokens for k, p in prompts.items()}
    policy = policy_for(engine, num_blocks=12, max_batch=2)
    for _ in range(2):  # the second round finds some prefixes cached, others evicted
        got = run_offline(engine, policy, {k: params(p) for k, p in prompts.items()})
        assert {k: r.tokens for k, r in got.items()} == reference
        policy.pool.check()
    assert policy.pool.num_used_blocks == 0 and len(policy.pool.by_hash) <= 12


def test_an_aborted_request_releases_its_blocks_while_shared_ones_stay_alive(engine, cold):
    policy = policy_for(engine)
    run_offline(engine, policy, {"warmup": params(SHARED[:64], 1)})
    shared = policy.pool.match_prefix(
        [r for r in policy.pool.by_hash][:3]
    )
    assert len(shared) == 3
    keep, leave = SHARED[:64] + [7, 8, 9], SHARED[:64] + [10, 11, 12]
    alone = cold(keep, 24)

    def abort_midway(plan):
        if plan.step == 4:
            assert policy.abort("leave") == "running"
            assert all(policy.pool.refcount[b] == 1 for b in shared)  # still held by "keep"

    got = run_offline(
        engine, policy, {"keep": params(keep, 24), "leave": params(leave, 24)}, on_step=abort_midway
    )
    assert got["keep"].tokens == alone.tokens
    assert got["leave"].finish is None and len(got["leave"].tokens) < 24
    assert policy.pool.num_used_blocks == 0 and engine.num_open == 0
    policy.pool.check()


def test_no_prefix_cache_means_no_hit(engine):
    policy = policy_for(engine, caching=False)
    run_offline(engine, policy, {"a": params(SHARED[:100])})
    again = run_offline(engine, policy, {"a": params(SHARED[:100])})["a"]
    assert again.num_cached_tokens == 0 and policy.pool.by_hash == {}


def test_decode_steps_reuse_the_block_table_array_while_nothing_moves(engine):
    policy = policy_for(engine)
    builds_before = engine.kv.num_table_builds
    steps = []
    run_offline(engine, policy, {"a": params([5] * 3, 40), "b": params([6] * 3, 40)}, on_step=steps.append)
    builds = engine.kv.num_table_builds - builds_before
    # Rebuilt when a row gains a block (every 16 tokens) or a block moves, not every step.
    assert len(steps) >= 40 and builds <= 8
