"""Granite (`granite`: IBM Granite 3.0 to 3.3 dense): llama's decoder with four
multipliers, each checked against transformers' `modeling_granite` and mlx-lm's `granite`:

- the embedding is multiplied by `embedding_multiplier` (12 in the releases);
- attention scores are scaled by `attention_multiplier`, not head_dim**-0.5;
- each block's output is multiplied by `residual_multiplier` before the residual add;
- logits are divided by `logits_scaling`.

The one-op residual blocks on the CPU (kernels/fused_blocks.py) add the branch as it
is, so a Granite layer runs its blocks by parts.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.models import llama
from runtime.models.layers import kept_rows

import mlx.core as mx

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def read_config(fields: ConfigFields) -> dict[str, Any]:
    """llama's fields, and the four multipliers."""
    own = llama.read_config(fields)
    return {**own, "extra": {**own.get("extra", {}), **read_multipliers(fields)}}


def read_multipliers(fields: ConfigFields) -> dict[str, float]:
    """The four multipliers (1, transformers' default, where left out); Granite 4.0's too."""
    multipliers = {}
    for name in MULTIPLIERS:
        value = fields.raw.get(name, 1.0)
        if not is_positive_number(value):
            raise CheckpointError(f"{fields.source}: granite's {name} must be a positive number, got {value!r}")
        multipliers[name] = float(value)
    return multipliers


class GraniteLayer(llama.DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.self_attn.scale = config.extra["attention_multiplier"] * self.self_attn.rope.attention_factor
        self.residual_multiplier = config.extra["residual_multiplier"]

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`."""
        m = self.residual_multiplier
        h = kept_rows(x, keep) + self.self_attn(self.input_layernorm(x), kv, keep) * m
        return h + self.mlp(self.post_attention_layernorm(h)) * m

    def plan_blocks(self) -> None:
        """None: the one-op blocks would add the branch without its multiplier."""


class Granite(llama.Decoder):
    """The multipliers around the layers: Granite 3's, or Granite 4.0's (granitemoehybrid.py)."""

    def __init__(self, config: ModelConfig, layer: llama.Layer = GraniteLayer):
        super().__init__(config, layer)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens) * self.config.extra["embedding_multiplier"]

    def project(self, h: mx.array) -> mx.array:
        return super().project(h) / self.config.extra["logits_scaling"]


build = Granite
