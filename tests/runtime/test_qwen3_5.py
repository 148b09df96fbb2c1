"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) against mlx-lm's `qwen3_5` on tiny
random checkpoints: the model alone, both weight forms, quantized, the multimodal
layout, and through the paged engine, whose rows carry recurrent state
(runtime/kv/recurrent.py) across chunks, mixed steps, lookahead, preemption, aborts,
a retried forward and ladder padding."""

import json
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.engine import FAULT_ENV, Engine
from runtime.errors import CadenceError, CheckpointError
from runtime.kv.base import RowSpan
from runtime.kv.blocks import BlockPool
from runtime.kv.recurrent import RecurrentStore
from runtime.ladder import BatchLadder
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import FinishCause, SequenceParams, StepBatch
from runtime.synth_configs import hf_config

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

TOKENS = mx.array([[1, 5, 9, 200, 33, 17, 4, 88, 120, 7, 301, 44]])
PROMPTS = {
    "a": [11, 305, 42, 977, 5, 1203, 64, 88, 300, 7, 1500, 19, 23, 99, 410],
    "b": [7, 8, 9],
    "c": [900, 5, 6, 31, 77, 2, 18, 260, 13],
    "d": [612],  # its token in no other prompt (the fault hook finds rows by it)
}
NEW_TOKENS = 10
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("qwen3_5_text", num_layers=4)  # 3 Gated DeltaNet layers, then attention


def reference(path: Path):
    """mlx-lm's model: a flat config is its `qwen3_5` (`qwen3_5_moe`) text config, whatever
    it names (mlx-lm has no `qwen3_5_text`)."""
    is_moe = "moe" in json.loads((path / "config.json").read_text())["model_type"]
    model, _ = mlx_lm.load(str(path), model_config={"model_type": "qwen3_5_moe" if is_moe else "qwen3_5"})
    return model


def greedy_tokens(model) -> dict[str, list[int]]:
    """mlx-lm's greedy tokens for each of PROMPTS (the hybrid families' tests share these
    prompts and the engine helpers below)."""
    return {
        rid: [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS)]
        for rid, prompt in PROMPTS.items()
    }


@pytest.fixture(scope="module")
def expected(checkpoint):
    return greedy_tokens(reference(checkpoint))


def engine_for(checkpoint, **kwargs):
    return Engine(load_model(checkpoint), **{"max_batch": 4, "block_size": BLOCK, "kv_budget": 1 << 22, **kwargs})


def policy_for(engine, *, chunk=256, budget=512, solo=0, num_blocks=None):
    pool = BlockPool(num_blocks or engine.kv.num_blocks, BLOCK, is_caching=False, layout=engine.kv.layout)
    return FcfsScheduler(engine.max_batch, pool, engine.max_context, chunk, budget, solo)


def params(rid, max_tokens=NEW_TOKENS, **kwargs):
    return SequenceParams(tuple(PROMPTS[rid]), max_tokens=max_tokens, ignore_eos=True, request_id=rid, **kwargs)


def run(engine, policy, rids, lookahead=1, on_step=None):
    got = run_offline(engine, policy, {rid: params(rid) for rid in rids}, lookahead=lookahead, on_step=on_step)
    # Every row's state freed (a family's all-attention variant, e.g. Granite 4.0-micro, has none).
    assert engine.num_open == 0 and len(engine.states or ()) == 0
    return got


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"])
@pytest.mark.parametrize("is_original", [True, False], ids=["hf-original", "mlx-converted"])
@pytest.mark.parametrize("is_tied", [True, False], ids=["tied", "untied"])
def test_logits_match_mlx_lm_in_both_weight_forms_and_layouts(make_checkpoint, family, is_original, is_tied):
    path = make_checkpoint(family, num_layers=4, hf_original=is_original, tie_word_embeddings=is_tied)
    got, want = load_model(path, keep_dtype=True).model(TOKENS), reference(path)(TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_both_weight_forms_load_to_the_same_logits(make_checkpoint, family):
    original = make_checkpoint(family, num_layers=4, hf_original=True)
    converted = make_checkpoint(family, num_layers=4, hf_original=False)
    stored = mx.load(str(original / "model.safetensors"))
    assert stored["model.language_model.layers.0.linear_attn.conv1d.weight"].shape[1] == 1
    assert ("model.language_model.layers.0.mlp.experts.gate_up_proj" in stored) == (family == "qwen3_5_moe")
    assert any(name.startswith("model.visual.") for name in stored) and "mtp.norm.weight" in stored
    a, b = (load_model(p, keep_dtype=True).model(TOKENS) for p in (original, converted))
    assert mx.array_equal(a, b).item()


def test_experts_stored_one_tensor_each_load_as_the_fused_ones(make_checkpoint, tmp_path):
    """Older exports (Qwen3-Next's) store `mlp.experts.{e}.gate_proj.weight` and so on."""
    fused = make_checkpoint("qwen3_5_moe_text", num_layers=4)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((fused / name).read_bytes())
    weights = mx.load(str(fused / "model.safetensors"))
    for name in [n for n in weights if n.endswith(".experts.gate_up_proj")]:
        prefix = name.removesuffix(".gate_up_proj")
        gate, up = mx.split(weights.pop(name), 2, axis=-2)
        down = weights.pop(f"{prefix}.down_proj")
        for e in range(gate.shape[0]):
            for projection, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                weights[f"{prefix}.{e}.{projection}.weight"] = mx.contiguous(w[e])
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "pt"})
    a, b = (load_model(p, keep_dtype=True).model(TOKENS) for p in (fused, tmp_path))
    assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"])
