"""StableLM against mlx-lm: StableLM 2 1.6B's layout (LayerNorms with biases, a quarter of
each head rotated, q/k/v biases, blocks in sequence) and the 12B's (per-head q/k LayerNorms
stored per head, blocks side by side); greedy tokens through the paged engine, float and
4-bit, rows in mixed steps of prompt chunks; its config."""

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
import numpy as np
import pytest

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_cohere import (
    assert_gguf_refused,
    assert_rows_in_mixed_steps_match_mlx_lm,
    rewrite_weights,
)

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 35))
VARIANTS = ("2-1.6b", "2-12b")


def stablelm(tmp_path: Path, variant: str, quantize=None) -> Path:
    path = make_tiny_checkpoint(tmp_path, "stablelm", num_layers=2, seed=3, quantize=quantize)
    if variant == "2-12b":  # per-head q/k norms as stored, one norm per layer, no q/k/v bias
        raw = json.loads((path / "config.json").read_text())
        raw.update(qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=False)
        (path / "config.json").write_text(json.dumps(raw))
        rng = np.random.default_rng(4)
        norms = {
            f"model.layers.{layer}.self_attn.{which}_layernorm.norms.{head}.weight": 1.0 + 0.3 * rng.standard_normal(16)
            for layer in range(2)
            for which, heads in (("q", 4), ("k", 2))
            for head in range(heads)
        }
        rewrite_weights(path, quantize, norms, keep=lambda name: (
            ".post_attention_layernorm." not in name and not re.search(r"[qkv]_proj\.bias$", name)
        ))
    return path


@pytest.mark.parametrize("variant", VARIANTS)
def test_stablelm_logits_match_mlx_lm(tmp_path: Path, variant):
    path = stablelm(tmp_path, variant)
    ours = load_model(path)
    layer = ours.model.model.layers[0]
    assert layer.self_attn.rope.dims == 4  # a quarter of 16
    assert ("q_norm" in layer.self_attn) == ("post_attention_layernorm" not in layer) == (variant == "2-12b")
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_stablelm_greedy_parity_through_the_engine(tmp_path: Path, variant, quantize):
    path = stablelm(tmp_path, variant, quantize)
    tokens = greedy(load_model(path), PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


@pytest.mark.parametrize("variant", VARIANTS)
def test_stablelm_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path, variant):
    path = stablelm(tmp_path, variant)
    assert_rows_in_mixed_steps_match_mlx_lm(path)


def test_stablelm_per_head_norms_missing_a_head_are_a_one_line_error(tmp_path: Path):
    path = stablelm(tmp_path, "2-12b")
    rewrite_weights(path, None, {}, keep=lambda name: name != "model.layers.1.self_attn.k_layernorm.norms.0.weight")
    with pytest.raises(CheckpointError, match=re.escape("k_norm.weight: the per-head norms stored are heads [1], not 0..0")):
        load_model(path)


def config(**fields):
    raw = hf_config("stablelm", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_stablelm_without_use_qkv_bias_reads_as_unbiased():
    raw = hf_config("stablelm", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    assert not config_from_dict({k: v for k, v in raw.items() if k != "use_qkv_bias"}).qkv_bias


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"partial_rotary_factor": 0.1}, "stablelm's partial_rotary_factor must rotate an even number of a head's 16"),
        ({"partial_rotary_factor": "0.25"}, "stablelm's partial_rotary_factor must rotate an even number"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "stablelm with RoPE scaling is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"use_parallel_residual": 1}, "field 'use_parallel_residual' should be bool"),
    ],
)
def test_stablelm_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_a_stablelm_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "stablelm")
