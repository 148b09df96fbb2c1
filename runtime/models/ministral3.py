"""Ministral 3 (`ministral3`: Ministral 3 3B/8B/14B, the text model of Mistral's
`mistral3` releases of December 2025): llama's decoder with two departures, each
checked against transformers' `modeling_ministral3` and mlx-lm's `ministral3`:

- RoPE is YaRN (runtime/models/layers.py), its settings under `rope_parameters`;
- each rotated query is multiplied by 1 + beta * log(1 + floor(p / context)) at its
  position p (`rope_parameters.llama_4_scaling_beta` and its
  `original_max_position_embeddings`): 1 within the original context, more past it.

As for mistral, a lone `sliding_window` is not applied (mlx-lm reads `layer_types`
only; the releases say null). Multimodal checkpoints load through mistral3.py.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number
from runtime.errors import CheckpointError
from runtime.models import llama, multimodal

import mlx.core as mx

build = llama.Decoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    rope = fields.get("rope_parameters", dict, None) or fields.get("rope_scaling", dict, None) or {}
    beta, context = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if not (is_positive_number(beta) or beta == 0) or isinstance(beta, bool):
        raise CheckpointError(
            f"{fields.source}: ministral3 needs rope_parameters.llama_4_scaling_beta, "
            f"a number of at least 0, got {beta!r}"
        )
    if not (isinstance(context, int) and not isinstance(context, bool) and context > 0):
        raise CheckpointError(
            f"{fields.source}: ministral3 needs rope_parameters.original_max_position_embeddings, "
            f"a positive integer, got {context!r}"
        )
    return {**llama.read_config(fields), "extra": {"attention_temperature": (float(beta), context)}}


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """A multimodal (`mistral3`) checkpoint's text model: its vision tower dropped."""
    return multimodal.text_weights(weights, "ministral3")
