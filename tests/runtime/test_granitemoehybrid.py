"""Granite 4.0 (`granitemoehybrid`: all attention, or Mamba2 + attention, with routed
experts or a dense MLP) and Granite 3 MoE (`granitemoe`) against mlx-lm's `granitemoehybrid` on tiny random checkpoints:
the model alone, both weight forms, quantized, and through the paged engine, whose rows
carry each Mamba2 layer's conv inputs and SSM state (runtime/kv/recurrent.py) across
chunks, mixed steps, lookahead and preemption."""

import json
import re

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from tests.runtime import test_qwen3_5
from tests.runtime.test_gguf import minimal_gguf, one_line_error
from tests.runtime.test_qwen3_5 import (
    PROMPTS,
    TOKENS,
    engine_for,
    greedy_tokens,
    policy_for,
    run,
)

DENSE = {"num_local_experts": 0}  # -h-micro's, -h-1b's: the shared MLP alone
ALL_ATTENTION = {**DENSE, "layer_types": ["attention"] * 4, "position_embedding_type": "rope"}  # -micro's
VARIANTS = {"hybrid-moe": None, "hybrid-dense": DENSE, "all-attention": ALL_ATTENTION}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, make_checkpoint):
    return make_checkpoint("granitemoehybrid", num_layers=4, granite4=VARIANTS[request.param])


@pytest.fixture(scope="module")
def expected(checkpoint):
    return greedy_tokens(mlx_lm.load(str(checkpoint))[0])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("is_original", [True, False], ids=["hf-original", "mlx-converted"])
def test_logits_match_mlx_lm_in_both_weight_forms(make_checkpoint, variant, is_original):
    path = make_checkpoint("granitemoehybrid", num_layers=4, granite4=VARIANTS[variant], hf_original=is_original)
    stored = mx.load(str(path / "model.safetensors"))
    if variant != "all-attention":
        assert stored["model.layers.0.mamba.conv1d.weight"].shape == ((192, 1, 4) if is_original else (192, 4, 1))
    if variant == "hybrid-moe":
        assert ("model.layers.0.block_sparse_moe.input_linear.weight" in stored) == is_original
    else:
        assert ("model.layers.0.shared_mlp.input_linear.weight" in stored) == is_original
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_mamba_biases_where_the_config_puts_them_match_mlx_lm(make_checkpoint):
    """`mamba_proj_bias` on in_proj and out_proj; `mamba_conv_bias: false` none on the conv."""
    path = make_checkpoint("granitemoehybrid", num_layers=4, granite4={"mamba_proj_bias": True, "mamba_conv_bias": False})
    stored = mx.load(str(path / "model.safetensors"))
    assert "model.layers.0.mamba.in_proj.bias" in stored and "model.layers.0.mamba.conv1d.bias" not in stored
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_the_attention_layers_rotate_only_where_the_config_says_rope(make_checkpoint):
    """-micro's "rope" and -h-'s "nope" give different logits (mlx-lm's agree with both)."""
    rope = make_checkpoint("granitemoehybrid", num_layers=4, granite4=ALL_ATTENTION)
    nope = make_checkpoint("granitemoehybrid", num_layers=4, granite4={**ALL_ATTENTION, "position_embedding_type": "nope"})
    a, b = (load_model(p, keep_dtype=True).model(TOKENS) for p in (rope, nope))
    assert mx.allclose(b, mlx_lm.load(str(nope))[0](TOKENS), atol=1e-4).item()
    assert not mx.allclose(a, b, atol=1e-2).item()


@pytest.mark.parametrize("variant", ["hybrid-moe", "hybrid-dense"])
def test_a_quantized_checkpoint_matches_mlx_lms_quantized_model(make_checkpoint, variant):
    path = make_checkpoint("granitemoehybrid", num_layers=4, granite4=VARIANTS[variant], quantize=(32, 4))
    assert "model.layers.0.mamba.in_proj.scales" in mx.load(str(path / "model.safetensors"))
    got, want = load_model(path).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


def test_mlx_lms_own_4_bit_conversion_with_its_8_bit_routers_matches_mlx_lm(make_checkpoint, tmp_path):
    """mlx-community's layout as mlx-lm's convert writes it: routers at 8 bits in groups of
    64 (per-layer entries in config.json's quantization), the rest at 4."""
    source = make_checkpoint("granitemoehybrid", num_layers=4)
    mlx_lm.convert(str(source), str(tmp_path / "q"), quantize=True, q_group_size=32, q_bits=4)
    quantization = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert quantization["model.layers.0.block_sparse_moe.router.layer"] == {"group_size": 64, "bits": 8}
    got, want = load_model(tmp_path / "q").model(TOKENS), mlx_lm.load(str(tmp_path / "q"))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


def test_only_the_attention_layers_get_kv_pools(make_checkpoint):
    engine = engine_for(make_checkpoint("granitemoehybrid", num_layers=4))
    assert engine.config.extra["mamba_layers"] == (True, True, False, True) and len(engine.kv.keys) == 1
    # 4 rows x 3 Mamba2 layers x (3 conv inputs x 192 channels + 8 heads x 16 x 16), float32.
    assert engine.recurrent_bytes == 4 * 3 * (3 * 192 + 8 * 16 * 16) * 4


