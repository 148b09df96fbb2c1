"""Phi (`phi`: Microsoft phi-2, phi-1.5, phi-1), each difference from llama checked against
transformers' `modeling_phi` and mlx-lm's `phi`; its layer is Cohere's (cohere.py) with
these settings:

- attention and the MLP side by side off one LayerNorm (a weight and a bias), a final
  LayerNorm (`final_layernorm`) of the same kind;
- RoPE (in halves) over the first `partial_rotary_factor` (0.4) of each head;
- every projection biased: q, k, v, the attention's output (`dense`, read as o_proj), the
  MLP's `fc1` and `fc2`, and the untied head;
- the MLP is not gated: `fc2(gelu_tanh(fc1(x)))` (`hidden_act` gelu_new).

`qk_layernorm` (no release sets it; mlx-lm has none) is refused. Its layers run by parts on
the CPU (the one-op blocks RMSNorm their input).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models import cohere, stablelm

import mlx.core as mx
import mlx.nn as nn

ROTATES_PART_OF_A_HEAD = True
# transformers' PhiConfig defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"layer_norm_eps": 1e-5, "partial_rotary_factor": 0.5, "hidden_act": "gelu_new"}
STORED_NAMES = {".self_attn.dense.": ".self_attn.o_proj.", "model.final_layernorm.": "model.norm."}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    activation = fields.get("hidden_act", str)
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{fields.source}: phi hidden_act '{activation}' is not supported")
    if fields.get("qk_layernorm", bool, False):
        raise CheckpointError(f"{fields.source}: phi's qk_layernorm=true is not supported")
    return {
        "qkv_bias": True,
        "o_bias": True,
        "tie_word_embeddings": False,
        "extra": {
            "layer_norm_eps": fields.get("layer_norm_eps", float),
            "layer_norm_bias": True,
            "rotary_dims": stablelm.partial_rotary_dims(fields),
        },
    }


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    return renamed(weights, STORED_NAMES)


def renamed(weights: dict[str, mx.array], names: dict[str, str]) -> dict[str, mx.array]:
    """`weights` with each stored part of a name (`names`' keys) read as ours."""
    out = {}
    for name, tensor in weights.items():
        for stored, ours in names.items():
            name = name.replace(stored, ours)
        out[name] = tensor
    return out


class PhiMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.gelu_approx(self.fc1(x)))  # the tanh form: gelu_new


class PhiLayer(cohere.CohereLayer):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.mlp = PhiMLP(config.hidden_size, config.intermediate_size)


class Phi(cohere.LayerNormDecoder):
    def __init__(self, config: ModelConfig):
        super().__init__(config, PhiLayer)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)


build = Phi
