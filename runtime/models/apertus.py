"""Apertus (`apertus`: swiss-ai Apertus 8B and 70B, Base and Instruct), each difference
from llama checked against transformers' `modeling_apertus` and mlx-lm's `apertus`:

- the MLP is not gated: `down(xielu(up(x)))`, xIELU with four learned scalars per layer
  (`act_fn.alpha_p`, `alpha_n`, `beta`, `eps`; alpha_p and alpha_n stored as [1], read as
  scalars as mlx-lm does):
  x > 0: softplus(alpha_p) x² + beta x;  else (expm1(min(x, eps)) - x)(beta + softplus(alpha_n)) + beta x;
- q and k RMSNormed per head (as Qwen3's) before RoPE (the releases' llama3 scaling);
- the two norms are named `attention_layernorm` and `feedforward_layernorm`, read as
  llama's `input_layernorm` and `post_attention_layernorm`.

The attention block takes the CPU's one-op residual block; the MLP's is not gated, so it
runs by parts.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models import llama, phi

import mlx.core as mx
import mlx.nn as nn

NORM_NAMES = {
    ".attention_layernorm.": ".input_layernorm.",
    ".feedforward_layernorm.": ".post_attention_layernorm.",
}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    activation = fields.get("hidden_act", str, "xielu")
    if activation != "xielu":
        raise CheckpointError(f"{fields.source}: apertus hidden_act '{activation}' is not supported")
    if not fields.get("qk_norm", bool, True):
        raise CheckpointError(f"{fields.source}: apertus with qk_norm=false is not supported")
    bias = fields.get("attention_bias", bool, False)
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """The norms under llama's names; each xIELU scalar as a scalar."""
    renamed = phi.renamed(weights, NORM_NAMES)
    for name, tensor in renamed.items():
        if ".mlp.act_fn." in name:
            if tensor.size != 1:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected one value")
            renamed[name] = tensor.reshape(())
    return renamed


class XIELU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Overwritten at load; these are the values an untrained layer starts from.
        self.alpha_p = mx.array(0.2034)  # softplus^-1(0.8)
        self.alpha_n = mx.array(-1.0502)  # softplus^-1(0.8 - beta)
        self.beta = mx.array(0.5)
        self.eps = mx.array(-1e-6)

    def __call__(self, x: mx.array) -> mx.array:
        alpha_p = nn.softplus(self.alpha_p)
        alpha_n = self.beta + nn.softplus(self.alpha_n)
        negative = (mx.expm1(mx.minimum(x, self.eps)) - x) * alpha_n
        return mx.where(x > 0, alpha_p * mx.square(x), negative) + self.beta * x


class XIELUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = XIELU()

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act_fn(self.up_proj(x)))

    def block_operands(self, norm: Any, post_norm: Any = None) -> None:
        """None: the one-op MLP block is a gated one."""
        return None

    def as_block(self, h: mx.array, block: None) -> None:
        return None


class ApertusLayer(llama.DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.mlp = XIELUMLP(config.hidden_size, config.intermediate_size)


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, ApertusLayer)
