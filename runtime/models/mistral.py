"""Mistral: llama's architecture under its own model_type.

Its `sliding_window` alone is not applied, as mlx-lm's loader does not apply it either:
the published checkpoints since v0.2 set it to null. A `layer_types` naming sliding
layers is, as in mlx-lm (llama.py reads it). The text model of a multimodal
`mistral3` checkpoint (Mistral Small 3.1 and later) loads here, its vision tower
skipped (mistral3.py).
"""

from __future__ import annotations

from runtime.config import ModelConfig
from runtime.models import llama, multimodal

import mlx.core as mx

build = llama.Decoder
read_config = llama.read_config


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """A multimodal (`mistral3`) checkpoint's text model: its vision tower dropped."""
    return multimodal.text_weights(weights, "mistral")
