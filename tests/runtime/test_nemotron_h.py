"""Nemotron-H (`nemotron_h`) against mlx-lm's `nemotron_h` on tiny random checkpoints:
NVIDIA-Nemotron-Nano-9B-v2's layout (Mamba2, attention and relu**2 MLP blocks) and
Nemotron 3 Nano 30B-A3B's (Mamba2, attention and routed-expert blocks), both weight
forms, quantized, and through the paged engine, whose rows carry each Mamba2 layer's
conv inputs and SSM state across chunks, mixed steps, lookahead and preemption."""

import json
import math
import re
import shutil

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
    TOKENS,
    engine_for,
    greedy_tokens,
)

# (the variant's own fields, its layer count): the dense one ends in a Mamba2 block, the
# experts' in an expert block (the last layer runs for the sampled tokens alone).
VARIANTS = {"nano-9b-v2": ({}, 6), "nano-3-moe": ({"hybrid_override_pattern": "MEM*E"}, 5)}


def make(make_checkpoint, variant, **kwargs):
    fields, num_layers = VARIANTS[variant]
    return make_checkpoint("nemotron_h", num_layers=num_layers, nemotron=fields, **kwargs)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, make_checkpoint):
    return make(make_checkpoint, request.param)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return greedy_tokens(mlx_lm.load(str(checkpoint))[0])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("is_original", [True, False], ids=["hf-original", "mlx-converted"])