def test_a_quantized_checkpoint_matches_mlx_lms_quantized_model(make_checkpoint, family):
    path = make_checkpoint(family, num_layers=4, quantize=(32, 4))
    got, want = load_model(path).model(TOKENS), reference(path)(TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


def test_a_bfloat16_checkpoint_kept_in_its_dtype_matches_mlx_lm(make_checkpoint):
    path = make_checkpoint("qwen3_5_text", num_layers=4, dtype="bfloat16")
    got, want = load_model(path, keep_dtype=True).model(TOKENS), reference(path)(TOKENS)
    assert got.dtype == want.dtype == mx.bfloat16
    assert mx.array_equal(got, want).item()


def test_only_the_attention_layers_get_kv_pools_and_the_budget_holds_the_states(checkpoint):
    engine = engine_for(checkpoint)
    config = engine.config
    assert config.extra["linear_layers"] == (True, True, True, False) and config.kv_layers == 1
    assert len(engine.kv.keys) == 1
    # 3 layers x (3 conv inputs of 2*32 + 64 channels, and a 4 x 16 x 16 state), float32.
    assert config.recurrent_row_bytes == 3 * (3 * 128 + 4 * 16 * 16) * 4
    assert engine.recurrent_bytes == 4 * config.recurrent_row_bytes
    # ... and as many snapshots of it for the prefix cache (runtime/kv/snapshots.py).
    assert engine.num_snapshots == 4 and engine.snapshot_bytes == engine.recurrent_bytes
    states = engine.recurrent_bytes + engine.snapshot_bytes
    assert engine.kv.nbytes + states <= 1 << 22
    assert engine.kv.nbytes > (1 << 22) - states - engine.bytes_per_block
    assert engine_for(checkpoint, num_snapshots=0).kv.nbytes > engine.kv.nbytes  # none kept, none held


def test_a_budget_the_rows_states_alone_outgrow_is_refused_naming_them(checkpoint):
    with pytest.raises(CadenceError, match="the linear-attention layers' state and its prefix-cache snapshots for --max-batch rows takes"):
        engine_for(checkpoint, kv_budget=1000)


def test_a_row_alone_matches_mlx_lm(checkpoint, expected):
    engine = engine_for(checkpoint)
    for rid in PROMPTS:
        assert run(engine, policy_for(engine), [rid])[rid].tokens == tuple(expected[rid]), rid


@pytest.mark.parametrize("lookahead", [1, 2])
@pytest.mark.parametrize(("chunk", "budget"), [(256, 512), (3, 6)], ids=["whole-prompts", "small-chunks"])
def test_rows_in_mixed_steps_match_mlx_lm(checkpoint, expected, lookahead, chunk, budget):
    """Small chunks: each prompt over several steps, beside the others' decode tokens."""
    engine = engine_for(checkpoint)
    policy = policy_for(engine, chunk=chunk, budget=budget)
    kinds = []

    def note(plan):  # steps with both a decode token and a prompt chunk of another row
        prefill = [span.is_prefill for span in plan.spans]
        kinds.append(any(prefill) and not all(prefill))

    got = run(engine, policy, PROMPTS, lookahead, on_step=note)
    assert {rid: list(r.tokens) for rid, r in got.items()} == expected
    assert any(kinds) or chunk == 256


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_preempted_row_recomputes_its_state_from_the_start(checkpoint, expected, lookahead):
    engine = engine_for(checkpoint)
    policy = policy_for(engine, chunk=4, budget=8, num_blocks=12)  # too few for all four rows
    held = []

    def note(plan):  # this plan's preempted rows are still running in the engine
        # (No states at all for a family's all-attention variant, e.g. Granite 4.0-micro.)
        held.append(len(engine.states or ()) - len(policy.running) - len(plan.preempted))

    got = run(engine, policy, PROMPTS, lookahead, on_step=note)
    assert policy.num_preemptions > 0
    assert max(held) <= 0  # a waiting (preempted) row holds no state
    assert {rid: list(r.tokens) for rid, r in got.items()} == expected


def test_an_aborted_neighbour_leaves_the_other_rows_as_they_were(checkpoint, expected):
    engine = engine_for(checkpoint)
    policy = policy_for(engine, chunk=3, budget=6)
    steps = []

    def abort_c(plan):
        steps.append(plan)
        if len(steps) == 6:
            policy.abort("c")

    got = run(engine, policy, PROMPTS, 2, on_step=abort_c)
    assert len(got["c"].tokens) < NEW_TOKENS
    assert {rid: list(got[rid].tokens) for rid in "abd"} == {rid: expected[rid] for rid in "abd"}


@pytest.mark.parametrize("fault", [":0", ":3"])
def test_a_forward_retried_in_halves_commits_no_half_updated_state(checkpoint, expected, monkeypatch, fault):
    """The fault raises once every layer of the forward is built: had the first try
    kept its states, the healthy rows' retries would start from advanced ones."""
    monkeypatch.setenv(FAULT_ENV, f"{PROMPTS['d'][0]}{fault}")
    engine = engine_for(checkpoint)
    got = run(engine, policy_for(engine, chunk=3, budget=6), PROMPTS, 1)
    assert got["d"].finish is FinishCause.ERROR
    assert {rid: list(got[rid].tokens) for rid in "abc"} == {rid: expected[rid] for rid in "abc"}


def test_ladder_pads_never_touch_a_rows_state(checkpoint, expected):
    engine = engine_for(checkpoint)
    engine.ladder = BatchLadder(tuple([10.0] * 7 + [1.0] * 9))  # 1..7 tokens run as 8
    got = run(engine, policy_for(engine, chunk=3, budget=6), PROMPTS, 2)
    assert {rid: list(r.tokens) for rid, r in got.items()} == expected


def test_a_row_stopped_by_a_stop_token_drops_its_speculative_step(checkpoint, expected):
    engine = engine_for(checkpoint)
    stop = expected["a"][4]  # the 5th token ends it while the 6th's step is queued
    requests = {
        "a": SequenceParams(tuple(PROMPTS["a"]), max_tokens=NEW_TOKENS, stop_token_ids=frozenset([stop])),
        "b": params("b"),
    }
    got = run_offline(engine, policy_for(engine), requests, lookahead=2)
    assert list(got["a"].tokens) == expected["a"][: expected["a"].index(stop) + 1]
    assert list(got["b"].tokens) == expected["b"] and len(engine.states) == 0


def test_a_span_not_starting_where_its_rows_state_is_fails(checkpoint):
    store = RecurrentStore()
    with pytest.raises(ValueError, match="row 7: its recurrent state is at position 0, the span starts at 16"):
        store.step([RowSpan(7, 16, 1, (0,) * 5)])  # a cached prefix: no state for it
    engine = engine_for(checkpoint)
    seq = engine.open(SequenceParams((1, 2, 3), max_tokens=2))
    engine.step(StepBatch((RowSpan(seq.seq_id, 0, 3, (0,)),)))
    assert len(engine.states) == 1
    (failed,) = engine.step(StepBatch((RowSpan(seq.seq_id, 1, 3, (0,)),)))  # not where it is
    assert failed.finish is FinishCause.ERROR and "recurrent state is at position 3" in failed.error
    engine.close(seq)
    assert len(engine.states) == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"num_experts": 2, "num_experts_per_tok": 4, "moe_intermediate_size": 8},
            r"num_experts_per_tok \(4\) is more than the 2 experts",
        ),
        ({"attn_output_gate": False}, "attn_output_gate=false is not supported"),
        ({"layer_types": ["full_attention"]}, "layer_types needs 4 entries"),
        ({"layer_types": ["linear_attention"] * 4}, "needs at least one full_attention layer"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim at least 2"),
        ({"layer_types": None, "full_attention_interval": 0}, "full_attention_interval.*must be positive, got 0"),
        ({"rope_parameters": {"partial_rotary_factor": 1.5}}, r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
        ({"rope_parameters": {"partial_rotary_factor": 0}}, r"partial_rotary_factor must be in \(0, 1\], got 0"),
        ({"rope_parameters": {"partial_rotary_factor": True}}, r"partial_rotary_factor must be in \(0, 1\], got True"),
    ],
)
def test_settings_it_cannot_run_are_one_line_errors(fields, message):
    raw = {**hf_qwen3_5(), **fields}
    with pytest.raises(CheckpointError, match=message):
        config_from_dict({name: value for name, value in raw.items() if value is not None})