# The engine's checks every hybrid family passes, run here on this family's checkpoint
# and mlx-lm's tokens (this module's `checkpoint` and `expected`).
test_a_row_alone_matches_mlx_lm = test_qwen3_5.test_a_row_alone_matches_mlx_lm
test_rows_in_mixed_steps_match_mlx_lm = test_qwen3_5.test_rows_in_mixed_steps_match_mlx_lm
test_a_preempted_row_recomputes_its_state_from_the_start = (
    test_qwen3_5.test_a_preempted_row_recomputes_its_state_from_the_start
)
test_ladder_pads_never_touch_a_rows_state = test_qwen3_5.test_ladder_pads_never_touch_a_rows_state


def test_a_granite_4_gguf_is_a_one_line_refusal(tmp_path):
    path = minimal_gguf(tmp_path / "g4.gguf", "granitehybrid", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert "unsupported GGUF architecture 'granitehybrid'" in one_line_error(path)


def granite_4_h_tiny(**changes):
    """granite-4.0-h-tiny's config.json (its shape and layer types as released)."""
    layer_types = ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]
    raw = {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "attention_bias": False, "attention_multiplier": 0.0078125, "embedding_multiplier": 12,
        "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 512, "layer_types": layer_types,
        "logits_scaling": 6, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_d_conv": 4,
        "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 48,
        "mamba_proj_bias": False, "max_position_embeddings": 131072, "num_attention_heads": 12,
        "num_experts_per_tok": 6, "num_hidden_layers": 40, "num_key_value_heads": 4, "num_local_experts": 64,
        "position_embedding_type": "nope", "residual_multiplier": 0.22, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000, "shared_intermediate_size": 1024,
        "tie_word_embeddings": True, "vocab_size": 100352, "eos_token_id": 100257,
    }
    return {**raw, **changes}


def test_granite_4_h_tiny_config_reads_as_released():
    config = config_from_dict(granite_4_h_tiny())
    experts, mamba = config.extra["experts"], config.extra["mamba"]
    assert experts.num_experts == 64 and experts.top_k == 6 and experts.intermediate_size == 512
    assert experts.shared_intermediate_size == 1024 and all(experts.sparse_layers)
    assert config.kv_layers == 4 and config.head_dim == 128 and not config.extra["rotates"]
    assert mamba["conv_dim"] == 48 * 64 + 2 * 128 and mamba["time_step_limit"] == (0.001, 100.0)
    # 36 Mamba2 layers x (3 conv inputs x 3328 channels + 48 heads x 64 x 128), float32: ~58 MB a row.
    assert config.recurrent_row_bytes == 36 * (3 * 3328 + 48 * 64 * 128) * 4


def test_an_auto_mamba_head_width_is_the_expanded_width_over_the_heads():
    """transformers' "auto": mamba_expand * hidden_size / mamba_n_heads (2 * 1536 / 48)."""
    assert config_from_dict(granite_4_h_tiny(mamba_d_head="auto")).extra["mamba"]["head_dim"] == 64
    assert config_from_dict(granite_4_h_tiny(mamba_d_head="auto", mamba_expand=1)).extra["mamba"]["head_dim"] == 32


def test_the_all_attention_model_keeps_no_recurrent_state(make_checkpoint):
    """-micro's layers all store K/V: no state to reserve, so prefix caching stays on."""
    engine = engine_for(make_checkpoint("granitemoehybrid", num_layers=4, granite4=ALL_ATTENTION))
    assert engine.states is None and engine.recurrent_bytes == 0 and len(engine.kv.keys) == 4


def test_a_config_without_a_position_embedding_type_rotates_nothing_as_transformers_reads_it():
    """transformers' default is None (no rotary embedding at all); mlx-lm's would rotate."""
    raw = granite_4_h_tiny()
    del raw["position_embedding_type"]
    assert not config_from_dict(raw).extra["rotates"]
    assert config_from_dict(granite_4_h_tiny(position_embedding_type="rope")).extra["rotates"]


def test_a_dense_model_runs_the_shared_mlps_width():
    """-h-micro's dense FFN is its shared MLP (transformers' `shared_mlp`), `shared_intermediate_size` wide."""
    config = config_from_dict(granite_4_h_tiny(num_local_experts=0, intermediate_size=999))
    assert config.extra["experts"] is None and config.intermediate_size == 1024


def test_the_fields_a_config_leaves_out_read_as_transformers_defaults():
    """-h-tiny's values of these are transformers' defaults: left out, the same model."""
    optional = ("attention_bias", "mamba_d_conv", "mamba_n_groups", "mamba_conv_bias", "mamba_proj_bias", "mamba_d_head")
    assert_left_out_read_as_released(granite_4_h_tiny(), optional)


