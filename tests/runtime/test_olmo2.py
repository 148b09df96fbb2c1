"""OLMo 2 against mlx-lm: its norms after each block and over each whole q and k
projection, greedy tokens through the paged engine, float and 4-bit, with q/k/v stacked
on the CPU and its layers off the one-op residual blocks (which norm their input)."""

from __future__ import annotations

import re
from pathlib import Path

from runtime import cpu_weights
from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_gguf import minimal_gguf, one_line_error

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 25))


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "apart"])
def test_olmo2_logits_match_mlx_lm_and_its_qk_norm_spans_every_head(tmp_path: Path, monkeypatch, stacked):
    """`apart`: q, k and v as the checkpoint has them (a GPU's), not stacked at load."""
    if not stacked:
        monkeypatch.setattr(cpu_weights, "_stack_projections", lambda model: None)
    path = make_tiny_checkpoint(tmp_path, "olmo2", num_layers=2, seed=3)
    ours = load_model(path)
    attention = ours.model.model.layers[0].self_attn
    assert ("qkv_proj" in attention) is stacked
    assert attention.q_norm.weight.shape == (4 * 16,) and attention.k_norm.weight.shape == (2 * 16,)
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_olmo2_greedy_parity_through_the_engine_with_stacked_qkv(tmp_path: Path, quantize):
    path = make_tiny_checkpoint(tmp_path, "olmo2", num_layers=2, quantize=quantize, seed=3)
    loaded = load_model(path)
    layers = loaded.model.model.layers
    assert all("qkv_proj" in layer.self_attn for layer in layers)  # the CPU's stacked form
    assert not any(layer.self_attn.block_operands(layer.post_attention_layernorm) for layer in layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def config(**fields):
    raw = hf_config("olmo2", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_olmo2_reads_attention_bias_and_transformers_default_eps():
    assert (config(attention_bias=True).qkv_bias, config(attention_bias=True).o_bias) == (True, True)
    raw = hf_config("olmo2", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    del raw["rms_norm_eps"]
    assert config_from_dict(raw).rms_norm_eps == 1e-5
    del raw["attention_bias"]  # transformers' default: no biases
    assert (config_from_dict(raw).qkv_bias, config_from_dict(raw).o_bias) == (False, False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported for model_type 'olmo2'"),
    ],
)
def test_olmo2_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_an_olmo2_gguf_stays_a_one_line_refusal(tmp_path: Path):
    path = minimal_gguf(tmp_path / "olmo2.gguf", "olmo2", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert "unsupported GGUF architecture 'olmo2'" in one_line_error(path)
