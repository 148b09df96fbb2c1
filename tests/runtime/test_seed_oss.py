"""Seed-OSS against mlx-lm: llama's decoder with q/k/v biases and o's apart
(`attention_out_bias`); greedy tokens through the paged engine and the CPU's one-op
blocks, float and 4-bit, rows in mixed steps of prompt chunks; its config."""

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

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_cohere import assert_gguf_refused, assert_rows_in_mixed_steps_match_mlx_lm

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 35))


def seed_oss(tmp_path: Path, quantize=None) -> Path:
    return make_tiny_checkpoint(tmp_path, "seed_oss", num_layers=2, seed=3, quantize=quantize)


def test_seed_oss_logits_match_mlx_lm_with_its_biases(tmp_path: Path):
    path = seed_oss(tmp_path)
    ours = load_model(path)
    attention = ours.model.model.layers[0].self_attn
    assert "bias" in attention.qkv_proj and "bias" not in attention.o_proj
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_seed_oss_greedy_parity_through_the_engine_and_its_one_op_blocks(tmp_path: Path, quantize):
    path = seed_oss(tmp_path, quantize)
    loaded = load_model(path)
    layers = loaded.model.model.layers
    assert all(layer.attention_block is not None and layer.mlp_block is not None for layer in layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def test_seed_oss_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path):
    path = seed_oss(tmp_path)
    assert_rows_in_mixed_steps_match_mlx_lm(path)


def test_seed_oss_output_bias_follows_attention_out_bias(tmp_path: Path):
    path = seed_oss(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    config = config_from_dict({**raw, "attention_out_bias": True})
    assert (config.qkv_bias, config.o_bias) == (True, True)
    config = config_from_dict({**raw, "attention_bias": False})
    assert (config.qkv_bias, config.o_bias) == (False, False)


def config(**fields):
    raw = hf_config("seed_oss", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_seed_oss_without_its_bias_fields_reads_as_unbiased():
    """transformers' SeedOssConfig defaults: attention_bias and attention_out_bias false."""
    raw = hf_config("seed_oss", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    read = config_from_dict({k: v for k, v in raw.items() if k not in ("attention_bias", "attention_out_bias")})
    assert (read.qkv_bias, read.o_bias) == (False, False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"attention_out_bias": "no"}, "field 'attention_out_bias' should be bool"),
    ],
)
def test_seed_oss_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_a_seed_oss_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "seed_oss")
