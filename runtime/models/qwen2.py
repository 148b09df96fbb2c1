"""Qwen2: llama's decoder with a bias on q, k and v (part of the architecture, not a
config choice) and none on o."""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields
from runtime.models import llama

build = llama.Decoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    return {"qkv_bias": True, "o_bias": False, "layer_windows": llama.sliding_windows(fields)}
