"""OLMoE (`olmoe`: AllenAI OLMoE-1B-7B, 0924 and 0125, Instruct), each difference from
llama checked against transformers' `modeling_olmoe` and mlx-lm's `olmoe`:

- q and k are RMSNormed over the whole projection (all heads at once) before RoPE, as
  OLMo 2's (olmo2.py), in llama's pre-norm layer;
- every MLP is routed experts (runtime/models/experts.py): `num_experts_per_tok` of
  `num_experts`, each `intermediate_size` wide, the router's top-k probabilities divided
  by their sum where `norm_topk_prob` says (the releases: false); the experts stored as
  qwen3_moe's (`mlp.gate`, `mlp.experts.{e}.gate_proj`), stacked at load.

`clip_qkv` (null in the releases; transformers would clamp q, k and v) is refused.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models import llama, olmo2, qwen3_moe
from runtime.models.experts import Experts

# transformers' OlmoeConfig defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5, "num_experts": 8, "num_experts_per_tok": 2}
EXPERT_NAMES = qwen3_moe.EXPERT_NAMES
rename_weights = qwen3_moe.rename_weights


def read_config(fields: ConfigFields) -> dict[str, Any]:
    if fields.raw.get("clip_qkv") is not None:
        raise CheckpointError(f"{fields.source}: olmoe's clip_qkv is not supported, got {fields.raw['clip_qkv']!r}")
    experts = Experts.read(
        fields,
        num_experts=fields.get("num_experts", int),
        intermediate_size=fields.get("intermediate_size", int),
        normalize=fields.get("norm_topk_prob", bool, False),
    )
    return {**olmo2.read_config(fields), "extra": {"experts": experts}}


class OlmoeLayer(llama.DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.self_attn = olmo2.WholeProjectionNormAttention(config, layer)


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, OlmoeLayer)
