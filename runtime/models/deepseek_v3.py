"""DeepSeek-V3's layout (`deepseek_v3`: Moonlight-16B-A3B, DeepSeek-V3 and R1, and the
small models built on it): DeepSeek-V2's MLA and layers (deepseek_v2.py) with V3's router,
checked against transformers' `modeling_deepseek_v3` and mlx-lm's `deepseek_v3`.

The router ("noaux_tc", the one topk_method V3 has): sigmoid scores; a per-expert
`e_score_correction_bias` added for choosing only; with `n_group` groups, each group scored
by its two best (biased) scores and all but the best `topk_group` zeroed; the top
`num_experts_per_tok` chosen; their unbiased scores divided by their sum where
`norm_topk_prob` says (the releases do), then times `routed_scaling_factor`.

Weights load as Hugging Face stores them (each expert apart) and as mlx-lm's conversions
do: the experts stacked, and, from mlx-lm 0.30 on, kv_b_proj split per head into
`embed_q` (the key part, transposed) and `unembed_out` (the value part); those are put
back together at load (dequantized where packed: kv_b_proj then runs in float, a layer
of kv_lora_rank inputs). Multi-token-prediction layers (past `num_hidden_layers`) are
dropped, as mlx-lm does. DeepSeek's FP8 originals (`weight_scale_inv` beside each
weight) are refused: use a bf16 or MLX-quantized conversion.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models import deepseek_v2, llama
from runtime.models.deepseek_v2 import LatentShape

import mlx.core as mx

build = deepseek_v2.build
EXPERT_NAMES = deepseek_v2.EXPERT_NAMES  # stored: ours
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    for name, only in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if (value := fields.get(name, str, only)) != only:
            raise CheckpointError(f"{fields.source}: {name} '{value}' is not supported for deepseek_v3 (only '{only}')")
    experts = deepseek_v2.read_experts(fields)
    return deepseek_v2.read_latent_config(fields, experts, deepseek_v2.sigmoid_routing(fields, experts))


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    fp8 = next((name for name in weights if name.endswith("weight_scale_inv")), None)
    if fp8 is not None:
        raise CheckpointError(
            f"tensor {fp8!r}: FP8 weights are not supported; use a bf16 or MLX-quantized conversion"
        )
    for name in list(weights):  # multi-token prediction
        if (match := _LAYER.match(name)) and int(match[1]) >= config.num_hidden_layers:
            del weights[name]
    for name in [n for n in weights if n.endswith(".self_attn.embed_q.weight")]:
        attention = name.removesuffix(".embed_q.weight")
        weights[f"{attention}.kv_b_proj.weight"] = _joined_kv_b(weights, attention, config)
    return deepseek_v2.rename_weights(weights, config)


def _joined_kv_b(weights: dict[str, mx.array], attention: str, config: ModelConfig) -> mx.array:
    """mlx-lm's embed_q [H, kv_lora_rank, nope] and unembed_out [H, v, kv_lora_rank] (both
    removed) as kv_b_proj's weight [H * (nope + v), kv_lora_rank], in float."""
    mla: LatentShape = config.extra["mla"]
    key = _dequantized(weights, f"{attention}.embed_q", mla.nope_dims, config)
    value = _dequantized(weights, f"{attention}.unembed_out", mla.kv_lora_rank, config)
    H = config.num_attention_heads
    if key.shape != (H, mla.kv_lora_rank, mla.nope_dims) or value.shape != (H, mla.value_dims, mla.kv_lora_rank):
        raise CheckpointError(
            f"tensors '{attention}.embed_q' and '.unembed_out' have shapes {tuple(key.shape)} and "
            f"{tuple(value.shape)}, expected {(H, mla.kv_lora_rank, mla.nope_dims)} and {(H, mla.value_dims, mla.kv_lora_rank)}"
        )
    return mx.concatenate([key.swapaxes(1, 2), value], axis=1).reshape(-1, mla.kv_lora_rank)


def _dequantized(weights: dict[str, mx.array], layer: str, num_inputs: int, config: ModelConfig) -> mx.array:
    """`layer`'s weight (removed from `weights` with its scales and biases), unpacked where
    it is stored packed: bits and group size from the shapes, as they were packed."""
    weight = weights.pop(f"{layer}.weight", None)
    if weight is None:
        raise CheckpointError(f"missing tensor '{layer}.weight'")
    scales, biases = weights.pop(f"{layer}.scales", None), weights.pop(f"{layer}.biases", None)
    if scales is None:
        return weight
    quantization = config.quantization
    mode = quantization.mode if quantization is not None else "affine"
    if quantization is not None and layer in quantization.per_layer:
        mode = quantization.per_layer[layer][2]
    groups = scales.shape[-1] if scales.ndim else 0
    if not groups or num_inputs % groups or (weight.shape[-1] * 32) % num_inputs:
        raise CheckpointError(f"tensor '{layer}.weight' is not {num_inputs} inputs packed in groups")
    bits, group_size = weight.shape[-1] * 32 // num_inputs, num_inputs // groups
    try:
        return mx.dequantize(weight, scales, biases, group_size, bits, mode=mode)
    except ValueError as error:
        raise CheckpointError(f"tensor '{layer}.weight': {str(error).splitlines()[0]}") from None
