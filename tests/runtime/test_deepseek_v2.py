"""DeepSeek-V2 (MLA and its experts) against mlx-lm, beyond the engine's parity cases
(tests/runtime/test_engine.py) and the quantized ones (tests/kernels/test_quantized_models.py):
the pieces that must each be run, what the paged KV stores and counts, preemption."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.engine import Engine
from runtime.errors import CheckpointError
from runtime.kv.paged import PagedKV
from runtime.models import build_model
from runtime.models.deepseek_v2 import LatentAttention, LatentExperts
from runtime.runner import run_offline
from runtime.synth import (
    EXPERT_NAMES,
    make_tiny_checkpoint,
    per_expert_weights,
    random_weights,
    save_weights,
)

import attrs
import mlx.core as mx
import mlx_lm
import pytest

from tests.runtime.test_engine import PROMPT, generate, mlx_lm_greedy, params, policy_for

TOKENS = mx.array([list(range(5, 45))])  # 40 positions, past YaRN's original 16
SHAPE = dict(num_layers=3, seed=3)


def checkpoint(tmp_path: Path, family: str = "deepseek_v2", **fields) -> Path:
    """A tiny checkpoint, its config.json's `fields` replaced and its weights remade to fit."""
    path = make_tiny_checkpoint(tmp_path, family, **SHAPE)
    if fields:
        raw = {**json.loads((path / "config.json").read_text()), **fields}
        (path / "config.json").write_text(json.dumps(raw))
        weights = random_weights(build_model(config_from_dict(raw)), seed=3)
        save_weights(path, per_expert_weights(weights, EXPERT_NAMES[family]))
    return path


def test_logits_match_mlx_lm_and_each_part_of_mla_and_the_experts_is_run(tmp_path: Path):
    path = checkpoint(tmp_path)
    want = mlx_lm.load(str(path))[0](TOKENS)
    ours = load_model(path)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    assert want.std().item() > 1.0
    attention = ours.model.model.layers[1].self_attn
    assert attention.rope_factor != 1.0  # the synth's mscale and mscale_all_dim differ
    for part, value in (("rope_factor", 1.0), ("scale", attention.scale * 0.5)):
        ours = load_model(path)
        setattr(ours.model.model.layers[1].self_attn, part, value)
        assert not mx.allclose(ours.model(TOKENS), want, atol=1e-2).item(), part
    ours = load_model(path)
    experts = ours.model.model.layers[2].mlp
    assert isinstance(experts, LatentExperts) and experts.routing.scaling == 1.5
    experts.routing = attrs.evolve(experts.routing, scaling=1.0)
    assert not mx.allclose(ours.model(TOKENS), want, atol=1e-2).item()
    assert not isinstance(ours.model.model.layers[0].mlp, LatentExperts)  # first_k_dense_replace


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_attention_bias_puts_biases_where_deepseeks_code_does(tmp_path: Path, family):
    """On q_a_proj (V3's q LoRA), kv_a_proj_with_mqa and o_proj; never q_proj or kv_b_proj."""
    path = checkpoint(tmp_path, family, attention_bias=True)
    attention = load_model(path).model.model.layers[0].self_attn
    biased = {name for name in ("q_proj", "q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
              if name in attention and "bias" in attention[name]}
    assert biased == ({"q_a_proj"} if family == "deepseek_v3" else set()) | {"kv_a_proj_with_mqa", "o_proj"}
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(load_model(path).model(TOKENS), want, atol=1e-4).item()


def test_values_wider_than_queries_and_keys_pad_those_instead(tmp_path: Path):
    """The store's width is the wider of q.k's and v's (GLM-4.7-Flash's are equal)."""
    path = checkpoint(tmp_path, v_head_dim=32)  # q.k: 16 + 8
    ours = load_model(path)
    assert ours.config.head_dim == 32
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    assert generate(Engine(ours, max_batch=2), PROMPT, 16, ignore_eos=True)[0] == mlx_lm_greedy(path, PROMPT, 16)


def test_the_paged_kv_stores_every_head_at_the_key_width_and_the_budget_counts_it(tmp_path: Path):
    loaded = load_model(checkpoint(tmp_path))
    config = loaded.config
    heads, width = config.num_attention_heads, 16 + 8  # qk_nope_head_dim + qk_rope_head_dim
    assert (config.num_key_value_heads, config.head_dim) == (heads, width)
    engine = Engine(loaded, max_batch=2, block_size=4)
    kv = engine.kv
    assert kv.keys[0].shape == (heads * kv.num_slots, width) == kv.values[0].shape
    block = PagedKV.bytes_per_block(3, heads, width, 4, kv.dtype)
    assert engine.bytes_per_block == block and kv.nbytes == kv.num_blocks * block


# DeepSeek-V2-Lite(-Chat)'s config.json, its architecture's fields.
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
    "bos_token_id": 100000, "eos_token_id": 100001, "pretraining_tp": 1, "tie_word_embeddings": False,
    "rope_theta": 10000, "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
    "vocab_size": 102400,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def test_the_v2_lite_release_config_reads_and_its_kv_costs_what_the_readme_says():
    config = config_from_dict(V2_LITE)
    mla = config.extra["mla"]
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.nope_dims, mla.rope_dims, mla.value_dims) == (None, 512, 128, 64, 128)
    assert (config.num_key_value_heads, config.head_dim) == (16, 192)
    assert config.extra["experts"].sparse_layers == (False,) + (True,) * 26
    assert config.extra["routing"].scaling == 1.0 and not config.extra["routing"].normalize
    per_token = PagedKV.bytes_per_block(27, 16, 192, 1, mx.bfloat16)
    assert per_token == 331_776 and round(per_token / ((512 + 64) * 27 * 2), 1) == 10.7  # 324 KiB, 10.7x


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_preempted_rows_recompute_to_the_tokens_they_get_alone(tmp_path: Path, family):
    engine = Engine(load_model(checkpoint(tmp_path, family)), max_batch=4, block_size=4)
    specs = [(PROMPT, 24), (PROMPT[:5], 24), ([42, 43, 44, 45], 24), ([9] * 9, 24)]
    alone = [generate(engine, p, max_tokens=n, ignore_eos=True)[0] for p, n in specs]
    policy = policy_for(engine, chunk=8, budget=12, num_blocks=20)
    requests = {str(i): params(p, n, ignore_eos=True) for i, (p, n) in enumerate(specs)}
    got = run_offline(engine, policy, requests)
    assert [list(got[str(i)].tokens) for i in range(len(specs))] == alone
    assert policy.num_preemptions > 0
    policy.pool.check()


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"topk_method": "sinkhorn"}, "topk_method 'sinkhorn' is not supported"),
        ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group (3) must divide the 4 experts"),
        ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1}, "num_experts_per_tok (2) is more than"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace must be a whole number"),
        ({"kv_lora_rank": None}, "field 'kv_lora_rank' should be int"),
        ({"n_shared_experts": False}, "field 'n_shared_experts' should be int"),  # not read as 0
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_a_config_cadence_cannot_run_is_refused_in_one_line(make_checkpoint, fields, says):
    raw = {**json.loads((make_checkpoint("deepseek_v2", **SHAPE) / "config.json").read_text()), **fields}
    with pytest.raises(CheckpointError, match=says.replace("(", r"\(").replace(")", r"\)")) as error:
        config_from_dict(raw)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("shape", [(100, 64), ()], ids=["rows-past-whole-heads", "scalar"])
