"""Seed-OSS (`seed_oss`: ByteDance Seed-OSS-36B, Base and Instruct), checked against
transformers' `modeling_seed_oss` and mlx-lm's `seed_oss`: llama's decoder (the CPU's
one-op residual blocks included) whose q, k and v carry a bias (`attention_bias`) and o one
only where `attention_out_bias` says (the releases: q/k/v yes, o no).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields
from runtime.models import llama

build = llama.Decoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    return {
        "qkv_bias": fields.get("attention_bias", bool, False),
        "o_bias": fields.get("attention_out_bias", bool, False),
    }
