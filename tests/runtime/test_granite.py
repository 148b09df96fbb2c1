"""Granite against mlx-lm: its four multipliers each mattering, greedy tokens through the
paged engine, float and 4-bit, with its layers kept off the CPU's one-op residual blocks
(which would add each branch without its multiplier), and its config's refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.models.granite import MULTIPLIERS
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_gguf import minimal_gguf, one_line_error

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 25))


def granite(tmp_path: Path, quantize=None, **fields) -> Path:
    path = make_tiny_checkpoint(tmp_path, "granite", num_layers=2, quantize=quantize, seed=3)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))
    return path


@pytest.mark.parametrize("is_tied", [False, True], ids=["untied", "tied"])
def test_granite_logits_match_mlx_lm_and_each_multiplier_matters(tmp_path: Path, is_tied: bool):
    path = granite(tmp_path, tie_word_embeddings=is_tied)
    ours = load_model(path)
    assert ours.config.extra == {
        "embedding_multiplier": 12.0, "attention_multiplier": 1 / 16, "residual_multiplier": 0.22, "logits_scaling": 8.0,
    }
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-5).item()
    if not is_tied:
        for name in MULTIPLIERS:
            plain = load_model(granite(tmp_path / name, **{name: 1.0})).model(TOKENS)
            assert not mx.allclose(plain, want, atol=1e-3).item(), name


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_granite_greedy_parity_through_the_engine_off_the_one_op_blocks(tmp_path: Path, quantize):
    path = granite(tmp_path, quantize=quantize)
    loaded = load_model(path)
    layers = loaded.model.model.layers
    assert all("qkv_proj" in layer.self_attn for layer in layers)  # the CPU's stacked form, planned
    assert not any(layer.attention_block or layer.mlp_block for layer in layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def config(**fields):
    raw = hf_config("granite", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_granite_multipliers_left_out_are_1_as_transformers():
    raw = hf_config("granite", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    for name in MULTIPLIERS:
        raw.pop(name)
    assert config_from_dict(raw).extra == dict.fromkeys(MULTIPLIERS, 1.0)
    assert (config(attention_bias=True).qkv_bias, config(attention_bias=True).o_bias) == (True, True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logits_scaling": 0}, "granite's logits_scaling must be a positive number, got 0"),
        ({"embedding_multiplier": "12"}, "granite's embedding_multiplier must be a positive number, got '12'"),
        ({"residual_multiplier": None}, "granite's residual_multiplier must be a positive number, got None"),
        ({"attention_multiplier": True}, "granite's attention_multiplier must be a positive number, got True"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ],
)
def test_granite_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_a_granite_gguf_stays_a_one_line_refusal(tmp_path: Path):
    path = minimal_gguf(tmp_path / "granite.gguf", "granite", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert "unsupported GGUF architecture 'granite'" in one_line_error(path)
