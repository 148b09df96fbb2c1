"""Hunyuan dense against mlx-lm: llama's decoder with q/k norms after RoPE (kept off the
CPU's one-op attention block) and RoPE's base raised by the NTK alpha; greedy tokens through
the paged engine, float and 4-bit, rows in mixed steps of prompt chunks; its config."""

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


def hunyuan(tmp_path: Path, quantize=None, **fields) -> Path:
    path = make_tiny_checkpoint(tmp_path, "hunyuan_v1_dense", num_layers=2, seed=3, quantize=quantize, tie_word_embeddings=True)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))
    return path


def test_hunyuan_logits_match_mlx_lm_and_the_norms_order_and_alpha_matter(tmp_path: Path):
    path = hunyuan(tmp_path)
    ours = load_model(path)
    assert ours.config.rope_theta == pytest.approx(10_000 * 1000 ** (16 / 14))
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    for layer in ours.model.model.layers:
        layer.self_attn.qk_norm_after_rope = False
    assert not mx.allclose(ours.model(TOKENS), want, atol=1e-3).item()
    plain = load_model(hunyuan(tmp_path / "plain", rope_scaling=None)).model(TOKENS)
    assert not mx.allclose(plain, want, atol=1e-3).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_hunyuan_greedy_parity_through_the_engine(tmp_path: Path, quantize):
    path = hunyuan(tmp_path, quantize)
    loaded = load_model(path)
    layers = loaded.model.model.layers
    assert all(layer.attention_block is None and layer.mlp_block is not None for layer in layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def test_hunyuan_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path):
    path = hunyuan(tmp_path)
    assert_rows_in_mixed_steps_match_mlx_lm(path)


def config(**fields):
    raw = hf_config("hunyuan_v1_dense", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_hunyuan_reads_use_cla_left_out_as_off_and_alpha_over_the_configs_head_dim():
    raw = hf_config("hunyuan_v1_dense", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    assert config_from_dict({k: v for k, v in raw.items() if k != "use_cla"}) == config()
    # head_dim 32 beside hidden 64 / 4 heads: the base grows by alpha ** (32 / 30), not ** (16 / 14)
    read = config(head_dim=32, rope_scaling={"type": "dynamic", "alpha": 1000.0})
    assert read.rope_theta == pytest.approx(raw["rope_theta"] * 1000.0 ** (32 / 30)) and read.rope_scaling is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling dynamic needs a positive 'alpha', got None"),
        ({"rope_scaling": {"type": "dynamic", "alpha": -1}}, "rope_scaling dynamic needs a positive 'alpha', got -1"),
        ({"use_cla": True}, "hunyuan_v1_dense's use_cla=true is not supported"),
        ({"head_dim": 2, "rope_scaling": {"type": "dynamic", "alpha": 1000.0}}, "heads of 2 are too narrow for its RoPE"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_hunyuan_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_a_hunyuan_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "hunyuan-dense")
