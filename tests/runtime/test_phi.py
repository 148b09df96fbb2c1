"""Phi-2 against mlx-lm: attention and an ungated GELU MLP side by side off one biased
LayerNorm, 40% of each head rotated, every projection and the head biased, its own names
for the attention's output (`dense`) and final norm; greedy tokens through the paged
engine, float and 4-bit, rows in mixed steps of prompt chunks; its config."""

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
SHAPE = dict(hidden_size=160, num_heads=4, num_kv_heads=4, num_layers=2, seed=4)  # heads of 40: 16 rotated


def phi(tmp_path: Path, quantize=None) -> Path:
    return make_tiny_checkpoint(tmp_path, "phi", quantize=quantize, **SHAPE)


def test_phi_logits_match_mlx_lm(tmp_path: Path):
    path = phi(tmp_path)
    ours = load_model(path)
    attention = ours.model.model.layers[0].self_attn
    assert attention.rope.dims == 16 and "bias" in ours.model.lm_head
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_phi_greedy_parity_through_the_engine(tmp_path: Path, quantize):
    path = phi(tmp_path, quantize)
    tokens = greedy(load_model(path), PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def test_phi_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path):
    path = phi(tmp_path)
    assert_rows_in_mixed_steps_match_mlx_lm(path)


def config(**fields):
    raw = hf_config("phi", vocab_size=300, eos_token_id=[1], hidden_size=160, num_layers=2,
                    num_heads=4, num_kv_heads=4, intermediate_size=128)
    return config_from_dict({**raw, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"qk_layernorm": True}, "phi's qk_layernorm=true is not supported"),
        ({"hidden_act": "silu"}, "phi hidden_act 'silu' is not supported"),
        ({"partial_rotary_factor": 0.01}, "phi's partial_rotary_factor must rotate an even number of a head's 40"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "phi with RoPE scaling is not supported"),
    ],
)
def test_phi_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_a_phi2_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "phi2")
