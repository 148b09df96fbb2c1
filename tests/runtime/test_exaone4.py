"""EXAONE 4.0 against mlx-lm: the 32B's layout (three sliding layers in four, the fourth
full without RoPE) past the window and the 1.2B's (every layer full and rotating, llama3
RoPE scaling), greedy tokens through the paged engine, float and 4-bit, rows in mixed
steps of prompt chunks; its config as transformers reads it."""

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

from tests.kernels.test_paged_attention import ATTENTION_PATHS
from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_cohere import assert_gguf_refused, assert_rows_in_mixed_steps_match_mlx_lm

TOKENS = mx.array([list(range(5, 45))])  # 40 positions: several times an 8-key window
PROMPT = list(range(5, 35))
# The 1.2B's: llama3 RoPE scaling over an original context of 16 (its 8,192), no windows.
VARIANTS = {
    "32b": {},
    "1.2b": {
        "sliding_window": None,
        "sliding_window_pattern": None,
        "layer_types": ["full_attention"] * 4,
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 16},
    },
}


def exaone4(tmp_path: Path, variant: str, quantize=None) -> Path:
    own = VARIANTS[variant]
    path = make_tiny_checkpoint(tmp_path, "exaone4", num_layers=4, seed=3, quantize=quantize,
                                tie_word_embeddings=own.get("tie_word_embeddings", False))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **own}))
    return path


@pytest.mark.parametrize("variant", VARIANTS)
def test_exaone4_logits_match_mlx_lm_past_the_window(tmp_path: Path, variant):
    path = exaone4(tmp_path, variant)
    ours = load_model(path)
    is_32b = variant == "32b"
    assert ours.config.layer_windows == ((8, 8, 8, None) if is_32b else ())
    layers = ours.model.model.layers
    assert [layer.self_attn.rope.base is None for layer in layers] == [not is_32b] * 3 + [True]  # NoPE / llama3
    assert all("q_norm" in layer.self_attn for layer in layers)
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_exaone4_greedy_parity_through_the_engine_off_the_one_op_blocks(tmp_path: Path, variant, quantize):
    path = exaone4(tmp_path, variant, quantize=quantize)
    loaded = load_model(path)
    assert all("qkv_proj" in layer.self_attn for layer in loaded.model.model.layers)  # the CPU's stacked form
    assert not any(hasattr(layer, "attention_block") for layer in loaded.model.model.layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_exaone4_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path, monkeypatch, path):
    assert_rows_in_mixed_steps_match_mlx_lm(exaone4(tmp_path, "32b"), monkeypatch=monkeypatch, path=path)


def config(*left_out: str, **fields):
    raw = hf_config("exaone4", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=8,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({name: value for name, value in {**raw, **fields}.items() if name not in left_out})


def test_exaone4_reads_its_layers_as_transformers_and_mlx_lm_do():
    assert config("layer_types").layer_windows == (8, 8, 8, None) * 2  # "LLLG"
    assert config("layer_types", sliding_window_pattern=2).layer_windows == (8, None) * 4
    assert config("layer_types", "sliding_window_pattern", "sliding_window").layer_windows == (4096, 4096, 4096, None) * 2
    full = config(sliding_window=None)
    assert full.layer_windows == () and "rope_layers" not in full.extra and full.qk_norm
    assert config(layer_types=["sliding_attention", "full_attention"] * 4).extra["rope_layers"] == (True, False) * 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": None, "sliding_window_pattern": "LLXG"}, "sliding_window_pattern must be a string of 'L' and 'G'"),
        ({"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern must be a string of 'L' and 'G'"),
        ({"layer_types": ["full_attention"]}, "layer_types needs 8 entries"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_exaone4_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_an_exaone4_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "exaone4")
