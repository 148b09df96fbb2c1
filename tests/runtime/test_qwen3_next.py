"""Qwen3-Next (Qwen3.5's hybrid decoder from its own checkpoint layout) against mlx-lm's
`qwen3_next` on tiny random checkpoints: both weight forms, dense layers among the
sparse ones, quantized, and through the paged engine (mixed steps with chunked
prefill, lookahead 2, preemption and recompute)."""

from __future__ import annotations

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.synth_configs import hf_config

import mlx.core as mx
import mlx_lm
import pytest

from tests.runtime.test_qwen3_5 import PROMPTS, TOKENS, engine_for, greedy_tokens, policy_for, run


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("qwen3_next", num_layers=4)  # 3 Gated DeltaNet layers, then attention


def reference(path):
    model, _ = mlx_lm.load(str(path))
    return model


@pytest.fixture(scope="module")
def expected(checkpoint):
    return greedy_tokens(reference(checkpoint))


def run_all(engine, policy, lookahead=1, on_step=None) -> dict[str, list[int]]:
    got = run(engine, policy, PROMPTS, lookahead, on_step)
    return {rid: list(r.tokens) for rid, r in got.items()}


@pytest.mark.parametrize("is_original", [True, False], ids=["hf-original", "mlx-converted"])
@pytest.mark.parametrize("is_tied", [True, False], ids=["tied", "untied"])
def test_logits_match_mlx_lm_in_both_weight_forms(make_checkpoint, is_original, is_tied):
    path = make_checkpoint("qwen3_next", num_layers=4, hf_original=is_original, tie_word_embeddings=is_tied)
    stored = mx.load(str(path / "model.safetensors"))
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in stored
    assert ("model.layers.0.mlp.experts.0.up_proj.weight" in stored) == is_original
    assert (stored["model.layers.0.linear_attn.conv1d.weight"].shape[1] == 1) == is_original
    got, want = load_model(path, keep_dtype=True).model(TOKENS), reference(path)(TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_both_weight_forms_load_to_the_same_logits(make_checkpoint):
    original = make_checkpoint("qwen3_next", num_layers=4, hf_original=True)
    converted = make_checkpoint("qwen3_next", num_layers=4, hf_original=False)
    a, b = (load_model(p, keep_dtype=True).model(TOKENS) for p in (original, converted))
    assert mx.array_equal(a, b).item()


def test_dense_layers_among_sparse_ones_match_mlx_lm(make_checkpoint):
    path = make_checkpoint("qwen3_next", num_layers=4, dense_layers=(1,))
    config = load_model(path).config
    assert config.extra["experts"].sparse_layers == (True, False, True, True)
    got, want = load_model(path, keep_dtype=True).model(TOKENS), reference(path)(TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_a_quantized_checkpoint_matches_mlx_lms_quantized_model(make_checkpoint):
    path = make_checkpoint("qwen3_next", num_layers=4, quantize=(32, 4))
    assert "model.layers.0.linear_attn.in_proj_qkvz.scales" in mx.load(str(path / "model.safetensors"))
    got, want = load_model(path).model(TOKENS), reference(path)(TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


def test_rows_alone_match_mlx_lm(checkpoint, expected):
    engine = engine_for(checkpoint)
    for rid in PROMPTS:
        assert list(run(engine, policy_for(engine), [rid])[rid].tokens) == expected[rid], rid


@pytest.mark.parametrize("lookahead", [1, 2])
def test_rows_in_mixed_steps_with_chunked_prompts_match_mlx_lm(checkpoint, expected, lookahead):
    engine = engine_for(checkpoint)
    kinds = []

    def note(plan):  # steps with both a decode token and a prompt chunk of another row
        prefill = [span.is_prefill for span in plan.spans]
        kinds.append(any(prefill) and not all(prefill))

    assert run_all(engine, policy_for(engine, chunk=3, budget=6), lookahead, on_step=note) == expected
    assert any(kinds)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_preempted_row_recomputes_its_state_from_the_start(checkpoint, expected, lookahead):
    engine = engine_for(checkpoint)
    policy = policy_for(engine, chunk=4, budget=8, num_blocks=12)  # too few for all four rows
    assert run_all(engine, policy, lookahead) == expected
    assert policy.num_preemptions > 0


def hf_qwen3_next(**fields):
    raw = hf_config(
        "qwen3_next", vocab_size=512, eos_token_id=[1], hidden_size=64, num_layers=4,
        num_heads=4, num_kv_heads=2, intermediate_size=128,
    )
    return {**raw, **fields}


def test_its_config_reads_as_the_hybrid_model_with_qwen3_moes_experts():
    config = config_from_dict(hf_qwen3_next(decoder_sparse_step=2, norm_topk_prob=False))
    assert config.extra["linear_layers"] == (True, True, True, False)
    assert config.extra["experts"].sparse_layers == (False, True, False, True)
    assert config.extra["experts"].shared_intermediate_size == 256
    assert not config.extra["experts"].normalize
    assert config.num_kv_layers == 1 and config.recurrent_row_bytes > 0
    assert config_from_dict(hf_qwen3_next(num_experts=0)).extra["experts"] is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) is more than the 4 experts"),
        ({"mlp_only_layers": [4]}, "mlp_only_layers must list layer numbers in 0..3"),
        ({"full_attention_interval": 5}, "needs at least one full_attention layer"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ],
)
def test_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_dict(hf_qwen3_next(**fields))
