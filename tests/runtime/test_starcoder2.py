"""StarCoder2 against mlx-lm: Phi's layer with the blocks in sequence, biased LayerNorms and
projections, a GELU-tanh MLP (mlx-lm's exact GELU given the tanh form transformers runs) and
every layer sliding as transformers runs it (mlx-lm given the window's mask); greedy tokens
through the paged engine, float and 4-bit, rows in mixed steps of prompt chunks; its config."""

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
import mlx_lm.models.starcoder2 as mlx_lm_starcoder2
import pytest
from mlx_lm.models.base import create_attention_mask

from tests.kernels.test_paged_attention import ATTENTION_PATHS
from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_cohere import assert_gguf_refused, assert_rows_in_mixed_steps_match_mlx_lm

TOKENS = mx.array([list(range(5, 45))])  # 40 positions: several times an 8-key window
PROMPT = list(range(5, 35))


@pytest.fixture
def as_transformers(monkeypatch):
    """mlx-lm's starcoder2 with transformers' GELU-tanh and every layer's 8-key window."""

    def windowed_mask(h, cache=None, window_size=None, **kwargs):
        return create_attention_mask(h, cache, window_size=8, **kwargs)

    monkeypatch.setattr(mlx_lm_starcoder2, "create_attention_mask", windowed_mask)
    monkeypatch.setattr(mlx_lm_starcoder2.nn, "gelu", nn.gelu_approx)


def starcoder2(tmp_path: Path, quantize=None) -> Path:
    return make_tiny_checkpoint(tmp_path, "starcoder2", num_layers=2, seed=3, quantize=quantize)


def test_starcoder2_logits_match_mlx_lm_past_the_window(tmp_path: Path, as_transformers):
    path = starcoder2(tmp_path)
    ours = load_model(path)
    assert ours.config.layer_windows == (8, 8) and ours.config.tie_word_embeddings
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_starcoder2_greedy_parity_through_the_engine(tmp_path: Path, quantize, as_transformers):
    path = starcoder2(tmp_path, quantize)
    tokens = greedy(load_model(path), PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_starcoder2_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path, monkeypatch, as_transformers, path):
    assert_rows_in_mixed_steps_match_mlx_lm(starcoder2(tmp_path), monkeypatch=monkeypatch, path=path)


def config(**fields):
    raw = hf_config("starcoder2", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=4096)
    return config_from_dict({**raw, **fields})


def test_starcoder2_slides_only_where_its_window_is_shorter_than_the_context():
    assert config(sliding_window=4096).layer_windows == ()
    assert config(sliding_window=None).layer_windows == ()
    assert config(sliding_window=1024).layer_windows == (1024, 1024)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_act": "silu"}, "starcoder2 hidden_act 'silu' is not supported"),
        ({"use_bias": False}, "starcoder2's use_bias=false is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "starcoder2 with RoPE scaling is not supported"),
    ],
)
def test_starcoder2_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_a_starcoder2_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "starcoder2")
