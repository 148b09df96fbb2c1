"""StarCoder2 (`starcoder2`: bigcode StarCoder2 3B, 7B, 15B and their Instruct), each
difference from llama checked against transformers' `modeling_starcoder2` and mlx-lm's
`starcoder2`; its layer is Phi's (phi.py), blocks in sequence:

- LayerNorms with a weight and a bias (`norm_epsilon`) before attention, before the MLP
  and at the end;
- q, k, v and o biased (`use_bias`), and the MLP ungated and biased:
  `c_proj(gelu_tanh(c_fc(x)))` (`hidden_act` gelu_pytorch_tanh, as transformers runs it;
  mlx-lm runs exact GELU), `c_fc` and `c_proj` read as Phi's `fc1` and `fc2`;
- every layer slides over the last `sliding_window` positions (4,096) where that is
  shorter than the context, as transformers runs it (mlx-lm runs every layer full: the
  two agree below the window).

Its layers run by parts on the CPU (the one-op blocks RMSNorm their input).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, rope_fields
from runtime.errors import CheckpointError
from runtime.models import cohere, phi

import mlx.core as mx

# transformers' Starcoder2Config defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"norm_epsilon": 1e-5, "hidden_act": "gelu_pytorch_tanh", "use_bias": True}
STORED_NAMES = {".mlp.c_fc.": ".mlp.fc1.", ".mlp.c_proj.": ".mlp.fc2."}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    activation = fields.get("hidden_act", str)
    if activation not in ("gelu_pytorch_tanh", "gelu_new"):
        raise CheckpointError(f"{fields.source}: starcoder2 hidden_act '{activation}' is not supported")
    if rope_fields(fields)[1] is not None:  # mlx-lm applies none; no release has one
        raise CheckpointError(f"{fields.source}: starcoder2 with RoPE scaling is not supported")
    bias = fields.get("use_bias", bool)
    if not bias:  # the MLP's biases are built in (every release has them)
        raise CheckpointError(f"{fields.source}: starcoder2's use_bias=false is not supported")
    context = fields.get("max_position_embeddings", int, 4096)
    window = fields.get("sliding_window", int, None)
    num_layers = fields.get("num_hidden_layers", int)
    return {
        "qkv_bias": True,
        "o_bias": True,
        "layer_windows": (window,) * num_layers if window is not None and window < context else (),
        "extra": {"layer_norm_eps": fields.get("norm_epsilon", float), "layer_norm_bias": True, "parallel_block": False},
    }


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    return phi.renamed(weights, STORED_NAMES)


def build(config: ModelConfig) -> cohere.LayerNormDecoder:
    return cohere.LayerNormDecoder(config, phi.PhiLayer)