def test_a_rotated_projection_of_another_shape_is_a_one_line_refusal(tmp_path: Path, shape):
    """Not cut to whole heads (and reordered) by the interleave's reordering, but named."""
    path = checkpoint(tmp_path)
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight"] = mx.zeros(shape)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="q_proj.weight' has shape .*, not whole heads of 24 rows") as error:
        load_model(path)
    assert "\n" not in str(error.value)


def test_no_shared_experts_where_the_config_says_none_or_zero(tmp_path: Path):
    for count in (None, 0):
        path = checkpoint(tmp_path / str(count), n_shared_experts=count)
        experts = load_model(path).model.model.layers[1].mlp
        assert isinstance(experts, LatentExperts) and "shared_experts" not in experts


@pytest.mark.parametrize(
    ("fields", "normalize", "scaling", "groups"),
    [
        ({"norm_topk_prob": None}, False, 1.0, 1),  # DeepSeek's default: scaled, not normalised
        ({"norm_topk_prob": True, "routed_scaling_factor": 2.0}, True, 1.0, 1),
        # one expert a token: its score scaled, never normalised to 1 (DeepSeek's MoEGate)
        ({"norm_topk_prob": True, "num_experts_per_tok": 1, "routed_scaling_factor": 2.0}, False, 2.0, 1),
        ({"topk_method": "group_limited_greedy", "n_group": None, "topk_group": None}, False, 1.0, 1),
    ],
)
def test_the_v2_router_reads_as_deepseeks_code_runs_it(fields, normalize, scaling, groups):
    raw = {name: value for name, value in {**V2_LITE, **fields}.items() if value is not None or name == "q_lora_rank"}
    routing = config_from_dict(raw).extra["routing"]
    assert (routing.normalize, routing.scaling, routing.num_groups, routing.top_groups) == (normalize, scaling, groups, 1)


def test_yarn_of_factor_1_leaves_the_softmax_scale_as_deepseeks_yarn_get_mscale():
    """mscale(factor <= 1) is 1: the scale stays 1 / sqrt(nope + rope) whatever mscale_all_dim."""
    yarn = {**V2_LITE["rope_scaling"], "factor": 1.0}
    attention = LatentAttention(config_from_dict({**V2_LITE, "rope_scaling": yarn}), 0)
    assert (attention.scale, attention.rope_factor) == (192**-0.5, 1.0)


def test_moe_layer_freq_routes_only_every_nth_layer_from_first_k_dense_replace():
    """transformers' and DeepSeek's: sparse where i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    config = config_from_dict({**V2_LITE, "num_hidden_layers": 6, "moe_layer_freq": 2})
    assert config.extra["experts"].sparse_layers == (False, False, True, False, True, False)


def test_v3s_router_reads_one_group_where_the_config_gives_none(make_checkpoint):
    raw = json.loads((make_checkpoint("deepseek_v3", **SHAPE) / "config.json").read_text())
    raw = {name: value for name, value in raw.items() if name not in ("n_group", "topk_group")}
    routing = config_from_dict(raw).extra["routing"]
    assert (routing.num_groups, routing.top_groups) == (1, 1)


def test_group_limited_greedy_routes_within_the_best_groups(tmp_path: Path):
    """DeepSeek-V2's (full) router: each token's experts from its `topk_group` best groups."""
    path = checkpoint(tmp_path, topk_method="group_limited_greedy", n_group=2, topk_group=1)
    ours = load_model(path)
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    experts = ours.model.model.layers[1].mlp
    tokens = mx.random.normal((64, 64), key=mx.random.key(1))
    chosen, _ = experts.route(tokens)
    scores = mx.softmax(tokens @ experts.gate.weight.T, axis=-1)
    best_group = scores.reshape(64, 2, 2).max(axis=-1).argmax(axis=-1)  # 4 experts in 2 groups
    assert (chosen // 2 == best_group[:, None]).all().item()

