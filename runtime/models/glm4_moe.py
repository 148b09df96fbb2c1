"""GLM-4.5 (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6), each difference from llama
checked against transformers' `modeling_glm4_moe` and mlx-lm's `glm4_moe`:

- GQA attention whose RoPE rotates the first `partial_rotary_factor` (0.5) of each head
  in halves (i, i + R/2), cadence's own pairing (GLM-4's dense `glm4` pairs them
  interleaved: nothing is reordered here); q, k and v carry a bias where
  `attention_bias` says (the releases do), o none; `use_qk_norm` (GLM-4.5's, not Air's)
  norms each q and k head;
- the MLP of layers from `first_k_dense_replace` on is DeepSeek-V3's routed experts
  (deepseek_v2.py's `LatentExperts`): a sigmoid router with `e_score_correction_bias`
  for choosing, `n_group` groups of which the `topk_group` best stay eligible, the chosen
  scores divided by their sum where `norm_topk_prob` says, times `routed_scaling_factor`,
  beside `n_shared_experts` shared ones;
- the multi-token-prediction layer (`num_nextn_predict_layers`, stored past
  `num_hidden_layers`) is dropped at load, as mlx-lm does.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.models import deepseek_v2, llama
from runtime.models.deepseek_v2 import LatentExperts
from runtime.models.experts import Experts, stack_experts
from runtime.models.layers import GatedMLP, kept_rows

import mlx.core as mx

ROTATES_PART_OF_A_HEAD = True  # `partial_rotary_factor` (0.5 in the releases)
# transformers' Glm4MoeConfig defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"partial_rotary_factor": 0.5, "first_k_dense_replace": 1, "rms_norm_eps": 1e-5}
EXPERT_NAMES = deepseek_v2.EXPERT_NAMES  # stored: ours
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    for name, only in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if (value := fields.get(name, str, only)) != only:
            raise CheckpointError(f"{fields.source}: {name} '{value}' is not supported for glm4_moe (only '{only}')")
    head_dim = fields.get("head_dim", int)
    factor = fields.raw.get("partial_rotary_factor", 0.5)
    rotary_dims = int(head_dim * factor) if is_positive_number(factor) and factor <= 1 else 0
    if rotary_dims == 0 or rotary_dims % 2:
        raise CheckpointError(
            f"{fields.source}: glm4_moe's partial_rotary_factor must rotate an even number of a head's "
            f"{head_dim} dimensions, got {factor!r}"
        )
    experts = deepseek_v2.read_experts(fields)
    routing = deepseek_v2.sigmoid_routing(fields, experts)
    if experts is not None:
        deepseek_v2.check_routing(fields, experts, routing)
    return {
        "qkv_bias": fields.get("attention_bias", bool, False),
        "o_bias": False,
        "qk_norm": fields.get("use_qk_norm", bool, False),
        "extra": {"rotary_dims": rotary_dims, "experts": experts, "routing": routing},
    }


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """The multi-token-prediction layer dropped; per-expert tensors stacked."""
    for name in list(weights):
        if (match := _LAYER.match(name)) and int(match[1]) >= config.num_hidden_layers:
            del weights[name]
    experts: Experts | None = config.extra["experts"]
    if experts is not None:
        stack_experts(weights, experts, layer_prefix="model.layers.{layer}.mlp", names=EXPERT_NAMES)
    return weights


class Glm4MoeLayer(llama.DecoderLayer):
    """llama's layer (its attention on the one-op CPU block where it runs) with
    DeepSeek-V3's routed experts for the MLP of the sparse layers."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        experts: Experts | None = config.extra["experts"]
        if experts is not None and experts.sparse_layers[layer]:
            self.mlp = LatentExperts(config.hidden_size, experts, config.extra["routing"])
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        h = self.self_attn.as_block(x, kv, self.attention_block)
        if h is None:
            h = kept_rows(x, keep) + self.self_attn(self.input_layernorm(x), kv, keep)
        else:
            h = kept_rows(h, keep)
        return h + self.mlp(self.post_attention_layernorm(h))

    def plan_blocks(self) -> None:
        self.attention_block = self.self_attn.block_operands(self.input_layernorm)


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, Glm4MoeLayer)
