"""Qwen's vision-language checkpoints served as text: Qwen2-VL (`qwen2_vl`), Qwen2.5-VL
(`qwen2_5_vl`), Qwen3-VL (`qwen3_vl`) and Qwen3-VL-MoE (`qwen3_vl_moe`). Their text
models are qwen2's, qwen3's and qwen3_moe's decoders, loaded as mlx-lm's `qwen2_vl`,
`qwen3_vl` and `qwen3_vl_moe` load them; the vision tower is skipped.

Config: Qwen2-VL's and Qwen2.5-VL's releases are flat (the text model's fields beside
`vision_config`), later exports and every Qwen3-VL nest them under `text_config`
(`qwen2_5_vl_text`, `qwen3_vl_text`, `qwen3_vl_moe_text`); both are read.

RoPE: the text model rotates by a multimodal RoPE: each head's frequencies are split
into (temporal, height, width) sections (`mrope_section`; Qwen3-VL interleaves them),
each turned by its own position id. For text all three ids are the token's position
(transformers' get_rope_index without images), so every frequency turns by that
position and it is the plain RoPE of `rope_theta`, as mlx-lm runs it: a scaling of type
"mrope" or "default" is read as none, another (YaRN, as Qwen2.5-VL's model card
suggests) as itself. Qwen3-VL's deepstack adds the vision tower's features to the
first layers' hidden states at image tokens alone: without images it adds nothing, and
its weights are the vision tower's.

Weights: Hugging Face's Qwen2-VL and Qwen2.5-VL releases store `model.layers.*`,
`lm_head` and `visual.*`; later exports and Qwen3-VL `model.language_model.*`, `lm_head`
and `model.visual.*`; mlx-vlm's conversions `language_model.model.*`,
`language_model.lm_head` and `vision_tower.*` (quantized: the text model alone). The
MoE's Hugging Face experts are fused per layer: `mlp.experts.gate_up_proj`
[E, hidden, 2 I] (gate columns first) and `mlp.experts.down_proj` [E, I, hidden], the
transposes of the stacked `switch_mlp` that mlx-vlm's conversions store.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models import llama, multimodal, qwen2, qwen3, qwen3_moe

import mlx.core as mx
import structlog

log = structlog.get_logger("cadence.models")

# The text config's model_type -> the family whose decoder it is.
TEXT_FAMILIES = {
    "qwen2_vl_text": qwen2,
    "qwen2_5_vl_text": qwen2,
    "qwen3_vl_text": qwen3,
    "qwen3_vl_moe_text": qwen3_moe,
}
MROPE_TYPES = ("mrope", "default")  # "mrope": Qwen2-VL's releases; transformers reads it as "default"
VISUAL_PREFIXES = ("visual.", "model.visual.")  # Hugging Face's names for the vision tower

build = llama.Decoder


def unwrap_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The multimodal config (nested or flat) -> its text model's, its multimodal RoPE
    read as the plain RoPE it is for text."""
    text_type = raw["model_type"].removesuffix("_text") + "_text"
    if "text_config" in raw:
        raw = multimodal.text_config(raw, source, text_type)
    text = {**multimodal.text_quantization(raw), "model_type": text_type}
    if text_type == "qwen3_vl_moe_text":  # transformers' router always renormalises: it reads no norm_topk_prob
        text.setdefault("norm_topk_prob", True)
    scaling = text.get("rope_scaling")
    if isinstance(scaling, dict) and _is_mrope(scaling):
        text["rope_scaling"] = None
    parameters = text.get("rope_parameters")  # transformers 5's: rope_theta is in it
    if isinstance(parameters, dict) and _is_mrope(parameters):
        text["rope_parameters"] = {
            **{k: v for k, v in parameters.items() if k not in ("type", "mrope_section", "mrope_interleaved")},
            "rope_type": "default",
        }
    return text


def _is_mrope(rope: dict[str, Any]) -> bool:
    kinds = (rope.get("rope_type"), rope.get("type"))
    return all(kind is None or kind in MROPE_TYPES for kind in kinds)


def read_config(fields: ConfigFields) -> dict[str, Any]:
    settings: dict[str, Any] = TEXT_FAMILIES[fields.raw["model_type"]].read_config(fields)
    return settings


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Any of the three layouts -> the text model's names, the vision tower dropped; the
    MoE's fused experts stacked as `switch_mlp`."""
    weights = multimodal.text_weights(weights, config.model_type)
    visual = [name for name in weights if name.startswith(VISUAL_PREFIXES)]
    for name in visual:
        del weights[name]
    if visual:
        log.info(f"{config.model_type}: text model only, vision tower skipped", tensors_skipped=len(visual))
    if "experts" in config.extra:
        _unfuse_experts(weights, config)
        weights = qwen3_moe.rename_weights(weights, config)  # per-expert tensors, were any stored so
    return weights


def _unfuse_experts(weights: dict[str, mx.array], config: ModelConfig) -> None:
    """Hugging Face's fused experts -> `switch_mlp`'s [E, out, in] projections, in place."""
    hidden, size = config.hidden_size, config.extra["experts"].intermediate_size
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp"
        gate_up = weights.pop(f"{prefix}.experts.gate_up_proj", None)
        down = weights.pop(f"{prefix}.experts.down_proj", None)
        if gate_up is None and down is None:
            continue
        if gate_up is None or down is None or gate_up.shape[1:] != (hidden, 2 * size) or down.shape[1:] != (size, hidden):
            shapes = [None if w is None else tuple(w.shape) for w in (gate_up, down)]
            raise CheckpointError(
                f"{prefix}.experts: gate_up_proj and down_proj should be [E, {hidden}, {2 * size}] "
                f"and [E, {size}, {hidden}], got {shapes[0]} and {shapes[1]}"
            )
        gate, up = mx.split(gate_up, 2, axis=-1)
        # Copied: the expert kernel reads whole rows of [E, out, in].
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = mx.contiguous(gate.swapaxes(1, 2))
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = mx.contiguous(up.swapaxes(1, 2))
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = mx.contiguous(down.swapaxes(1, 2))
