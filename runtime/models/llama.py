"""Llama: the pre-norm decoder that mistral, qwen2 and qwen3 reuse with their own flags.

    h = x + attn(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h))

The flags come from `ModelConfig`: q/k/v and o biases, per-head q/k RMSNorm,
tied embeddings, head_dim, RoPE scaling (default, linear, llama3).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.kv.base import ForwardKV
from runtime.models.layers import Attention, CausalLM, GatedMLP, RMSNorm, RoPE

import mlx.core as mx
import mlx.nn as nn

from kernels.fused_blocks import NormedLayers, mlp_block, normed_layers


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        rope = RoPE(config.head_dim, config.rope_theta, config.rope_scaling)
        self.self_attn = Attention(
            config,
            layer,
            scale=config.head_dim**-0.5,
            rope=rope,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            qk_norm=RMSNorm if config.qk_norm else None,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # Each residual block as one op where the CPU kernels allow (kernels/fused_blocks.py):
    # planned once the CPU weights are in place (runtime/cpu_weights.py), else None.
    attention_block: NormedLayers | None = None
    mlp_block: NormedLayers | None = None

    def __call__(self, x: mx.array, kv: ForwardKV) -> mx.array:
        attn = self.self_attn
        h = None
        if self.attention_block is not None:
            H, Hkv = attn.num_heads, attn.num_kv_heads
            h = kv.residual_attention(attn.layer, x, self.attention_block, attn.rope, H, Hkv, attn.scale)
        if h is None:
            h = x + attn(self.input_layernorm(x), kv)
        out = None if self.mlp_block is None else mlp_block(h, self.mlp_block, "silu")
        return out if out is not None else h + self.mlp(self.post_attention_layernorm(h))

    def plan_blocks(self) -> None:
        """Which residual blocks run as one op: those whose layers are stacked and run on
        cadence's kernels (quantized or panels), their norms RMSNorms."""
        attn, mlp = self.self_attn, self.mlp
        norm, post_norm = self.input_layernorm, self.post_attention_layernorm  # RMSNorms
        qk_norm = None
        if "q_norm" in attn:  # qwen3: RMSNorms of one eps (the config's) on each head
            qk_norm = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
        self.attention_block = (
            normed_layers(norm.weight, norm.eps, attn["qkv_proj"], attn.o_proj, qk_norm)
            if "qkv_proj" in attn
            else None
        )
        self.mlp_block = (
            normed_layers(post_norm.weight, post_norm.eps, mlp["gate_up_proj"], mlp.down_proj)
            if "gate_up_proj" in mlp and mlp.activation == "silu"
            else None
        )


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Decoder(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = DecoderBody(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


build = Decoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    """attention_bias puts a bias on q, k, v and o alike."""
    bias = fields.get("attention_bias", bool, False)
    return {"qkv_bias": bias, "o_bias": bias}
