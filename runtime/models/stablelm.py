"""StableLM (`stablelm`: StableLM 2 1.6B and 12B, Zephyr, StableLM 3B 4E1T, StableCode),
each difference from llama checked against transformers' `modeling_stablelm` and mlx-lm's
`stablelm`; its layer is Cohere's (cohere.py) with these settings:

- LayerNorms with a weight and a bias (`layer_norm_eps`), the final norm too;
- RoPE over the first `partial_rotary_factor` (0.25) of each head, in halves;
- q, k and v biased where `use_qkv_bias` says, o never;
- `qk_layernorm` (StableLM 2 12B): each head of q and k LayerNormed with its own weight,
  stored per head (`q_layernorm.norms.{h}.weight`), stacked at load;
- `use_parallel_residual` (12B): attention and the MLP side by side off the one norm;
  else one after the other, each behind its own norm.

Its layers run by parts on the CPU (the one-op blocks RMSNorm their input).
"""

from __future__ import annotations

import re
from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number, rope_fields
from runtime.errors import CheckpointError
from runtime.models import cohere, llama

import mlx.core as mx

ROTATES_PART_OF_A_HEAD = True
# transformers' StableLmConfig defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"layer_norm_eps": 1e-5, "partial_rotary_factor": 0.25}
PER_HEAD_NORM = re.compile(r"(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight")

build = cohere.LayerNormDecoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    return {
        "qkv_bias": fields.get("use_qkv_bias", bool, False),
        "o_bias": False,
        "extra": {
            "layer_norm_eps": fields.get("layer_norm_eps", float),
            "layer_norm_bias": True,
            "rotary_dims": partial_rotary_dims(fields),
            "qk_layernorm": fields.get("qk_layernorm", bool, False),
            "parallel_block": fields.get("use_parallel_residual", bool, False),
        },
    }


def partial_rotary_dims(fields: ConfigFields) -> int:
    """How many of a head's dimensions RoPE rotates (StableLM's and Phi-2's), checked;
    RoPE scaling, which neither mlx-lm's nor (for these) most releases apply, refused."""
    family = fields.raw["model_type"]
    factor = fields.raw.get("partial_rotary_factor")
    head_dim = fields.get("hidden_size", int) // fields.get("num_attention_heads", int)
    rotary_dims = int(head_dim * factor) if is_positive_number(factor) and factor <= 1 else 0
    if rotary_dims == 0 or rotary_dims % 2:
        raise CheckpointError(
            f"{fields.source}: {family}'s partial_rotary_factor must rotate an even number of a head's "
            f"{head_dim} dimensions, got {factor!r}"
        )
    if rope_fields(fields)[1] is not None:
        raise CheckpointError(f"{fields.source}: {family} with RoPE scaling is not supported")
    return rotary_dims


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """The per-head q/k LayerNorm weights stacked into one [heads, head_dim] each."""
    renamed: dict[str, mx.array] = {}
    per_head: dict[str, dict[int, mx.array]] = {}
    for name, tensor in weights.items():
        if (match := PER_HEAD_NORM.fullmatch(name)) is None:
            renamed[name] = tensor
            continue
        prefix, which, head = match.groups()
        per_head.setdefault(f"{prefix}{which}_norm.weight", {})[int(head)] = tensor
    for name, heads in per_head.items():
        if sorted(heads) != list(range(len(heads))):
            raise CheckpointError(f"{name}: the per-head norms stored are heads {sorted(heads)}, not 0..{len(heads) - 1}")
        renamed[name] = mx.stack([heads[h] for h in range(len(heads))])
    return renamed
