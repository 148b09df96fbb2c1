"""Qwen3-Next (`qwen3_next`: Qwen3-Next-80B-A3B Instruct and Thinking): Qwen3.5's hybrid
decoder (runtime/models/qwen3_5.py: Gated DeltaNet layers, every
`full_attention_interval`-th layer gated full attention), as mlx-lm's `qwen3_next` runs it.

Its differences are in the checkpoint and the config, so it is built as Qwen3.5's model:

- each Gated DeltaNet layer stores one `in_proj_qkvz` and one `in_proj_ba`, their rows
  grouped per key head (for key head h: its q, its k, then the v and z of its Hv / Hk
  value heads; b then a likewise); they are regrouped at load into Qwen3.5's
  `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` (rows only, so a quantized
  weight's scales and biases move with them);
- the MLPs are qwen3_moe's rule (runtime/models/experts.py): routed experts beside a
  gated shared expert where `mlp_only_layers` and `decoder_sparse_step` make a layer
  sparse, else the dense MLP of `intermediate_size`; `norm_topk_prob` defaults to false;
- Hugging Face's originals store each expert apart (`mlp.experts.{e}.gate_proj.weight`),
  the conv weights [C, 1, K] and the decoder norms as offsets from 1 (zero-centred);
  mlx-lm's conversions store the experts stacked, [C, K, 1] and the scales. mlx-lm tells
  them apart by the per-expert names, Qwen3.5 by the conv weights' shape; for either
  form both say the same, and the conv weights' shape is read.

The multi-token-prediction head (`mtp.`) is dropped.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.models import qwen3_5, qwen3_moe
from runtime.models.experts import Experts

import mlx.core as mx

ROTATES_PART_OF_A_HEAD = True  # `partial_rotary_factor` (0.25 in the releases)
EXPERT_NAMES = qwen3_moe.EXPERT_NAMES  # stored: ours
build = qwen3_5.build


def read_config(fields: ConfigFields) -> dict[str, Any]:
    return qwen3_5.read_hybrid(fields, _experts(fields))


def _experts(fields: ConfigFields) -> Experts | None:
    """qwen3_moe's experts with a shared expert, or None where `num_experts` is 0 (every
    MLP dense, as mlx-lm builds it)."""
    if fields.raw.get("num_experts", 0) == 0:
        return None
    shared = fields.get("shared_expert_intermediate_size", int)
    return qwen3_moe.read_experts(fields, shared_intermediate_size=shared)


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    weights = {name: w for name, w in weights.items() if not name.startswith("mtp.")}
    if config.tie_word_embeddings:  # mlx-lm drops a stored head the config says is tied
        weights.pop("lm_head.weight", None)
    if config.extra["experts"] is not None:
        qwen3_moe.rename_weights(weights, config)
    lin = config.extra["linear"]
    for name in [n for n in weights if ".linear_attn.in_proj_qkvz." in n or ".linear_attn.in_proj_ba." in n]:
        _regroup(weights, name, lin)
    return qwen3_5.from_original(weights)


def _regroup(weights: dict[str, mx.array], name: str, lin: dict[str, int]) -> None:
    """One fused projection's tensor (weight, scales or biases: rows are its outputs),
    grouped per key head, -> Qwen3.5's projections, in place."""
    prefix, fused, suffix = name.rsplit(".", 2)
    Hk, Dk, Dv = lin["num_key_heads"], lin["key_head_dim"], lin["value_head_dim"]
    per_key = lin["num_value_heads"] // Hk  # value heads each key head serves, adjacent
    w = weights.pop(name)
    # Each key head's rows, by part: (name, rows), in their stored order.
    parts = (
        [("q", Dk), ("k", Dk), ("v", per_key * Dv), ("z", per_key * Dv)]
        if fused == "in_proj_qkvz"
        else [("b", per_key), ("a", per_key)]
    )
    bounds = [sum(rows for _, rows in parts[:i]) for i in range(1, len(parts))]
    split = mx.split(w.reshape(Hk, -1, w.shape[-1]), bounds, axis=1)
    by_part = {part: rows.reshape(-1, w.shape[-1]) for (part, _), rows in zip(parts, split, strict=True)}
    if fused == "in_proj_qkvz":
        weights[f"{prefix}.in_proj_qkv.{suffix}"] = mx.concatenate([by_part["q"], by_part["k"], by_part["v"]])
        weights[f"{prefix}.in_proj_z.{suffix}"] = by_part["z"]
    else:
        weights[f"{prefix}.in_proj_b.{suffix}"] = by_part["b"]
        weights[f"{prefix}.in_proj_a.{suffix}"] = by_part["a"]
