"""The Engine and the policy together (runtime.runner.run_offline): greedy parity with
mlx-lm, ragged mixed steps, lookahead, and the engine's own guarantees."""

from runtime.checkpoint import load_model
from runtime.engine import Engine, rows_are_finite
from runtime.errors import CadenceError, RequestError
from runtime.kv import paged
from runtime.kv.base import RowSpan
from runtime.kv.blocks import BlockPool
from runtime.kv.paged import PagedKV
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import FinishCause, SamplingParams, SequenceParams, StepBatch

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from kernels import paged_attention
from kernels.cpu_extension import cpu_extension
from tests.kernels.test_paged_attention import ATTENTION_PATHS

NEW_TOKENS = 64
PROMPT = [11, 305, 42, 977, 5, 1203, 64, 88, 300, 7, 1500, 19]


def policy_for(engine, *, max_batch=None, chunk=256, budget=512, num_blocks=None, caching=True):
    pool = BlockPool(num_blocks or engine.kv.num_blocks, engine.kv.block_size, is_caching=caching)
    return FcfsScheduler(max_batch or engine.max_batch, pool, engine.max_context, chunk, budget, 0)


def params(prompt, max_tokens=NEW_TOKENS, **kw):
    return SequenceParams(prompt_tokens=tuple(prompt), max_tokens=max_tokens, **kw)


def generate(engine, prompt, max_tokens=NEW_TOKENS, chunk=256, lookahead=1, **kw):
    """Greedy tokens for one sequence alone, and its finish cause."""
    result = run_offline(
        engine,
        policy_for(engine, chunk=chunk),
        {"a": params(prompt, max_tokens, **kw)},
        lookahead=lookahead,
    )["a"]
    return list(result.tokens), result.finish


def mlx_lm_greedy(path, prompt, n=NEW_TOKENS):
    model, _ = mlx_lm.load(str(path))
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for token, _ in steps]


PARITY_CASES = {
    "llama-gqa1": ("llama", dict(num_heads=4, num_kv_heads=4)),
    "llama-gqa2": ("llama", dict(num_heads=4, num_kv_heads=2)),
    "llama-gqa4": ("llama", dict(num_heads=8, num_kv_heads=2)),
    "llama-head-dim-24": ("llama", dict(num_heads=4, num_kv_heads=2, head_dim=24)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3-rope-scaling": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "mistral": ("mistral", dict()),
    # YaRN, and queries scaled past the original context of 16 (runtime/synth.py)
    "ministral3": ("ministral3", dict()),
    "mistral3": ("mistral3", dict(text_family="ministral3", tie_word_embeddings=True)),
    "mistral3-small": ("mistral3", dict(text_family="mistral")),
    "qwen3-yarn": (
        "qwen3",
        dict(head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    ),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=32, num_layers=3, dense_layers=(1,))),
    "mixtral": ("mixtral", dict(num_experts=6)),
    "qwen2_moe": ("qwen2_moe", dict(num_layers=3)),  # mlx-lm reads no dense layers for it
    # MLA (K 24 wide, V 16 padded to it), YaRN past 16 positions, its first layer dense
    "deepseek_v2": ("deepseek_v2", dict(num_layers=3)),
    # a q LoRA, sigmoid routing over 2 groups with a correction bias, no YaRN
    "deepseek_v3": ("deepseek_v3", dict(num_layers=3)),
    "glm4_moe_lite": ("glm4_moe_lite", dict(num_layers=3)),  # DeepSeek-V3's layout, V as wide as K
    # GQA, half of each head rotated in halves, qk norm, V3's router over 2 groups, a shared expert
    "glm4_moe": ("glm4_moe", dict(num_layers=3)),
    "llama-sharded": ("llama", dict(shards=3)),
}


