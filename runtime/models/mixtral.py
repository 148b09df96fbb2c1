"""Mixtral (`mixtral`: Mixtral 8x7B and 8x22B): Mistral's decoder with routed experts
for every layer's MLP (runtime/models/experts.py), `num_local_experts` of
`intermediate_size`, `num_experts_per_tok` a token, their weights renormalised over
the chosen (a softmax over the chosen experts' logits, as transformers and mlx-lm).

Hugging Face stores the block as `block_sparse_moe`, each expert as `w1` (gate),
`w3` (up) and `w2` (down); mlx-community's conversions store them stacked as
`block_sparse_moe.switch_mlp.{gate,up,down}_proj`. Both load: the block is renamed
to `mlp` and the experts stacked. Its `sliding_window` is not applied, as Mistral's.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.models import llama
from runtime.models.experts import Experts, stack_experts

import mlx.core as mx

build = llama.Decoder
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # stored: ours


def read_config(fields: ConfigFields) -> dict[str, Any]:
    experts = Experts.read(
        fields,
        num_experts=fields.get("num_local_experts", int),
        intermediate_size=fields.get("intermediate_size", int),
        normalize=True,
    )
    return {**llama.read_config(fields), "extra": {"experts": experts}}


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    # Stacked under the stored names first, so that an error names a tensor of the file.
    stack_experts(
        weights,
        config.extra["experts"],
        layer_prefix="model.layers.{layer}.block_sparse_moe",
        names=EXPERT_NAMES,
    )
    return {name.replace(".block_sparse_moe.", ".mlp."): w for name, w in weights.items()}
