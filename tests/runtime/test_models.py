"""One file per family behind the model_type registry; Gemma 3's details against mlx-lm."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict, load_config
from runtime.errors import CheckpointError
from runtime.models import FAMILIES, build_model
from runtime.models.gemma3 import _add_residual
from runtime.models.layers import AttentionTemperature, RoPE, yarn_attention_factor
from runtime.synth import hf_config, make_tiny_checkpoint

import attrs
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import transformers
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE
from structlog.testing import capture_logs

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy

TOKENS = mx.array([list(range(5, 45))])  # 40 positions: several times an 8-key window


def gemma_config(**fields):
    raw = hf_config(
        "gemma3_text", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=6,
        num_heads=4, num_kv_heads=1, intermediate_size=128, head_dim=32,
    )
    raw.update(fields)
    return raw


def test_every_family_is_one_module_in_the_registry_and_the_error_lists_them():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3"} <= set(FAMILIES)
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt2'") as error:
        config_from_dict({"model_type": "gpt2"})
    assert "gemma3_text" in str(error.value) and "llama" in str(error.value)


@pytest.mark.parametrize("family", ["gemma3_text", "gemma3"])
@pytest.mark.parametrize("is_tied", [True, False], ids=["tied", "untied"])
def test_gemma3_logits_match_mlx_lm_past_the_window(tmp_path: Path, family: str, is_tied: bool):
    path = make_tiny_checkpoint(
        tmp_path, family, num_layers=4, num_kv_heads=1, tie_word_embeddings=is_tied, seed=2
    )
    with capture_logs() as logs:
        ours = load_model(path)
    skipped = [e for e in logs if "vision tower skipped" in e["event"]]
    assert len(skipped) == (family == "gemma3")
    assert ours.config.layer_windows == (8, None, 8, None)
    reference, _ = mlx_lm.load(str(path))
    want = reference(TOKENS)
    got = ours.model(TOKENS)
    assert mx.allclose(got, want, atol=1e-4).item()
    assert want.std().item() > 1.0  # a real spread, not near-ties everywhere
    # The window is honoured: the same weights with every layer global differ.
    ours.model.config = attrs.evolve(ours.config, layer_windows=())
    assert not mx.allclose(ours.model(TOKENS), want, atol=1e-2).item()


def test_gemma3_scales_its_embedding_by_the_root_of_hidden_size_in_bfloat16(tmp_path: Path):
    """sqrt(96) is 9.80 against bfloat16's 9.81: exact, every logit was off mlx-lm's (and
    transformers', for bf16 weights) by ~5e-3 at real sizes (sqrt(1152): 33.94 vs 34.0)."""
    path = make_tiny_checkpoint(tmp_path, "gemma3_text", num_layers=2, hidden_size=96, seed=3)
    reference, _ = mlx_lm.load(str(path))
    want = reference(TOKENS)
    assert mx.allclose(load_model(path).model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3"])
@pytest.mark.parametrize("is_tied", [True, False], ids=["tied", "untied"])
def test_a_config_silent_on_tying_ties_exactly_when_no_lm_head_is_stored(
    make_checkpoint, tmp_path: Path, family: str, is_tied: bool
):
    """Published configs may leave tie_word_embeddings out: mlx-lm's llama and qwen2 then
    tie, its gemma3 ties when lm_head.weight is absent. Read as untied, a tied checkpoint
    was refused ("missing tensor 'lm_head.weight'"); a stored lm_head is used, as by
    transformers (whose llama default is untied) and mlx-lm's gemma3."""
    said = make_checkpoint(family, tie_word_embeddings=is_tied, num_layers=2, head_dim=16)
    silent = tmp_path / "silent"
    shutil.copytree(said, silent)
    raw = json.loads((silent / "config.json").read_text())
    del raw["tie_word_embeddings"]
    (silent / "config.json").write_text(json.dumps(raw))
    loaded = load_model(silent)
    assert loaded.config.tie_word_embeddings is is_tied
    assert loaded.model.config.tie_word_embeddings is is_tied
    prompt = TOKENS[0, :12].tolist()
    ours = greedy(loaded, prompt, 16)
    assert ours == mlx_lm_greedy(said, prompt, 16)  # mlx-lm told in config.json
    assert len(set(ours)) > 3


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_layer_types_naming_sliding_layers_make_them_slide_as_in_mlx_lm(tmp_path: Path, family):
    """mlx-lm's llama (Mistral's too) windows the layers `layer_types` calls sliding;
    ignoring it gave full attention, different tokens past the window, and no error."""
    path = make_tiny_checkpoint(tmp_path, family, seed=2)
    raw = json.loads((path / "config.json").read_text())
    sliding = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    (path / "config.json").write_text(json.dumps({**raw, **sliding}))
    ours = load_model(path)
    assert ours.config.layer_windows == (8, None)
    reference, _ = mlx_lm.load(str(path))
    want = reference(TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    prompt = TOKENS[0, :30].tolist()  # through the engine's paged pools, a windowed one
    steps = generate_step(mx.array(prompt), reference, max_tokens=16)
    assert greedy(ours, prompt, 16) == [int(token) for token, _ in steps]
    ours.model.config = attrs.evolve(ours.config, layer_windows=())  # the window matters here
    assert not mx.allclose(ours.model(TOKENS), want, atol=1e-2).item()


def test_layer_types_of_full_layers_only_or_a_qwen2s_sliding_ones_are_read():
    raw = hf_config("qwen2", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    every_full = {**raw, "sliding_window": 8, "layer_types": ["full_attention"] * 3}
    assert config_from_dict(every_full).layer_windows == ()
    later_slide = {**every_full, "layer_types": ["full_attention"] + ["sliding_attention"] * 2}
    assert config_from_dict(later_slide).layer_windows == (None, 8, 8)
    with pytest.raises(CheckpointError, match="layer_types needs 3 entries"):
        config_from_dict({**raw, "layer_types": ["sliding_attention"]})
    with pytest.raises(CheckpointError, match="field 'sliding_window' should be int"):
        config_from_dict({**later_slide, "sliding_window": None})


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwens_use_sliding_window_slides_the_layers_from_max_window_layers(family):
    """transformers derives `layer_types` from these two when a config has none; read
    as no window at all, every layer attended to the whole context, unannounced."""
    raw = hf_config(family, vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=4,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    windowed = {**raw, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    assert config_from_dict(windowed).layer_windows == (None, None, 8, 8)
    assert config_from_dict({**windowed, "use_sliding_window": False}).layer_windows == ()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_an_activation_other_than_silu_is_refused(family):
    """These families' MLP is SiLU-gated: a `gelu` config ran as SiLU, every token off."""
    raw = hf_config(family, vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    assert config_from_dict({**raw, "hidden_act": "swish"}).layer_windows == ()
    with pytest.raises(CheckpointError, match="hidden_act 'gelu' is not supported"):
        config_from_dict({**raw, "hidden_act": "gelu"})


def test_gemma3_refuses_a_scaled_rope_for_its_sliding_layers():
    """transformers 5's per-layer-type form: a scaling named for the sliding layers was
    dropped, and they ran plain RoPE."""
    local = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    rope = {"sliding_attention": local, "full_attention": {"rope_theta": 1e6}}
    with pytest.raises(CheckpointError, match="sliding-layer rope_type 'linear'"):
        config_from_dict(gemma_config(rope_parameters=rope))
    plain = {**rope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert config_from_dict(gemma_config(rope_parameters=plain)).extra["rope_local_base_freq"] == 1e4


def test_gemma3_reads_layer_types_or_the_older_sliding_window_pattern():
    by_pattern = config_from_dict({**gemma_config(sliding_window_pattern=3), "layer_types": None})
    assert by_pattern.layer_windows == (8, 8, None, 8, 8, None)
    by_types = config_from_dict(
        gemma_config(layer_types=["full_attention"] + ["sliding_attention"] * 5, sliding_window=16)
    )
    assert by_types.layer_windows == (None, 16, 16, 16, 16, 16)
    assert by_types.extra == {
        "query_pre_attn_scalar": 24.0, "rope_local_base_freq": 10000.0, "final_logit_softcapping": 0.0
    }
    assert by_types.tie_word_embeddings is False and by_types.rope_theta == 1_000_000.0


def test_gemma3_defaults_follow_transformers_when_fields_are_left_out():
    raw = gemma_config()
    for name in ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                 "tie_word_embeddings", "rope_theta", "rope_local_base_freq", "sliding_window_pattern"):
        del raw[name]
    config = config_from_dict(raw)
    assert config.head_dim == 256
    assert config.tie_word_embeddings is None  # decided from the weights at load
    assert config.layer_windows == (4096,) * 5 + (None,)
    assert config.extra["query_pre_attn_scalar"] == 256.0
    assert (config.rope_theta, config.extra["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)


def test_gemma3_rope_parameters_of_transformers_5():
    raw = gemma_config(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        }
    )
    config = config_from_dict(raw)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.extra["rope_local_base_freq"] == 5000.0


@pytest.mark.parametrize(
    ("family", "rope"),
    [
        ("llama", {"rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}}),
        ("qwen3", {"rope_theta": 1000000.0}),
        ("qwen3", {"rope_theta": 1000000.0, "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}),
    ],
)
def test_rope_parameters_as_transformers_5_writes_them_give_the_old_layouts_model(
    tmp_path: Path, family, rope
):
    path = make_tiny_checkpoint(tmp_path, family, seed=3)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **rope}))
    old = load_model(path)
    # transformers 5 rewrites it with neither rope_theta nor rope_scaling at the top level
    transformers.AutoConfig.from_pretrained(path).save_pretrained(path)
    rewritten = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in rewritten and "rope_theta" not in rewritten
    new = load_model(path)
    assert (new.config.rope_theta, new.config.rope_scaling) == (old.config.rope_theta, old.config.rope_scaling)
    assert new.config.rope_theta == rope["rope_theta"]
    assert mx.allclose(new.model(TOKENS), old.model(TOKENS), atol=1e-5).item()


def test_gemma3_caps_its_logits_where_config_json_sets_final_logit_softcapping(tmp_path: Path):
    """transformers' Gemma3ForCausalLM caps them (c * tanh(z / c)) where
    final_logit_softcapping is set, as Rnj-1 (a Gemma 3 of EssentialAI's) sets it; it
    was refused. Gemma 2's cap is the same code."""
    path = make_tiny_checkpoint(tmp_path, "gemma3_text", num_layers=2, hidden_size=96, seed=3)
    plain = load_model(path).model(TOKENS)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 0.5}))
    capped = load_model(path).model(TOKENS)
    assert mx.abs(plain).max().item() > 0.5
    assert mx.allclose(capped, mx.tanh(plain / 0.5) * 0.5, atol=1e-5).item()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping must be a positive number or null"),
        ({"layer_types": ["sliding_attention"]}, "layer_types needs 6 entries"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        ({"sliding_window": 0}, "'sliding_window' must be positive"),
        ({"layer_types": [{}] * 6}, "layer_types needs 6 entries"),
        (
            {"rope_parameters": {"full_attention": {"rope_theta": "x"}}},
            "rope_parameters.full_attention: field 'rope_theta' should be float",
        ),
        (
            {"rope_parameters": {"sliding_attention": {"rope_theta": None}}},
            "rope_parameters.sliding_attention: field 'rope_theta' should be float",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "linear"}}},
            "rope_parameters.full_attention: missing required field 'factor'",
        ),
    ],
)
def test_unsupported_gemma3_settings_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_dict(gemma_config(**fields))


def test_multimodal_gemma3_config_needs_its_text_config(tmp_path: Path):
    make_tiny_checkpoint(tmp_path, "gemma3", num_layers=2)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert load_config(tmp_path).model_type == "gemma3_text"
    del raw["text_config"]
    with pytest.raises(CheckpointError, match="without a 'text_config'"):
        config_from_dict(raw)


@pytest.mark.parametrize("family", ["gemma3_text", "gemma3"])
def test_quantized_gemma3_matches_mlx_lm(tmp_path: Path, family: str):
    path = make_tiny_checkpoint(tmp_path, family, num_layers=2, quantize=(32, 4), seed=4)
    if family == "gemma3":  # mixed bits, named as mlx-community names the multimodal layout
        name = "language_model.model.layers.0.mlp.down_proj"
        weights = dict(mx.load(str(path / "model.safetensors")).items())
        parts = [weights[f"{name}.{p}"] for p in ("weight", "scales", "biases")]
        requantized = mx.quantize(mx.dequantize(*parts, group_size=32, bits=4), group_size=64, bits=8)
        weights.update(zip([f"{name}.{p}" for p in ("weight", "scales", "biases")], requantized, strict=True))
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
        raw = json.loads((path / "config.json").read_text())
        raw["quantization"][name] = {"group_size": 64, "bits": 8}
        raw["quantization"]["vision_tower.vision_model.post_layernorm"] = False
        (path / "config.json").write_text(json.dumps(raw))
    config = load_config(path)
    assert config.quantization is not None
    if family == "gemma3":
        assert config.quantization.per_layer == {"model.layers.0.mlp.down_proj": (64, 8, "affine")}
    ours = load_model(path, keep_dtype=True)
    reference, _ = mlx_lm.load(str(path))
    assert mx.allclose(ours.model(TOKENS), reference(TOKENS), atol=1e-3).item()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_bidirectional_attention": True}, "bidirectional attention is not supported"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
            "unsupported rope_type 'yarn'",
        ),
    ],
)
def test_gemma3_settings_it_cannot_run_are_refused(fields, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_dict(gemma_config(**fields))


def test_gemma3_takes_both_names_of_its_gelu_and_rope_parameters_without_a_theta():
    assert config_from_dict(gemma_config(hidden_activation="gelu_tanh")).model_type == "gemma3_text"
    # A full_attention entry naming no rope_theta keeps the config's own, unscaled.
    config = config_from_dict(
        gemma_config(rope_theta=250_000.0, rope_parameters={"full_attention": {"rope_type": "default"}})
    )
    assert config.rope_theta == 250_000.0 and config.rope_scaling is None


def test_multimodal_gemma3_quantization_keeps_only_the_text_models_entries():
    text = gemma_config()
    raw = {
        "model_type": "gemma3",
        "text_config": text,
        "vocab_size": text["vocab_size"],
        "quantization": {
            "group_size": 64,
            "bits": 4,
            "language_model.model.layers.1.mlp.up_proj": {"group_size": 32, "bits": 8},
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1": {"group_size": 64, "bits": 8},
            "model.multi_modal_projector.mm_input_projection": {"group_size": 64, "bits": 8},
        },
    }
    config = config_from_dict(raw)
    assert config.quantization.per_layer == {"model.layers.1.mlp.up_proj": (32, 8, "affine")}


def test_gemma3_in_the_newer_multimodal_layout_loads_as_the_older_one(tmp_path: Path):
    """transformers >= 4.52 names the text model `model.language_model.` and the vision
    tower `model.vision_tower.`; the head stays `lm_head`."""
    older = make_tiny_checkpoint(tmp_path / "older", "gemma3", num_layers=2, seed=5)
    newer = make_tiny_checkpoint(tmp_path / "newer", "gemma3", num_layers=2, seed=5)
    weights = mx.load(str(newer / "model.safetensors"))
    renamed = {}
    for name, tensor in weights.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model."):
            name = name.removeprefix("language_model.")
        else:  # the vision tower and projector
            name = "model." + name
        renamed[name] = tensor
    assert any(k.startswith("model.vision_tower.") for k in renamed)
    mx.save_safetensors(str(newer / "model.safetensors"), renamed, metadata={"format": "pt"})
    with capture_logs() as logs:
        ours = load_model(newer)
    assert [e for e in logs if "vision tower skipped" in e["event"]]
    want = load_model(older).model(TOKENS[:, :12])
    assert mx.array_equal(ours.model(TOKENS[:, :12]), want).item()


def test_gemma3_residual_adds_in_float32_and_clips_to_float16s_range():
    x = mx.array([60000.0, -60000.0, 1.0, 2048.0], dtype=mx.float16)
    y = mx.array([10000.0, -10000.0, 2.0, 1.0], dtype=mx.float16)
    got = _add_residual(x, y)
    assert got.dtype == mx.float16
    bound = float(mx.finfo(mx.float16).max)
    want = mx.array([bound, -bound, 3.0, 2049.0], dtype=mx.float32).astype(mx.float16)
    assert mx.array_equal(got, want).item()
    wide = _add_residual(x.astype(mx.float32), y.astype(mx.float32))  # float32: a plain add
    assert mx.array_equal(wide, mx.array([70000.0, -70000.0, 3.0, 2049.0])).item()


@pytest.mark.parametrize("key", ["rope_type", "type"])  # "type": older configs' name
def test_linear_rope_scaling_matches_mlx_lm(tmp_path: Path, key: str):
    scaling = {key: "linear", "factor": 4.0}
    path = make_tiny_checkpoint(tmp_path / "scaled", "llama", rope_scaling=scaling, seed=3)
    reference, _ = mlx_lm.load(str(path))
    want = reference(TOKENS)
    assert mx.allclose(load_model(path).model(TOKENS), want, atol=1e-4).item()
    unscaled = load_model(make_tiny_checkpoint(tmp_path / "plain", "llama", seed=3))  # same weights
    assert not mx.allclose(unscaled.model(TOKENS), want, atol=1e-2).item()


# mistral as mlx-lm runs it (as llama), qwen3 as transformers does (mlx-lm drops its biases)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_attention_bias_puts_a_bias_on_q_k_v_and_o(family):
    raw = hf_config(family, vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    raw.pop("attention_bias", None)
    assert (config_from_dict(raw).qkv_bias, config_from_dict(raw).o_bias) == (False, False)
    config = config_from_dict({**raw, "attention_bias": True})
    assert config.qkv_bias and config.o_bias
    attention = build_model(config).model.layers[0].self_attn
    assert all("bias" in getattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))


def test_a_bfloat16_gemma3_kept_in_its_dtype_matches_mlx_lm(tmp_path: Path):
    """The embedding's sqrt(hidden) factor is cast to the weights' dtype: a bfloat16 model
    stays bfloat16 from the embedding on (hidden 128: the factor is not exact)."""
    path = make_tiny_checkpoint(tmp_path, "gemma3_text", num_layers=2, dtype="bfloat16", hidden_size=128, seed=6)
    ours = load_model(path, keep_dtype=True)
    assert ours.model.embed(TOKENS).dtype == mx.bfloat16
    reference, _ = mlx_lm.load(str(path))
    got, want = ours.model(TOKENS), reference(TOKENS)
    assert got.dtype == want.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=1e-2).item()


