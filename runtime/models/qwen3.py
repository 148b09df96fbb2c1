"""Qwen3: llama's decoder with RMSNorm on each head of q and k before RoPE."""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields
from runtime.models import llama

build = llama.Decoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    return {**llama.read_config(fields), "qk_norm": True}
