"""SmolLM3 against mlx-lm: llama's decoder whose every fourth layer has no RoPE (NoPE),
through the paged engine on every attention path, and its config as transformers reads it."""

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

from kernels import paged_attention
from tests.kernels.test_paged_attention import ATTENTION_PATHS
from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 35))


def smollm3(tmp_path: Path, **fields) -> Path:
    path = make_tiny_checkpoint(tmp_path / "smollm3", "smollm3", num_layers=4, seed=4)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))
    return path


def test_smollm3_logits_match_mlx_lm_and_its_nope_layer_matters(tmp_path: Path):
    path = smollm3(tmp_path)
    ours = load_model(path)
    assert ours.config.extra["rope_layers"] == (True, True, True, False)
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    every_layer_rotating = load_model(smollm3(tmp_path / "roped", no_rope_layers=[1, 1, 1, 1])).model(TOKENS)
    assert not mx.allclose(every_layer_rotating, want, atol=1e-2).item()


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_smollm3_greedy_parity_through_the_paged_engine(tmp_path: Path, monkeypatch, path):
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    checkpoint = smollm3(tmp_path, no_rope_layers=[1, 0, 1, 0])  # layers 1 and 3 without RoPE
    before = paged_attention.dispatch_counts[path]
    assert greedy(load_model(checkpoint), PROMPT, 24) == mlx_lm_greedy(checkpoint, PROMPT, 24)
    assert paged_attention.dispatch_counts[path] > before


def config(**fields):
    raw = hf_config("smollm3", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=8,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_smollm3_reads_its_layers_as_transformers_derives_them():
    assert config().extra["rope_layers"] == (True, True, True, False) * 2
    assert config(no_rope_layer_interval=2).extra["rope_layers"] == (True, False) * 4
    assert config(no_rope_layers=[0] * 10).extra["rope_layers"] == (False,) * 8  # at least one a layer
    # Without layer_types, use_sliding_window makes the NoPE layers slide.
    assert config(use_sliding_window=True, sliding_window=16).layer_windows == (None, None, None, 16) * 2
    assert config().layer_windows == ()
    # layer_types, where given, names the sliding layers (as llama's).
    sliding = ["sliding_attention", "full_attention"] * 4
    assert config(layer_types=sliding, sliding_window=16).layer_windows == (16, None) * 4


def test_smollm3s_attention_bias_puts_a_bias_on_q_k_v_and_o():
    assert (config().qkv_bias, config().o_bias) == (False, False)
    assert (config(attention_bias=True).qkv_bias, config(attention_bias=True).o_bias) == (True, True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"no_rope_layers": [1, 0]}, "no_rope_layers must hold a 0 or 1 for each of the 8 layers"),
        ({"no_rope_layers": [1] * 7}, "no_rope_layers must hold a 0 or 1 for each of the 8 layers"),
        ({"no_rope_layers": [2] * 8}, "no_rope_layers must hold a 0 or 1"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_smollm3_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)
