"""GLM-4 against mlx-lm: its four norms (in the CPU's one-op blocks too), half of each
head rotated in interleaved pairs (run as halves over reordered q/k rows), its fused
gate_up_proj split at load; greedy tokens through the paged engine, float and 4-bit."""

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
import numpy as np
import pytest

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_gguf import minimal_gguf, one_line_error

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 25))


def test_glm4_logits_match_mlx_lm_and_the_row_reorder_matters(tmp_path: Path, monkeypatch):
    path = make_tiny_checkpoint(tmp_path, "glm4", num_layers=2, seed=3)
    ours = load_model(path)
    assert ours.config.extra == {"rotary_dims": 8} and ours.config.qkv_bias and not ours.config.o_bias
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    monkeypatch.setattr(glm4, "halves_order", lambda name, tensor, D, R: tensor)
    assert not mx.allclose(load_model(path).model(TOKENS), want, atol=1e-2).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_glm4_greedy_parity_through_the_engine_and_its_one_op_blocks(tmp_path: Path, quantize):
    path = make_tiny_checkpoint(tmp_path, "glm4", num_layers=2, quantize=quantize, seed=3)
    loaded = load_model(path)
    # Both norms of each block inside the op, as Gemma 3's.
    layers = loaded.model.model.layers
    assert all(layer.attention_block.post_norm is not None for layer in layers)
    assert all(layer.mlp_block.post_norm is not None for layer in layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def config(**fields):
    raw = hf_config("glm4", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128, head_dim=32)
    return config_from_dict({**raw, **fields})


def test_glm4_reads_its_rotated_share_and_defaults_as_transformers():
    assert config().extra["rotary_dims"] == 16
    assert config(partial_rotary_factor=1.0).extra["rotary_dims"] == 32
    assert config(partial_rotary_factor=None, rope_parameters={"partial_rotary_factor": 0.25}).extra["rotary_dims"] == 8
    raw = hf_config("glm4", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128, head_dim=32)
    for name in ("partial_rotary_factor", "attention_bias", "head_dim"):
        del raw[name]
    got = config_from_dict(raw)
    assert (got.head_dim, got.extra["rotary_dims"], got.qkv_bias) == (128, 64, True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"partial_rotary_factor": 0}, "glm4's partial_rotary_factor must rotate an even number of a head's 32"),
        ({"partial_rotary_factor": 1.5}, "glm4's partial_rotary_factor must rotate an even number"),
        ({"partial_rotary_factor": 0.03125}, "glm4's partial_rotary_factor must rotate an even number"),  # 1 of 32
        ({"partial_rotary_factor": "half"}, "glm4's partial_rotary_factor must rotate an even number"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "glm4 with RoPE scaling is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_glm4_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_a_glm4_fused_projection_of_the_wrong_size_is_named(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "glm4", num_layers=1, intermediate_size=96, seed=3)
    raw = (path / "config.json").read_text().replace('"intermediate_size": 96', '"intermediate_size": 128')
    (path / "config.json").write_text(raw)
    with pytest.raises(CheckpointError, match=re.escape("mlp.gate_up_proj.weight' has shape (192, 64), expected 256 rows")):
        load_model(path)


def test_a_glm4_q_or_k_proj_of_part_of_a_head_is_named(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "glm4", num_layers=1, head_dim=32, seed=3)
    raw = (path / "config.json").read_text().replace('"head_dim": 32', '"head_dim": 24')
    (path / "config.json").write_text(raw)
    with pytest.raises(CheckpointError, match="_proj.(weight|bias). has shape .*, not whole heads of 24 rows"):
        load_model(path)


def test_a_glm4_gguf_stays_a_one_line_refusal(tmp_path: Path):
    path = minimal_gguf(tmp_path / "glm4.gguf", "glm4", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert "unsupported GGUF architecture 'glm4'" in one_line_error(path)
