"""Cohere (`cohere`: Command-R, Command-R+, Aya 23 and Expanse; `cohere2`: Command R7B,
Command A), each difference from llama checked against transformers' `modeling_cohere`
and `modeling_cohere2` and mlx-lm's `cohere` and `cohere2`:

- one LayerNorm (mean subtracted, a weight and no bias) feeds attention and the MLP,
  which run side by side: `out = x + attn(norm(x)) + mlp(norm(x))`; the final norm is
  the same kind;
- RoPE rotates interleaved pairs (2i, 2i + 1): q_proj's and k_proj's rows are reordered
  at load as glm4's are (evens then odds within each head), and the per-head q/k norms'
  weights with them;
- `use_qk_norm` (Command-R+ 08-2024) LayerNorms each head of q and k before RoPE, with
  a weight per head ([heads, head_dim]);
- the head is the embedding, its logits multiplied by `logit_scale`;
- cohere2: the layers `layer_types` names sliding (without it, three in each
  `sliding_window_pattern` of 4, as transformers derives them) see their last
  `sliding_window` positions with RoPE; the full ones rotate nothing (NoPE).

Neither the LayerNorm nor the side-by-side block is what the CPU's one-op residual
blocks compute (kernels/fused_blocks.py), so its layers run by parts.
"""

from __future__ import annotations

from typing import Any

from runtime.config import (
    ConfigFields,
    ModelConfig,
    is_positive_number,
    read_sliding_layers,
    rope_fields,
)
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.models import glm4, llama
from runtime.models.experts import feed_forward
from runtime.models.layers import Attention, RoPE, kept_rows

import mlx.core as mx
import mlx.nn as nn

# transformers' CohereConfig and Cohere2Config defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"layer_norm_eps": 1e-5, "logit_scale": 0.0625}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    _, rope_scaling = rope_fields(fields)
    if rope_scaling is not None:  # mlx-lm runs none; no release has one
        raise CheckpointError(f"{fields.source}: {fields.raw['model_type']} with RoPE scaling is not supported")
    logit_scale = fields.raw.get("logit_scale")
    if not is_positive_number(logit_scale):
        raise CheckpointError(f"{fields.source}: logit_scale must be a positive number, got {logit_scale!r}")
    bias = fields.get("attention_bias", bool, False)
    windows: tuple[int | None, ...] = ()
    if fields.raw["model_type"] == "cohere2":
        is_sliding = read_sliding_layers(fields)
        if is_sliding is None:
            pattern = fields.get("sliding_window_pattern", int, 4)
            is_sliding = [(i + 1) % pattern != 0 for i in range(fields.get("num_hidden_layers", int))]
        window = fields.get("sliding_window", int, 4096)
        windows = tuple(window if sliding else None for sliding in is_sliding)
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "tie_word_embeddings": True,
        "layer_windows": windows,
        "extra": {
            "layer_norm_eps": fields.get("layer_norm_eps", float),
            "logit_scale": float(logit_scale),
            "qk_layernorm": fields.get("use_qk_norm", bool, False),
            "nope_full_layers": bool(windows),  # cohere2's full layers
        },
    }


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """q_proj's and k_proj's rows (and the q/k norms' weights along a head) from
    interleaved RoPE pairs to halves; everything else as stored."""
    D = config.head_dim
    renamed = {}
    for name, tensor in weights.items():
        layer = name.rpartition(".")[0]
        if layer.endswith((".self_attn.q_proj", ".self_attn.k_proj")):
            renamed[name] = glm4.halves_order(name, tensor, D, D)
        elif layer.endswith((".self_attn.q_norm", ".self_attn.k_norm")):
            renamed[name] = glm4.halves_order(name, tensor.T, D, D).T
        else:
            renamed[name] = tensor
    return renamed


class HeadLayerNorm(nn.Module):
    """A LayerNorm over each head's dimensions with a weight per head (no bias)."""

    def __init__(self, heads: int, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((heads, dims))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        """x [N, heads, dims]."""
        return mx.fast.layer_norm(x, None, None, self.eps) * self.weight


class CohereLayer(nn.Module):
    """Cohere's layer; StableLM's too (stablelm.py), from the config's `extra`: its
    LayerNorms with a bias, RoPE over part of each head, and unless it runs the blocks side
    by side (`use_parallel_residual`), one after the other with a second norm."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        eps, bias = config.extra["layer_norm_eps"], config.extra.get("layer_norm_bias", False)
        is_nope = config.extra.get("nope_full_layers", False) and config.window_of(layer) is None
        rotary_dims = config.extra.get("rotary_dims", config.head_dim)
        rope = RoPE(rotary_dims, config.rope_theta, llama.NO_ROTATION if is_nope else None)
        self.self_attn = Attention(
            config, layer, scale=config.head_dim**-0.5, rope=rope, qkv_bias=config.qkv_bias, o_bias=config.o_bias
        )
        if config.extra.get("qk_layernorm", False):
            self.self_attn.q_norm = HeadLayerNorm(config.num_attention_heads, config.head_dim, eps)
            self.self_attn.k_norm = HeadLayerNorm(config.num_key_value_heads, config.head_dim, eps)
        self.mlp = feed_forward(config, layer)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps, bias=bias)
        if not config.extra.get("parallel_block", True):
            self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps, bias=bias)

    # No `plan_blocks`: the one-op blocks RMSNorm their input and add one branch.

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`."""
        normed = self.input_layernorm(x)
        h = kept_rows(x, keep) + self.self_attn(normed, kv, keep)
        if "post_attention_layernorm" in self:  # one block after the other
            return h + self.mlp(self.post_attention_layernorm(h))
        return h + self.mlp(kept_rows(normed, keep))


class LayerNormDecoder(llama.Decoder):
    """llama's frame with `CohereLayer`s and a final LayerNorm of the same kind."""

    def __init__(self, config: ModelConfig, layer: llama.Layer = CohereLayer):
        super().__init__(config, layer)
        bias = config.extra.get("layer_norm_bias", False)
        self.model.norm = nn.LayerNorm(config.hidden_size, eps=config.extra["layer_norm_eps"], bias=bias)


class Cohere(LayerNormDecoder):
    def project(self, h: mx.array) -> mx.array:
        return super().project(h) * self.config.extra["logit_scale"]


build = Cohere
