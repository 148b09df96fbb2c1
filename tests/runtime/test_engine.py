"""The Engine against mlx-lm (greedy parity) and against itself (batch invariance)."""

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.errors import CapacityError, RequestError
from runtime.kv.base import RowSpan
from runtime.kv.dense import DenseKV
from runtime.sequence import FinishCause, PrefillPiece, SequenceParams, StepBatch

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

NEW_TOKENS = 64
PROMPT = [11, 305, 42, 977, 5, 1203, 64, 88, 300, 7, 1500, 19]


def generate(engine, prompt, max_tokens=NEW_TOKENS, chunk=None, **params):
    """Greedy tokens for one sequence run as a batch of one."""
    seq = engine.open(SequenceParams(prompt_tokens=tuple(prompt), max_tokens=max_tokens, **params))
    prefill(engine, seq, len(prompt), chunk)
    tokens = []
    while True:
        (outcome,) = engine.step(StepBatch(decode=(seq,)))
        tokens.append(outcome.token)
        if outcome.finish:
            engine.close(seq)
            return tokens, outcome.finish


def prefill(engine, seq, prompt_len, chunk=None):
    todo = prompt_len - 1
    chunk = chunk or max(todo, 1)
    for start in range(0, todo, chunk):
        engine.prefill(seq, PrefillPiece(start, min(chunk, todo - start)))


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
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "mistral": ("mistral", dict()),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32)),
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


def test_quantized_parity_with_mlx_lm(make_checkpoint):
    path = make_checkpoint("llama", quantize=(32, 4), hidden_size=128, intermediate_size=256)
    # keep_dtype runs the quantized matmuls, as mlx-lm does: token-exact.
    engine = Engine(load_model(path, keep_dtype=True), max_batch=1)
    ours, _ = generate(engine, PROMPT, ignore_eos=True)
    assert ours == mlx_lm_greedy(path, PROMPT)


def test_quantized_expanded_to_float32_matches_quantized_logits(make_checkpoint):
    path = make_checkpoint("llama", quantize=(32, 4), hidden_size=128, intermediate_size=256)
    quantized = load_model(path, keep_dtype=True).model
    expanded = load_model(path).model
    assert expanded.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    tokens = mx.array([PROMPT])
    assert mx.allclose(expanded(tokens), quantized(tokens), atol=1e-3, rtol=1e-3).item()


def test_batch_rows_match_batch_of_one(make_checkpoint):
    """Every row of a B=4 step gives the same tokens as the same sequence alone."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=4)
    prompts = [PROMPT, PROMPT[:3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [900]]
    alone = [generate(engine, p, max_tokens=24, ignore_eos=True)[0] for p in prompts]

    seqs = []
    for prompt in prompts:
        seq = engine.open(SequenceParams(prompt_tokens=tuple(prompt), max_tokens=24, ignore_eos=True))
        prefill(engine, seq, len(prompt))
        seqs.append(seq)
    together = {s.seq_id: [] for s in seqs}
    batch = StepBatch(decode=tuple(seqs))
    for _ in range(24):
        for outcome in engine.step(batch):
            together[outcome.seq_id].append(outcome.token)
    assert [together[s.seq_id] for s in seqs] == alone


def test_batched_forward_logits_match_single_rows(make_checkpoint):
    """The decode forward over rows of different lengths equals each row's own forward."""
    loaded = load_model(make_checkpoint("qwen3"))
    model, cfg = loaded.model, loaded.config
    kv = DenseKV(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_slots=4, max_length=64)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:9], [3, 1, 4, 1, 5, 9, 2, 6]]
    slots = [kv.allocate() for _ in prompts]
    for slot, prompt in zip(slots, prompts, strict=True):
        model.hidden(mx.array([prompt[:-1]]), kv.forward([RowSpan(slot, 0, len(prompt) - 1)]))
    last = mx.array([[p[-1]] for p in prompts])
    rows = [RowSpan(slot, len(p) - 1, 1) for slot, p in zip(slots, prompts, strict=True)]
    batched = model(last, kv.forward(rows))[:, -1]  # [4, V]
    for i, prompt in enumerate(prompts):
        single = model(mx.array([prompt]))[:, -1]  # plain causal forward, no cache
        assert mx.allclose(batched[i], single[0], atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("chunk", [1, 3, 5, 64])
def test_chunked_prefill_equals_one_shot(make_checkpoint, chunk):
    engine = Engine(load_model(make_checkpoint("qwen2")), max_batch=1)
    one_shot, _ = generate(engine, PROMPT, max_tokens=16, ignore_eos=True)
    chunked, _ = generate(engine, PROMPT, max_tokens=16, chunk=chunk, ignore_eos=True)
    assert chunked == one_shot


def test_rows_join_and_leave_with_lookahead(make_checkpoint):
    """Continuous batching with step N+1 queued before N is read; nobody's tokens change."""
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=3)
    specs = [(PROMPT, 20), (PROMPT[:4], 5), ([42, 43, 44], 12), ([5, 6], 9)]
    alone = [generate(engine, p, max_tokens=n, ignore_eos=True)[0] for p, n in specs]

    waiting = list(enumerate(specs))
    live, got = {}, {i: [] for i in range(len(specs))}
    while waiting or live or engine.num_pending:
        while waiting and engine.num_free_slots:  # admit between steps
            i, (prompt, n) = waiting.pop(0)
            seq = engine.open(SequenceParams(prompt_tokens=tuple(prompt), max_tokens=n, ignore_eos=True))
            prefill(engine, seq, len(prompt))
            live[seq.seq_id] = (i, seq)
        if live:
            engine.submit(StepBatch(decode=tuple(seq for _, seq in live.values())))
        if engine.num_pending > 1 or not live:
            for outcome in engine.collect():
                i, seq = live[outcome.seq_id]
                got[i].append(outcome.token)
                if outcome.finish:
                    assert outcome.finish is FinishCause.LENGTH
                    del live[outcome.seq_id]
                    engine.close(seq)
    assert [got[i] for i in range(len(specs))] == alone


