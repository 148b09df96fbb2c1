"""Gemma 3 through the paged engine: sliding-window layers keep only their window,
with greedy parity against mlx-lm (its RotatingKVCache) on tiny random checkpoints."""

import itertools

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.kv.layout import NULL_BLOCK, SIZING_CHUNK
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from kernels.cpu_extension import cpu_extension
from tests.kernels.test_paged_attention import ATTENTION_PATHS
from tests.runtime.test_scheduler import planned_steps

WINDOW, BLOCK = 8, 4
PROMPT = [11, 305, 42, 977, 5, 1203, 64, 88, 300, 7, 1500, 19]
LONG_PROMPT = (PROMPT * 3)[:30]  # several windows long


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    # 4 layers, every 2nd global: groups of 2 layers, one full and one windowed.
    return make_checkpoint("gemma3_text", num_layers=4, num_kv_heads=1, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine(load_model(checkpoint), max_batch=4, block_size=BLOCK, kv_budget=1 << 22)


@pytest.fixture(scope="module")
def long_context_engine(make_checkpoint):
    """Room for prompts of several long chunks (the policy tests only use its layout)."""
    path = make_checkpoint(
        "gemma3_text", num_layers=4, num_kv_heads=1, sliding_window=WINDOW, max_position_embeddings=1 << 14
    )
    return Engine(load_model(path), max_batch=4, block_size=BLOCK, kv_budget=1 << 22)


def policy_for(engine, *, chunk=256, budget=512, solo=0, caching=True, num_blocks=None):
    pool = BlockPool(
        num_blocks or engine.kv.num_blocks, BLOCK, is_caching=caching, layout=engine.kv.layout
    )
    return FcfsScheduler(engine.max_batch, pool, engine.max_context, chunk, budget, solo)


def params(prompt, max_tokens):
    return SequenceParams(prompt_tokens=tuple(prompt), max_tokens=max_tokens, ignore_eos=True)


def mlx_lm_greedy(path, prompt, n):
    model, _ = mlx_lm.load(str(path))
    return [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_the_layout_has_a_full_and_a_windowed_group_each_with_its_own_pool(engine):
    layout = engine.kv.layout
    assert layout.group_windows == (None, WINDOW)
    assert layout.group_layers == ((1, 3), (0, 2)) and layout.group_of_layer == (1, 0, 1, 0)
    # The windowed pool holds max_batch rows at their largest: window + chunk, in blocks.
    assert layout.group_num_blocks == (engine.kv.num_blocks, 4 * (-(-(WINDOW - 1 + SIZING_CHUNK) // BLOCK) + 1))
    assert engine.kv.keys[0].shape[0] == layout.group_num_blocks[1] * BLOCK  # one KV head
    assert engine.kv.keys[1].shape[0] == engine.kv.num_blocks * BLOCK
    # The KV budget's accounting is what the storage really allocates.
    budget_bytes = engine.kv.num_blocks * engine.bytes_per_block + engine.window_bytes
    assert engine.kv.nbytes == budget_bytes <= 1 << 22


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_greedy_parity_past_the_window(checkpoint, engine, monkeypatch, path):
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    got = run_offline(engine, policy_for(engine), {"a": params(LONG_PROMPT, 40)})["a"]
    want = mlx_lm_greedy(checkpoint, LONG_PROMPT, 40)
    assert list(got.tokens) == want
    assert len(set(want)) > 4, "the test model should not be degenerate"


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_rows_of_different_lengths_with_chunks_straddling_the_window_edge(
    checkpoint, engine, monkeypatch, path
):
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    requests = {
        "short": params(PROMPT[:3], 24),
        "window": params(PROMPT[:WINDOW], 20),
        "past": params(PROMPT + PROMPT[:5], 20),
        "long": params(LONG_PROMPT + PROMPT, 16),  # 42 tokens in 7-token chunks
    }
    chunks = []

    def note(plan):
        chunks.extend((s.start, s.num_new) for s in plan.spans if s.num_new > 1)

    policy = policy_for(engine, chunk=7, budget=12)
    got = run_offline(engine, policy, requests, on_step=note)
    # Chunks continuing a row past the window: each query's window reaches back before
    # the chunk, and later queries drop keys the first one saw; some start mid-block.
    assert any(start > 0 and start + n > WINDOW for start, n in chunks)
    assert any(start > WINDOW and start % BLOCK != 0 for start, _ in chunks)
    for request_id, request in requests.items():
        want = mlx_lm_greedy(checkpoint, list(request.prompt_tokens), request.max_tokens)
        assert list(got[request_id].tokens) == want, request_id
    policy.pool.check()
    assert policy.pool.num_used_blocks == 0


def test_a_prefix_cache_hit_past_the_window_keeps_parity(checkpoint, engine):
    policy = policy_for(engine)
    first = run_offline(engine, policy, {"a": params(LONG_PROMPT, 4)})["a"]
    again = LONG_PROMPT + [77, 78]
    warm = run_offline(engine, policy, {"b": params(again, 24)})["b"]
    assert first.num_cached_tokens == 0
    assert warm.num_cached_tokens == 28 > WINDOW  # 7 full blocks of the 30 shared tokens
    assert list(warm.tokens) == mlx_lm_greedy(checkpoint, again, 24)


@pytest.fixture(scope="module")
def every_layer_slides(make_checkpoint):
    """2 layers, the pattern's global layer past them: one group, windowed."""
    return make_checkpoint(
        "gemma3_text", num_layers=2, num_kv_heads=1, sliding_window=WINDOW, sliding_window_pattern=4
    )


def test_a_prefix_hit_past_the_window_when_every_layer_slides(every_layer_slides):
    """No full group: the first group's own table starts with NULL_BLOCK entries. (mlx-lm
    cannot load such a Gemma 3, so the oracle is a cold run without the cache.)"""
    engine = Engine(load_model(every_layer_slides), max_batch=2, block_size=BLOCK, kv_budget=1 << 22)
    assert engine.kv.layout.group_windows == (WINDOW,)
    policy = policy_for(engine)
    run_offline(engine, policy, {"a": params(LONG_PROMPT, 4)})
    again = LONG_PROMPT + [77, 78]
    warm = run_offline(engine, policy, {"b": params(again, 24)})["b"]
    cold = run_offline(engine, policy_for(engine, caching=False), {"c": params(again, 24)})["c"]
    assert warm.num_cached_tokens == 28 > WINDOW and cold.num_cached_tokens == 0
    assert list(warm.tokens) == list(cold.tokens)
    assert len(set(cold.tokens)) > 4, "the test model should not be degenerate"
    policy.pool.check()
    assert policy.pool.num_used_blocks == 0


def test_when_every_layer_slides_a_pool_smaller_than_a_window_bounds_the_context(
    every_layer_slides,
):
    """A row past the pool would wait forever for a block: it is refused up front."""
    engine = Engine(load_model(every_layer_slides), max_batch=2, block_size=BLOCK, kv_budget=1)
    assert engine.kv.num_blocks == 1 and engine.max_context == BLOCK
    requests = {"fits": params(PROMPT[:2], 2), "outgrows": params(PROMPT[:2], 8)}
    got = run_offline(engine, policy_for(engine), requests)
    assert len(got["fits"].tokens) == 2
    assert got["outgrows"].error == (
        "the KV budget holds 4 tokens in all (--kv-budget); the prompt has 2 tokens "
        "and max_tokens asks for 8 more"
    )


def test_a_hit_needs_the_windowed_blocks_too(engine):
    """Full-group blocks cached but the window's blocks evicted: not a hit that far."""
    pool = policy_for(engine).pool
    hashes = [bytes([i]) * 16 for i in range(6)]
    tables = pool.new_tables()
    pool.grow_tables(tables, 6)
    for i, h in enumerate(hashes):
        pool.publish_tables(tables, i, h)
    full, windowed = pool.match_tables(hashes)
    assert full == tables[0] and windowed == [NULL_BLOCK] * 4 + tables[1][4:]
    pool.release_tables(tables)
    window_pool = pool.group_pools[1]
    window_pool.by_hash.pop(hashes[5])  # the window's last block is gone
    window_pool.block_hash[tables[1][5]] = None
    window_pool.cached.pop(tables[1][5])
    window_pool.free.append(tables[1][5])
    full, windowed = pool.match_tables(hashes)
    # 5 blocks: the window before position 20 reads blocks 3 and 4, both still cached.
    assert len(full) == 5 and windowed == [NULL_BLOCK] * 3 + tables[1][3:5]


def test_a_long_row_gives_its_windowed_blocks_back_as_it_goes(engine):
    policy = policy_for(engine, caching=False)
    free_counts, tables = [], []

    def note(plan):
        free_counts.append(policy.pool.group_pools[1].num_free_blocks)  # the windowed pool's
        if "a" in policy.running:
            tables.append([list(t) for t in policy.running["a"].tables])

    run_offline(engine, policy, {"a": params(PROMPT[:4], 60)}, on_step=note)
    full, windowed = tables[-1]
    assert len(full) == len(windowed) == 16  # 63 positions, 4 a block
    held = [b for b in windowed if b != NULL_BLOCK]
    assert len(held) <= WINDOW // BLOCK + 1  # the window's blocks, not the row's
    # While the row went on, some steps handed a block back: the free count rose.
    assert any(later > earlier for earlier, later in itertools.pairwise(free_counts))
    # Net, the windowed pool gave the row ~3 blocks, not the 16 the full one did.
    assert policy.pool.group_pools[1].num_blocks - min(free_counts) <= WINDOW // BLOCK + 1
    assert policy.pool.num_used_blocks == 0


@pytest.mark.parametrize(("chunk", "num_prompts"), [(4096, 1), (700, 3)])
def test_a_chunk_past_512_tokens_never_takes_the_windowed_block_a_decoding_row_needs(
    long_context_engine, chunk, num_prompts
):
    """The windowed pool holds max_batch rows at their largest for 512-token chunks
    (SIZING_CHUNK): a longer chunk shrinks to what it has left, but only after leaving
    every row the block its next token needs, so no decoding row misses a step."""
    engine = long_context_engine
    budget = engine.max_batch + num_prompts * chunk
    policy = policy_for(engine, chunk=chunk, budget=budget, solo=SIZING_CHUNK)
    for i in range(engine.max_batch - num_prompts):
        policy.add(f"decode{i}", params(PROMPT[i : i + 3], 200))
    steps = planned_steps(policy, check_pool=True)
    for _ in range(3):  # the short prompts are decoding when the long ones arrive
        next(steps)
    prompt_len = 3 * chunk
    for i in range(num_prompts):
        policy.add(f"prompt{i}", params(range(1000 * i, 1000 * i + prompt_len), 2))
    prompt_chunks = []
    for decoding, plan in steps:
        assert decoding <= {s.request_id for s in plan.spans}, f"step {plan.step} left a row out"
        prompt_chunks += [s.num_new for s in plan.spans if s.request_id.startswith("prompt")]
    assert sum(prompt_chunks) == num_prompts * prompt_len + num_prompts  # and their 2 tokens
    assert any(1 < n < chunk for n in prompt_chunks), "the windowed pool should have bound"
    assert policy.pool.num_used_blocks == 0


def test_a_pool_too_small_for_every_row_at_once_stays_correct(checkpoint, engine):
    """Rows wait, are preempted and resume from the cache under a tiny pool; every
    step leaves the pool consistent and every row keeps parity."""
    requests = {f"r{i}": params((PROMPT * 3)[i : i + 14 + 3 * i], 30) for i in range(4)}
    policy = policy_for(engine, chunk=8, budget=12, num_blocks=28)

    def check(plan):
        policy.pool.check()

    got = run_offline(engine, policy, requests, on_step=check)
    assert policy.num_preemptions > 0
    for request_id, request in requests.items():
        want = mlx_lm_greedy(checkpoint, list(request.prompt_tokens), request.max_tokens)
        assert list(got[request_id].tokens) == want, request_id
    assert policy.pool.num_used_blocks == 0


@pytest.mark.skipif(cpu_extension() is None, reason="the C++ kernels were not built here")
def test_the_mlps_gelu_runs_in_the_cpu_kernel_with_parity(checkpoint, engine):
    """Gemma's GELU-tanh is the extension's gated activation on the CPU (mlx's own is a
    single-threaded tanh), and the tokens stay mlx-lm's."""
    ext = cpu_extension()
    before = ext.num_gated_calls()
    got = run_offline(engine, policy_for(engine), {"a": params(PROMPT, 6)})["a"]
    assert ext.num_gated_calls() - before >= 4 * 6  # every layer, every step
    assert list(got.tokens) == mlx_lm_greedy(checkpoint, PROMPT, 6)
