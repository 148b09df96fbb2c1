"""InternLM3 against mlx-lm: llama's decoder whose dynamic NTK RoPE is plain within its
`max_position_embeddings`, the longest context served; greedy tokens through the paged
engine and the CPU's one-op blocks, float and 4-bit, rows in mixed steps of prompt chunks;
its config."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.engine import Engine
from runtime.errors import CadenceError, CheckpointError
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import pytest

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_cohere import assert_gguf_refused, assert_rows_in_mixed_steps_match_mlx_lm

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 35))


def internlm3(tmp_path: Path, quantize=None) -> Path:
    return make_tiny_checkpoint(tmp_path, "internlm3", num_layers=2, seed=3, quantize=quantize, max_position_embeddings=64)


def test_internlm3_logits_match_mlx_lm_within_its_context(tmp_path: Path):
    path = internlm3(tmp_path)
    ours = load_model(path)
    assert ours.config.rope_scaling is None
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


def test_internlm3_serves_no_context_past_where_its_rope_would_grow(tmp_path: Path):
    loaded = load_model(internlm3(tmp_path))
    assert Engine(loaded, max_batch=1).model_max_context == 64
    with pytest.raises(CadenceError, match=re.escape("max_context 65 is outside this model's 1..64 tokens")):
        Engine(loaded, max_batch=1, max_context=65)


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_internlm3_greedy_parity_through_the_engine_and_its_one_op_blocks(tmp_path: Path, quantize):
    path = internlm3(tmp_path, quantize)
    loaded = load_model(path)
    assert all(layer.attention_block is not None for layer in loaded.model.model.layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def test_internlm3_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path):
    path = internlm3(tmp_path)
    assert_rows_in_mixed_steps_match_mlx_lm(path)


def config(**fields):
    raw = hf_config("internlm3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_internlm3_keeps_a_rope_scaling_other_than_dynamic_and_reads_none():
    """Only dynamic NTK is read as plain RoPE (within the context served); none stays none."""
    assert config(rope_scaling=None).rope_scaling is None
    assert config(rope_scaling={"rope_type": "linear", "factor": 2.0}).rope_scaling["factor"] == 2.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bias": True}, "internlm3's bias=true is not supported"),
        ({"qkv_bias": True}, "internlm3's qkv_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, "rope_scaling dynamic needs a positive 'factor', got None"),
        ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "unsupported rope_scaling type 'su'"),
    ],
)
def test_internlm3_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_an_internlm3_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "internlm3")
