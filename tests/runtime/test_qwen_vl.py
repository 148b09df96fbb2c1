"""Qwen's vision-language checkpoints served as text (runtime/models/qwen_vl.py): the
releases' configs, every weight layout (Hugging Face's originals, older and newer,
mlx-vlm's conversions, float and 4-bit) against mlx-lm's `qwen2_vl`, `qwen3_vl` and
`qwen3_vl_moe` through the engine, and the multimodal RoPE against its own definition."""

import json
import math

from runtime.checkpoint import load_model
from runtime.config import config_from_dict, load_config
from runtime.engine import Engine
from runtime.errors import CheckpointError
from runtime.models.layers import RoPE
from runtime.sequence import FinishCause
from runtime.synth import save_weights

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from structlog.testing import capture_logs

from tests.runtime.test_engine import PROMPT, generate, mlx_lm_greedy

# The releases' config.json, their text model's fields and layout as published (the
# vision tower's own fields cut to a few).
QWEN2_5_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 2048, "fullatt_block_indexes": [7, 15, 23, 31]},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}
QWEN3_VL_4B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "initializer_range": 0.02,
        "intermediate_size": 9728,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "video_token_id": 151656,
    "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_size": 1024, "model_type": "qwen3_vl"},
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}
QWEN3_VL_30B_A3B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl_moe",
    "text_config": {
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_vl_moe_text",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "video_token_id": 151656,
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_size": 1152, "model_type": "qwen3_vl_moe"},
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}


def test_the_releases_configs_are_read_as_their_text_models():
    qwen2_5 = config_from_dict(QWEN2_5_VL_3B)
    assert (qwen2_5.model_type, qwen2_5.hidden_size, qwen2_5.head_dim) == ("qwen2_5_vl_text", 2048, 128)
    assert qwen2_5.qkv_bias and not qwen2_5.o_bias and not qwen2_5.qk_norm  # qwen2's attention
    assert qwen2_5.tie_word_embeddings is True and qwen2_5.layer_windows == ()
    qwen3 = config_from_dict(QWEN3_VL_4B)
    assert (qwen3.model_type, qwen3.hidden_size, qwen3.head_dim) == ("qwen3_vl_text", 2560, 128)
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.tie_word_embeddings is True
    assert qwen3.eos_token_ids == (151645,)
    moe = config_from_dict(QWEN3_VL_30B_A3B)
    experts = moe.extra["experts"]
    assert (moe.model_type, experts.num_experts, experts.intermediate_size) == ("qwen3_vl_moe_text", 128, 768)
    assert experts.normalize and all(experts.sparse_layers) and moe.tie_word_embeddings is False
    for config in (qwen2_5, qwen3, moe):  # the multimodal RoPE is the plain one for text
        assert config.rope_scaling is None
    assert (qwen2_5.rope_theta, qwen3.rope_theta) == (1e6, 5e6)


def test_the_moes_router_renormalises_where_its_config_does_not_say():
    """As transformers' Qwen3-VL-MoE router always does: it reads no norm_topk_prob."""
    text = {k: v for k, v in QWEN3_VL_30B_A3B["text_config"].items() if k != "norm_topk_prob"}
    assert config_from_dict({**QWEN3_VL_30B_A3B, "text_config": text}).extra["experts"].normalize


