"""Falcon-H1 (`falcon_h1`) against mlx-lm's `falcon_h1` on tiny random checkpoints: attention
and Mamba2 side by side in every layer, its multipliers folded into an original's weights,
quantized, and through the paged engine, whose rows carry each layer's K/V and Mamba2
state across chunks, mixed steps, lookahead and preemption."""

import json
import re

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError

import mlx.core as mx
import mlx_lm
import pytest

from tests.runtime.test_granitemoehybrid import assert_left_out_read_as_released
from tests.runtime.test_qwen3_5 import (
    PROMPTS,
    TOKENS,
    engine_for,
    greedy_tokens,
    policy_for,
    run,
)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, make_checkpoint):
    return make_checkpoint("falcon_h1", num_layers=3, tie_word_embeddings=request.param, hf_original=False)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return greedy_tokens(mlx_lm.load(str(checkpoint))[0])


@pytest.mark.parametrize("is_tied", [False, True], ids=["untied", "tied"])
def test_a_conversion_matches_mlx_lm(make_checkpoint, is_tied):
    path = make_checkpoint("falcon_h1", num_layers=3, tie_word_embeddings=is_tied, hf_original=False)
    assert mx.load(str(path / "model.safetensors"))["model.layers.0.mamba.conv1d.weight"].shape[-1] == 1
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


@pytest.mark.parametrize("is_tied", [False, True], ids=["untied", "tied"])
def test_an_originals_multipliers_are_folded_in_as_mlx_lm_folds_them(make_checkpoint, is_tied):
    """key_multiplier 1 (mlx-lm leaves it out: below), every other multiplier as released."""
    path = make_checkpoint("falcon_h1", num_layers=3, tie_word_embeddings=is_tied, hf_original=True, nemotron={"key_multiplier": 1.0})
    assert mx.load(str(path / "model.safetensors"))["model.layers.0.mamba.conv1d.weight"].shape[1] == 1
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_an_originals_keys_are_scaled_by_key_multiplier(make_checkpoint, tmp_path):
    """transformers (and vLLM, SGLang, llama.cpp) multiply the keys by key_multiplier;
    mlx-lm's sanitize folds it into a `key_proj` no checkpoint has. The same original with
    its k_proj pre-scaled is what mlx-lm computes for it."""
    path = make_checkpoint("falcon_h1", num_layers=3, hf_original=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    weights = mx.load(str(path / "model.safetensors"))
    key_multiplier = json.loads((path / "config.json").read_text())["key_multiplier"]
    for name in [n for n in weights if n.endswith("k_proj.weight")]:
        weights[name] = weights[name] * key_multiplier
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "pt"})
    got = load_model(path, keep_dtype=True).model(TOKENS)
    assert mx.allclose(got, mlx_lm.load(str(tmp_path))[0](TOKENS), atol=1e-4).item()
    assert not mx.allclose(got, mlx_lm.load(str(path))[0](TOKENS), atol=1e-3).item()


def test_a_quantized_conversion_matches_mlx_lms_quantized_model(make_checkpoint):
    path = make_checkpoint("falcon_h1", num_layers=3, quantize=(32, 4))
    assert "model.layers.0.mamba.in_proj.scales" in mx.load(str(path / "model.safetensors"))
    got, want = load_model(path).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


def test_every_layer_gets_a_kv_pool_and_a_recurrent_state(make_checkpoint):
    engine = engine_for(make_checkpoint("falcon_h1", num_layers=3, hf_original=False))
    assert len(engine.kv.keys) == 3
    # 4 rows x 3 layers x (3 conv inputs x (128 + 2 x 16) channels + 8 heads x 16 x 16), float32.
    assert engine.recurrent_bytes == 4 * 3 * (3 * 160 + 8 * 16 * 16) * 4


def test_a_row_alone_matches_mlx_lm(checkpoint, expected):
    engine = engine_for(checkpoint)
    for rid in PROMPTS:
        assert run(engine, policy_for(engine), [rid])[rid].tokens == tuple(expected[rid]), rid


