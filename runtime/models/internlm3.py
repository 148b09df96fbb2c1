"""InternLM3 (`internlm3`: internlm3-8b-instruct), checked against its modeling code and
mlx-lm's `internlm3`: llama's decoder (the CPU's one-op residual blocks included).

Its `rope_scaling` is dynamic NTK (factor 6): RoPE's base grows with the sequence once it
is longer than `max_position_embeddings`, which is also the longest context cadence serves
(runtime/engine.py), so within it the rotation is plain RoPE, as both run it.
`bias` and `qkv_bias` (false in the release; the two disagree on which projections the
latter reaches) are refused.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, is_positive_number, rope_fields
from runtime.errors import CheckpointError
from runtime.models import llama

ROPE_TYPES = ("dynamic",)  # plain within the context served, see above

build = llama.Decoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    for name in ("bias", "qkv_bias"):
        if fields.get(name, bool, False):
            raise CheckpointError(f"{fields.source}: internlm3's {name}=true is not supported")
    _, scaling = rope_fields(fields)
    if scaling is None or scaling.get("rope_type", scaling.get("type")) not in ROPE_TYPES:
        return {}  # none, or one config.py checked and layers.RoPE runs
    if not is_positive_number(scaling.get("factor")):
        raise CheckpointError(f"{fields.source}: rope_scaling dynamic needs a positive 'factor', got {scaling.get('factor')!r}")
    return {"rope_scaling": None}
