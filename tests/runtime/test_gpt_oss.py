"""gpt-oss against mlx-lm: its sinks, alternating windows, biased clamped experts and
YaRN, on every attention path of the paged engine; and the three weight layouts
(mlx-community's, OpenAI's MXFP4 release, transformers' float one) loading alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.models.experts import clamped_swiglu
from runtime.models.layers import RoPE
from runtime.synth import make_tiny_checkpoint, save_weights

import attrs
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from kernels import paged_attention
from kernels.cpu_extension import cpu_extension
from tests.kernels.test_paged_attention import ATTENTION_PATHS
from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy

TOKENS = mx.array([list(range(5, 45))])  # 40 positions: several 8-key windows
SHAPE = dict(num_layers=4, hidden_size=64, head_dim=32, num_heads=4, num_kv_heads=2, sliding_window=8, seed=4)
# The releases' YaRN (factor 32 over 4,096 positions), scaled down so that the test's
# positions run past the original context. The releases say `truncate: false`, which
# mlx-lm ignores (it always rounds the ramp's bounds); cadence follows transformers
# and OpenAI's reference there (tests/runtime/test_models.py checks that formula), so
# parity with mlx-lm is checked with truncation on.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": True,
}


def gpt_oss(tmp_path: Path, **fields) -> Path:
    path = make_tiny_checkpoint(tmp_path, "gpt_oss", **SHAPE, rope_scaling=YARN, max_position_embeddings=64)
    if fields:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, **fields}))
    return path


def test_gpt_oss_logits_match_mlx_lm_and_sinks_and_windows_matter(tmp_path: Path):
    path = gpt_oss(tmp_path)
    ours = load_model(path)
    assert ours.config.layer_windows == (8, None, 8, None)
    assert ours.config.qkv_bias and ours.config.o_bias
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    assert want.std().item() > 1.0
    attention = ours.model.model.layers[0].self_attn
    attention.sinks = mx.full(attention.sinks.shape, -1e9)  # one layer's sinks off
    assert not mx.allclose(ours.model(TOKENS), want, atol=1e-2).item()
    ours = load_model(path)
    ours.model.config = attrs.evolve(ours.config, layer_windows=())
    assert not mx.allclose(ours.model(TOKENS), want, atol=1e-2).item()
    untruncated = load_model(gpt_oss(tmp_path / "release", rope_scaling={**YARN, "truncate": False}))
    assert untruncated.config.rope_scaling["truncate"] is False
    assert not mx.allclose(untruncated.model(TOKENS), want, atol=1e-3).item()


def test_the_clamp_and_the_biases_of_the_experts_are_run(tmp_path: Path):
    """A swiglu_limit that clamps the tiny model's activations, and experts without
    their biases, each change the logits (and mlx-lm's clamp is not configurable)."""
    path = gpt_oss(tmp_path)
    want = load_model(path).model(TOKENS)
    clamped = load_model(gpt_oss(tmp_path / "clamped", swiglu_limit=0.1))
    assert clamped.config.extra["experts"].swiglu_limit == 0.1
    assert not mx.allclose(clamped.model(TOKENS), want, atol=1e-2).item()
    ours = load_model(path)
    experts = ours.model.model.layers[1].mlp.switch_mlp
    experts.down_proj.bias = mx.zeros_like(experts.down_proj.bias)
    assert not mx.allclose(ours.model(TOKENS), want, atol=1e-2).item()


def test_the_clamp_caps_the_gate_from_above_only_as_transformers():
    """transformers' GptOssExperts: gate.clamp(max=limit), up.clamp(-limit, limit), then
    (up + 1) * gate * sigmoid(1.702 gate); a gate far below -limit stays itself."""
    gate = np.array([-30.0, -9.0, -2.0, 0.0, 3.0, 9.0], dtype=np.float32)
    up = np.array([-9.0, 1.0, 0.5, 2.0, 8.0, -1.0], dtype=np.float32)
    capped = np.minimum(gate, 7.0)
    want = (np.clip(up, -7.0, 7.0) + 1.0) * capped / (1.0 + np.exp(-1.702 * capped))
    got = clamped_swiglu(mx.array(gate), mx.array(up), 7.0)
    assert np.allclose(np.array(got), want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_sinks_keep_greedy_parity_on_every_attention_path(tmp_path: Path, monkeypatch, path):
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    checkpoint = gpt_oss(tmp_path)
    prompt = TOKENS[0, :30].tolist()
    before = paged_attention.dispatch_counts[path]
    tokens = greedy(load_model(checkpoint), prompt, 24)
    assert tokens == mlx_lm_greedy(checkpoint, prompt, 24)
    assert len(set(tokens)) > 4
    assert paged_attention.dispatch_counts[path] > before  # no silent fallback


def openai_layout(weights: dict[str, mx.array], float_experts: bool) -> dict[str, mx.array]:
    """mlx-community's stacked experts as OpenAI released them (MXFP4 blocks of 32
    weights in 16 bytes, with uint8 scales) or as transformers holds them in float
    ([E, in, out]); gate and up interleaved row by row in one `gate_up_proj`."""
    out = {}
    for name, w in weights.items():
        block, is_expert, rest = name.partition(".mlp.experts.")
        if not is_expert:
            out[name] = w
            continue
        projection, _, suffix = rest.partition(".")
        if projection == "up_proj":
            continue  # with gate_proj
        stored = "gate_up_proj" if projection == "gate_proj" else "down_proj"
        parts = [w] if projection == "down_proj" else [w, weights[name.replace("gate_proj", "up_proj")]]
        if suffix == "bias":
            out[f"{block}.mlp.experts.{stored}_bias"] = mx.stack(parts, axis=-1).reshape(w.shape[0], -1)
            continue
        if float_experts:
            joined = mx.stack(parts, axis=2).reshape(w.shape[0], -1, w.shape[-1])  # rows interleaved
            out[f"{block}.mlp.experts.{stored}"] = joined.swapaxes(1, 2)
            continue
        packed = [mx.quantize(p, group_size=32, bits=4, mode="mxfp4") for p in parts]
        words = mx.stack([q for q, _ in packed], axis=2).reshape(w.shape[0], -1, w.shape[-1] // 8)
        scales = mx.stack([s for _, s in packed], axis=2).reshape(w.shape[0], -1, w.shape[-1] // 32)
        out[f"{block}.mlp.experts.{stored}_blocks"] = mx.view(words, mx.uint8).reshape(*scales.shape, 16)
        out[f"{block}.mlp.experts.{stored}_scales"] = scales
    return out


def relayout(source: Path, into: Path, float_experts: bool) -> Path:
    into.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (into / name).write_bytes((source / name).read_bytes())
    weights = openai_layout(mx.load(str(source / "model.safetensors")), float_experts)
    save_weights(into, weights)
    if not float_experts:
        raw = json.loads((into / "config.json").read_text())
        raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
        (into / "config.json").write_text(json.dumps(raw))
    return into


def test_openais_mxfp4_release_layout_loads_as_mlx_lm_reads_it(tmp_path: Path):
    path = relayout(gpt_oss(tmp_path / "source"), tmp_path / "openai", float_experts=False)
    ours = load_model(path, keep_dtype=True)
    experts = ours.model.model.layers[0].mlp.switch_mlp.gate_proj
    assert (experts.mode, experts.bits, experts.group_size) == ("mxfp4", 4, 32)
    assert ours.config.foreign_quantization is None
    reference = mlx_lm.load(str(path))[0]
    assert mx.allclose(ours.model(TOKENS), reference(TOKENS), atol=1e-4).item()
    prompt = TOKENS[0, :20].tolist()
    on_cpu = load_model(path)  # the experts on cadence's kernel: its exponents as float32 scales
    ext = cpu_extension()
    calls = ext.num_expert_calls() if ext is not None else 0
    assert greedy(on_cpu, prompt, 16) == mlx_lm_greedy(path, prompt, 16)
    if ext is not None:
        assert on_cpu.model.model.layers[0].mlp.switch_mlp.up_proj.scales.dtype == mx.float32
        assert ext.num_expert_calls() > calls


def test_transformers_float_layout_loads_as_the_stacked_one(tmp_path: Path):
    source = gpt_oss(tmp_path / "source")
    path = relayout(source, tmp_path / "transformers", float_experts=True)
    stacked = load_model(source).model(TOKENS)
    assert mx.array_equal(load_model(path).model(TOKENS), stacked).item()


def test_an_experts_tensor_of_another_layout_is_named(tmp_path: Path):
    source = gpt_oss(tmp_path / "source")
    weights = mx.load(str(source / "model.safetensors"))
    weights["model.layers.0.mlp.experts.gate_up_proj"] = mx.zeros((4, 64))  # 2-D
    save_weights(source, weights)
    with pytest.raises(CheckpointError, match="'gate_up_proj' should be \\[E, in, out\\]"):
        load_model(source)


@pytest.mark.parametrize("damage", ["float16", "3-D"])
def test_mxfp4_blocks_of_another_dtype_or_rank_are_named(tmp_path: Path, damage):
    """Viewed as packed words regardless, such blocks loaded as weights no one wrote."""
    path = relayout(gpt_oss(tmp_path / "source"), tmp_path / "openai", float_experts=False)
    weights = mx.load(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    blocks = weights[name]
    weights[name] = blocks.astype(mx.float16) if damage == "float16" else blocks.reshape(*blocks.shape[:2], -1)
    save_weights(path, weights)
    with pytest.raises(CheckpointError, match=re.escape("'gate_up_proj_blocks' should be uint8 [E, out, groups, 16]")):
        load_model(path)


def test_an_experts_tensor_of_no_projection_is_named_not_split_over_gate_and_up(tmp_path: Path):
    path = relayout(gpt_oss(tmp_path / "source"), tmp_path / "openai", float_experts=False)
    weights = mx.load(str(path / "model.safetensors"))
    stored = weights["model.layers.0.mlp.experts.gate_up_proj_bias"]
    weights["model.layers.0.mlp.experts.zzz_bias"] = stored * 2
    save_weights(path, weights)
    with pytest.raises(CheckpointError, match="unexpected experts tensor 'zzz'"):
        load_model(path)


# gpt-oss-20b's config.json as OpenAI released it (the fields cadence reads).
RELEASE_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_fields_the_config_leaves_out_default_as_transformers():
    """GptOssConfig's defaults: swiglu_limit 7, a 128-token window, biased attention."""
    left_out = ("swiglu_limit", "sliding_window", "attention_bias")
    config = config_from_dict({k: v for k, v in RELEASE_CONFIG.items() if k not in left_out})
    assert config.extra["experts"].swiglu_limit == 7.0
    assert config.layer_windows == (128, None) * 12
    assert config.qkv_bias and config.o_bias


def openai_yarn(head_dim=64, base=150000.0, factor=32.0, context=4096, beta_fast=32.0, beta_slow=1.0):
    """(inverse frequencies, concentration) as OpenAI's reference implementation of
    gpt-oss computes them: the ramp's bounds not rounded."""
    half = head_dim // 2
    freqs = base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low = half * np.log(context / (beta_fast * 2 * np.pi)) / np.log(base)
    high = half * np.log(context / (beta_slow * 2 * np.pi)) / np.log(base)
    ramp = np.clip((np.arange(half) - low) / (high - low), 0, 1)
    inv_freq = (1 / (factor * freqs)) * ramp + (1 / freqs) * (1 - ramp)
    return inv_freq, 0.1 * np.log(factor) + 1.0


def test_the_released_config_reads_as_openai_runs_the_model():
    config = config_from_dict(RELEASE_CONFIG)
    assert config.layer_windows == (128, None) * 12
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (64, 8, 201088)
    experts = config.extra["experts"]
    assert (experts.num_experts, experts.top_k, experts.intermediate_size) == (32, 4, 2880)
    assert experts.swiglu_limit == 7.0 and experts.biases and experts.normalize
    assert config.quantization is not None and config.foreign_quantization is None
    assert (config.quantization.group_size, config.quantization.bits, config.quantization.mode) == (32, 4, "mxfp4")
    rope = RoPE(config.head_dim, config.rope_theta, config.rope_scaling)
    inv_freq, concentration = openai_yarn()
    np.testing.assert_allclose(np.array(rope.inv_freqs), inv_freq, rtol=1e-6)
    assert rope.attention_factor == pytest.approx(concentration**2, rel=1e-6)  # on q and k: squared
    # Rounding the ramp's bounds (mlx-lm's and llama.cpp's YaRN) moves some frequencies.
    rounded = RoPE(config.head_dim, config.rope_theta, {**config.rope_scaling, "truncate": True})
    assert not np.allclose(np.array(rounded.inv_freqs), inv_freq, rtol=1e-3)