def test_gemma3_scales_rope_on_its_global_layers_only_as_mlx_lm(tmp_path: Path):
    scaling = {"rope_type": "linear", "factor": 8.0}
    path = make_tiny_checkpoint(tmp_path / "scaled", "gemma3_text", num_layers=4, rope_scaling=scaling, seed=2)
    ours = load_model(path)
    assert ours.config.rope_scaling == scaling
    reference, _ = mlx_lm.load(str(path))
    want = reference(TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    unscaled = load_model(make_tiny_checkpoint(tmp_path / "plain", "gemma3_text", num_layers=4, seed=2))
    assert not mx.allclose(unscaled.model(TOKENS), want, atol=1e-2).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["cpu-kernel", "mlx-fallback"])
def test_llama3_rope_rotates_as_mlx_lms(dtype):
    """Original context 64 at head_dim 16: two frequencies smoothed, five scaled by the factor."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    x = mx.random.normal((6, 2, 16), key=mx.random.key(0)).astype(dtype)
    positions = mx.array([0, 1, 7, 40, 300, 4000], dtype=mx.int32)
    got = RoPE(16, 10000.0, scaling)(x, positions)
    want = Llama3RoPE(16, base=10000.0, scaling_config=scaling)(x[:, :, None, :], positions)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == mx.float32 else 1e-2
    assert mx.allclose(got, want[:, :, 0, :], atol=tolerance).item()
    assert not mx.allclose(got, RoPE(16, 10000.0, None)(x, positions), atol=1e-2).item()


def test_every_norm_takes_the_configs_rms_norm_eps_as_mlx_lm(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "qwen3", seed=3)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 0.5}))
    reference, _ = mlx_lm.load(str(path))
    assert mx.allclose(load_model(path).model(TOKENS), reference(TOKENS), atol=1e-4).item()


def phi3_checkpoint(tmp_path: Path, **fields) -> Path:
    """A tiny Phi-3 (q/k/v and gate/up stored fused) with `fields` set in config.json."""
    path = make_tiny_checkpoint(tmp_path / "phi3", "phi3", seed=1, max_position_embeddings=4096)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))
    return path


LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0] * 8,  # head_dim 16: 8 frequencies
    "long_factor": [1.0 + 3 * i for i in range(8)],
}


@pytest.mark.parametrize("scaling", [None, LONGROPE], ids=["default-rope", "longrope"])
def test_phi3_splits_its_fused_projections_and_matches_mlx_lm(tmp_path: Path, scaling):
    """Phi-3's qkv_proj and gate_up_proj are split at load; LongRoPE runs its long
    factors and its attention factor (sqrt(1 + ln 16 / ln 256) here) as mlx-lm's."""
    path = phi3_checkpoint(tmp_path, rope_scaling=scaling, original_max_position_embeddings=256)
    assert "model.layers.0.self_attn.qkv_proj.weight" in mx.load(str(path / "model.safetensors"))
    ours = load_model(path)
    reference, _ = mlx_lm.load(str(path))
    want = reference(TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    assert want.std().item() > 1.0
    prompt = TOKENS[0, :12].tolist()
    assert greedy(ours, prompt, 16) == mlx_lm_greedy(path, prompt, 16)
    if scaling is not None:  # the factors matter: the plain rotation differs
        plain = load_model(phi3_checkpoint(tmp_path / "plain"))
        assert not mx.allclose(plain.model(TOKENS), want, atol=1e-2).item()
        factor = ours.model.model.layers[0].self_attn.scale * 16**0.5
        assert factor == pytest.approx(1 + math.log(16) / math.log(256))


def test_phi3_applies_its_sliding_window_to_every_layer_as_transformers(
    tmp_path: Path, monkeypatch
):
    """Phi-3-mini-4k says sliding_window 2047: transformers windows every layer with it,
    mlx-lm runs them full. The reference is mlx-lm's phi3 given transformers' mask."""
    path = phi3_checkpoint(tmp_path, sliding_window=8)
    ours = load_model(path)
    assert ours.config.layer_windows == (8, 8)
    reference, _ = mlx_lm.load(str(path))
    prompt = TOKENS[0, :30].tolist()
    unwindowed = reference(TOKENS), mlx_lm_greedy(path, prompt, 16)

    def windowed_mask(h, cache=None, window_size=None, **kwargs):
        return create_attention_mask(h, cache, window_size=8, **kwargs)

    monkeypatch.setattr(mlx_lm.models.phi3, "create_attention_mask", windowed_mask)
    want = reference(TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    tokens = greedy(ours, prompt, 16)  # through the engine's one windowed pool
    assert tokens == mlx_lm_greedy(path, prompt, 16)
    assert not mx.allclose(unwindowed[0], want, atol=1e-2).item() and tokens != unwindowed[1]
    # A window as long as the context is none (Phi-3.5's 262144 over 131072).
    long = phi3_checkpoint(tmp_path / "long", sliding_window=4096)
    assert load_model(long).config.layer_windows == ()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"partial_rotary_factor": 0.0625},
            "partial_rotary_factor rotates 1 of a head's 16 dimensions; it needs an even number",
        ),
        ({"partial_rotary_factor": 1.5}, "rotates 24 of a head's 16 dimensions"),
        ({"attention_bias": True}, "attention_bias=true is not supported for phi3"),
        (
            {"rope_scaling": {**LONGROPE, "long_factor": [1.0] * 7}},
            "needs 'long_factor', a list of 8 positive numbers",
        ),
        (
            {"rope_scaling": {**LONGROPE, "long_factor": [1.0] * 9}},
            "needs 'long_factor', a list of 8 positive numbers",
        ),
        (
            {"rope_scaling": {**LONGROPE, "short_factor": [1.0] * 7 + [0.0]}},
            "needs 'short_factor', a list of 8 positive numbers",
        ),
        (
            {"rope_scaling": LONGROPE, "original_max_position_embeddings": None},
            "needs a positive integer original_max_position_embeddings, got None",
        ),
        (
            {"rope_scaling": {**LONGROPE, "attention_factor": -1}},
            "attention_factor must be a positive number, got -1",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling type 'dynamic'"),
    ],
    ids=["partial-rotary-odd", "partial-rotary-over", "bias", "long-short", "long-long", "short-zero", "no-original", "factor", "dynamic"],
)
def test_phi3_settings_it_cannot_run_are_one_line_errors(fields, message):
    raw = hf_config(
        "phi3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, intermediate_size=128,
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict({**raw, **fields})


def test_phi3_longrope_from_transformers_5s_rope_parameters_and_its_own_attention_factor():
    raw = hf_config(
        "phi3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, intermediate_size=128,
    )
    del raw["rope_scaling"], raw["rope_theta"], raw["original_max_position_embeddings"]
    parameters = {
        **LONGROPE, "rope_type": "longrope", "rope_theta": 10000.0,
        "original_max_position_embeddings": 256, "attention_factor": 1.25,
    }
    config = config_from_dict({**raw, "rope_parameters": parameters})
    assert config.rope_scaling is not None
    assert config.rope_scaling["long_factor"] == LONGROPE["long_factor"]
    assert config.rope_scaling["attention_factor"] == 1.25
    assert RoPE(16, 10000.0, config.rope_scaling).attention_factor == 1.25**2



@pytest.mark.parametrize(("context", "factor"), [(256, 1.0), (4096, math.sqrt(1 + math.log(16) / math.log(256)))])
def test_phi3_longropes_default_attention_factor_is_1_within_the_original_context(context, factor):
    raw = hf_config("phi3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    raw.update(rope_scaling=LONGROPE, original_max_position_embeddings=256, max_position_embeddings=context)
    assert config_from_dict(raw).rope_scaling["attention_factor"] == pytest.approx(factor)


@pytest.mark.parametrize(("attention_factor", "gain"), [(0.5, 0.25), (1.0, None), (2.0, 4.0)])
def test_phi3_partial_rotations_longrope_factor_below_1_is_folded_into_q_too(attention_factor, gain):
    raw = hf_config("phi3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    longrope = {**LONGROPE, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "attention_factor": attention_factor}
    raw.update(rope_scaling=longrope, partial_rotary_factor=0.5, original_max_position_embeddings=256)
    assert config_from_dict(raw).extra.get("rotated_query_gain") == gain


def test_a_phi3_fused_projection_of_the_wrong_size_is_named(tmp_path: Path):
    path = phi3_checkpoint(tmp_path)
    weights = mx.load(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.gate_up_proj.weight"
    weights[name] = weights[name][:-2]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError) as error:
        load_model(path)
    assert str(error.value).endswith(f"tensor '{name}' has shape (254, 64), expected 256 rows")
    assert str(path) in str(error.value)


@pytest.mark.parametrize("quantize", [None, (64, 4)], ids=["float", "q4"])
@pytest.mark.parametrize("scaling", [None, "longrope"])
def test_phi4_minis_partial_rotation_matches_mlx_lm(tmp_path: Path, scaling, quantize):
    """Phi-4-mini rotates 0.75 of each head; LongRoPE's attention factor scales only that
    part of q and k (folded into q_proj's rotated rows, through a quantized layer's
    scales and biases), so the attention's scale cannot carry it."""
    path = make_tiny_checkpoint(
        tmp_path / "phi4mini", "phi3", seed=1, max_position_embeddings=4096, quantize=quantize,
        hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2,
    )
    raw = json.loads((path / "config.json").read_text())
    longrope = {**LONGROPE, "short_factor": [1.0] * 4, "long_factor": [1.0, 4.0, 7.0, 10.0]}
    raw.update(
        partial_rotary_factor=0.5,  # 8 of 16
        original_max_position_embeddings=256,
        rope_scaling=longrope if scaling else None,
    )
    (path / "config.json").write_text(json.dumps(raw))
    ours = load_model(path)
    assert ours.model.model.layers[0].self_attn.rope.dims == 8
    reference, _ = mlx_lm.load(str(path))
    want = reference(TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    prompt = TOKENS[0, :12].tolist()
    assert greedy(ours, prompt, 16) == mlx_lm_greedy(path, prompt, 16)
    if scaling:  # the factor on the whole of q (the full-rotation way) is not the same
        raw["partial_rotary_factor"] = 1.0
        raw["rope_scaling"] = {**LONGROPE, "long_factor": [1.0, 4.0, 7.0, 10.0] * 2}
        (path / "config.json").write_text(json.dumps(raw))
        assert not mx.allclose(load_model(path).model(TOKENS), want, atol=1e-2).item()


def test_a_microscaling_phi4_mini_with_longrope_is_refused_by_name(tmp_path: Path):
    """Its power-of-two scales cannot carry the attention factor into q_proj's rows."""
    path = make_tiny_checkpoint(
        tmp_path / "mx", "phi3", quantize=(32, 4), quantize_mode="mxfp4",
        max_position_embeddings=4096, hidden_size=128, intermediate_size=256,
    )
    raw = json.loads((path / "config.json").read_text())
    longrope = {**LONGROPE, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    raw.update(partial_rotary_factor=0.5, original_max_position_embeddings=256, rope_scaling=longrope)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="q_proj must be float or affine-quantized, not microscaling"):
        load_model(path)
    raw["rope_scaling"] = None  # without LongRoPE there is nothing to fold: it loads
    (path / "config.json").write_text(json.dumps(raw))
    assert load_model(path).model.model.layers[0].self_attn.rope.dims == 16


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["cpu-kernel", "mlx-fallback"])
@pytest.mark.parametrize(
    "settings",
    [{}, {"beta_fast": 16.0, "beta_slow": 2.0}, {"factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0}],
    ids=["defaults", "betas", "ministral3-mscales"],
)
def test_yarn_rope_rotates_and_scales_as_mlx_lms(dtype, settings):
    """Original context 64 at head_dim 16: low frequencies slowed by the factor, high
    ones kept, a ramp between; q and k each scaled by mlx-lm's mscale (squared into the
    attention's scale here)."""
    scaling = {**YARN, **settings}
    x = mx.random.normal((6, 2, 16), key=mx.random.key(0)).astype(dtype)
    positions = mx.array([0, 1, 7, 40, 300, 4000], dtype=mx.int32)
    ours = RoPE(16, 10000.0, scaling)
    extra = {k: v for k, v in scaling.items() if k not in ("rope_type", "factor")}
    theirs = YarnRoPE(16, base=10000.0, scaling_factor=scaling["factor"], **extra)
    want = mx.concatenate([theirs(x[None, i : i + 1].transpose(0, 2, 1, 3), offset=int(p)) for i, p in
                           enumerate(positions.tolist())], axis=2)[0].transpose(1, 0, 2)
    got = ours(x, positions) * ours.attention_factor**0.5
    assert got.dtype == dtype
    assert ours.attention_factor == pytest.approx(theirs.mscale**2)
    assert mx.allclose(got, want, atol=1e-4 if dtype == mx.float32 else 2e-2).item()
    assert not mx.allclose(ours(x, positions), RoPE(16, 10000.0, None)(x, positions), atol=1e-2).item()


def test_yarn_with_truncate_false_ramps_between_the_exact_dimensions_as_transformers():
    """gpt-oss's configs say truncate: false; transformers then leaves the ramp's bounds
    unrounded (its formula, evaluated here in NumPy)."""
    dims, base, factor, context = 16, 10000.0, 4.0, 64
    bound = [dims * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base)) for turns in (32, 1)]
    low, high = max(bound[0], 0), min(bound[1], dims - 1)
    ramp = np.clip((np.arange(dims // 2) - low) / (high - low), 0, 1)
    periods = base ** (np.arange(0, dims, 2) / dims)
    want = (1 - ramp) / periods + ramp / (factor * periods)
    exact = RoPE(dims, base, {**YARN, "truncate": False}).inv_freqs
    assert np.allclose(np.array(exact), want, rtol=1e-5)
    assert not np.allclose(np.array(RoPE(dims, base, YARN).inv_freqs), want, rtol=1e-3)


def transformers_yarn_inv_freqs(dims: int, base: float, scaling: dict) -> np.ndarray:
    """transformers' `_compute_yarn_parameters` (the frequencies), in NumPy."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]

    def bound(turns: float) -> float:
        return dims * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = bound(scaling.get("beta_fast", 32)), bound(scaling.get("beta_slow", 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2) - low) / (high - low), 0, 1)
    periods = base ** (np.arange(0, dims, 2) / dims)
    return (1 - ramp) / periods + ramp / (factor * periods)


@pytest.mark.parametrize(
    ("dims", "base", "scaling"),
    [
        (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen3's long context
        (128, 1e8, {"factor": 16.0, "original_max_position_embeddings": 16384,  # Ministral 3's
                    "beta_fast": 32.0, "beta_slow": 1.0}),
        (64, 10000.0, {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 24.0, "beta_slow": 3.0}),
        (128, 10000.0, {"factor": 8.0, "original_max_position_embeddings": 3500}),  # beta_fast's 32 floors to 19
        (16, 10000.0, {"factor": 4.0, "original_max_position_embeddings": 64}),  # low below dimension 0
        (16, 10000.0, {"factor": 4.0, "original_max_position_embeddings": 6}),  # both bounds at 0: 0.001 apart
        (16, 10000.0, {"factor": 4.0, "original_max_position_embeddings": 100000, "beta_slow": 1e-4}),  # high past the last
        # low == high just below dimension 4: transformers' 0.001 apart decides dimension 4
        (16, 10000.0, {"factor": 4.0, "original_max_position_embeddings": 2 * math.pi * 10000.0 ** (3.995 / 8),
                       "beta_fast": 1.0, "beta_slow": 1.0, "truncate": False}),
    ],
    ids=["qwen3", "ministral3", "betas", "defaults", "low-clamped", "bounds-at-0", "high-clamped", "equal-bounds"],
)
def test_yarn_frequencies_follow_transformers_formula(dims, base, scaling):
    got = np.array(RoPE(dims, base, {"rope_type": "yarn", **scaling}).inv_freqs)
    assert np.allclose(got, transformers_yarn_inv_freqs(dims, base, scaling), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("settings", "factor"),
    [
        ({"factor": 4.0}, 0.1 * math.log(4.0) + 1),
        ({"factor": 4.0, "attention_factor": 1.5}, 1.5),
        ({"factor": 4.0, "mscale": 2.0, "mscale_all_dim": 1.0}, (0.2 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1)),
        ({"factor": 4.0, "mscale": 2.0}, 0.1 * math.log(4.0) + 1),  # alone, transformers ignores it
        ({"factor": 4.0, "mscale_all_dim": 2.0}, 0.1 * math.log(4.0) + 1),  # so too
        ({"factor": 1.0}, 1.0),
    ],
    ids=["from-factor", "stated", "mscale-ratio", "mscale-alone", "mscale-all-dim-alone", "factor-1"],
)
def test_yarn_attention_factor_as_transformers_reads_it(settings, factor):
    assert yarn_attention_factor(settings) == pytest.approx(factor)


def qwen3_config(**fields):
    raw = hf_config("qwen3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=4096)
    raw.update(fields)
    return raw


def test_yarn_fills_in_its_original_context_and_factor_as_transformers():
    config = config_from_dict(qwen3_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    derived = config_from_dict(qwen3_config(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 1024}))
    assert derived.rope_scaling["factor"] == 4.0
    # transformers 5's defaults for Ministral 3 name only the older "type"
    only_type = {"type": "yarn", "rope_theta": 5e5, "factor": 2.0, "original_max_position_embeddings": 64}
    config = config_from_dict(qwen3_config(rope_parameters=only_type, rope_theta=None, rope_scaling=None))
    assert (config.rope_theta, config.rope_scaling["factor"]) == (5e5, 2.0)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"factor": 0}, "yarn needs a positive number 'factor', got 0"),
        ({"factor": 4.0, "original_max_position_embeddings": "long"}, "'original_max_position_embeddings', got 'long'"),
        # No factor, and no original context to derive it from: named, not a KeyError.
        ({"original_max_position_embeddings": "long"}, "needs a positive number 'factor', got None"),
        ({"factor": 4.0, "beta_fast": -1}, "yarn's 'beta_fast' must be a number of at least 0, got -1"),
        ({"factor": 4.0, "mscale": "x"}, "yarn's 'mscale' must be a number of at least 0"),
        ({"factor": 4.0, "attention_factor": 0}, "'attention_factor' must be above 0"),
        ({"factor": 4.0, "beta_slow": -1}, "yarn's 'beta_slow' must be a number of at least 0, got -1"),
        ({"factor": 4.0, "attention_factor": "big"}, "yarn's 'attention_factor' must be a number of at least 0"),
        ({"factor": 4.0, "mscale_all_dim": "x"}, "yarn's 'mscale_all_dim' must be a number of at least 0"),
    ],
)
def test_yarn_settings_it_cannot_run_are_one_line_errors(scaling, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict(qwen3_config(rope_scaling={"rope_type": "yarn", **scaling}))


def test_yarn_over_a_rope_theta_of_one_is_refused_not_a_division_by_zero():
    with pytest.raises(CheckpointError, match="rope_theta above 0 other than 1, got 1.0"):
        config_from_dict(qwen3_config(rope_theta=1.0, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_yarn_without_any_context_takes_the_default_max_position_embeddings():
    raw = qwen3_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    del raw["max_position_embeddings"]
    config = config_from_dict(raw)
    assert config.max_position_embeddings == config.rope_scaling["original_max_position_embeddings"] == 4096


def test_a_stated_rope_scaling_wins_over_rope_parameters():
    linear = {"rope_type": "linear", "factor": 2.0}
    raw = qwen3_config(rope_scaling=linear, rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0})
    config = config_from_dict(raw)
    assert (config.rope_theta, config.rope_scaling) == (10000.0, linear)


def test_yarn_settings_of_0_are_allowed():
    zeros = {"beta_fast": 0, "beta_slow": 0, "mscale": 0, "mscale_all_dim": 0}
    config = config_from_dict(qwen3_config(rope_scaling={"rope_type": "yarn", "factor": 4.0, **zeros}))
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, **zeros}


def test_yarn_on_a_partial_rotation_is_refused_for_phi3():
    raw = hf_config("phi3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    assert config_from_dict(raw).rope_scaling["rope_type"] == "yarn"  # a whole rotation runs it
    with pytest.raises(CheckpointError, match="yarn with partial_rotary_factor is not supported"):
        config_from_dict({**raw, "partial_rotary_factor": 0.5})


def test_gemma3_runs_yarn_on_its_global_layers_as_mlx_lm(tmp_path: Path):
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}
    path = make_tiny_checkpoint(tmp_path, "gemma3_text", num_layers=4, rope_scaling=scaling, seed=2)
    ours = load_model(path)
    reference, _ = mlx_lm.load(str(path))
    assert mx.allclose(ours.model(TOKENS), reference(TOKENS), atol=1e-4).item()


def test_ministral3s_query_temperature_steps_up_past_each_original_context():
    temperature = AttentionTemperature(0.1, 16)
    got = temperature(mx.array([0, 15, 16, 31, 32, 47, 48], dtype=mx.int32))
    steps = [0, 0, 1, 1, 2, 2, 3]
    assert mx.allclose(got, mx.array([1 + 0.1 * math.log(1 + s) for s in steps]), atol=1e-6).item()


def test_ministral3_within_its_original_context_is_llama_with_yarn(tmp_path: Path):
    """Positions 0-15 see no temperature: the same logits as the config without it,
    and from position 16 on, different ones (mlx-lm's parity: tests/runtime/test_engine.py)."""
    path = make_tiny_checkpoint(tmp_path, "ministral3", seed=4)
    ours = load_model(path)
    cooled = load_model(path)
    cooled.model.config = attrs.evolve(cooled.config, extra={})
    for layer in cooled.model.model.layers:
        layer.self_attn.query_scale = None
    got, plain = ours.model(TOKENS), cooled.model(TOKENS)
    assert mx.allclose(got[:, :16], plain[:, :16], atol=1e-5).item()
    assert not mx.allclose(got[:, 16:], plain[:, 16:], atol=1e-3).item()


def ministral3_config(**rope):
    raw = hf_config("ministral3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    raw["rope_parameters"].update(rope)
    return raw


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"llama_4_scaling_beta": None}, "needs rope_parameters.llama_4_scaling_beta, a number of at least 0, got None"),
        ({"llama_4_scaling_beta": -0.1}, "got -0.1"),
        ({"llama_4_scaling_beta": True}, "got True"),
        ({"llama_4_scaling_beta": False}, "got False"),
        (  # under a plain RoPE: YaRN's own check names it otherwise
            {"rope_type": "default", "type": "default", "original_max_position_embeddings": 0},
            "needs rope_parameters.original_max_position_embeddings, a positive integer, got 0",
        ),
        (
            {"rope_type": "default", "type": "default", "original_max_position_embeddings": True},
            "needs rope_parameters.original_max_position_embeddings, a positive integer, got True",
        ),
    ],
)
def test_ministral3_settings_it_cannot_run_are_one_line_errors(rope, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict(ministral3_config(**rope))


def test_ministral3_with_a_beta_of_0_runs_no_temperature():
    config = config_from_dict(ministral3_config(llama_4_scaling_beta=0))
    assert config.extra["attention_temperature"] == (0.0, 16)


def test_ministral3_reads_its_temperature_from_the_older_rope_scaling():
    """transformers 4's layout: rope_theta beside, every other RoPE setting under rope_scaling."""
    raw = ministral3_config(llama_4_scaling_beta=0.25, original_max_position_embeddings=32)
    parameters = raw.pop("rope_parameters")
    raw.update(rope_theta=parameters.pop("rope_theta"), rope_scaling=parameters)
    config = config_from_dict(raw)
    assert config.extra["attention_temperature"] == (0.25, 32)
    assert config.rope_scaling["original_max_position_embeddings"] == 32


def test_mistral3_is_read_as_its_text_model():
    raw = hf_config("mistral3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128, text_family="mistral")
    raw["quantization"] = {
        "group_size": 64, "bits": 4,
        "language_model.model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
        "vision_tower.transformer.layers.0.attention.q_proj": {"group_size": 64, "bits": 8},
    }
    config = config_from_dict(raw)
    assert (config.model_type, config.eos_token_ids) == ("mistral", (1,))
    assert set(config.quantization.per_layer) == {"model.layers.0.mlp.down_proj"}
    assert config_from_dict({**raw, "text_config": {**raw["text_config"], "model_type": "ministral3",
                                                     "rope_parameters": ministral3_config()["rope_parameters"]}
                             }).model_type == "ministral3"


def test_mistral3s_text_config_naming_no_model_type_is_mistral():
    raw = hf_config("mistral3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128, text_family="mistral")
    del raw["text_config"]["model_type"]
    assert config_from_dict(raw).model_type == "mistral"


def test_mistral3s_text_config_wins_over_the_outer_fields():
    raw = hf_config("mistral3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128, text_family="mistral")
    raw.update(vocab_size=1000, max_position_embeddings=64)  # beside the text model's own
    config = config_from_dict(raw)
    assert config.vocab_size == 300
    assert config.max_position_embeddings == raw["text_config"]["max_position_embeddings"] != 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text_config": None}, "mistral3 config without a 'text_config' object"),
        ({"text_config": "mistral"}, "mistral3 config without a 'text_config' object"),
        ({"text_config": {"model_type": "pixtral"}}, "mistral3 with a text model of type 'pixtral' is not supported"),
        ({"text_config": {"model_type": "qwen2"}}, "type 'qwen2' is not supported (supported: mistral, ministral3)"),
    ],
)
def test_mistral3_with_a_text_model_it_cannot_run_is_a_one_line_error(change, message):
    raw = hf_config("mistral3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict({**raw, **change})


def test_mistral3_loads_its_text_model_and_skips_the_vision_tower(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "mistral3", seed=1)
    with capture_logs() as logs:
        ours = load_model(path)
    skipped = [e for e in logs if e["event"] == "ministral3: text model only, vision tower skipped"]
    assert [e["tensors_skipped"] for e in skipped] == [2]
    reference, _ = mlx_lm.load(str(path))
    assert mx.allclose(ours.model(TOKENS), reference(TOKENS), atol=1e-4).item()
