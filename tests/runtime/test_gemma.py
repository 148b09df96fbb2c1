"""Gemma 1 against mlx-lm, whose MLP is given the tanh GELU transformers runs (mlx-lm's
`gemma` runs exact GELU): logits, greedy tokens through the paged engine and the CPU's
one-op residual blocks, float and 4-bit, and its config as transformers reads it."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import mlx_lm.models.gemma
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_gguf import minimal_gguf, one_line_error

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 25))


@pytest.fixture
def tanh_gelu_mlx_lm(monkeypatch):
    def mlp(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))

    monkeypatch.setattr(mlx_lm.models.gemma.MLP, "__call__", mlp)


def test_gemma_logits_match_mlx_lm_with_transformers_gelu(tmp_path: Path, tanh_gelu_mlx_lm):
    path = make_tiny_checkpoint(tmp_path, "gemma", num_layers=2, seed=3)
    ours = load_model(path)
    assert ours.config.tie_word_embeddings and ours.config.head_dim == 16
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_gemma_greedy_parity_through_the_engine_and_its_one_op_blocks(tmp_path: Path, tanh_gelu_mlx_lm, quantize):
    path = make_tiny_checkpoint(tmp_path, "gemma", num_layers=2, quantize=quantize, seed=3)
    loaded = load_model(path)
    # Its blocks are llama's with (1 + w) norms and GELU-tanh, which the one-op blocks take.
    assert all(layer.attention_block and layer.mlp_block for layer in loaded.model.model.layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


@pytest.mark.parametrize("recipe", ["mxfp4", "mixed_3_6"])
def test_what_mlx_lm_convert_writes_of_a_gemma_gives_its_greedy_tokens(tmp_path: Path, tanh_gelu_mlx_lm, recipe):
    """As mlx-community's conversions are made (tests/kernels/test_quantized_models.py
    does so for the families whose mlx-lm needs no patch)."""
    source = make_tiny_checkpoint(tmp_path / "source", "gemma", hidden_size=128, intermediate_size=256, seed=3)
    path = tmp_path / recipe
    options = {"q_mode": recipe} if recipe == "mxfp4" else {"quant_predicate": recipe}
    mlx_lm.convert(str(source), str(path), quantize=True, **options)
    tokens = greedy(load_model(path), PROMPT, 16)
    model, _ = mlx_lm.load(str(path))
    model.set_dtype(mx.float32)  # as cadence computes on the CPU, so that the formats alone compare
    assert tokens == [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=16)]
    assert len(set(tokens)) >= 4


def config(*left_out: str, **fields):
    raw = hf_config("gemma", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=1, intermediate_size=128)
    return config_from_dict({name: value for name, value in {**raw, **fields}.items() if name not in left_out})


def test_gemma_defaults_and_activation_names_follow_transformers():
    assert config("head_dim").head_dim == 256  # the 7B's 16 heads of 256 in a hidden of 3072
    assert config(tie_word_embeddings=False).tie_word_embeddings  # always tied
    # The releases' legacy hidden_act "gelu" is the tanh form to transformers.
    assert config(hidden_activation=None, hidden_act="gelu").model_type == "gemma"
    assert config("hidden_activation", "hidden_act").model_type == "gemma"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_activation": "gelu"}, "gemma hidden_activation 'gelu' (exact GELU) is not supported"),
        ({"hidden_activation": None, "hidden_act": "silu"}, "gemma hidden_activation 'silu' is not supported"),
        ({"attention_bias": True}, "gemma with attention_bias is not supported"),
        ({"use_bidirectional_attention": True}, "gemma with bidirectional attention is not supported"),
    ],
)
def test_gemma_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_a_gemma_gguf_stays_a_one_line_refusal(tmp_path: Path):
    """GGUF is another reader (runtime/gguf.py), whose architectures are its own."""
    path = minimal_gguf(tmp_path / "gemma.gguf", "gemma", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert "unsupported GGUF architecture 'gemma'" in one_line_error(path)
