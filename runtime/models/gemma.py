"""Gemma 1 (`gemma`: Gemma 2B and 7B, CodeGemma): llama's two-norm pre-norm layer with
Gemma's pieces (gemma3.py), each checked against transformers' `modeling_gemma`:

- RMSNorm multiplies by (1 + w);
- the MLP is GELU with the tanh approximation: transformers reads the releases'
  legacy `hidden_act: "gelu"` as the tanh form (mlx-lm runs exact GELU there);
- the embedding is scaled by sqrt(hidden_size) rounded to bfloat16 (the releases'
  dtype, to which transformers rounds it), as Gemma 3's;
- embeddings are always tied; head_dim defaults to 256 (the 7B's 16 heads of 256
  are wider than hidden_size / heads).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models import gemma3, llama
from runtime.models.layers import CausalLM, GatedMLP, OffsetRMSNorm

import mlx.nn as nn

# transformers' GemmaConfig defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"head_dim": 256}

# What transformers runs for each name: the legacy "gelu" is the tanh form too.
TANH_GELU_NAMES = ("gelu", "gelu_pytorch_tanh", "gelu_tanh")


def read_config(fields: ConfigFields) -> dict[str, Any]:
    # Older transformers ran `hidden_activation` where set (exact GELU for "gelu"); 5
    # reads `hidden_act` alone. The releases set both to the tanh form or leave it out.
    activation = fields.get("hidden_activation", str, None)
    if activation == "gelu":
        raise CheckpointError(f"{fields.source}: gemma hidden_activation 'gelu' (exact GELU) is not supported")
    activation = activation or fields.get("hidden_act", str, "gelu_pytorch_tanh")
    if activation not in TANH_GELU_NAMES:
        raise CheckpointError(f"{fields.source}: gemma hidden_activation '{activation}' is not supported")
    if fields.get("attention_bias", bool, False):
        raise CheckpointError(f"{fields.source}: gemma with attention_bias is not supported")
    if fields.raw.get("use_bidirectional_attention"):
        raise CheckpointError(f"{fields.source}: gemma with bidirectional attention is not supported")
    return {"tie_word_embeddings": True}


class GemmaLayer(llama.DecoderLayer):
    """llama's layer (its attention, residual blocks and fused CPU blocks, which take
    the (1 + w) norms' weights and the GELU by name) with Gemma's norms and MLP."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, activation="gelu_tanh")
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [GemmaLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = GemmaBody(config)

    embed = gemma3.Gemma3.embed  # scaled by sqrt(hidden_size) rounded to bfloat16


build = Gemma
