"""LFM2 (hybrid gated short convolutions + GQA attention) against mlx-lm's `lfm2` on tiny
random checkpoints: the model alone, both conv weight forms, quantized, and through the
paged engine, whose rows carry each conv layer's last inputs (runtime/kv/recurrent.py)
across chunks, mixed steps, lookahead and preemption."""

import re

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.synth_configs import hf_config

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from tests.runtime import test_qwen3_5
from tests.runtime.test_gguf import minimal_gguf, one_line_error
from tests.runtime.test_qwen3_5 import PROMPTS, TOKENS, engine_for, greedy_tokens, policy_for, run


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("lfm2", num_layers=4)  # conv, conv, attention, conv


@pytest.fixture(scope="module")
def expected(checkpoint):
    return greedy_tokens(mlx_lm.load(str(checkpoint))[0])


@pytest.mark.parametrize("is_original", [True, False], ids=["hf-original", "mlx-converted"])
def test_logits_match_mlx_lm_in_both_weight_forms(make_checkpoint, is_original):
    path = make_checkpoint("lfm2", num_layers=4, hf_original=is_original)
    stored = mx.load(str(path / "model.safetensors"))
    assert stored["model.layers.0.conv.conv.weight"].shape == ((64, 1, 3) if is_original else (64, 3, 1))
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_a_conv_bias_matches_mlx_lm(make_checkpoint, tmp_path):
    """`conv_bias: true` puts a bias on in_proj, the conv and out_proj."""
    path = make_checkpoint("lfm2", num_layers=4)
    config = (path / "config.json").read_text().replace('"conv_bias": false', '"conv_bias": true')
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    (tmp_path / "config.json").write_text(config)
    weights = mx.load(str(path / "model.safetensors"))
    for name in [n for n in weights if ".conv." in n and n.endswith(".weight")]:
        rows = weights[name].shape[0]
        weights[name.removesuffix(".weight") + ".bias"] = mx.linspace(-0.3, 0.3, rows)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "pt"})
    got, want = load_model(tmp_path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(tmp_path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()
    assert not mx.allclose(got, load_model(path, keep_dtype=True).model(TOKENS), atol=1e-2).item()


def test_a_quantized_checkpoint_matches_mlx_lms_quantized_model(make_checkpoint):
    path = make_checkpoint("lfm2", num_layers=4, quantize=(32, 4))
    assert "model.layers.0.conv.in_proj.scales" in mx.load(str(path / "model.safetensors"))
    got, want = load_model(path).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


def test_a_bfloat16_checkpoint_kept_in_its_dtype_matches_mlx_lm(make_checkpoint):
    path = make_checkpoint("lfm2", num_layers=4, dtype="bfloat16")
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert got.dtype == want.dtype == mx.bfloat16
    assert mx.array_equal(got, want).item()


def lfm2_config(**changes):
    raw = hf_config(
        "lfm2", vocab_size=512, eos_token_id=[2], hidden_size=1024, num_layers=16, num_heads=16,
        num_kv_heads=8, intermediate_size=128,
    )
    raw.update(full_attn_idxs=[2, 5, 8, 10, 12, 14], block_ff_dim=6656, block_multiple_of=256)
    raw.update(changes)
    return {name: value for name, value in raw.items() if value is not None}


def test_the_ffn_width_is_adjusted_as_the_releases_say():
    """LFM2-350M: block_ff_dim 6656 -> 2/3 of it, rounded up to 256: 4608 (its w1's rows)."""
    assert config_from_dict(lfm2_config()).intermediate_size == 4608
    assert config_from_dict(lfm2_config(block_ffn_dim_multiplier=1.5)).intermediate_size == 6656
    assert config_from_dict(lfm2_config(block_auto_adjust_ff_dim=False)).intermediate_size == 6656
    # Without block_ff_dim, intermediate_size is the width to adjust (transformers' name).
    assert config_from_dict(lfm2_config(block_ff_dim=None, intermediate_size=6656)).intermediate_size == 4608


def test_the_attention_layers_are_read_from_either_field():
    config = config_from_dict(lfm2_config())
    assert config.kv_layers == 6 and config.extra["conv_layers"].count(True) == 10
    # 10 conv layers x 2 stored inputs x 1024 channels, float32.
    assert config.recurrent_row_bytes == 10 * 2 * 1024 * 4
    by_types = config_from_dict(lfm2_config(full_attn_idxs=None))
    assert by_types.extra["conv_layers"] == tuple(i % 3 != 2 for i in range(16))
    assert config.tie_word_embeddings and config.head_dim == 64 and config.rms_norm_eps == 1e-6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"full_attn_idxs": [], "layer_types": None}, "needs at least one attention layer"),
        ({"full_attn_idxs": [16]}, "full_attn_idxs needs layer indices below 16"),
        ({"full_attn_idxs": None, "layer_types": ["conv"] * 15}, "layer_types needs 16 entries"),
        ({"full_attn_idxs": None, "layer_types": None}, "missing required field 'full_attn_idxs'"),
        ({"conv_L_cache": 1}, "conv_L_cache must be at least 2"),
        ({"block_dim": 512}, "block_dim must equal hidden_size"),
        ({"conv_bias": "no"}, "field 'conv_bias' should be bool"),
    ],
)
def test_a_malformed_config_is_one_line(changes, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_dict(lfm2_config(**changes))


def test_only_the_attention_layers_get_kv_pools(checkpoint):
    engine = engine_for(checkpoint)
    assert engine.config.extra["conv_layers"] == (True, True, False, True) and len(engine.kv.keys) == 1
    assert engine.recurrent_bytes == 4 * 3 * 2 * 64 * 4


# The engine's checks every hybrid family passes, run here on this family's checkpoint
# and mlx-lm's tokens (this module's `checkpoint` and `expected`).
test_a_row_alone_matches_mlx_lm = test_qwen3_5.test_a_row_alone_matches_mlx_lm
test_rows_in_mixed_steps_match_mlx_lm = test_qwen3_5.test_rows_in_mixed_steps_match_mlx_lm
test_a_preempted_row_recomputes_its_state_from_the_start = (
    test_qwen3_5.test_a_preempted_row_recomputes_its_state_from_the_start
)


def test_an_lfm2_gguf_is_a_one_line_refusal(tmp_path):
    path = minimal_gguf(tmp_path / "lfm2.gguf", "lfm2", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert "unsupported GGUF architecture 'lfm2'" in one_line_error(path)


MOE = {"num_layers": 4, "dense_layers": (0,)}  # a dense first layer, then routed experts


@pytest.mark.parametrize("is_original", [True, False], ids=["hf-original", "mlx-converted"])
def test_lfm2_moe_logits_match_mlx_lm_in_both_weight_forms(make_checkpoint, is_original):
    path = make_checkpoint("lfm2_moe", **MOE, hf_original=is_original)
    stored = mx.load(str(path / "model.safetensors"))
    per_expert = "model.layers.1.feed_forward.experts.3.w1.weight" in stored
    assert per_expert == is_original and ("model.layers.0.feed_forward.w1.weight" in stored) == is_original
    assert "model.layers.1.feed_forward.expert_bias" in stored
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_lfm2_moe_weighs_by_its_scaling_factor_as_mlx_lm(make_checkpoint, tmp_path):
    path = make_checkpoint("lfm2_moe", **MOE)
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    config = (path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace('"routed_scaling_factor": 1.0', '"routed_scaling_factor": 2.5'))
    got, want = load_model(tmp_path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(tmp_path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()
    assert not mx.allclose(got, load_model(path, keep_dtype=True).model(TOKENS), atol=1e-2).item()


def test_a_quantized_lfm2_moe_matches_mlx_lms_quantized_model(make_checkpoint):
    path = make_checkpoint("lfm2_moe", **MOE, quantize=(32, 4))
    got, want = load_model(path).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


@pytest.mark.parametrize("lookahead", [1, 2])
def test_lfm2_moe_rows_in_mixed_small_chunk_steps_match_mlx_lm(make_checkpoint, lookahead):
    path = make_checkpoint("lfm2_moe", **MOE)
    want = greedy_tokens(mlx_lm.load(str(path))[0])
    engine = engine_for(path)
    got = run(engine, policy_for(engine, chunk=3, budget=6), PROMPTS, lookahead)
    assert {rid: list(r.tokens) for rid, r in got.items()} == want


def lfm2_8b_a1b(**changes):
    """LFM2-8B-A1B's config.json (its fields as released)."""
    layer_types = ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]
    raw = {
        "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "vocab_size": 65536,
        "hidden_size": 2048, "intermediate_size": 7168, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 8, "layer_types": layer_types, "conv_L_cache": 3, "conv_bias": False,
        "norm_eps": 1e-5, "rope_theta": 1_000_000.0, "max_position_embeddings": 128000, "num_experts": 32,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1792, "num_dense_layers": 2,
        "use_expert_bias": True, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "eos_token_id": 7,
    }
    return {**raw, **changes}


def test_lfm2_8b_a1b_config_reads_as_released():
    config = config_from_dict(lfm2_8b_a1b())
    experts = config.extra["experts"]
    assert config.intermediate_size == 7168 and experts.intermediate_size == 1792  # neither adjusted
    assert experts.sparse_layers == (False, False) + (True,) * 22 and experts.top_k == 4 and experts.normalize
    assert config.kv_layers == 6 and config.rms_norm_eps == 1e-5 and config.head_dim == 64


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_dense_layers": 25}, "num_dense_layers must be 0 to 24"),
        ({"num_experts_per_tok": 33}, "num_experts_per_tok (33) is more than the 32 experts"),
        ({"use_expert_bias": 1}, "field 'use_expert_bias' should be bool"),
    ],
)
def test_a_malformed_lfm2_moe_config_is_one_line(changes, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict(lfm2_8b_a1b(**changes))