def test_fields_a_config_leaves_out_take_mlx_lms_defaults():
    """mlx-lm's ModelArgs: a conv kernel of 4, the output gate on, experts' weights
    renormalized; the rotated part is rope_parameters' partial_rotary_factor."""
    raw = hf_qwen3_5()
    for name in ("linear_conv_kernel_dim", "attn_output_gate"):
        del raw[name]
    raw["rope_parameters"] = {**raw["rope_parameters"], "partial_rotary_factor": 0.5}
    config = config_from_dict(raw)
    assert config.extra["linear"]["conv_kernel"] == 4
    assert config.extra["rotary_dims"] == config.head_dim // 2 == 8
    experts = {**hf_qwen3_5(), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    assert config_from_dict(experts).extra["experts"].normalize is True
    headless = hf_qwen3_5()
    del headless["head_dim"]  # hidden_size / num_attention_heads: 16, a quarter of it turned
    assert config_from_dict(headless).extra["rotary_dims"] == 4


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_a_flat_config_of_the_multimodal_type_reads_as_its_text_model(model_type):
    raw = {**hf_qwen3_5(), "model_type": model_type}
    if "moe" in model_type:
        raw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    assert config_from_dict(raw).model_type == f"{model_type}_text"


def test_attention_bias_gives_the_full_attention_layers_biases_as_mlx_lm_does(make_checkpoint, tmp_path):
    path = make_checkpoint("qwen3_5_text", num_layers=4)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "attention_bias": True}))
    weights = mx.load(str(path / "model.safetensors"))
    mx.random.seed(5)
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rows = weights[f"model.layers.3.self_attn.{projection}.weight"].shape[0]
        weights[f"model.layers.3.self_attn.{projection}.bias"] = mx.random.normal((rows,))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "pt"})
    got, want = load_model(tmp_path, keep_dtype=True).model(TOKENS), reference(tmp_path)(TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_rows_of_the_experts_model_in_mixed_steps_match_mlx_lm(make_checkpoint):
    path = make_checkpoint("qwen3_5_moe", num_layers=4)
    model = reference(path)
    want = {
        rid: [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS)]
        for rid, prompt in PROMPTS.items()
    }
    engine = engine_for(path)
    got = run(engine, policy_for(engine, chunk=3, budget=6), PROMPTS, 2)
    assert {rid: list(r.tokens) for rid, r in got.items()} == want


