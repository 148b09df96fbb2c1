"""OLMo 3 against mlx-lm: OLMo 2's layer with three sliding layers in four and RoPE
scaling (the long-context releases' YaRN) on the full layers only; greedy tokens through
the paged engine, float and 4-bit; its config as transformers reads it."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.models.olmo3 import build
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_gguf import minimal_gguf, one_line_error

TOKENS = mx.array([list(range(5, 45))])  # 40 positions: several times an 8-key window
PROMPT = list(range(5, 35))
# The releases' YaRN over an original context of 16 (theirs: 8,192), so that 40 tokens pass it.
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "attention_factor": 1.2079441541679836}


def olmo3(tmp_path: Path, **shape) -> Path:
    return make_tiny_checkpoint(tmp_path, "olmo3", num_layers=4, seed=3, max_position_embeddings=128, **shape)


@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
def test_olmo3_logits_match_mlx_lm_past_the_window_with_yarn_on_its_full_layers(tmp_path: Path, scaling):
    path = olmo3(tmp_path, rope_scaling=scaling)
    ours = load_model(path)
    assert ours.config.layer_windows == (8, 8, 8, None)
    assert [layer.self_attn.rope.attention_factor > 1 for layer in ours.model.model.layers] == [
        False, False, False, scaling is not None
    ]
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_olmo3_greedy_parity_through_the_engine(tmp_path: Path, quantize):
    path = olmo3(tmp_path, rope_scaling=YARN, quantize=quantize)
    tokens = greedy(load_model(path), PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def config(*left_out: str, **fields):
    raw = hf_config("olmo3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=8,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({name: value for name, value in {**raw, **fields}.items() if name not in left_out})


def test_olmo3_reads_its_layers_and_rope_as_transformers():
    assert config("layer_types", "sliding_window").layer_windows == (4096, 4096, 4096, None) * 2
    assert config("rope_theta").rope_theta == 500_000.0  # Olmo3Config's default
    flat = config("rope_theta", rope_parameters={"rope_type": "default", "rope_theta": 20_000.0})
    assert flat.rope_theta == 20_000.0
    per_kind = config("rope_theta", rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
    })
    assert (per_kind.rope_theta, per_kind.extra["sliding_rope_theta"]) == (50_000.0, 10_000.0)
    # Each kind's layers turn at their own theta.
    bases = [layer.self_attn.rope.base for layer in build(per_kind).model.layers[:4]]
    assert bases == [10_000.0, 10_000.0, 10_000.0, 50_000.0]
    # A kind the nested form leaves out turns at the config's theta.
    one_kind = config(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50_000.0}})
    assert (one_kind.rope_theta, one_kind.extra["sliding_rope_theta"]) == (50_000.0, config().rope_theta)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rope_parameters": {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "yarn"}}},
         "olmo3's rope_parameters.full_attention must be a default RoPE"),
        ({"rope_parameters": {"sliding_attention": 5, "full_attention": {"rope_type": "default"}}},
         "olmo3's rope_parameters.sliding_attention must be a default RoPE"),
        ({"layer_types": ["full_attention"]}, "layer_types needs 8 entries"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_olmo3_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_an_olmo3_gguf_stays_a_one_line_refusal(tmp_path: Path):
    path = minimal_gguf(tmp_path / "olmo3.gguf", "olmo3", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert "unsupported GGUF architecture 'olmo3'" in one_line_error(path)
