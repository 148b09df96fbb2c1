"""GLM-4 (`glm4`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1), each difference from llama
checked against transformers' `modeling_glm4` and mlx-lm's `glm4`:

- each block's output is normed before the residual add (`post_self_attn_layernorm`,
  `post_mlp_layernorm`) as well as its input, Gemma 3's four norms as plain RMSNorms;
- RoPE rotates the first `partial_rotary_factor` (0.5) of each head, in interleaved
  pairs (2i, 2i + 1) where cadence's rotation pairs halves (i, i + R/2): q_proj's and
  k_proj's rows are reordered at load, evens then odds within each head's rotated part,
  which gives q and k the same permutation and leaves every q.k, so every score, as it is;
- q, k and v carry a bias (`attention_bias`), o none;
- gate and up are stored as one `gate_up_proj`, split at load (the CPU stacks them again).

The one-op residual blocks on the CPU (kernels/fused_blocks.py) take both norms of a
block, as Gemma 3's.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number, rope_fields
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.models import llama
from runtime.models.layers import RMSNorm, kept_rows

import mlx.core as mx

from kernels.fused_blocks import NormedLayers

ROTATES_PART_OF_A_HEAD = True
# transformers' Glm4Config defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"head_dim": 128, "attention_bias": True, "rms_norm_eps": 1.5625e-07}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    _, rope_scaling = rope_fields(fields)
    if rope_scaling is not None:
        raise CheckpointError(f"{fields.source}: glm4 with RoPE scaling is not supported")
    parameters = fields.get("rope_parameters", dict, None) or {}
    factor = fields.raw.get("partial_rotary_factor")  # transformers 5 writes it under rope_parameters
    if factor is None:
        factor = parameters.get("partial_rotary_factor", 0.5)
    head_dim = fields.get("head_dim", int)
    rotary_dims = int(head_dim * factor) if is_positive_number(factor) and factor <= 1 else 0
    if rotary_dims == 0 or rotary_dims % 2:
        raise CheckpointError(
            f"{fields.source}: glm4's partial_rotary_factor must rotate an even number of a head's "
            f"{head_dim} dimensions, got {factor!r}"
        )
    return {
        "qkv_bias": fields.get("attention_bias", bool),
        "o_bias": False,
        "extra": {"rotary_dims": rotary_dims},
    }


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """gate_up_proj split into gate_proj and up_proj; q_proj's and k_proj's rows (weight,
    quantized scales and biases, bias) reordered from interleaved RoPE pairs to halves."""
    ffn = config.intermediate_size
    renamed = {}
    for name, tensor in weights.items():
        layer, _, part = name.rpartition(".")  # part: weight, scales, biases or bias
        if layer.endswith(".mlp.gate_up_proj"):
            if tensor.ndim < 1 or tensor.shape[0] != 2 * ffn:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {2 * ffn} rows")
            block = layer.removesuffix(".gate_up_proj")
            renamed[f"{block}.gate_proj.{part}"] = tensor[:ffn]
            renamed[f"{block}.up_proj.{part}"] = tensor[ffn:]
        elif layer.endswith((".self_attn.q_proj", ".self_attn.k_proj")):
            renamed[name] = halves_order(name, tensor, config.head_dim, config.extra["rotary_dims"])
        else:
            renamed[name] = tensor
    return renamed


def halves_order(name: str, tensor: mx.array, D: int, R: int) -> mx.array:
    """A q or k projection's rows, each head's (of D) rotated ones (its first R) as
    evens then odds."""
    if tensor.ndim < 1 or tensor.shape[0] % D:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, not whole heads of {D} rows")
    within_head = mx.concatenate([mx.arange(0, R, 2), mx.arange(1, R, 2), mx.arange(R, D)])
    heads = tensor.shape[0] // D
    rows = (mx.arange(heads)[:, None] * D + within_head[None, :]).reshape(-1)
    return mx.take(tensor, rows, axis=0)


class Glm4Layer(llama.DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    attention_block: NormedLayers | None = None
    mlp_block: NormedLayers | None = None

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`."""
        h = self.self_attn.as_block(x, kv, self.attention_block)
        if h is None:
            attended = self.self_attn(self.input_layernorm(x), kv, keep)
            h = kept_rows(x, keep) + self.post_self_attn_layernorm(attended)
        else:
            h = kept_rows(h, keep)
        out = self.mlp.as_block(h, self.mlp_block)
        if out is None:
            out = h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))
        return out

    def plan_blocks(self) -> None:
        attn, mlp = self.self_attn, self.mlp
        self.attention_block = attn.block_operands(self.input_layernorm, self.post_self_attn_layernorm)
        self.mlp_block = mlp.block_operands(self.post_attention_layernorm, self.post_mlp_layernorm)


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, Glm4Layer)
