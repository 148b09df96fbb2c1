"""The text model inside a multimodal checkpoint (Gemma 3's `gemma3`, Mistral's
`mistral3`): its config under `text_config`, its weights under `language_model.`
(`model.language_model.` in newer exports). The vision tower and projector are
skipped with one log line; cadence serves text.
"""

from __future__ import annotations

from typing import Any

from runtime.errors import CheckpointError

import mlx.core as mx
import structlog

log = structlog.get_logger("cadence.models")

# The other towers' tensors (Gemma 4's too: audio, and the embedders of both).
VISION_PREFIXES = tuple(
    prefix + name
    for prefix in ("", "model.")
    for name in (
        "vision_tower.",
        "multi_modal_projector.",
        "audio_tower.",
        "embed_vision.",
        "embed_audio.",
        "vision_embedder.",
    )
)


def text_config(raw: dict[str, Any], source: str, default_model_type: str) -> dict[str, Any]:
    """The multimodal config -> its text model's: the outer fields (quantization, EOS,
    tying) under the text model's own, which win; `default_model_type` where the text
    config names none."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: {raw.get('model_type')} config without a 'text_config' object")
    outer = text_quantization({k: v for k, v in raw.items() if k not in ("text_config", "vision_config")})
    model_type = text.get("model_type") or default_model_type
    return {**outer, **text, "model_type": model_type}


def text_quantization(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with its `quantization`'s per-layer entries naming the text model's modules
    (a multimodal conversion names them under `language_model.`, and the towers' too)."""
    quant = raw.get("quantization")
    if not isinstance(quant, dict):
        return raw
    kept = {k.removeprefix("language_model."): v for k, v in quant.items() if not k.startswith(VISION_PREFIXES)}
    return {**raw, "quantization": kept}


def text_weights(weights: dict[str, mx.array], family: str) -> dict[str, mx.array]:
    """Multimodal names -> the text model's; the vision tower's tensors are dropped.
    A text-only checkpoint's weights come back as they are."""
    if not any(k.startswith(("language_model.", "model.language_model.")) for k in weights):
        return weights
    renamed, num_skipped = {}, 0
    for name, tensor in weights.items():
        if name.startswith(VISION_PREFIXES):
            num_skipped += 1
        elif name.startswith("language_model."):
            renamed[name.removeprefix("language_model.")] = tensor
        elif name.startswith("model.language_model."):
            renamed["model." + name.removeprefix("model.language_model.")] = tensor
        else:
            renamed[name] = tensor
    if num_skipped:
        log.info(f"{family}: text model only, vision tower skipped", tensors_skipped=num_skipped)
    return renamed