@pytest.mark.parametrize("case", PARITY_CASES)
def test_greedy_parity_with_mlx_lm(make_checkpoint, case):
    family, shape = PARITY_CASES[case]
    path = make_checkpoint(family, **shape)
    engine = Engine(load_model(path), max_batch=2)
    ours, finish = generate(engine, PROMPT, ignore_eos=True)
    assert finish is FinishCause.LENGTH
    assert ours == mlx_lm_greedy(path, PROMPT)
    assert len(set(ours)) > 4, "the test model should not be degenerate"


MIXED_FAMILIES = [
    "llama-gqa4", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "llama3-rope-scaling",
    "ministral3", "qwen3-yarn", "deepseek_v2", "deepseek_v3",
    "glm4_moe_lite", "glm4_moe",
]


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("case", MIXED_FAMILIES)
def test_a_row_prefilling_in_chunks_beside_three_decoding_rows_keeps_mlx_lm_parity(
    make_checkpoint, monkeypatch, case, path
):
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    family, shape = PARITY_CASES[case]
    checkpoint = make_checkpoint(family, **shape)
    engine = Engine(load_model(checkpoint), max_batch=4, block_size=4)
    long_prompt = (PROMPT * 4)[:45]
    requests = {
        "a": params(PROMPT[:3], 24, ignore_eos=True),
        "b": params(PROMPT[3:8], 24, ignore_eos=True),
        "c": params(PROMPT[8:12], 24, ignore_eos=True),
        "long": params(long_prompt, 16, ignore_eos=True),
    }
    mixed_steps = []

    def note(plan):
        sizes = [s.num_new for s in plan.spans]
        if sum(n > 1 for n in sizes) == 1 and sum(n == 1 for n in sizes) == 3:
            mixed_steps.append(sizes)

    # A 12-token budget takes the three short prompts in step 1; the long one then
    # arrives in 7-token chunks (not a multiple of the 4-token block) beside them.
    policy = policy_for(engine, chunk=7, budget=12)
    ran_before = dict(paged_attention.dispatch_counts)
    ext = cpu_extension()
    copies_before = ext.num_pool_copies() if ext is not None else 0
    calls_before = ext.num_attention_calls() if ext is not None else 0
    got = run_offline(engine, policy, requests, on_step=note)
    assert len(mixed_steps) >= 5
    assert paged_attention.dispatch_counts[path] > ran_before.get(path, 0)  # no silent fallback
    if path == "native":  # steps write K/V into the pools' own buffers (see below)
        assert_pools_are_never_copied(ext, copies_before, calls_before)
    for other in {"gather", "fast", "native"} - {path}:
        assert paged_attention.dispatch_counts[other] == ran_before.get(other, 0), other
    for request_id, request in requests.items():
        want = mlx_lm_greedy(checkpoint, list(request.prompt_tokens), request.max_tokens)
        assert list(got[request_id].tokens) == want, request_id
    policy.pool.check()
    assert policy.pool.num_used_blocks == 0


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_logits_of_a_row_alone_and_in_a_mixed_step_agree(make_checkpoint, monkeypatch, path):
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    loaded = load_model(make_checkpoint("qwen3", head_dim=32))
    model, cfg = loaded.model, loaded.config
    kv = PagedKV(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.num_queries_per_kv,
        num_blocks=32,
        block_size=4,
    )
    decoding = [PROMPT, PROMPT[2:9], [3, 1, 4, 1, 5, 9, 2, 6]]
    tables = [(0, 1, 2, 3), (4, 5), (6, 7, 8)]
    # Step 1: the three decoding rows' prompts, all but their last token.
    first = [
        RowSpan(i, 0, len(p) - 1, t) for i, (p, t) in enumerate(zip(decoding, tables, strict=True))
    ]
    model.hidden(mx.array([sum((p[:-1] for p in decoding), [])]), kv.forward(first, 0))
    # Step 2: their last tokens beside a 9-token chunk of a fourth row.
    newcomer = [17, 2, 99, 4, 1000, 6, 7, 300, 9]
    spans = [
        RowSpan(i, len(p) - 1, 1, t) for i, (p, t) in enumerate(zip(decoding, tables, strict=True))
    ]
    spans.append(RowSpan(3, 0, len(newcomer), (9, 10, 11)))
    tokens = [p[-1] for p in decoding] + newcomer
    logits = model(mx.array([tokens]), kv.forward(spans, 0))[0]  # [N, V]
    for i, prompt in enumerate(decoding):
        alone = model(mx.array([prompt]))[0, -1]  # plain causal forward, no cache
        assert mx.allclose(logits[i], alone, atol=1e-4, rtol=1e-4).item()
    alone = model(mx.array([newcomer]))[0]
    assert mx.allclose(logits[3:], alone, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("length", [12, 48], ids=["one-op-blocks", "by-parts"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_kept_tokens_get_the_full_forwards_states(make_checkpoint, family, length):
    """`hidden(..., keep)`: the last layer runs past its attention for the kept tokens
    alone, and they come out as the full forward has them."""
    model = load_model(make_checkpoint(family)).model
    tokens = mx.array([(PROMPT * 4)[:length]])
    full = model.hidden(tokens)
    for keep in ([length - 1], [0, 5, length - 1], list(range(0, length, 5))):
        kept = model.hidden(tokens, None, mx.array(keep, mx.int32))
        assert kept.shape == (1, len(keep), full.shape[-1])
        assert mx.allclose(kept, full[:, mx.array(keep)], atol=1e-5, rtol=1e-5).item(), keep


def test_a_prompt_runs_the_last_layers_mlp_for_its_sampling_token_alone(
    make_checkpoint, monkeypatch
):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=2)
    layers = engine.model.model.layers
    rows_seen: dict[str, list[int]] = {"first": [], "last": []}
    for name, mlp in (("first", layers[0].mlp), ("last", layers[-1].mlp)):

        def as_block(h, block, run=mlp.as_block, seen=rows_seen[name]):
            seen.append(h.shape[1])
            return run(h, block)

        monkeypatch.setattr(mlp, "as_block", as_block)
    requests = {
        "a": params(PROMPT * 2, 2, ignore_eos=True),
        "b": params(PROMPT[:5], 2, ignore_eos=True),
    }
    got = run_offline(engine, policy_for(engine, chunk=64, budget=64), requests, lookahead=1)
    assert all(len(r.tokens) == 2 for r in got.values())
    # Step 1: both prompts, 29 tokens, 2 of them sampling; then a 2-row decode step.
    assert rows_seen["first"] == [29, 2]
    assert rows_seen["last"] == [2, 2]


@pytest.mark.parametrize(("chunk", "block_size"), [(1, 16), (3, 4), (5, 16), (7, 4), (64, 4)])
def test_chunked_prefill_equals_one_shot(make_checkpoint, chunk, block_size):
    engine = Engine(load_model(make_checkpoint("qwen2")), max_batch=1, block_size=block_size)
    one_shot, _ = generate(engine, PROMPT, max_tokens=16, ignore_eos=True)
    chunked, _ = generate(engine, PROMPT, max_tokens=16, chunk=chunk, ignore_eos=True)
    assert chunked == one_shot


def test_batch_rows_match_batch_of_one(make_checkpoint):
    """Every row of a B=4 batch gives the same tokens as the same sequence alone."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=4)
    prompts = [PROMPT, PROMPT[:3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [900]]
    alone = [generate(engine, p, max_tokens=24, ignore_eos=True)[0] for p in prompts]
    requests = {str(i): params(p, 24, ignore_eos=True) for i, p in enumerate(prompts)}
    together = run_offline(engine, policy_for(engine), requests)
    assert [list(together[str(i)].tokens) for i in range(4)] == alone


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_rows_join_and_leave_with_lookahead(make_checkpoint, lookahead):
    """Continuous batching with later steps queued before earlier ones are read."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=3)
    specs = [(PROMPT, 20), (PROMPT[:4], 5), ([42, 43, 44], 12), ([5, 6], 9), ([8] * 30, 3)]
    alone = [generate(engine, p, max_tokens=n, ignore_eos=True)[0] for p, n in specs]
    policy = policy_for(engine, chunk=8, budget=8)
    requests = {str(i): params(p, n, ignore_eos=True) for i, (p, n) in enumerate(specs)}
    got = run_offline(engine, policy, requests, lookahead=lookahead)
    assert [list(got[str(i)].tokens) for i in range(len(specs))] == alone
    assert all(r.finish is FinishCause.LENGTH for r in got.values())
    policy.pool.check()
    assert policy.pool.num_used_blocks == 0 and engine.num_open == 0


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_pool_too_small_for_every_request_preempts_and_each_gets_its_text_alone(
    make_checkpoint, lookahead
):
    """Preemption by recompute: the victims resume from their prompt and generated tokens."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=4, block_size=4)
    specs = [(PROMPT, 30, 0), (PROMPT[:5], 30, 1), ([42, 43, 44, 45], 30, 0), ([9] * 9, 30, 2)]
    alone = [generate(engine, p, max_tokens=n, ignore_eos=True)[0] for p, n, _ in specs]
    # 24 blocks of 4: the four rows need ~40 together, so some must yield and come back.
    policy = policy_for(engine, chunk=8, budget=12, num_blocks=24)
    requests = {
        str(i): params(p, n, ignore_eos=True, priority=prio) for i, (p, n, prio) in enumerate(specs)
    }
    got = run_offline(engine, policy, requests, lookahead=lookahead)
    assert [list(got[str(i)].tokens) for i in range(len(specs))] == alone
    assert policy.num_preemptions > 0
    policy.pool.check()
    assert policy.pool.num_used_blocks == 0 and engine.num_open == 0


def test_on_the_cpu_a_prompt_chunk_behind_another_step_runs_only_once_that_one_is_read(
    make_checkpoint, monkeypatch
):
    """Engine.defers_start: mx.async_eval on the CPU returns only when the step is nearly
    done, so starting a prompt chunk before the step ahead of it is read would hold that
    step's tokens back for the whole chunk. A decode-only step starts at once."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=2)
    assert engine.defers_start == (mx.default_device() == mx.cpu)
    engine.defers_start = True
    prompt_b = PROMPT[3:9]
    alone_a, alone_b = generate(engine, PROMPT, max_tokens=3)[0], generate(engine, prompt_b, max_tokens=2)[0]
    started: list[int] = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (started.append(len(a)), real_async_eval(*a)))
    a, b = engine.open(params(PROMPT, 3)), engine.open(params(prompt_b, 2))
    span = lambda seq, start, n, first: RowSpan(seq.seq_id, start, n, (first, first + 1))  # noqa: E731
    engine.submit(StepBatch((span(a, 0, len(PROMPT), 0),), 0))
    assert len(started) == 1  # nothing in flight: it starts at once
    engine.submit(StepBatch((span(a, len(PROMPT), 1, 0), span(b, 0, len(prompt_b), 2)), 0))
    assert len(started) == 1  # a prompt chunk, held back behind the first step
    first = engine.collect()
    engine.start_queued()
    assert len(started) == 2
    engine.start_queued()
    assert len(started) == 2  # a started step is not handed over twice
    engine.submit(StepBatch((span(a, len(PROMPT) + 1, 1, 0), span(b, len(prompt_b), 1, 2)), 0))
    assert len(started) == 3  # decoding rows only: started at once
    second, third = engine.collect(), engine.collect()
    tokens = {seq: [] for seq in (a.seq_id, b.seq_id)}
    for outcome in first + second + third:
        tokens[outcome.seq_id].append(outcome.token)
    engine.close(a)
    engine.close(b)
    assert tokens == {a.seq_id: alone_a, b.seq_id: alone_b}


def test_lookahead_2_finishes_rows_at_max_tokens_and_at_the_context_bound(make_checkpoint):
    """No speculative step runs past a row's max_tokens or context bound (it used to fail
    every row of the step with a CapacityError)."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=4, max_context=16)
    specs = {
        "max_tokens": (PROMPT[:5], 3),
        "context": (PROMPT[:6], None),  # runs until the 16-token context is full
        "other": (PROMPT[2:6], 8),
        "full": (PROMPT[:4], 12),  # its max_tokens ends exactly at the context bound
    }
    alone = {
        name: generate(engine, p, max_tokens=n, ignore_eos=True) for name, (p, n) in specs.items()
    }
    policy = policy_for(engine)
    requests = {name: params(p, n, ignore_eos=True) for name, (p, n) in specs.items()}
    steps = []
    got = run_offline(engine, policy, requests, lookahead=2, on_step=steps.append)
    for name in specs:
        assert (list(got[name].tokens), got[name].finish) == alone[name], name
    assert got["context"].finish is FinishCause.CONTEXT_EXHAUSTED
    assert len(PROMPT[:6]) + len(got["context"].tokens) == 16
    assert got["max_tokens"].finish is FinishCause.LENGTH and len(got["max_tokens"].tokens) == 3
    # No plan ever asked for a position at or past the context bound.
    assert max(s.start + s.num_new for plan in steps for s in plan.spans) <= 15
    assert policy.pool.num_used_blocks == 0


def test_rows_are_finite_does_not_overflow_in_half_precision():
    logits = mx.ones((2, 151_936), dtype=mx.float16)
    assert not mx.isfinite(logits.sum(axis=-1)).any().item()  # what a row sum would say
    assert rows_are_finite(logits).tolist() == [True, True]
    logits[1, 7] = mx.nan
    assert rows_are_finite(logits).tolist() == [True, False]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_large_vocabulary_model_is_not_failed(make_checkpoint, dtype):
    path = make_checkpoint("llama", dtype=dtype, vocab_size=151_936, tie_word_embeddings=True)
    loaded = load_model(path, keep_dtype=True)
    # Make every logit of a row the same sign, so their float16 sum overflows.
    embed = loaded.model.model.embed_tokens
    embed.weight = mx.broadcast_to(embed.weight[:1] * 4, embed.weight.shape).astype(
        embed.weight.dtype
    )
    if dtype == "float16":  # the defect's precondition: a row sum is inf
        logits = loaded.model(mx.array([PROMPT]))[0, -1]
        assert logits.dtype == mx.float16 and not mx.isfinite(logits.sum()).item()
    engine = Engine(loaded, max_batch=2)
    tokens, finish = generate(engine, PROMPT, max_tokens=4, ignore_eos=True)
    assert finish is FinishCause.LENGTH and len(tokens) == 4


def test_fault_in_one_row_leaves_the_others_running(make_checkpoint, monkeypatch):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=3)
    expected = generate(engine, PROMPT, max_tokens=10, ignore_eos=True)[0]
    original = engine._row_input

    def row_input(row, span):
        if row.params.request_id == "faulty" and row.num_generated >= 4:
            raise RuntimeError("injected fault")
        return original(row, span)

    monkeypatch.setattr(engine, "_row_input", row_input)
    requests = {
        rid: params(PROMPT, 10, ignore_eos=True, request_id=rid) for rid in ("a", "faulty", "b")
    }
    policy = policy_for(engine)
    got = run_offline(engine, policy, requests)
    assert got["faulty"].finish is FinishCause.ERROR and "injected fault" in got["faulty"].error
    assert len(got["faulty"].tokens) == 4
    assert list(got["a"].tokens) == expected and list(got["b"].tokens) == expected
    assert policy.pool.num_used_blocks == 0


def test_eos_and_stop_token_ids_finish_the_row(make_checkpoint):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=1)
    free_run, _ = generate(engine, PROMPT, max_tokens=12, ignore_eos=True)
    stop_at = free_run[5]
    tokens, finish = generate(engine, PROMPT, max_tokens=12, stop_token_ids=frozenset({stop_at}))
    assert finish is FinishCause.EOS
    assert tokens == free_run[: free_run.index(stop_at) + 1]


def test_open_refuses_what_cannot_fit(make_checkpoint):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=1, max_context=32)
    with pytest.raises(RequestError) as err:
        engine.open(params(range(30), 8))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestError):
        engine.open(params((), 8))
    with pytest.raises(RequestError):
        engine.open(params((10**9,), 8))


def test_a_request_larger_than_the_whole_kv_budget_is_refused_naming_it(make_checkpoint):
    loaded = load_model(make_checkpoint("llama"))
    small = Engine(loaded, max_batch=2, kv_budget=Engine(loaded).bytes_per_block * 3)
    assert small.kv.num_blocks == 3 and small.max_context == 48
    with pytest.raises(RequestError, match="KV budget") as err:
        small.open(params(range(1, 41), 10))
    assert err.value.code == "context_length_exceeded"
    tokens, finish = generate(small, range(1, 41), 8, ignore_eos=True)
    assert finish is FinishCause.LENGTH and len(tokens) == 8


def test_context_exhausted_without_max_tokens(make_checkpoint):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=1, max_context=16)
    tokens, finish = generate(engine, PROMPT, max_tokens=None, ignore_eos=True)
    assert finish is FinishCause.CONTEXT_EXHAUSTED
    assert len(PROMPT) + len(tokens) == 16


@pytest.mark.parametrize(("start", "num_new"), [(0, 13), (-1, 2), (4, 0)])
def test_a_span_outside_the_rows_tokens_is_that_rows_error(make_checkpoint, start, num_new):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=2)
    good, bad = engine.open(params(PROMPT, 4)), engine.open(params(PROMPT, 4))
    spans = (RowSpan(good.seq_id, 0, 12, (0,)), RowSpan(bad.seq_id, start, num_new, (1,)))
    outcomes = engine.step(StepBatch(spans))
    by_row = {o.seq_id: o for o in outcomes}
    assert by_row[bad.seq_id].finish is FinishCause.ERROR and "outside" in by_row[bad.seq_id].error
    assert by_row[good.seq_id].token is not None and by_row[good.seq_id].finish is None


@pytest.mark.parametrize(
    ("start", "num_new"), [(11, 2), (11, 1)], ids=["its last token and that", "its last token alone"]
)
def test_a_row_with_a_queued_sample_can_be_fed_only_that_sample(make_checkpoint, start, num_new):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=1)
    seq = engine.open(params(PROMPT, 4))
    engine.submit(StepBatch((RowSpan(seq.seq_id, 0, 12, (0,)),)))  # samples token 12
    engine.submit(StepBatch((RowSpan(seq.seq_id, start, num_new, (0,)),)))
    outcomes = engine.collect() + engine.collect()
    assert [o.finish for o in outcomes] == [FinishCause.ERROR]  # its queued sample is dropped
    assert "queued sample" in outcomes[0].error


@pytest.mark.parametrize(
    ("prompt", "max_tokens"), [(PROMPT, 1), (PROMPT + [1, 2, 3], None)], ids=["max_tokens", "context"]
)
def test_a_span_that_would_sample_past_the_rows_bounds_runs_no_forward(
    make_checkpoint, prompt, max_tokens
):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=1, max_context=16)
    seq = engine.open(params(prompt, max_tokens))
    engine.submit(StepBatch((RowSpan(seq.seq_id, 0, len(prompt), (0,)),)))  # its last token
    forwards = []
    engine.kv.forward = lambda spans, epoch: forwards.append(spans)
    engine.submit(StepBatch((RowSpan(seq.seq_id, len(prompt), 1, (0,)),)))
    assert forwards == []
    outcomes = engine.collect() + engine.collect()
    assert [o.finish for o in outcomes] == [FinishCause.LENGTH if max_tokens else FinishCause.CONTEXT_EXHAUSTED]


def test_a_block_size_out_of_range_is_refused_before_the_pool_is_sized(make_checkpoint):
    with pytest.raises(CadenceError, match="block_size"):
        Engine(load_model(make_checkpoint("llama")), max_batch=1, block_size=0)


def test_a_kv_pool_that_holds_the_whole_context_names_the_models_limit(make_checkpoint):
    loaded = load_model(make_checkpoint("llama"))
    per_block = Engine(loaded, max_batch=1).bytes_per_block
    engine = Engine(loaded, max_batch=1, max_context=32, kv_budget=per_block * 2)  # 2 x 16
    assert engine.kv_tokens == engine.max_context == 32 and engine.kv_bound is None
    with pytest.raises(RequestError, match="this model's maximum context length is 32"):
        engine.open(params(range(1, 41), 4))


def test_a_row_with_non_finite_logits_fails_alone(make_checkpoint, monkeypatch):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=2)
    expected = generate(engine, PROMPT, max_tokens=10, ignore_eos=True)[0]
    project = type(engine.model).project
    calls = []

    def poisoned(model, hidden):  # the second sampling row's logits turn NaN at call 4
        logits = project(model, hidden)
        calls.append(logits.shape[0])
        if len(calls) == 4 and logits.shape[0] == 2:
            logits = mx.concatenate([logits[:1], mx.full(logits[1:2].shape, mx.nan)])
        return logits

    monkeypatch.setattr(type(engine.model), "project", poisoned)
    requests = {"a": params(PROMPT, 10, ignore_eos=True), "b": params(PROMPT, 10, ignore_eos=True)}
    got = run_offline(engine, policy_for(engine), requests)
    assert (got["b"].finish, got["b"].error) == (FinishCause.ERROR, "non-finite logits")
    assert len(got["b"].tokens) == 3
    assert list(got["a"].tokens) == expected and got["a"].finish is FinishCause.LENGTH


def test_a_max_context_beyond_the_models_limit_is_an_error_not_a_silent_cap(make_checkpoint):
    loaded = load_model(make_checkpoint("llama"))  # max_position_embeddings 1024
    with pytest.raises(CadenceError, match="max_context 5000 is outside"):
        Engine(loaded, max_context=5000)
    assert Engine(loaded, max_context=1024).max_context == 1024


def test_logprobs_leave_greedy_tokens_unchanged_and_top_the_list(make_checkpoint, monkeypatch):
    """Greedy rows asking for logprobs get the same tokens; each token is the first of its
    top list, with its logprob. A faulty row splits the forward, so the halves' logprobs
    (one half asking for none) are joined too."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=4)
    expected = generate(engine, PROMPT, max_tokens=10, ignore_eos=True)[0]
    monkeypatch.setattr(engine, "_fault", (999, 3))
    asking = {"a": 5, "b": 0, "c": None}
    requests = {
        rid: params(PROMPT, 10, ignore_eos=True, sampling=SamplingParams(logprobs=n))
        for rid, n in asking.items()
    }
    requests["faulty"] = params([*PROMPT, 999], 10, ignore_eos=True)
    got = run_offline(engine, policy_for(engine), requests)
    assert got["faulty"].finish is FinishCause.ERROR
    for rid, n in asking.items():
        assert list(got[rid].tokens) == expected
        assert len(got[rid].logprobs) == (0 if n is None else 10)
    for entry, token in zip(got["a"].logprobs, expected, strict=True):
        assert len(entry.top) == 5 and entry.top[0] == (token, entry.logprob)
        assert entry.logprob == max(value for _, value in entry.top) and entry.logprob <= 0
    assert all(entry.top == () for entry in got["b"].logprobs)
    assert [e.logprob for e in got["b"].logprobs] == [e.logprob for e in got["a"].logprobs]


@pytest.mark.skipif(cpu_extension() is None, reason="the C++ kernels were not built here")
def test_prefill_only_steps_leave_the_pools_to_the_next_steps_write(make_checkpoint, monkeypatch):
    """A step that samples nothing is evaluated before the next is submitted: a queued
    reference to the pools then would make the next step's K/V write copy every pool.
    Shown with the pools' in-place writes off (POOLS_IN_PLACE), which would hide it: a
    write then copies a pool exactly when something still holds it (13 copies without
    the evaluation)."""
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "native")
    monkeypatch.setattr(paged, "POOLS_IN_PLACE", False)
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=2, block_size=4)
    policy = policy_for(engine, chunk=7, budget=7)  # 45 prompt tokens: six steps sample nothing
    ext = cpu_extension()
    copies_before, calls_before = ext.num_pool_copies(), ext.num_attention_calls()
    # One token: the last chunk samples it, and no step is ever queued behind another.
    got = run_offline(engine, policy, {"a": params((PROMPT * 4)[:45], 1, ignore_eos=True)})
    assert len(got["a"].tokens) == 1
    assert_pools_are_never_copied(ext, copies_before, calls_before)


