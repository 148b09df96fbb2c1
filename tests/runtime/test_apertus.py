"""Apertus against mlx-lm: llama's attention with per-head q/k norms and llama3 RoPE, an
ungated xIELU MLP whose learned scalars each matter; greedy tokens through the paged engine
(the attention's one-op block, the MLP by parts), float and 4-bit, rows in mixed steps of
prompt chunks; its config."""

from __future__ import annotations

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
# The releases' llama3 scaling over an original context of 16 (theirs: 8,192).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
          "original_max_position_embeddings": 16}


def apertus(tmp_path: Path, quantize=None) -> Path:
    return make_tiny_checkpoint(tmp_path, "apertus", num_layers=2, seed=3, quantize=quantize, rope_scaling=LLAMA3)


def test_apertus_logits_match_mlx_lm_and_each_xielu_scalar_matters(tmp_path: Path):
    path = apertus(tmp_path)
    ours = load_model(path)
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    activation = ours.model.model.layers[0].mlp.act_fn
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        kept = activation[name]
        activation[name] = kept + (0.5 if name != "eps" else -0.5)
        assert not mx.allclose(ours.model(TOKENS), want, atol=1e-3).item(), name
        activation[name] = kept


def test_xielu_takes_its_negative_branch_at_zero_and_below_as_transformers():
    """x > 0 squared; x <= 0 (0 too, where the other branch is off by ~1e-6) the expm1 one."""
    from runtime.models.apertus import XIELU

    activation = XIELU()
    x = mx.array([0.0, -2.0, 2.0])
    alpha_p, alpha_n = mx.logaddexp(activation.alpha_p, 0.0), 0.5 + mx.logaddexp(activation.alpha_n, 0.0)
    negative = (mx.expm1(mx.minimum(x, -1e-6)) - x) * alpha_n + 0.5 * x
    want = mx.where(mx.array([False, False, True]), alpha_p * x * x + 0.5 * x, negative)
    assert mx.allclose(activation(x), want, rtol=0, atol=1e-8).item() and activation(x)[0].item() != 0.0


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_apertus_greedy_parity_through_the_engine(tmp_path: Path, quantize):
    path = apertus(tmp_path, quantize)
    loaded = load_model(path)
    layers = loaded.model.model.layers
    assert all(layer.attention_block is not None and layer.mlp_block is None for layer in layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def test_apertus_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path):
    path = apertus(tmp_path)
    assert_rows_in_mixed_steps_match_mlx_lm(path)


def config(**fields):
    raw = hf_config("apertus", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_act": "silu"}, "apertus hidden_act 'silu' is not supported"),
        ({"qk_norm": False}, "apertus with qk_norm=false is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ],
)
def test_apertus_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_an_apertus_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "apertus")