def test_transformers_5s_rope_parameters_and_a_nested_qwen2_5_vl_are_read():
    nested = {
        "model_type": "qwen2_5_vl",
        "text_config": {
            **{k: v for k, v in QWEN2_5_VL_3B.items() if k not in ("vision_config", "rope_scaling", "rope_theta")},
            "model_type": "qwen2_5_vl_text",
            "rope_parameters": {"type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
        },
        "vision_config": QWEN2_5_VL_3B["vision_config"],
    }
    config = config_from_dict(nested)
    assert (config.model_type, config.rope_theta, config.rope_scaling) == ("qwen2_5_vl_text", 1e6, None)


def test_a_rope_type_of_another_kind_is_a_one_line_error():
    config = {**QWEN2_5_VL_3B, "rope_scaling": {"type": ["mrope"], "mrope_section": [16, 24, 24]}}
    with pytest.raises(CheckpointError, match=r"unsupported rope_scaling type '\['mrope'\]'"):
        config_from_dict(config)


def test_a_yarn_scaling_beside_the_sections_is_yarn():
    """Qwen2.5-VL's model card extends the context so: YaRN, its sections kept."""
    yarn = {"type": "yarn", "mrope_section": [16, 24, 24], "factor": 4, "original_max_position_embeddings": 32768}
    config = config_from_dict({**QWEN2_5_VL_3B, "rope_scaling": yarn})
    assert config.rope_scaling is not None and config.rope_scaling["type"] == "yarn"
    assert config.rope_scaling["factor"] == 4


def mrope_rotated(x: np.ndarray, positions: np.ndarray, sections: list[int], interleaved: bool, base: float) -> np.ndarray:
    """x [T, D] rotated by the multimodal RoPE as transformers defines it: frequency i of
    the D/2 turns by the temporal, height or width position (positions [3, T]) that its
    section picks (Qwen2-VL: consecutive sections; Qwen3-VL: interleaved, H and W at
    every third index from 1 and 2 within 3 * section)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-np.arange(0, half) * 2 / x.shape[-1])
    angles = positions[:, :, None] * inv_freq  # [3, T, D/2]
    picked = angles[0].copy()
    if interleaved:
        for axis, offset in ((1, 1), (2, 2)):
            index = np.arange(offset, sections[axis] * 3, 3)
            picked[:, index] = angles[axis][:, index]
    else:
        start = 0
        for axis, size in enumerate(sections):
            picked[:, start : start + size] = angles[axis][:, start : start + size]
            start += size
    cos, sin = np.cos(picked), np.sin(picked)
    x1, x2 = x[:, :half], x[:, half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize(
    "sections, interleaved", [([16, 24, 24], False), ([24, 20, 20], True)], ids=["qwen2-vl", "qwen3-vl"]
)
def test_for_text_the_multimodal_rope_is_the_plain_rope(sections, interleaved):
    """Text's three position ids are one: the sections all turn by it, as plain RoPE does.
    (Ids that differ, as an image's, turn the sections apart: the check can tell.)"""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 128)).astype(np.float32)
    positions = np.arange(3, 12, dtype=np.float64)
    ours = np.array(RoPE(128, 5e6, None)(mx.array(x)[:, None, :], mx.array(positions.astype(np.int32)))[:, 0])
    text = mrope_rotated(x, np.stack([positions] * 3), sections, interleaved, 5e6)
    assert np.allclose(ours, text, atol=1e-4)
    image = mrope_rotated(x, np.stack([positions, positions + 1, positions * 2]), sections, interleaved, 5e6)
    assert not np.allclose(ours, image, atol=1e-2)


PARITY_CASES = {
    # Hugging Face's layouts: Qwen2.5-VL's release (`model.layers`, `visual`), Qwen3-VL's
    # (`model.language_model`, `model.visual`; the MoE's experts fused)
    "qwen2_vl": ("qwen2_vl", dict()),
    "qwen2_5_vl-tied": ("qwen2_5_vl", dict(tie_word_embeddings=True)),
    "qwen3_vl-tied": ("qwen3_vl", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3_vl_moe": ("qwen3_vl_moe", dict(head_dim=32, num_layers=3)),
    # Qwen2.5-VL's model card's long context: YaRN beside the sections, past an original 16
    "qwen2_5_vl-yarn": (
        "qwen2_5_vl",
        dict(rope_scaling={"type": "yarn", "mrope_section": [2, 3, 3], "factor": 4.0, "original_max_position_embeddings": 16}),
    ),
    # mlx-vlm's conversions (`language_model.`, `vision_tower`), float and 4-bit
    "qwen2_5_vl-mlx-vlm": ("qwen2_5_vl", dict(hf_original=False)),
    "qwen2_5_vl-4bit": ("qwen2_5_vl", dict(tie_word_embeddings=True, quantize=(32, 4))),
    "qwen3_vl-4bit": ("qwen3_vl", dict(head_dim=32, quantize=(32, 4))),
    "qwen3_vl_moe-mlx-vlm": ("qwen3_vl_moe", dict(head_dim=32, hf_original=False)),
    "qwen3_vl_moe-4bit": ("qwen3_vl_moe", dict(head_dim=32, quantize=(32, 4))),
}


@pytest.mark.parametrize("case", PARITY_CASES)
def test_greedy_parity_with_mlx_lm(make_checkpoint, case):
    family, shape = PARITY_CASES[case]
    path = make_checkpoint(family, **shape)
    with capture_logs() as logs:
        loaded = load_model(path)
    assert any("vision tower skipped" in e["event"] for e in logs)
    ours, finish = generate(Engine(loaded, max_batch=2), PROMPT, max_tokens=24, ignore_eos=True)
    assert finish is FinishCause.LENGTH
    assert ours == mlx_lm_greedy(path, PROMPT, 24)
    assert len(set(ours)) > 4, "the test model should not be degenerate"


def stored(path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = mx.load(str(path / "model.safetensors"))  # type: ignore[assignment]
    return weights


def test_the_newer_hugging_face_layout_of_qwen2_5_vl_loads_the_same_model(make_checkpoint, tmp_path):
    """transformers >= 4.52 saves Qwen2.5-VL as Qwen3-VL: `model.language_model.*`, `model.visual.*`."""
    path = make_checkpoint("qwen2_5_vl")
    newer = tmp_path / "newer"
    newer.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (newer / name).write_bytes((path / name).read_bytes())
    renamed = {
        name.replace("model.", "model.language_model.", 1).replace("visual.", "model.visual.", 1): w
        for name, w in stored(path).items()
    }
    assert "model.language_model.embed_tokens.weight" in renamed and "model.visual.merger.ln_q.weight" in renamed
    save_weights(newer, renamed)
    tokens = mx.array([PROMPT])
    want = load_model(path).model(tokens)
    assert mx.array_equal(load_model(newer).model(tokens), want).item()


def _saved_beside(path, tmp_path, weights):
    """A copy of checkpoint `path`'s small files with `weights` as its weights."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((path / name).read_bytes())
    save_weights(broken, weights)
    return broken


def test_fused_experts_of_another_shape_are_a_one_line_error(make_checkpoint, tmp_path):
    path = make_checkpoint("qwen3_vl_moe", head_dim=32, num_layers=3)
    weights = stored(path)
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    weights[name] = weights[name].swapaxes(1, 2)  # [E, 2 I, hidden]: not the releases' layout
    broken = _saved_beside(path, tmp_path, weights)
    with pytest.raises(CheckpointError, match=r"experts: gate_up_proj and down_proj should be \[E, 64, 256\]"):
        load_model(broken)


@pytest.mark.parametrize("kept", ["gate_up_proj", "down_proj"])
def test_one_of_the_fused_experts_pair_stored_alone_is_a_one_line_error(make_checkpoint, tmp_path, kept):
    path = make_checkpoint("qwen3_vl_moe", head_dim=32, num_layers=3)
    weights = stored(path)
    other = "down_proj" if kept == "gate_up_proj" else "gate_up_proj"
    del weights[f"model.language_model.layers.1.mlp.experts.{other}"]
    broken = _saved_beside(path, tmp_path, weights)
    with pytest.raises(CheckpointError, match=r"layers.1.mlp.experts: gate_up_proj and down_proj should be .* got .*None"):
        load_model(broken)


def test_the_synthetic_configs_keep_the_releases_layout(make_checkpoint):
    flat = json.loads((make_checkpoint("qwen2_5_vl") / "config.json").read_text())
    assert "text_config" not in flat and flat["rope_scaling"]["type"] == "mrope"
    assert sum(flat["rope_scaling"]["mrope_section"]) == 8  # half of a 16-wide head
    nested = json.loads((make_checkpoint("qwen3_vl_moe", head_dim=32, num_layers=3) / "config.json").read_text())
    assert set(nested) >= {"text_config", "vision_config", "tie_word_embeddings", "image_token_id"}
    text = nested["text_config"]
    assert text["model_type"] == "qwen3_vl_moe_text" and text["rope_scaling"]["mrope_interleaved"]
    assert sum(text["rope_scaling"]["mrope_section"]) == 32 // 2 and "eos_token_id" in text
    assert math.isclose(config_from_dict(nested).rope_theta, 10000.0)


CONVERSIONS = {  # mlx-lm's converter, as mlx-community's checkpoints are made
    "qwen3_vl_moe": ("qwen3_vl_moe", dict(head_dim=32, num_layers=3, hidden_size=128), {}),  # routers 8-bit
    "qwen2_5_vl-mixed": ("qwen2_5_vl", dict(hidden_size=128), {"quant_predicate": "mixed_3_6"}),
}


@pytest.mark.parametrize("case", CONVERSIONS)
def test_what_mlx_lm_convert_writes_gives_its_greedy_tokens(make_checkpoint, tmp_path, case):
    """Per-layer quantization entries named under `language_model.`, in a flat config
    (Qwen2.5-VL's) as in a nested one, name the text model's layers."""
    family, shape, options = CONVERSIONS[case]
    path = tmp_path / "converted"
    mlx_lm.convert(str(make_checkpoint(family, **shape)), str(path), quantize=True, **options)
    per_layer = load_config(path).quantization.per_layer
    assert per_layer and all(name.startswith("model.") or name == "lm_head" for name in per_layer)
    model, _ = mlx_lm.load(str(path))
    model.set_dtype(mx.float32)  # as cadence computes on the CPU, so that the tokens compare the packing alone
    ours, _ = generate(Engine(load_model(path), max_batch=2), PROMPT, max_tokens=24, ignore_eos=True)
    assert ours == [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=24)]
    assert len(set(ours)) > 4, "the test model should not be degenerate"
