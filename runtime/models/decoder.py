"""The pre-norm decoder shared by llama, mistral, qwen2 and qwen3.

The families differ only in flags read from `ModelConfig`: q/k/v bias (qwen2),
per-head q/k RMSNorm (qwen3), tied embeddings, head_dim, RoPE scaling. Module
and parameter names follow the Hugging Face checkpoints, so weights load by name.
"""

from __future__ import annotations

import math

from runtime.config import ModelConfig
from runtime.kv.base import CausalNoCache, ForwardKV

import mlx.core as mx
import mlx.nn as nn

from kernels.swiglu import swiglu


class RoPE(nn.Module):
    """Rotary embedding with per-row offsets; default, linear and llama3 scaling."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dims = config.head_dim
        self.base: float | None = config.rope_theta
        self.scale = 1.0
        self._freqs: mx.array | None = None
        scaling = config.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            self.scale = 1.0 / float(scaling["factor"])
        elif kind == "llama3":
            self._freqs = _llama3_freqs(self.dims, config.rope_theta, scaling)
            self.base = None

    def __call__(self, x: mx.array, offset: mx.array | int) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=False,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self._freqs,
        )


def _llama3_freqs(dims: int, base: float, scaling: dict) -> mx.array:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > old_context / low, freqs * factor, freqs)
    is_medium = (wavelens > old_context / high) & (wavelens < old_context / low)
    smooth = (old_context / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(is_medium, smooth_freqs, freqs)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.rope = RoPE(config)

    def __call__(self, x: mx.array, kv: ForwardKV) -> mx.array:
        B, T, _ = x.shape
        N = B * T  # the engine's ragged step is one flat batch: B = 1, T = N
        q = self.q_proj(x).reshape(N, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE per token: each token is a batch row of length 1 at its own position.
        q = self.rope(q[:, :, None, :], kv.positions)[:, :, 0, :]  # [N, H, D]
        k = self.rope(k[:, :, None, :], kv.positions)[:, :, 0, :]  # [N, Hkv, D]
        out = kv.attend(self.layer, q, k, v, self.scale)  # [N, H, D]
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, kv: ForwardKV) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Decoder(nn.Module):
    """tokens [B, T] int32 -> logits [B, T, vocab]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, kv: ForwardKV | None = None) -> mx.array:
        return self.project(self.hidden(tokens, kv))

    def hidden(self, tokens: mx.array, kv: ForwardKV | None = None) -> mx.array:
        """tokens [B, T] -> final normed hidden states [B, T, hidden]; no vocab projection."""
        kv = kv if kv is not None else CausalNoCache(*tokens.shape)
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h, kv)
        return self.model.norm(h)

    def project(self, h: mx.array) -> mx.array:
        """Final hidden states [..., hidden] -> logits [..., vocab]."""
        if "lm_head" in self:
            return self.lm_head(h)
        return self.model.embed_tokens.as_linear(h)
