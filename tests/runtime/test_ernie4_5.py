"""ERNIE 4.5 against mlx-lm: llama's decoder with interleaved RoPE, run as halves after
reordering q_proj's and k_proj's rows at load; greedy tokens through the paged engine and
the CPU's one-op blocks, float and 4-bit, rows in mixed steps of prompt chunks; its config."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.models import glm4
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import pytest

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_cohere import assert_gguf_refused, assert_rows_in_mixed_steps_match_mlx_lm

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 35))


@pytest.mark.parametrize("is_tied", [True, False], ids=["tied", "untied"])
def test_ernie4_5_logits_match_mlx_lm_and_the_row_reorder_matters(tmp_path: Path, monkeypatch, is_tied: bool):
    path = make_tiny_checkpoint(tmp_path, "ernie4_5", num_layers=2, seed=3, tie_word_embeddings=is_tied)
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(load_model(path).model(TOKENS), want, atol=1e-4).item()
    monkeypatch.setattr(glm4, "halves_order", lambda name, tensor, D, R: tensor)
    assert not mx.allclose(load_model(path).model(TOKENS), want, atol=1e-2).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_ernie4_5_greedy_parity_through_the_engine_and_its_one_op_blocks(tmp_path: Path, quantize):
    path = make_tiny_checkpoint(tmp_path, "ernie4_5", num_layers=2, quantize=quantize, seed=3, tie_word_embeddings=True)
    loaded = load_model(path)
    layers = loaded.model.model.layers
    assert all(layer.attention_block is not None and layer.mlp_block is not None for layer in layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def test_ernie4_5_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "ernie4_5", num_layers=2, seed=3, tie_word_embeddings=True)
    assert_rows_in_mixed_steps_match_mlx_lm(path)


def config(**fields):
    raw = hf_config("ernie4_5", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_ernie4_5_without_use_bias_reads_as_unbiased():
    """transformers' Ernie4_5Config default (False)."""
    raw = hf_config("ernie4_5", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    read = config_from_dict({name: value for name, value in raw.items() if name != "use_bias"})
    assert (read.qkv_bias, read.o_bias) == (False, False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_bias": True}, "ernie4_5's use_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_traditional": True}, "rope_traditional=true is not supported"),
    ],
)
def test_ernie4_5_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_an_ernie4_5_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "ernie4_5")
