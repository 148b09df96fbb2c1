"""OLMo 2 (`olmo2`: AllenAI OLMo 2 1B, 7B, 13B, 32B), each difference from llama checked
against transformers' `modeling_olmo2` and mlx-lm's `olmo2`:

- no norm before attention or the MLP: each block's output is normed (RMSNorm) before
  the residual add, `h = x + norm(attn(x))`, `out = h + norm(mlp(h))`;
- q and k are RMSNormed over the whole projection (all heads at once, a weight of
  heads * head_dim), not per head, before RoPE.

Neither is what the one-op residual blocks on the CPU compute (kernels/fused_blocks.py:
a norm before, per-head q/k norms), so its layers run by parts; q, k and v still run
as one stacked matmul there.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.kv.base import ForwardKV
from runtime.models import llama
from runtime.models.experts import feed_forward
from runtime.models.layers import Attention, RMSNorm, RoPE, kept_rows

import mlx.core as mx
import mlx.nn as nn

# transformers' Olmo2Config default, for a config that leaves it out.
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    """`attention_bias` on q, k, v and o, and a SiLU MLP, as llama's; every layer full."""
    llama.check_activation(fields)
    bias = fields.get("attention_bias", bool, False)
    return {"qkv_bias": bias, "o_bias": bias}


class WholeProjectionNormAttention(Attention):
    """Attention whose q and k are RMSNormed across all their heads before RoPE."""

    def __init__(self, config: ModelConfig, layer: int):
        rope = RoPE(config.head_dim, config.rope_theta, config.rope_scaling)
        super().__init__(
            config,
            layer,
            scale=config.head_dim**-0.5 * rope.attention_factor,
            rope=rope,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
        )
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        B, T, _ = x.shape
        N = B * T
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if "qkv_proj" in self:  # stacked at load on the CPU (runtime/cpu_weights.py)
            q, k, v = mx.split(self.qkv_proj(x).reshape(N, -1), [H * D, (H + Hkv) * D], axis=-1)
        else:
            q, k, v = (proj(x).reshape(N, -1) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q = self.rope(self.q_norm(q).reshape(N, H, D), kv.positions)
        k = self.rope(self.k_norm(k).reshape(N, Hkv, D), kv.positions)
        # With no norm before it, the first layer projects the embedding as looked up: an
        # mxfp4 one gives bfloat16, and v stayed so where the norms made q and k float32.
        v = v.reshape(N, Hkv, D).astype(k.dtype)
        out = kv.attend(self.layer, q, k, v, self.scale)  # [N, H, D]
        return self.o_proj(kept_rows(out.reshape(B, T, -1), keep))

    def block_operands(self, norm: Any, post_norm: Any = None) -> None:
        """None: the one-op block norms each head of q and k, not the whole projection."""
        return None


class Olmo2Layer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn: Attention = WholeProjectionNormAttention(config, layer)
        self.mlp = feed_forward(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # No `plan_blocks`: the one-op blocks norm their input, which these layers do not.

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`."""
        h = kept_rows(x, keep) + self.post_attention_layernorm(self.self_attn(x, kv, keep))
        return h + self.post_feedforward_layernorm(self.mlp(h))


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, Olmo2Layer)
