"""Gemma 2 against mlx-lm: its two soft caps, its alternating windows as transformers
runs them (mlx-lm runs every layer full, so it is given transformers' mask), and the
capped scores on every attention path of the paged engine."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.base import create_attention_mask

from kernels import paged_attention
from tests.kernels.test_paged_attention import ATTENTION_PATHS
from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy

TOKENS = mx.array([list(range(5, 45))])
SHAPE = dict(num_layers=4, num_kv_heads=1, head_dim=32, seed=2)


# Caps low enough to bite on a tiny random model's small scores and logits (the
# releases' 50 and 30 would leave them almost as they are).
CAPS = {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 10.0}


def gemma2(tmp_path: Path, **fields) -> Path:
    path = make_tiny_checkpoint(tmp_path, "gemma2", **SHAPE, sliding_window=fields.pop("sliding_window", 4096))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **CAPS, **fields}))
    return path


def test_gemma2_logits_match_mlx_lm_and_both_caps_matter(tmp_path: Path):
    path = gemma2(tmp_path)
    ours = load_model(path)
    assert ours.config.layer_windows == (4096, None, 4096, None)
    assert ours.config.tie_word_embeddings and not ours.config.qk_norm
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    assert float(mx.abs(want).max()) < 10.0  # the final cap
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = load_model(gemma2(tmp_path / cap, **{cap: None}))
        assert uncapped.config.extra[cap] == 0.0
        assert not mx.allclose(uncapped.model(TOKENS), want, atol=1e-2).item(), cap


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_capped_scores_keep_greedy_parity_on_every_attention_path(tmp_path: Path, monkeypatch, path):
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    checkpoint = gemma2(tmp_path)
    prompt = TOKENS[0, :30].tolist()
    before = paged_attention.dispatch_counts[path]
    assert greedy(load_model(checkpoint), prompt, 24) == mlx_lm_greedy(checkpoint, prompt, 24)
    assert paged_attention.dispatch_counts[path] > before  # no silent fallback


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_sliding_layers_see_their_window_as_transformers_runs_them(tmp_path: Path, monkeypatch, path):
    """Every layer sliding (window 8), so that mlx-lm's one mask can be transformers'."""
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    checkpoint = gemma2(tmp_path, sliding_window=8, layer_types=["sliding_attention"] * 4)
    ours = load_model(checkpoint)
    assert ours.config.layer_windows == (8, 8, 8, 8)
    prompt = TOKENS[0, :30].tolist()
    full = mlx_lm_greedy(checkpoint, prompt, 16)

    def windowed_mask(h, cache=None, window_size=None, **kwargs):
        return create_attention_mask(h, cache, window_size=8, **kwargs)

    monkeypatch.setattr(mlx_lm.models.gemma2, "create_attention_mask", windowed_mask)
    want = mlx_lm.load(str(checkpoint))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    tokens = greedy(ours, prompt, 16)
    assert tokens == mlx_lm_greedy(checkpoint, prompt, 16) != full


def config(**fields):
    raw = hf_config("gemma2", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=4,
                    num_heads=4, num_kv_heads=1, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_gemma2_defaults_follow_transformers():
    raw = hf_config("gemma2", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=4,
                    num_heads=4, num_kv_heads=1, intermediate_size=128)
    for name in ("head_dim", "query_pre_attn_scalar", "sliding_window", "attn_logit_softcapping",
                 "final_logit_softcapping", "hidden_activation"):
        raw.pop(name)
    got = config_from_dict(raw)
    assert got.head_dim == 256 and got.layer_windows == (4096, None, 4096, None)
    assert got.extra == {
        "query_pre_attn_scalar": 256.0, "rope_local_base_freq": 10000.0,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"attn_logit_softcapping": 0}, "attn_logit_softcapping must be a positive number or null, got 0"),
        ({"final_logit_softcapping": "30"}, "final_logit_softcapping must be a positive number or null, got '30'"),
        ({"hidden_activation": "relu"}, "gemma2 hidden_activation 'relu' is not supported"),
        ({"hidden_activation": "gelu"}, "gemma2 hidden_activation 'gelu' is not supported"),  # exact, not tanh's
        ({"layer_types": ["full_attention"]}, "layer_types needs 4 entries"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "gemma2 with RoPE scaling is not supported"),
    ],
)
def test_gemma2_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_gemma2_takes_both_names_of_its_gelu():
    """transformers' Gemma2Config writes hidden_activation; older configs only hidden_act."""
    assert config(hidden_activation="gelu_tanh").model_type == "gemma2"
    assert config(hidden_activation=None, hidden_act="gelu_pytorch_tanh").model_type == "gemma2"
    with pytest.raises(CheckpointError, match="gemma2 hidden_activation 'silu' is not supported"):
        config(hidden_activation=None, hidden_act="silu")


def test_gemma2_rotates_every_layer_by_the_one_base_transformers_5_writes_under_rope_parameters():
    got = config(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    assert got.rope_theta == got.extra["rope_local_base_freq"] == 5000.0
