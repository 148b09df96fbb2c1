"""Model families, one file each, behind a registry keyed on config.json's `model_type`.

A family file gives `build(config) -> CausalLM` and `read_config(fields) -> dict`
(its own config fields, as `ModelConfig` keyword arguments); it may also give
`DEFAULTS` (values for fields its configs may leave out), `unwrap_config` (a
wrapped layout -> the text model's config, whose own family then reads it), `rename_weights` (checkpoint names
-> the model's), `ROPE_TYPES` (RoPE scalings beyond the shared ones, which its
`read_config` checks) and `ROTATES_PART_OF_A_HEAD` (it reads `partial_rotary_factor`,
which runtime/config.py refuses for the others). Adding a family means adding a file
and a line below.
"""

from __future__ import annotations

from types import ModuleType

from runtime.config import ModelConfig
from runtime.models import (
    apertus,
    cohere,
    deepseek_v2,
    deepseek_v3,
    ernie4_5,
    exaone4,
    falcon_h1,
    gemma,
    gemma2,
    gemma3,
    gemma4,
    glm4,
    glm4_moe,
    glm4_moe_lite,
    gpt_oss,
    granite,
    granitemoehybrid,
    hunyuan_v1_dense,
    internlm3,
    lfm2,
    llama,
    ministral3,
    mistral,
    mistral3,
    mixtral,
    nemotron_h,
    olmo2,
    olmo3,
    olmoe,
    phi,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    qwen_vl,
    seed_oss,
    smollm3,
    stablelm,
    starcoder2,
)
from runtime.models.layers import CausalLM

import mlx.core as mx

FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "smollm3": smollm3,
    "mistral": mistral,
    "ministral3": ministral3,
    "mistral3": mistral3,  # the multimodal layout: its text model (mistral or ministral3)
    "qwen2": qwen2,
    "qwen2_moe": qwen2_moe,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "qwen3_5_text": qwen3_5,  # hybrid: linear-attention layers keep a recurrent state
    "qwen3_5": qwen3_5,  # the multimodal layout (or a flat text config): its text model
    "qwen3_5_moe_text": qwen3_5,  # the same with routed experts
    "qwen3_5_moe": qwen3_5,
    "qwen3_next": qwen3_next,  # Qwen3.5's hybrid decoder, its checkpoints' layout regrouped at load
    # Qwen's vision-language layouts, served as their text models (qwen2, qwen3, qwen3_moe)
    "qwen2_vl": qwen_vl,
    "qwen2_vl_text": qwen_vl,
    "qwen2_5_vl": qwen_vl,
    "qwen2_5_vl_text": qwen_vl,
    "qwen3_vl": qwen_vl,
    "qwen3_vl_text": qwen_vl,
    "qwen3_vl_moe": qwen_vl,
    "qwen3_vl_moe_text": qwen_vl,
    "lfm2": lfm2,  # hybrid: short-convolution layers keep their last inputs
    "lfm2_moe": lfm2,  # the same with routed experts
    "mixtral": mixtral,
    "gpt_oss": gpt_oss,
    "deepseek_v2": deepseek_v2,  # Multi-head Latent Attention, routed and shared experts
    "deepseek_v3": deepseek_v3,  # the same layers, a sigmoid router over groups of experts
    "glm4_moe_lite": glm4_moe_lite,  # DeepSeek-V3's layout (GLM-4.7-Flash)
    "glm4_moe": glm4_moe,  # GQA, half of each head rotated, DeepSeek-V3's router (GLM-4.5, 4.6)
    "phi": phi,  # phi-2: Cohere's LayerNorm layer, side by side, biased everywhere
    "phi3": phi3,
    "starcoder2": starcoder2,  # Phi's layer, blocks in sequence, every layer sliding
    "glm4": glm4,
    "olmo2": olmo2,
    "olmo3": olmo3,
    "olmoe": olmoe,  # OLMo 2's q/k norms in llama's layer, routed experts
    "granite": granite,
    "granitemoe": granitemoehybrid,  # Granite 3 MoE: Granite 4.0's decoder, all attention, experts alone
    "granitemoehybrid": granitemoehybrid,  # Granite 4.0: all attention, or a hybrid with Mamba2 layers
    "nemotron_h": nemotron_h,  # Mamba2, attention, MLP and expert blocks, one mixer each
    "falcon_h1": falcon_h1,  # attention and Mamba2 side by side in every layer
    "internlm3": internlm3,
    "hunyuan_v1_dense": hunyuan_v1_dense,  # q/k norms after RoPE, its base raised by NTK alpha
    "cohere": cohere,
    "cohere2": cohere,  # sliding layers beside full ones without RoPE
    "exaone4": exaone4,  # OLMo 2's layer, per-head q/k norms, sliding layers beside NoPE full ones
    "ernie4_5": ernie4_5,
    "seed_oss": seed_oss,
    "apertus": apertus,
    "stablelm": stablelm,  # Cohere's LayerNorm layer, in sequence or side by side
    "gemma": gemma,
    "gemma2": gemma2,
    "gemma3_text": gemma3,
    "gemma3": gemma3,  # the multimodal layout: its text model
    "gemma4_text": gemma4,
    "gemma4": gemma4,  # the multimodal layout: its text model
}


def build_model(config: ModelConfig) -> CausalLM:
    """The (randomly initialised) model for `config`; load weights into it by name."""
    model: CausalLM = FAMILIES[config.model_type].build(config)
    return model


def rename_weights(config: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint tensor names -> the model's, for families whose layouts differ."""
    family = FAMILIES[config.model_type]
    return family.rename_weights(weights, config) if hasattr(family, "rename_weights") else weights
