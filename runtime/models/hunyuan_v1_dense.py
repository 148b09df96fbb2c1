"""Hunyuan dense (`hunyuan_v1_dense`: Tencent Hunyuan 0.5B, 1.8B, 4B and 7B, Pretrain and
Instruct), each difference from llama checked against transformers'
`modeling_hunyuan_v1_dense` and mlx-lm's `hunyuan_v1_dense`:

- q and k RMSNormed per head after RoPE, not before (`use_qk_norm`; stored as
  `query_layernorm` and `key_layernorm`), so its attention skips the CPU's one-op block;
- RoPE's base raised by the releases' NTK `alpha` (`rope_scaling` of type dynamic, alpha
  1000): base * alpha^(d / (d - 2)) for heads of d, at every length.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number, rope_fields
from runtime.errors import CheckpointError
from runtime.models import llama, phi

import mlx.core as mx

ROPE_TYPES = ("dynamic",)  # with an `alpha`, read below
STORED_NAMES = {".self_attn.query_layernorm.": ".self_attn.q_norm.", ".self_attn.key_layernorm.": ".self_attn.k_norm."}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    if fields.get("use_cla", bool, False):
        raise CheckpointError(f"{fields.source}: hunyuan_v1_dense's use_cla=true is not supported")
    own: dict[str, Any] = {**llama.read_config(fields), "qk_norm": fields.get("use_qk_norm", bool, True)}
    rope_theta, scaling = rope_fields(fields)
    if scaling is None or scaling.get("rope_type", scaling.get("type")) not in ROPE_TYPES:
        return own  # none, or one config.py checked and layers.RoPE runs
    alpha = scaling.get("alpha")
    if not is_positive_number(alpha):
        raise CheckpointError(f"{fields.source}: rope_scaling dynamic needs a positive 'alpha', got {alpha!r}")
    head_dim = fields.get("head_dim", int, None) or fields.get("hidden_size", int) // fields.get("num_attention_heads", int)
    if head_dim <= 2:
        raise CheckpointError(f"{fields.source}: hunyuan_v1_dense's heads of {head_dim} are too narrow for its RoPE")
    return {**own, "rope_theta": rope_theta * alpha ** (head_dim / (head_dim - 2)), "rope_scaling": None}


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    return phi.renamed(weights, STORED_NAMES)


class HunyuanLayer(llama.DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.self_attn.qk_norm_after_rope = True


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, HunyuanLayer)
