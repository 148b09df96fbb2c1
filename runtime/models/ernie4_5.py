"""ERNIE 4.5 (`ernie4_5`: ERNIE-4.5-0.3B, Base and PT), checked against transformers'
`modeling_ernie4_5` and mlx-lm's `ernie4_5`: llama's decoder whose RoPE rotates
interleaved pairs (2i, 2i + 1), run as halves with q_proj's and k_proj's rows reordered at
load as Cohere's are (cohere.py). Its blocks are llama's, so they take the CPU's one-op
residual blocks. `use_bias` (a bias on every projection, the MLP's too) is refused: no
release sets it.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields
from runtime.errors import CheckpointError
from runtime.models import cohere, llama

# transformers' Ernie4_5Config defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5}

build = llama.Decoder
rename_weights = cohere.rename_weights


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    if fields.get("use_bias", bool, False):
        raise CheckpointError(f"{fields.source}: ernie4_5's use_bias=true is not supported")
    return {"qkv_bias": False, "o_bias": False}
