"""Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B):
Qwen3's decoder with routed experts for its MLPs (runtime/models/experts.py).

Layer i routes among `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok`
a token, unless `mlp_only_layers` lists it or (i + 1) is not a multiple of
`decoder_sparse_step`; those run the dense MLP of `intermediate_size`. The router's
top-k probabilities are divided by their sum when `norm_topk_prob` says so (the
released checkpoints do), as transformers and mlx-lm run them.

Hugging Face stores each expert's projections (`mlp.experts.{e}.gate_proj.weight`);
they are stacked at load into `mlp.switch_mlp`, the layout mlx-community's quantized
conversions already store.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models import llama, qwen3
from runtime.models.experts import Experts, stack_experts

import mlx.core as mx

build = llama.Decoder
EXPERT_NAMES = {name: name for name in ("gate_proj", "up_proj", "down_proj")}  # stored: ours


def read_config(fields: ConfigFields) -> dict[str, Any]:
    return {**qwen3.read_config(fields), "extra": {"experts": read_experts(fields)}}


def read_experts(fields: ConfigFields, shared_intermediate_size: int | None = None) -> Experts:
    """The Qwen MoE configs' expert fields (qwen2_moe's add a shared expert's size)."""
    return Experts.read(
        fields,
        num_experts=fields.get("num_experts", int),
        intermediate_size=fields.get("moe_intermediate_size", int),
        normalize=fields.get("norm_topk_prob", bool, False),
        dense_layers=dense_layers(fields),
        sparse_step=fields.get("decoder_sparse_step", int, 1),
        shared_intermediate_size=shared_intermediate_size,
    )


def dense_layers(fields: ConfigFields) -> list[int]:
    """`mlp_only_layers`: layer numbers, each in the model."""
    num_layers = fields.get("num_hidden_layers", int)
    listed = fields.get("mlp_only_layers", list, [])
    if not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in listed
    ):
        raise CheckpointError(
            f"{fields.source}: mlp_only_layers must list layer numbers in 0..{num_layers - 1}, got {listed!r}"
        )
    return listed


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    stack_experts(
        weights,
        config.extra["experts"],
        layer_prefix="model.layers.{layer}.mlp",
        names=EXPERT_NAMES,
    )
    return weights