def assert_left_out_read_as_released(fields, optional):
    """A Mamba2 hybrid's config without `optional` reads as its release, which states
    transformers' defaults for them (Granite 4.0's and Falcon-H1's tests)."""
    released = config_from_dict(fields)
    left_out = config_from_dict({k: v for k, v in fields.items() if k not in optional})
    assert left_out.extra["mamba"] == released.extra["mamba"]
    assert (left_out.qkv_bias, left_out.o_bias) == (released.qkv_bias, released.o_bias) == (False, False)


def test_a_time_step_limit_may_clip_to_one_value():
    """[low, high] with low == high (transformers clips to it; mlx-lm too)."""
    assert config_from_dict(granite_4_h_tiny(time_step_limit=[0, 0])).extra["mamba"]["time_step_limit"] == (0.0, 0.0)
    assert config_from_dict(granite_4_h_tiny(time_step_limit=[0.5, 0.5])).extra["mamba"]["time_step_limit"] == (0.5, 0.5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layer_types": ["mamba"] * 40}, "needs at least one attention layer"),
        ({"layer_types": None}, "needs at least one attention layer"),
        ({"layer_types": ["mamba"] * 39}, "layer_types needs 40 entries of 'mamba' or 'attention'"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type must be 'rope' or 'nope'"),
        ({"mamba_n_groups": 5}, "mamba_n_heads (48) is not a multiple of mamba_n_groups (5)"),
        ({"mamba_d_conv": 1}, "mamba_d_conv must be at least 2"),
        ({"mamba_d_state": None}, "missing required field 'mamba_d_state'"),
        ({"time_step_limit": [1.0]}, "time_step_limit must be [low, high]"),
        ({"shared_intermediate_size": None}, "missing required field 'shared_intermediate_size'"),
        ({"num_experts_per_tok": 65}, "num_experts_per_tok (65) is more than the 64 experts"),
        ({"residual_multiplier": 0}, "residual_multiplier must be a positive number"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_a_malformed_config_is_one_line(changes, message):
    raw = {name: value for name, value in granite_4_h_tiny(**changes).items() if value is not None or name == "rope_scaling"}
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict(raw)


@pytest.mark.parametrize("is_original", [True, False], ids=["hf-original", "mlx-converted"])
def test_granite_3_moe_logits_match_mlx_lm_in_both_weight_forms(make_checkpoint, is_original):
    """`granitemoe`: every layer rotated attention and routed experts, no shared MLP."""
    path = make_checkpoint("granitemoe", num_layers=3, hf_original=is_original)
    stored = mx.load(str(path / "model.safetensors"))
    assert ("model.layers.0.block_sparse_moe.input_linear.weight" in stored) == is_original
    assert not any("shared_mlp" in name for name in stored)
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_mlx_lms_own_mixed_4_and_8_bit_granite_3_moe_conversion_matches_mlx_lm(make_checkpoint, tmp_path):
    """mlx-lm's convert keeps granitemoe's routers, o_proj and lm_head at 8 bits."""
    source = make_checkpoint("granitemoe", num_layers=3)
    mlx_lm.convert(str(source), str(tmp_path / "q"), quantize=True, q_group_size=32, q_bits=4)
    quantization = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert quantization["model.layers.0.self_attn.o_proj"] == {"group_size": 64, "bits": 8}
    got, want = load_model(tmp_path / "q").model(TOKENS), mlx_lm.load(str(tmp_path / "q"))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


@pytest.mark.parametrize("lookahead", [1, 2])
def test_granite_3_moe_rows_in_mixed_small_chunk_steps_match_mlx_lm(make_checkpoint, lookahead):
    path = make_checkpoint("granitemoe", num_layers=3)
    want = greedy_tokens(mlx_lm.load(str(path))[0])
    engine = engine_for(path)
    got = run(engine, policy_for(engine, chunk=3, budget=6), PROMPTS, lookahead)
    assert {rid: list(r.tokens) for rid, r in got.items()} == want


def test_a_granite_3_moe_config_without_experts_is_one_line():
    raw = {name: value for name, value in granite_4_h_tiny(model_type="granitemoe").items() if name != "num_local_experts"}
    with pytest.raises(CheckpointError, match="missing required field 'num_local_experts'"):
        config_from_dict(raw)


@pytest.mark.parametrize("variant", ["hybrid-moe", "hybrid-dense"])
@pytest.mark.parametrize("damage", ["no-output-linear", "odd-input-linear"])
def test_a_damaged_original_mlp_is_a_one_line_refusal(make_checkpoint, tmp_path, variant, damage):
    """A Hugging Face original's stacked MLP tensors were moved blindly: one left out was a
    KeyError, gate and up rows of odd count a ValueError from the split."""
    path = make_checkpoint("granitemoehybrid", num_layers=4, granite4=VARIANTS[variant])
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    weights = mx.load(str(path / "model.safetensors"))
    prefix = "model.layers.1." + ("block_sparse_moe" if variant == "hybrid-moe" else "shared_mlp")
    if damage == "no-output-linear":
        del weights[f"{prefix}.output_linear.weight"]
    else:
        weights[f"{prefix}.input_linear.weight"] = weights[f"{prefix}.input_linear.weight"][..., 1:, :]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.1."):
        load_model(tmp_path)