@pytest.mark.skipif(cpu_extension() is None, reason="the C++ kernels were not built here")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stacked_projections_rotate_q_and_k_inside_the_attention_op(make_checkpoint, monkeypatch, family):
    """On the CPU with q/k/v stacked at load, each layer's RoPE runs inside the native
    attention op (ForwardKV.attend_stacked): no RoPE op of its own, same tokens."""
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    loaded = load_model(make_checkpoint(family))
    assert "qkv_proj" in loaded.model.model.layers[0].self_attn
    engine = Engine(loaded, max_batch=2)
    ext = cpu_extension()
    ropes, calls = ext.num_rope_calls(), ext.num_attention_calls()
    tokens, _ = generate(engine, PROMPT, max_tokens=6)
    assert ext.num_attention_calls() > calls and ext.num_rope_calls() == ropes
    assert tokens == mlx_lm_greedy(make_checkpoint(family), PROMPT, 6)


def assert_pools_are_never_copied(ext, copies_before, calls_before):
    """Each native attention call writes two pools, taking their buffers over. The
    engine's pools are written in place even while mlx still holds them for an op queued
    before (runtime/kv/paged.py, POOLS_IN_PLACE): no write may copy one (copying on every
    step ran at 7 tok/s instead of 54)."""
    writes = 2 * (ext.num_attention_calls() - calls_before)
    assert writes > 0
    assert ext.num_pool_copies() == copies_before


@pytest.mark.skipif(cpu_extension() is None, reason="the C++ kernels were not built here")
def test_the_engine_writes_k_v_into_its_pools_even_while_they_are_held(make_checkpoint, monkeypatch):
    """mlx still holds a step's pools while an op queued before it has not run; the
    engine's writes take them over all the same (PagedKV's POOLS_IN_PLACE). Held here by
    a reference, the deterministic stand-in for a step queued while the last one runs."""
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=2)
    ext = cpu_extension()
    held = list(engine.kv.keys) + list(engine.kv.values)
    copies, calls = ext.num_pool_copies(), ext.num_attention_calls()
    tokens, _ = generate(engine, PROMPT, max_tokens=6)
    assert len(tokens) == 6 and ext.num_attention_calls() > calls
    assert ext.num_pool_copies() == copies
    assert len(held) == 2 * len(engine.kv.keys)


def test_a_model_without_recurrent_state_keeps_no_snapshots_so_gets_no_snapshot_book(make_checkpoint):
    """The service builds a hybrid prefix cache's book only for an engine with snapshots
    (actors/service.py): a plain model's prefix cache hits on K/V alone."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=4)
    assert engine.num_snapshots == 0 and engine.snapshot_bytes == 0
