"""Mistral: llama's architecture under its own model_type.

Its `sliding_window` alone is not applied, as mlx-lm's loader does not apply it either:
the published checkpoints since v0.2 set it to null. A `layer_types` naming sliding
layers is, as in mlx-lm (llama.py reads it).
"""

from __future__ import annotations

from runtime.models import llama

build = llama.Decoder
read_config = llama.read_config
