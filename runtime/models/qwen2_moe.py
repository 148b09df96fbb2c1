"""Qwen2-MoE (`qwen2_moe`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention
(q/k/v biases) with routed experts (runtime/models/experts.py) beside a shared expert.

Each sparse layer routes a token to `num_experts_per_tok` of `num_experts` experts of
`moe_intermediate_size`, and adds a dense SwiGLU of `shared_expert_intermediate_size`
that every token runs, scaled by sigmoid(`shared_expert_gate`(x)). The router's top-k
probabilities are renormalised only where `norm_topk_prob` says so (the released
configs say false). `mlp_only_layers` and `decoder_sparse_step` pick dense layers as
in qwen3_moe.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields
from runtime.models import llama, qwen2, qwen3_moe

build = llama.Decoder
EXPERT_NAMES = qwen3_moe.EXPERT_NAMES  # stored: ours


def read_config(fields: ConfigFields) -> dict[str, Any]:
    shared = fields.get("shared_expert_intermediate_size", int)
    experts = qwen3_moe.read_experts(fields, shared_intermediate_size=shared)
    return {**qwen2.read_config(fields), "extra": {"experts": experts}}


rename_weights = qwen3_moe.rename_weights  # the same per-expert names, stacked the same way