def test_full_attention_interval_places_the_attention_layers_without_layer_types():
    raw = {**hf_qwen3_5(num_layers=8), "full_attention_interval": 2}
    del raw["layer_types"]
    assert config_from_dict(raw).extra["linear_layers"] == (True, False) * 4


def hf_qwen3_5(num_layers=4):
    return hf_config(
        "qwen3_5_text", vocab_size=512, eos_token_id=[1], hidden_size=64, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, intermediate_size=128,
    )


def test_a_row_left_out_of_a_step_keeps_a_copy_of_its_state_not_the_batch():
    """Decoding rows' states are held as one batch; a row that sits out a step must not
    keep the others' (a constrained row awaiting its sample, a prompt without budget)."""
    store = RecurrentStore()
    spans = [RowSpan(r, 0, 1, (0,)) for r in range(3)]

    def forward(spans):
        step = store.step(spans)
        n = len(spans)
        step.convolve(0, mx.ones((n, 8)), mx.ones((8, 4)))
        step.delta_rule(0, *(mx.ones((n, 2, 4)) for _ in range(3)), mx.ones((n, 2)), mx.ones((n, 2)))
        store.commit(step)

    forward(spans)
    batch = store._rows[0].delta[0].batch
    assert all(store._rows[r].delta[0].batch is batch for r in range(3))  # held as one
    forward([RowSpan(r, 1, 1, (0,)) for r in (0, 1)])  # row 2 sits out
    sat_out = store._rows[2]
    assert [h.batch.shape[0] for h in (*sat_out.conv, *sat_out.delta)] == [1, 1]
    assert mx.array_equal(sat_out.delta[0].array, batch[2]).item()


