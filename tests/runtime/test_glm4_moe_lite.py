"""GLM-4.7-Flash's layout against mlx-lm beyond the engine's parity cases
(tests/runtime/test_engine.py, tests/kernels/test_quantized_models.py): its latent norms'
eps, its multi-token-prediction layer dropped, the mlx-lm layout packed, which layers
route where its config leaves it out or says so in transformers 5's field."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.models.deepseek_v2 import LatentExperts
from runtime.synth import make_tiny_checkpoint, save_weights

import mlx.core as mx
import mlx_lm
import pytest

TOKENS = mx.array([list(range(5, 45))])
SHAPE = dict(num_layers=3, hidden_size=128, intermediate_size=256, seed=7)


def test_the_latent_norms_take_rms_norm_eps_and_the_mtp_layer_is_dropped_as_mlx_lm_does(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "glm4_moe_lite", quantize=(32, 4), **SHAPE)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 0.5}))  # large enough to show
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.layers.3.eh_proj.weight"] = mx.zeros((128, 256))  # the MTP layer, past the 3
    save_weights(path, weights, is_mlx_format=True)
    ours = load_model(path)
    attention = ours.model.model.layers[1].self_attn
    assert attention.q_a_layernorm.eps == attention.kv_a_layernorm.eps == 0.5
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    assert ours.config.head_dim == 32 + 16  # q.k's width; v's (32) padded to it


def test_without_rms_norm_eps_every_norm_takes_transformers_default(tmp_path: Path):
    """Glm4MoeLiteConfig's 1e-5, the latent norms' too (DeepSeek's fixed 1e-6 is not GLM's)."""
    path = make_tiny_checkpoint(tmp_path, "glm4_moe_lite", **SHAPE)
    raw = json.loads((path / "config.json").read_text())
    config = config_from_dict({k: v for k, v in raw.items() if k != "rms_norm_eps"})
    assert config.rms_norm_eps == config.extra["mla"].norm_eps == 1e-5


def test_without_first_k_dense_replace_the_first_layer_is_dense_as_transformers_and_mlx_lm_default(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "glm4_moe_lite", **SHAPE)
    raw = json.loads((path / "config.json").read_text())
    del raw["first_k_dense_replace"]
    (path / "config.json").write_text(json.dumps(raw))
    ours = load_model(path)
    assert [isinstance(layer.mlp, LatentExperts) for layer in ours.model.model.layers] == [False, True, True]
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


def test_mlp_layer_types_says_which_layers_route(tmp_path: Path):
    """transformers 5's field, read where a config gives it (mlx-lm reads none)."""
    path = make_tiny_checkpoint(tmp_path, "glm4_moe_lite", **SHAPE)
    raw = {**json.loads((path / "config.json").read_text()), "mlp_layer_types": ["dense", "sparse", "dense"]}
    config = config_from_dict(raw)
    assert config.extra["experts"].sparse_layers == (False, True, False)
    with pytest.raises(CheckpointError, match="mlp_layer_types needs 3 entries of 'dense' or 'sparse'"):
        config_from_dict({**raw, "mlp_layer_types": ["dense", "moe", "dense"]})
