"""GLM-4.5's layout (`glm4_moe`) against mlx-lm beyond the engine's parity cases
(tests/runtime/test_engine.py, tests/kernels/test_quantized_models.py): its
multi-token-prediction layer dropped, which layers route, the rotation and routing
fields it refuses, and preemption by recompute."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.engine import Engine
from runtime.errors import CheckpointError
from runtime.models.deepseek_v2 import LatentExperts
from runtime.runner import run_offline
from runtime.synth import make_tiny_checkpoint, save_weights

import mlx.core as mx
import mlx_lm
import pytest

from tests.runtime.test_engine import PROMPT, generate, mlx_lm_greedy, params, policy_for

TOKENS = mx.array([list(range(5, 45))])
SHAPE = dict(num_layers=3, hidden_size=128, intermediate_size=256, seed=7)


@pytest.mark.parametrize("quantize", [None, (32, 4)])
def test_the_mtp_layer_is_dropped_and_the_first_layer_is_dense_as_mlx_lm_runs_them(tmp_path: Path, quantize):
    path = make_tiny_checkpoint(tmp_path, "glm4_moe", quantize=quantize, **SHAPE)
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.layers.3.eh_proj.weight"] = mx.zeros((128, 256))  # the MTP layer, past the 3
    weights["model.layers.3.mlp.gate.e_score_correction_bias"] = mx.zeros((4,))
    save_weights(path, weights, is_mlx_format=quantize is not None)
    ours = load_model(path)
    assert [isinstance(layer.mlp, LatentExperts) for layer in ours.model.model.layers] == [False, True, True]
    attention = ours.model.model.layers[1].self_attn
    assert "q_norm" in attention and "k_norm" in attention  # use_qk_norm
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    assert want.std().item() > 1.0


def test_without_qk_norm_as_glm_4_5_air_it_matches_mlx_lm(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "glm4_moe", **SHAPE)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "use_qk_norm": False, "n_group": 1, "routed_scaling_factor": 1.0}))
    weights = {k: v for k, v in mx.load(str(path / "model.safetensors")).items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    save_weights(path, weights, is_mlx_format=False)
    ours = load_model(path)
    assert "q_norm" not in ours.model.model.layers[0].self_attn
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("partial_rotary_factor", 0.3, "must rotate an even number of a head's 32 dimensions"),
        ("partial_rotary_factor", -0.5, "must rotate an even number of a head's 32 dimensions"),
        ("partial_rotary_factor", "0.5", "must rotate an even number of a head's 32 dimensions"),
        ("topk_method", "greedy", "topk_method 'greedy' is not supported for glm4_moe"),
        ("scoring_func", "softmax", "scoring_func 'softmax' is not supported for glm4_moe"),
        ("n_group", 3, "n_group"),
    ],
)
def test_fields_it_cannot_run_are_refused_naming_them(tmp_path: Path, field, value, message):
    path = make_tiny_checkpoint(tmp_path, "glm4_moe", **SHAPE)
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=message):
        config_from_dict({**raw, field: value})


def test_fields_left_out_read_as_transformers_glm4_moe_config_defaults(tmp_path: Path):
    """Half of each head rotated; the norms' eps 1e-5 (not the llama families' 1e-6)."""
    path = make_tiny_checkpoint(tmp_path, "glm4_moe", **SHAPE)
    raw = json.loads((path / "config.json").read_text())
    config = config_from_dict({k: v for k, v in raw.items() if k not in ("partial_rotary_factor", "rms_norm_eps")})
    assert (config.extra["rotary_dims"], config.rms_norm_eps) == (16, 1e-5)


def test_groups_too_small_to_score_by_their_two_best_are_refused(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "glm4_moe", **SHAPE)
    raw = json.loads((path / "config.json").read_text())  # 4 experts
    with pytest.raises(CheckpointError, match="leaves groups of fewer than the 2 experts"):
        config_from_dict({**raw, "n_group": 4, "topk_group": 2})


def test_a_pool_too_small_for_every_request_preempts_and_each_gets_mlx_lms_tokens(make_checkpoint):
    """Preemption by recompute: the victims resume from their prompt and generated tokens."""
    path = make_checkpoint("glm4_moe", num_layers=3)
    engine = Engine(load_model(path), max_batch=4, block_size=4)
    specs = [(PROMPT, 20), (PROMPT[:5], 20), ([42, 43, 44, 45], 20), ([9] * 9, 20)]
    policy = policy_for(engine, chunk=8, budget=12, num_blocks=20)
    requests = {str(i): params(p, n, ignore_eos=True) for i, (p, n) in enumerate(specs)}
    got = run_offline(engine, policy, requests)
    assert policy.num_preemptions > 0
    for i, (prompt, n) in enumerate(specs):
        assert list(got[str(i)].tokens) == mlx_lm_greedy(path, prompt, n), i
    assert generate(engine, PROMPT, max_tokens=4, ignore_eos=True)[0] == mlx_lm_greedy(path, PROMPT, 4)
    policy.pool.check()
    assert policy.pool.num_used_blocks == 0 and engine.num_open == 0


# GLM-4.5-Air's config.json fields (its release's layout, as conversions of it copy it).
AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
}


def test_glm_4_5_airs_release_config_reads_as_its_layers_run():
    config = config_from_dict(AIR)
    experts, routing = config.extra["experts"], config.extra["routing"]
    assert (config.head_dim, config.extra["rotary_dims"], config.num_key_value_heads) == (128, 64, 8)
    assert (config.qkv_bias, config.o_bias, config.qk_norm) == (True, False, False)
    assert (experts.num_experts, experts.top_k, experts.shared_intermediate_size) == (128, 8, 1408)
    assert experts.sparse_layers == (False,) + (True,) * 45
    assert (routing.sigmoid, routing.num_groups, routing.normalize, routing.scaling) == (True, 1, True, 1.0)
