"""DeepSeek-V3's layout against mlx-lm beyond the engine's parity cases
(tests/runtime/test_engine.py, tests/kernels/test_quantized_models.py): its router, the
weight layouts that load (Hugging Face's, mlx-lm's split kv_b_proj, packed or not, with
multi-token-prediction layers) and the ones refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.models.deepseek_v2 import LatentExperts
from runtime.synth import make_tiny_checkpoint, save_weights
from runtime.synth_family_fields import DEEPSEEK_YARN

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

TOKENS = mx.array([list(range(5, 45))])
SHAPE = dict(num_layers=3, hidden_size=128, intermediate_size=256, seed=5)


def weights_of(path: Path) -> dict[str, mx.array]:
    return mx.load(str(path / "model.safetensors"))


def edited(path: Path, **fields) -> Path:
    raw = {**json.loads((path / "config.json").read_text()), **fields}
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("quantize", [None, (32, 4), (64, 8)], ids=["float", "4-bit", "8-bit"])
def test_logits_match_mlx_lm_in_every_layout(tmp_path: Path, quantize):
    """Float: Hugging Face's layout (kv_b_proj, experts apart). Packed: mlx-lm's (kv_b_proj
    as embed_q and unembed_out, both packed at group 32; embed_q's 32 inputs stay float at 64)."""
    path = make_tiny_checkpoint(tmp_path, "deepseek_v3", quantize=quantize, **SHAPE)
    stored = weights_of(path)
    assert ("model.layers.1.self_attn.embed_q.weight" in stored) == (quantize is not None)
    ours = load_model(path)
    assert ours.config.extra["mla"].q_lora_rank == 64
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    assert want.std().item() > 1.0


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_what_mlx_lm_convert_writes_unquantized_loads(tmp_path: Path, family):
    """mlx-lm's float conversion: the experts stacked, kv_b_proj split into float embed_q
    and unembed_out (its quantized ones: tests/kernels/test_quantized_models.py)."""
    source = make_tiny_checkpoint(tmp_path / "hf", family, **SHAPE)
    mlx_lm.convert(str(source), str(tmp_path / "mlx"))
    stored = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    assert "model.layers.1.self_attn.embed_q.weight" in stored
    assert "model.layers.1.mlp.switch_mlp.gate_proj.weight" in stored
    want = load_model(source).model(TOKENS)
    assert mx.allclose(load_model(tmp_path / "mlx").model(TOKENS), want, atol=1e-4).item()


def test_yarn_as_deepseek_v3_releases_write_it_matches_mlx_lm(tmp_path: Path):
    """DeepSeek-V3's (factor 40, mscale = mscale_all_dim = 1) over an original 16 positions."""
    yarn = {**DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "type": "yarn"}
    path = make_tiny_checkpoint(tmp_path, "deepseek_v3", rope_scaling=yarn, **SHAPE)
    ours = load_model(path)
    assert ours.model.model.layers[0].self_attn.rope_factor == 1.0
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


def test_multi_token_prediction_layers_are_dropped(tmp_path: Path):
    """DeepSeek-V3's layer 61 (past num_hidden_layers' 61) holds its MTP module (mlx-lm
    drops that number alone)."""
    path = make_tiny_checkpoint(tmp_path, "deepseek_v3", **SHAPE)
    want = load_model(path).model(TOKENS)
    weights = weights_of(path)
    weights["model.layers.3.eh_proj.weight"] = mx.zeros((128, 256))
    weights["model.layers.3.enorm.weight"] = mx.ones((128,))
    save_weights(path, weights)
    assert mx.allclose(load_model(path).model(TOKENS), want).item()


def test_dropped_groups_are_never_chosen_even_above_the_kept_groups_biased_scores(tmp_path: Path):
    """DeepSeek's reference code masks the groups left out with -inf; transformers and
    mlx-lm write 0 there, which kept experts whose biased scores fall below 0 lose to."""
    loaded = load_model(make_tiny_checkpoint(tmp_path, "deepseek_v3", **SHAPE))
    experts = loaded.model.model.layers[1].mlp
    assert isinstance(experts, LatentExperts) and experts.routing.num_groups == 2
    experts.gate.e_score_correction_bias = mx.full((4,), -2.0)  # every biased score below 0
    tokens = mx.random.normal((256, 128), key=mx.random.key(2))
    chosen, weights = experts.route(tokens)
    biased = mx.sigmoid(tokens @ experts.gate.weight.T) - 2.0
    best_group = biased.reshape(256, 2, 2).sum(axis=-1).argmax(axis=-1)  # 2 experts a group: both its best
    assert (chosen // 2 == best_group[:, None]).all().item()
    assert mx.allclose(weights.sum(axis=-1), mx.array(2.5)).item()  # normalised, times the scaling


def test_rope_interleave_false_pairs_halves_as_transformers_reads_it(tmp_path: Path):
    """mlx-lm always pairs (2i, 2i + 1); its logits on weights whose rotated rows were
    interleaved from halves are cadence's on the weights as they are, read as halves."""
    path = make_tiny_checkpoint(tmp_path / "halves", "deepseek_v3", **SHAPE)
    edited(path, rope_interleave=False)
    weights = weights_of(path)
    mla = config_from_dict(json.loads((path / "config.json").read_text())).extra["mla"]
    interleaved = make_tiny_checkpoint(tmp_path / "pairs", "deepseek_v3", **SHAPE)
    for name, w in weights.items():
        if name.endswith(("q_b_proj.weight", "kv_a_proj_with_mqa.weight")):
            rows = w.shape[0] // (mla.nope_dims + mla.rope_dims) if "q_b" in name else 1
            block = w.shape[0] // rows
            start = block - mla.rope_dims
            half = mla.rope_dims // 2
            within = np.arange(block)
            within[start:] = start + np.stack([np.arange(half), half + np.arange(half)], axis=1).reshape(-1)
            weights[name] = w[mx.array((np.arange(rows)[:, None] * block + within).reshape(-1))]
    save_weights(interleaved, weights)
    want = mlx_lm.load(str(interleaved))[0](TOKENS)
    ours = load_model(path)
    assert not ours.config.extra["mla"].interleaved
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    read_as_pairs = load_model(edited(path, rope_interleave=True))
    assert not mx.allclose(read_as_pairs.model(TOKENS), want, atol=1e-2).item()


def test_fp8_originals_are_refused_in_one_line(tmp_path: Path):
    path = make_tiny_checkpoint(tmp_path, "deepseek_v3", **SHAPE)
    weights = weights_of(path)
    name = "model.layers.0.self_attn.o_proj.weight"
    weights[name] = weights[name].astype(mx.uint8)  # as mlx reads F8_E4M3
    weights[f"{name.removesuffix('.weight')}.weight_scale_inv"] = mx.ones((1, 1))
    save_weights(path, weights)
    edited(path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(CheckpointError, match="FP8 weights are not supported") as error:
        load_model(path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("float-of-another-shape", "embed_q' and '.unembed_out' have shapes (4, 64, 16) and (4, 32, 64)"),
        ("scales-of-other-groups", "embed_q.weight' is not 32 inputs packed in groups"),
    ],
)
def test_a_damaged_split_kv_b_proj_is_a_one_line_refusal(tmp_path: Path, damage, says):
    """mlx-lm's embed_q [H, kv_lora_rank, nope] (here 4 x 64 x 32, packed 4-bit at 32)."""
    path = make_tiny_checkpoint(tmp_path, "deepseek_v3", quantize=(32, 4), **SHAPE)
    weights = weights_of(path)
    name = "model.layers.1.self_attn.embed_q"
    if damage == "float-of-another-shape":
        del weights[f"{name}.scales"], weights[f"{name}.biases"]
        weights[f"{name}.weight"] = mx.zeros((4, 64, 16))
    else:
        weights[f"{name}.scales"] = weights[f"{name}.biases"] = mx.ones((4, 64, 3))
    save_weights(path, weights)
    with pytest.raises(CheckpointError, match=re.escape(says)) as error:
        load_model(path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported for deepseek_v3"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported for deepseek_v3"),
        ({"n_group": 4, "topk_group": 2}, "leaves groups of fewer than the 2 experts"),
        ({"n_group": 2, "topk_group": 3}, "be at least topk_group"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_a_router_cadence_cannot_run_is_refused(make_checkpoint, fields, says):
    raw = {**json.loads((make_checkpoint("deepseek_v3", **SHAPE) / "config.json").read_text()), **fields}
    with pytest.raises(CheckpointError, match=says):
        config_from_dict(raw)
