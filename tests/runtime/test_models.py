"""One file per family behind the model_type registry; Gemma 3's details against mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict, load_config
from runtime.errors import CheckpointError
from runtime.models import FAMILIES
from runtime.synth import hf_config, make_tiny_checkpoint

import attrs
import mlx.core as mx
import mlx_lm
import pytest
from structlog.testing import capture_logs

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


def test_gemma3_reads_layer_types_or_the_older_sliding_window_pattern():
    by_pattern = config_from_dict({**gemma_config(sliding_window_pattern=3), "layer_types": None})
    assert by_pattern.layer_windows == (8, 8, None, 8, 8, None)
    by_types = config_from_dict(
        gemma_config(layer_types=["full_attention"] + ["sliding_attention"] * 5, sliding_window=16)
    )
    assert by_types.layer_windows == (None, 16, 16, 16, 16, 16)
    assert by_types.extra == {"query_pre_attn_scalar": 24.0, "rope_local_base_freq": 10000.0}
    assert by_types.tie_word_embeddings is False and by_types.rope_theta == 1_000_000.0


def test_gemma3_defaults_follow_transformers_when_fields_are_left_out():
    raw = gemma_config()
    for name in ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                 "tie_word_embeddings", "rope_theta", "rope_local_base_freq", "sliding_window_pattern"):
        del raw[name]
    config = config_from_dict(raw)
    assert config.head_dim == 256 and config.tie_word_embeddings
    assert config.layer_windows == (4096,) * 5 + (None,)
    assert config.extra["query_pre_attn_scalar"] == 256.0


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
    ("fields", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
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