def test_a_model_ending_in_a_linear_attention_layer_matches_mlx_lm(make_checkpoint):
    """Its last layer projects out only the sampling tokens (`keep`) after the recurrence
    ran over every token."""
    path = make_checkpoint("qwen3_5_text", num_layers=6)  # layers 4 and 5 linear
    model = reference(path)
    want = {
        rid: [int(t) for t, _ in generate_step(mx.array(PROMPTS[rid]), model, max_tokens=NEW_TOKENS)]
        for rid in "ab"
    }
    engine = engine_for(path)
    got = run(engine, policy_for(engine, chunk=3, budget=6), "ab", 1)
    assert {rid: list(r.tokens) for rid, r in got.items()} == want


@pytest.mark.parametrize("chunk", [256, 48], ids=["one-span", "spans-of-48"])
def test_a_long_prompt_computed_by_chunks_of_the_delta_rule_matches_mlx_lm(checkpoint, chunk):
    """150 tokens: three of the delta rule's 64-token chunks in one span (or spans of
    48, each one chunk), against mlx-lm's token-by-token recurrence."""
    prompt = [(37 * i) % 1500 + 3 for i in range(150)]
    want = [int(t) for t, _ in generate_step(mx.array(prompt), reference(checkpoint), max_tokens=NEW_TOKENS)]
    engine = engine_for(checkpoint)
    requests = {"long": SequenceParams(tuple(prompt), max_tokens=NEW_TOKENS, ignore_eos=True)}
    got = run_offline(engine, policy_for(engine, chunk=chunk, budget=chunk + 4), requests)
    assert list(got["long"].tokens) == want


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_an_experts_config_without_a_dense_intermediate_size_loads_as_the_releases_do(make_checkpoint, family):
    """Qwen3.5-35B-A3B's and the larger releases' configs give only moe_intermediate_size
    and shared_expert_intermediate_size: every layer routes."""
    path = make_checkpoint(family, num_layers=4)
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config", raw)
    del text["intermediate_size"]
    (path / "config.json").write_text(json.dumps(raw))
    got, want = load_model(path, keep_dtype=True).model(TOKENS), reference(path)(TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_yarn_as_the_model_card_sets_it_gains_only_the_rotated_part_as_mlx_lm_does(make_checkpoint, tmp_path):
    """Qwen's card extends the context with YaRN in rope_parameters; its gain (mscale)
    multiplies the rotated quarter of q and k, not the whole head."""
    path = make_checkpoint("qwen3_5", num_layers=4, head_dim=64)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["text_config"]["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(tmp_path, keep_dtype=True)
    assert model.model.model.layers[3].self_attn.rope.attention_factor > 1.2  # (0.1 ln 4 + 1)^2
    got, want = model.model(TOKENS), reference(tmp_path)(TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_near_zero_queries_and_keys_are_l2_normed_with_mlx_lms_eps(make_checkpoint, tmp_path):
    """The eps goes on the sum of squares (transformers' l2norm, mlx-lm's normalize_qk):
    through rms_norm, on the mean, it is divided by the head size. Only q and k small
    enough to meet it tell the two apart."""
    path = make_checkpoint("qwen3_5_text", num_layers=4)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    weights = mx.load(str(path / "model.safetensors"))
    for layer in range(3):
        name = f"model.layers.{layer}.linear_attn.in_proj_qkv.weight"
        qk = 2 * 2 * 16  # q's and k's channels: 2 key heads of 16
        weights[name] = mx.concatenate([weights[name][:qk] * 1e-3, weights[name][qk:]])
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "pt"})
    got, want = load_model(tmp_path, keep_dtype=True).model(TOKENS), reference(tmp_path)(TOKENS)
    # 1e-3: the CPU's silu and sigmoid (kernels, not mlx's exp) differ from mlx-lm's by
    # ~1e-6 relative, which reach these logits at ~2e-4; the eps put on the mean: ~12.
    assert mx.allclose(got, want, atol=1e-3).item()