def test_speculative_step_after_finish_is_undone(make_checkpoint):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=2)
    seq = engine.open(SequenceParams(prompt_tokens=tuple(PROMPT), max_tokens=3, ignore_eos=True))
    prefill(engine, seq, len(PROMPT))
    batch = StepBatch(decode=(seq,))
    engine.submit(batch)
    outcomes = []
    for _ in range(3):
        engine.submit(batch)  # the third submit runs past max_tokens
        outcomes += engine.collect()
    outcomes += engine.collect()
    assert [o.finish for o in outcomes] == [None, None, FinishCause.LENGTH]
    snap = engine.snapshot(seq)
    assert snap.kv.length == len(PROMPT) + 3 - 1  # the last token was never fed back


def test_fault_in_one_row_leaves_the_others_running(make_checkpoint, monkeypatch):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=3)
    expected = generate(engine, PROMPT, max_tokens=10, ignore_eos=True)[0]
    seqs = []
    for _ in range(3):
        seq = engine.open(SequenceParams(prompt_tokens=tuple(PROMPT), max_tokens=10, ignore_eos=True))
        prefill(engine, seq, len(PROMPT))
        seqs.append(seq)
    faulty = seqs[1]
    original = engine._row_input

    def row_input(row):
        if row.handle == faulty and row.num_computed > len(PROMPT) + 2:
            raise RuntimeError("injected fault")
        return original(row)

    monkeypatch.setattr(engine, "_row_input", row_input)
    got = {s.seq_id: [] for s in seqs}
    failures = []
    for _ in range(10):
        for outcome in engine.step(StepBatch(decode=tuple(seqs))):
            if outcome.finish is FinishCause.ERROR:
                failures.append(outcome)
            else:
                got[outcome.seq_id].append(outcome.token)
    assert [f.seq_id for f in failures] == [faulty.seq_id]
    assert "injected fault" in failures[0].error
    assert got[seqs[0].seq_id] == expected and got[seqs[2].seq_id] == expected
    assert len(got[faulty.seq_id]) == 4


def test_snapshot_and_restore_resume_exactly(make_checkpoint):
    engine = Engine(load_model(make_checkpoint("qwen3")), max_batch=2)
    straight, _ = generate(engine, PROMPT, max_tokens=20, ignore_eos=True)
    params = SequenceParams(prompt_tokens=tuple(PROMPT), max_tokens=20, ignore_eos=True)
    seq = engine.open(params)
    prefill(engine, seq, len(PROMPT))
    first = [engine.step(StepBatch(decode=(seq,)))[0].token for _ in range(8)]
    snap = engine.snapshot(seq)
    engine.close(seq)
    resumed = engine.restore(snap)
    rest = []
    while True:
        (outcome,) = engine.step(StepBatch(decode=(resumed,)))
        rest.append(outcome.token)
        if outcome.finish:
            break
    assert first + rest == straight


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
        engine.open(SequenceParams(prompt_tokens=tuple(range(30)), max_tokens=8))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestError):
        engine.open(SequenceParams(prompt_tokens=(), max_tokens=8))
    with pytest.raises(RequestError):
        engine.open(SequenceParams(prompt_tokens=(10**9,), max_tokens=8))
    engine.open(SequenceParams(prompt_tokens=(1, 2), max_tokens=8))
    with pytest.raises(CapacityError):
        engine.open(SequenceParams(prompt_tokens=(1, 2), max_tokens=8))


def test_context_exhausted_without_max_tokens(make_checkpoint):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=1, max_context=16)
    tokens, finish = generate(engine, PROMPT, max_tokens=None, ignore_eos=True)
    assert finish is FinishCause.CONTEXT_EXHAUSTED
    assert len(PROMPT) + len(tokens) == 16