@pytest.mark.parametrize("lookahead", [1, 2])
def test_rows_in_mixed_small_chunk_steps_match_mlx_lm(checkpoint, expected, lookahead):
    engine = engine_for(checkpoint)
    kinds = []

    def note(plan):  # steps with both a decode token and a prompt chunk of another row
        prefill = [span.is_prefill for span in plan.spans]
        kinds.append(any(prefill) and not all(prefill))

    got = run(engine, policy_for(engine, chunk=3, budget=6), PROMPTS, lookahead, on_step=note)
    assert {rid: list(r.tokens) for rid, r in got.items()} == expected and any(kinds)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_preempted_row_recomputes_its_state_from_the_start(checkpoint, expected, lookahead):
    engine = engine_for(checkpoint)
    policy = policy_for(engine, chunk=4, budget=8, num_blocks=12)  # too few for all four rows
    got = run(engine, policy, PROMPTS, lookahead)
    assert policy.num_preemptions > 0
    assert {rid: list(r.tokens) for rid, r in got.items()} == expected


def falcon_h1_0_5b(**changes):
    """Falcon-H1-0.5B-Instruct's shape and multipliers (mlx-lm's defaults are its)."""
    raw = {
        "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "attention_bias": False,
        "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375, "embedding_multiplier": 5.656854249492381,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 2048,
        "key_multiplier": 0.390625, "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 128,
        "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_d_state": 128,
        "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 24, "mamba_norm_before_gate": False,
        "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_use_mlp": True, "max_position_embeddings": 16384,
        "mlp_bias": False, "mlp_multipliers": [0.8838834764831844, 0.5859375], "num_attention_heads": 8,
        "num_hidden_layers": 36, "num_key_value_heads": 2, "projectors_bias": False, "rms_norm_eps": 1e-05,
        "rope_theta": 100000000000.0, "ssm_in_multiplier": 1.25,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False, "vocab_size": 32784,
        "eos_token_id": 11,
    }
    return {**raw, **changes}


def test_falcon_h1_0_5b_config_reads_as_released():
    config = config_from_dict(falcon_h1_0_5b())
    mamba = config.extra["mamba"]
    assert config.kv_layers == 36 and config.head_dim == 64 and mamba["conv_dim"] == 1536 + 2 * 128
    # 36 layers x (3 conv inputs x 1792 channels + 24 heads x 64 x 128), float32: ~29 MB a row.
    assert config.recurrent_row_bytes == 36 * (3 * 1792 + 24 * 64 * 128) * 4


def test_the_fields_a_config_leaves_out_read_as_transformers_defaults():
    """0.5B's values of these are FalconH1Config's defaults: left out, the same model."""
    optional = ("mamba_n_groups", "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias", "projectors_bias", "attention_bias")
    assert_left_out_read_as_released(falcon_h1_0_5b(), optional)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mamba_rms_norm": True}, "mamba_rms_norm=true"),
        ({"mamba_d_ssm": 1024}, "mamba_n_heads x mamba_d_head (24 x 64) is not mamba_d_ssm (1024)"),
        ({"mamba_n_groups": 5}, "mamba_n_heads (24) is not a multiple of mamba_n_groups (5)"),
        ({"key_multiplier": 0}, "key_multiplier must be a positive number"),
        ({"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers must be 5 positive numbers"),
        ({"mamba_d_conv": 1}, "mamba_d_conv must be at least 2"),
    ],
)
def test_a_malformed_config_is_one_line(changes, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict(falcon_h1_0_5b(**changes))


@pytest.mark.parametrize("stored", [(), (3, 64)], ids=["scalar", "too-few-rows"])
def test_a_misshapen_in_proj_in_an_original_is_a_one_line_refusal(make_checkpoint, tmp_path, stored):
    """Folding the multipliers read its rows: a 0-d tensor was an IndexError from the fold."""
    path = make_checkpoint("falcon_h1", num_layers=3, hf_original=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.layers.0.mamba.in_proj.weight"] = mx.zeros(stored)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape("tensor 'model.layers.0.mamba.in_proj.weight' has shape")):
        load_model(tmp_path)
