"""Llama: the pre-norm decoder that mistral, qwen2 and qwen3 reuse with their own flags.

    h = x + attn(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h))

The flags come from `ModelConfig`: q/k/v and o biases, per-head q/k RMSNorm,
tied embeddings, head_dim, RoPE scaling (default, linear, llama3, YaRN; phi3's
LongRoPE), ministral3's query temperature, gpt-oss's attention sinks, smollm3's layers
without RoPE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.config import ConfigFields, ModelConfig, read_sliding_layers
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.models.experts import feed_forward
from runtime.models.layers import (
    AnyRMSNorm,
    Attention,
    AttentionTemperature,
    CausalLM,
    RMSNorm,
    RoPE,
    kept_rows,
)

import mlx.core as mx
import mlx.nn as nn

from kernels.fused_blocks import NormedLayers

NO_ROTATION = {"rope_type": "none"}  # NoPE: the RoPE of a layer that rotates nothing


def attention(config: ModelConfig, layer: int) -> Attention:
    """Layer `layer`'s attention as the config's flags make it."""
    rotary_dims = config.extra.get("rotary_dims", config.head_dim)  # phi3's may be fewer
    rope_layers = config.extra.get("rope_layers")  # smollm3's: False for a layer without RoPE
    scaling = config.rope_scaling if rope_layers is None or rope_layers[layer] else NO_ROTATION
    rope = RoPE(rotary_dims, config.rope_theta, scaling)
    temperature = config.extra.get("attention_temperature")  # ministral3's (beta, context)
    return Attention(
        config,
        layer,
        scale=config.head_dim**-0.5 * rope.attention_factor,
        rope=rope,
        qkv_bias=config.qkv_bias,
        o_bias=config.o_bias,
        qk_norm=RMSNorm if config.qk_norm else None,
        query_scale=None if temperature is None else AttentionTemperature(*temperature),
        sinks=config.extra.get("attention_sinks", False),  # gpt-oss's
    )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = attention(config, layer)
        self.mlp = feed_forward(config, layer)  # dense, or routed experts (runtime/models/experts.py)
        # AnyRMSNorm: Gemma 1's layer (gemma.py) takes its (1 + w) norms here.
        self.input_layernorm: AnyRMSNorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm: AnyRMSNorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # Each residual block as one op where the CPU kernels allow (kernels/fused_blocks.py):
    # planned once the CPU weights are in place (runtime/cpu_weights.py), else None.
    attention_block: NormedLayers | None = None
    mlp_block: NormedLayers | None = None

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`."""
        h = self.self_attn.as_block(x, kv, self.attention_block)
        if h is None:
            h = kept_rows(x, keep) + self.self_attn(self.input_layernorm(x), kv, keep)
        else:
            h = kept_rows(h, keep)
        out = self.mlp.as_block(h, self.mlp_block)
        return out if out is not None else h + self.mlp(self.post_attention_layernorm(h))

    def plan_blocks(self) -> None:
        self.attention_block = self.self_attn.block_operands(self.input_layernorm)
        self.mlp_block = self.mlp.block_operands(self.post_attention_layernorm)


Layer = Callable[[ModelConfig, int], nn.Module]  # (config, index) -> a decoder layer


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig, layer: Layer):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [layer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Decoder(CausalLM):
    """Embedding, `layer`s, a final RMSNorm, and an output head unless it is tied: the
    frame every family's decoder shares but Gemma's (offset norms) and LFM2's (its final
    norm's name); the others pass their own layer."""

    def __init__(self, config: ModelConfig, layer: Layer = DecoderLayer):
        super().__init__(config)
        self.model = DecoderBody(config, layer)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


build = Decoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    """attention_bias puts a bias on q, k, v and o alike; `layer_types` may make some
    layers slide over the last `sliding_window` positions (mlx-lm's llama reads both)."""
    check_activation(fields)
    bias = fields.get("attention_bias", bool, False)
    return {"qkv_bias": bias, "o_bias": bias, "layer_windows": sliding_windows(fields)}


def check_activation(fields: ConfigFields) -> None:
    """These families' MLP is SiLU-gated; another `hidden_act` (transformers would run
    it) is refused rather than run as SiLU, token after token wrong."""
    activation = fields.get("hidden_act", str, "silu")
    if activation not in ("silu", "swish"):
        raise CheckpointError(f"{fields.source}: hidden_act '{activation}' is not supported")


def sliding_windows(fields: ConfigFields) -> tuple[int | None, ...]:
    """Per layer, its window where `layer_types` names sliding layers; () when none does
    (a config's `sliding_window` alone, as Mistral v0.1's, is not applied: see mistral.py).

    Without `layer_types`, Qwen2's and Qwen3's `use_sliding_window: true` makes the
    layers from `max_window_layers` on slide, as transformers derives them (mlx-lm
    ignores it; every released Qwen config says false)."""
    is_sliding = read_sliding_layers(fields)
    if is_sliding is None and fields.get("use_sliding_window", bool, False):
        first = fields.get("max_window_layers", int)
        is_sliding = [i >= first for i in range(fields.get("num_hidden_layers", int))]
    if not is_sliding or not any(is_sliding):
        return ()
    window = fields.get("sliding_window", int)
    return tuple(window if sliding else None for sliding in is_sliding)