def test_logits_match_mlx_lm_in_both_weight_forms(make_checkpoint, variant, is_original):
    path = make(make_checkpoint, variant, hf_original=is_original)
    stored = mx.load(str(path / "model.safetensors"))
    assert stored["backbone.layers.0.mixer.conv1d.weight"].shape == ((192, 1, 4) if is_original else (192, 4, 1))
    if variant == "nano-3-moe":
        assert ("backbone.layers.1.mixer.experts.0.up_proj.weight" in stored) == is_original
    got, want = load_model(path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_quantized_checkpoint_matches_mlx_lms_quantized_model(make_checkpoint, variant):
    path = make(make_checkpoint, variant, quantize=(32, 4))
    stored = mx.load(str(path / "model.safetensors"))
    assert "backbone.layers.0.mixer.in_proj.scales" in stored
    got, want = load_model(path).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


def test_mlx_lms_own_4_bit_conversion_matches_mlx_lm(make_checkpoint, tmp_path):
    """mlx-community's layout as mlx-lm's convert writes it (its router left float)."""
    source = make(make_checkpoint, "nano-3-moe")
    mlx_lm.convert(str(source), str(tmp_path / "q"), quantize=True, q_group_size=32, q_bits=4)
    stored = mx.load(str(tmp_path / "q" / "model.safetensors"))
    assert "backbone.layers.1.mixer.switch_mlp.fc1.scales" in stored and "backbone.layers.1.mixer.gate.scales" not in stored
    got, want = load_model(tmp_path / "q").model(TOKENS), mlx_lm.load(str(tmp_path / "q"))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()


def test_the_gated_norm_is_taken_per_group(make_checkpoint, tmp_path):
    """n_groups 2 vs 1 over the same weights: the norm's groups alone differ (mlx-lm agrees
    with both), so a norm over the whole width could not match both."""
    path = make(make_checkpoint, "nano-9b-v2")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    raw = json.loads((path / "config.json").read_text())
    # One group of B and C would change the conv's width: keep it by doubling the state.
    (tmp_path / "config.json").write_text(json.dumps({**raw, "n_groups": 1, "ssm_state_size": 32}))
    got, want = load_model(tmp_path, keep_dtype=True).model(TOKENS), mlx_lm.load(str(tmp_path))[0](TOKENS)
    assert mx.allclose(got, want, atol=1e-3).item()
    assert not mx.allclose(got, load_model(path, keep_dtype=True).model(TOKENS), atol=1e-2).item()


def test_only_the_attention_layers_get_kv_pools(make_checkpoint):
    engine = engine_for(make(make_checkpoint, "nano-9b-v2"))  # M-M*-M
    assert engine.config.extra["pattern"] == "M-M*-M" and len(engine.kv.keys) == 1
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


def nano_3_30b_a3b(**changes):
    """NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json as released (no time_step_limit:
    transformers' (0, inf))."""
    raw = {
        "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2, "expand": 2,
        "head_dim": 128, "hidden_dropout": 0.0, "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "initializer_range": 0.02, "intermediate_size": 1856, "layer_norm_epsilon": 1e-05,
        "mamba_head_dim": 64, "mamba_hidden_act": "silu", "mamba_num_heads": 64, "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32", "max_position_embeddings": 262144, "mlp_bias": False,
        "mlp_hidden_act": "relu2", "model_type": "nemotron_h", "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "n_groups": 8, "n_routed_experts": 128,
        "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2, "num_logits_to_keep": 1,
        "pad_token_id": 0, "partial_rotary_factor": 1.0, "rescale_prenorm_residual": True,
        "residual_in_fp32": False, "rope_theta": 10000, "routed_scaling_factor": 2.5, "sliding_window": None,
        "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_max": 0.1,
        "time_step_min": 0.001, "topk_group": 1, "torch_dtype": "bfloat16", "transformers_version": "4.55.4",
        "use_bias": False, "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True,
        "vocab_size": 131072,
    }
    return {**raw, **changes}


def test_nemotron_3_nano_config_reads_as_released():
    config = config_from_dict(nano_3_30b_a3b())
    experts, mamba = config.extra["experts"], config.extra["mamba"]
    assert experts.num_experts == 128 and experts.top_k == 6 and experts.intermediate_size == 1856
    assert experts.shared_intermediate_size == 3712 and experts.normalize
    assert config.extra["routing"] == (1, 1, 2.5) and config.kv_layers == 6 and config.head_dim == 128
    assert mamba["conv_dim"] == 64 * 64 + 2 * 8 * 128 and mamba["norm_groups"] == 8
    assert mamba["time_step_limit"] == (0.0, math.inf) and config.rms_norm_eps == 1e-05
    # Nano 9B v2's [0.0, Infinity], and as mlx-lm's convert (and transformers 5) tag infinity.
    for limit in ([0.0, math.inf], [0.0, {"__float__": "Infinity"}], None):
        assert config_from_dict(nano_3_30b_a3b(time_step_limit=limit)).extra["mamba"]["time_step_limit"] == (0.0, math.inf)
    # 23 Mamba2 layers x (3 conv inputs x 6144 channels + 64 heads x 64 x 128), float32.
    assert config.recurrent_row_bytes == 23 * (3 * 6144 + 64 * 64 * 128) * 4


def test_the_layer_count_and_pattern_may_come_from_layers_block_type():
    """transformers' newer configs name each block and leave num_hidden_layers out."""
    names = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
    raw = nano_3_30b_a3b()
    pattern = raw.pop("hybrid_override_pattern")
    del raw["num_hidden_layers"]
    config = config_from_dict({**raw, "layers_block_type": [names[c] for c in pattern]})
    assert config.extra["pattern"] == pattern and config.num_hidden_layers == 52


def test_an_originals_mtp_head_and_transformers_5s_stacked_experts_load_as_mlx_lm_runs_them(make_checkpoint, tmp_path):
    """`mtp.*` dropped; `mixer.experts.up_proj` [E, I, hidden] (and down_proj) read as the
    per-expert tensors stacked."""
    original = make(make_checkpoint, "nano-3-moe", hf_original=True)
    shutil.copytree(original, tmp_path / "restacked")
    weights = mx.load(str(original / "model.safetensors"))
    for layer in (1, 4):  # MEM*E's expert blocks
        for name in ("up_proj", "down_proj"):
            prefix = f"backbone.layers.{layer}.mixer.experts"
            each = [weights.pop(f"{prefix}.{e}.{name}.weight") for e in range(4)]
            weights[f"{prefix}.{name}"] = mx.stack(each)
    weights["mtp.layers.0.norm.weight"] = mx.ones((64,))
    mx.save_safetensors(str(tmp_path / "restacked" / "model.safetensors"), weights)
    got = load_model(tmp_path / "restacked", keep_dtype=True).model(TOKENS)
    assert mx.allclose(got, mlx_lm.load(str(original))[0](TOKENS), atol=1e-4).item()


def test_the_routers_fields_left_out_read_as_transformers_defaults():
    """One group, all of it kept, the weights normalised (Nano 3's values are the defaults)."""
    left_out = ("n_group", "topk_group", "norm_topk_prob")
    config = config_from_dict({k: v for k, v in nano_3_30b_a3b().items() if k not in left_out})
    assert config.extra["routing"] == (1, 1, 2.5) and config.extra["experts"].normalize
    # the one group holds all 128 experts to choose from
    raw = {k: v for k, v in nano_3_30b_a3b(num_experts_per_tok=100).items() if k not in left_out}
    assert config_from_dict(raw).extra["experts"].top_k == 100


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hybrid_override_pattern": "MEME", "num_hidden_layers": 4}, "needs at least one attention layer"),
        ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern must be characters M, *, - and E"),
        ({"hybrid_override_pattern": ["M", "*", 1]}, "hybrid_override_pattern must be characters M, *, - and E"),
        ({"hybrid_override_pattern": 52}, "hybrid_override_pattern must be characters M, *, - and E"),
        ({"hybrid_override_pattern": None}, "needs hybrid_override_pattern, or layers_block_type"),
        ({"num_hidden_layers": 51}, "num_hidden_layers is 51, but hybrid_override_pattern has 52"),
        ({"n_groups": 5}, "mamba_num_heads (64) is not a multiple of n_groups (5)"),
        ({"conv_kernel": 1}, "conv_kernel must be at least 2"),
        ({"time_step_limit": [1.0]}, "time_step_limit must be [low, high]"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported"),
        ({"moe_latent_size": 1024}, "moe_latent_size"),
        ({"n_group": 3}, "n_routed_experts (128) in n_group (3) groups"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok (129) is more than the 128 experts"),
        ({"n_group": 8, "topk_group": 1, "num_experts_per_tok": 17}, "num_experts_per_tok (17) is more than"),
        ({"moe_shared_expert_intermediate_size": None}, "missing required field 'moe_shared_expert_intermediate_size'"),
    ],
)
def test_a_malformed_config_is_one_line(changes, message):
    raw = {name: value for name, value in nano_3_30b_a3b(**changes).items() if value is not None or name not in changes}
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict(raw)


def test_group_limited_routing_chooses_within_the_top_groups():
    """n_group 2, topk_group 1: each token's experts all come from the group whose two best
    scores sum highest, even where the other group holds the single best expert."""
    from runtime.models.nemotron_h import MoE

    config = config_from_dict(nano_3_30b_a3b(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1))
    moe = MoE(8, config.extra["experts"], *config.extra["routing"])
    # Scores (as logits): group 0 = experts 0, 1: [5, -5]; group 1 = experts 2, 3: [2, 2].
    moe.gate.weight = mx.array([[5.0] + [0] * 7, [-5.0] + [0] * 7, [2.0] + [0] * 7, [2.0] + [0] * 7])
    chosen, weights = moe.route(mx.array([[1.0] + [0] * 7]))
    assert sorted(chosen[0].tolist()) == [2, 3]
    assert mx.allclose(weights, mx.array([[1.25, 1.25]])).item()  # normalised, times 2.5


def test_heads_are_attention_head_dim_or_transformers_128_wide_not_hidden_over_heads():
    """Nemotron-H 4B's config says `attention_head_dim: 128` beside hidden_size 3072 and 32
    heads (no head_dim); transformers' head_dim defaults to 128. Read as 3072 / 32, its q_proj
    [4096, 3072] was refused as misshapen."""
    raw = {name: value for name, value in nano_3_30b_a3b(hidden_size=3072, num_attention_heads=32).items() if name != "head_dim"}
    assert config_from_dict({**raw, "attention_head_dim": 128}).head_dim == 128
    assert config_from_dict(raw).head_dim == 128
    assert config_from_dict({**raw, "head_dim": 64, "attention_head_dim": 128}).head_dim == 64


@pytest.mark.parametrize("architecture", ["nemotron_h", "nemotron_h_moe", "falcon-h1"])
def test_a_nemotron_h_or_falcon_h1_gguf_is_a_one_line_refusal(tmp_path, architecture):
    """llama.cpp's names for them; cadence reads their safetensors (README: Not yet)."""
    path = minimal_gguf(tmp_path / "m.gguf", architecture, {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert f"unsupported GGUF architecture '{architecture}'" in one_line_error(path)
