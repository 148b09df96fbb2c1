"""config.json's family-specific fields from a GGUF's `{arch}.*` metadata (runtime/gguf.py
reads the shared ones): what each architecture's converter writes, and what llama.cpp
hard-codes for it where the file is silent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.config import MAX_INT_FIELD
from runtime.errors import CheckpointError
from runtime.gguf_reader import Metadata
from runtime.gguf_rope import ministral3_scaling

import numpy as np


def add_family_fields(
    config: dict[str, Any],
    metadata: Metadata,
    key: Callable[[str], str],
    tensors: dict[str, Any],
    *,
    has_experts: bool,
) -> None:
    """`config` (the shared fields, for `config["model_type"]`) completed in place."""
    model_type = config["model_type"]
    if model_type == "gemma3_text":
        config.update(_gemma3_fields(metadata, key, config))
    if model_type == "gemma2":
        config.update(_gemma2_fields(metadata, key, config))
    if model_type == "phi3":
        config.update(_phi3_fields(metadata, key, config))
    if model_type == "ministral3":
        config["rope_scaling"] = ministral3_scaling(metadata, key, config)
    if model_type == "gemma4_text":  # its RoPE settings are per kind of layer
        config.update(_gemma4_fields(metadata, key, config, tensors))
        del config["rope_theta"]
    elif has_experts or metadata.get(key("expert_count")) not in (None, 0):
        config.update(_expert_fields(metadata, key, model_type, has_experts))
    if model_type == "gpt_oss":
        config.update(_gpt_oss_fields(metadata, key, config))


def _gpt_oss_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """What gpt-oss's config.json says and llama.cpp hard-codes: biased attention, every
    other layer sliding from the first (its swa pattern of 2), the SwiGLU clamp at 7;
    YaRN untruncated, as the model was trained (llama.cpp rounds the ramp's bounds,
    as mlx-lm does: see tests/runtime/test_gpt_oss.py)."""
    scaling = config["rope_scaling"]
    return {
        "attention_bias": True,
        "sliding_window": metadata.require(key("attention.sliding_window"), int),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(config["num_hidden_layers"])
        ],
        "swiglu_limit": 7.0,
        "rope_scaling": None if scaling is None else {**scaling, "truncate": False},
    }


def _expert_fields(metadata: Metadata, key: Callable[[str], str], model_type: str, has_experts: bool) -> dict[str, Any]:
    """Routed experts in every layer, as llama.cpp runs them: renormalised over the chosen
    for qwen3moe and Mixtral (which its converter writes as `llama`), raw probabilities
    beside a shared expert for qwen2moe."""
    if not has_experts and model_type != "llama":
        raise CheckpointError(f"{metadata.source}: routed experts are not supported for this architecture")
    num_experts = metadata.require(key("expert_count"), int)
    top_k = metadata.require(key("expert_used_count"), int)
    if model_type == "gpt_oss":
        return {
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
            "intermediate_size": metadata.require(key("expert_feed_forward_length"), int),
        }
    if model_type == "llama":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
        }
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": metadata.require(key("expert_feed_forward_length"), int),
        "norm_topk_prob": model_type == "qwen3_moe",  # llama.cpp's qwen2moe: raw probabilities
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if model_type == "qwen2_moe":
        shared = metadata.require(key("expert_shared_feed_forward_length"), int)
        fields["shared_expert_intermediate_size"] = shared
    return fields


def _phi3_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """Phi-3's window, its pre-LongRoPE context, and how much of a head RoPE rotates
    (Phi-4-mini's 0.75)."""
    rotated = metadata.optional(key("rope.dimension_count"), int, config["head_dim"])
    window_key = key("attention.sliding_window")
    # llama.cpp's converter writes 0 for Phi-4, whose config.json's window is null.
    no_window = metadata.get(window_key) == 0
    fields: dict[str, Any] = {
        "sliding_window": None if no_window else metadata.optional(window_key, int),
        # Half a dimension over, so int(head_dim * factor), as the family reads it, gives
        # `rotated` back: 30 / 44 * 44 is 29.999... in floating point.
        "partial_rotary_factor": (rotated + 0.5) / config["head_dim"],
    }
    original = metadata.optional(key("rope.scaling.original_context_length"), int)
    if original is not None:
        fields["original_max_position_embeddings"] = original
    return fields


def _gemma3_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """What Gemma 3's config.json says and its GGUF leaves to llama.cpp's code: the local
    RoPE base (10,000), one global layer in six, and the attention scale (head_dim, but
    hidden/heads for the 62-layer 27B), as llama.cpp hard-codes them, unless the file
    states them (newer converters write a per-layer sliding pattern and the local base);
    no sliding layer where the file has no window."""
    is_27b = config["num_hidden_layers"] == 62
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window_pattern": 6,
        "rope_local_base_freq": metadata.optional(key("rope.freq_base_swa"), float, 10000.0),
        "query_pre_attn_scalar": (
            config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
        ),
        # Written where config.json sets one (Rnj-1, a Gemma 3 of EssentialAI's).
        "final_logit_softcapping": metadata.optional(key("final_logit_softcapping"), float),
        "attn_logit_softcapping": None,
    }
    if key("attention.sliding_window") not in metadata:
        # Left out by the converter where every layer is global (config.json's
        # sliding_window_pattern 1: Rnj-1); llama.cpp then slides in no layer.
        return {**fields, "layer_types": ["full_attention"] * config["num_hidden_layers"]}
    fields["sliding_window"] = metadata.require(key("attention.sliding_window"), int)
    pattern = metadata.get(key("attention.sliding_window_pattern"))
    if isinstance(pattern, list) and len(pattern) == config["num_hidden_layers"]:
        if not all(isinstance(is_sliding, bool) for is_sliding in pattern):
            raise CheckpointError(
                f"{metadata.source}: GGUF metadata '{key('attention.sliding_window_pattern')}' "
                "should be a list of booleans, one per layer"
            )
        fields["layer_types"] = [
            "sliding_attention" if is_sliding else "full_attention" for is_sliding in pattern
        ]
    return fields


def _gemma4_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any], tensors: dict[str, Any]
) -> dict[str, Any]:
    """Gemma 4's config.json fields, as llama.cpp's converter writes them: the per-layer
    sliding pattern, head widths and KV head counts per kind of layer, a RoPE base per
    kind, how much of a full layer's head rotates (its `rope_freqs`: 1 for a rotated pair,
    1e30 for the rest), the shared-KV layers, the MLP widths (doubled from the first
    shared layer where `use_double_wide_mlp`), per-layer inputs and routed experts; what
    it writes no key for is read from the tensors (experts from `ffn_gate_inp`, keys as
    values from a full layer with no `attn_v`)."""
    source = metadata.source
    num_layers = config["num_hidden_layers"]
    pattern = metadata.require(key("attention.sliding_window_pattern"), list)
    if len(pattern) != num_layers or not all(isinstance(p, bool) for p in pattern):
        raise CheckpointError(
            f"{source}: GGUF metadata '{key('attention.sliding_window_pattern')}' should be a list of "
            f"{num_layers} booleans"
        )
    full = [i for i, sliding in enumerate(pattern) if not sliding]
    sliding_layers = [i for i, sliding in enumerate(pattern) if sliding]
    kv_heads = _per_layer(metadata, key("attention.head_count_kv"), num_layers)
    by_kind = {kind: {kv_heads[i] for i in layers} for kind, layers in (("full", full), ("sliding", sliding_layers))}
    if any(len(counts) > 1 for counts in by_kind.values()):
        raise CheckpointError(f"{source}: layers of one kind differ in KV head count: {kv_heads}")
    head_dim = metadata.require(key("attention.key_length_swa"), int)
    global_head_dim = metadata.require(key("attention.key_length"), int)
    if metadata.optional(key("rope.dimension_count_swa"), int, head_dim) != head_dim:
        raise CheckpointError(f"{source}: gemma4 sliding layers rotating part of their heads are not supported")
    keys_are_values = bool(full) and f"blk.{full[0]}.attn_v.weight" not in tensors
    sliding_kv = by_kind["sliding"].pop() if by_kind["sliding"] else config["num_key_value_heads"]
    full_kv = by_kind["full"].pop() if by_kind["full"] else sliding_kv
    if full_kv != sliding_kv and not keys_are_values:
        raise CheckpointError(
            f"{source}: full layers with {full_kv} KV heads and sliding ones with {sliding_kv}, "
            "but full layers store values (transformers' Gemma 4 gives both the same count then)"
        )
    num_shared = _count(metadata, key("attention.shared_kv_layers"))
    widths = _per_layer(metadata, key("feed_forward_length"), num_layers)
    first_shared = num_layers - num_shared
    doubled = [w * 2 if i >= first_shared else w for i, w in enumerate([widths[0]] * num_layers)]
    if widths != [widths[0]] * num_layers and widths != doubled:
        raise CheckpointError(
            f"{source}: GGUF metadata '{key('feed_forward_length')}' {widths} is neither one width "
            "nor one doubled from the first KV-shared layer"
        )
    per_layer_size = _count(metadata, key("embedding_length_per_layer_input"))
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": widths[0],
        "use_double_wide_mlp": widths != [widths[0]] * num_layers,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_key_value_heads": sliding_kv,
        "num_global_key_value_heads": full_kv,
        "attention_k_eq_v": keys_are_values,
        "sliding_window": metadata.require(key("attention.sliding_window"), int),
        "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
        "num_kv_shared_layers": num_shared,
        "final_logit_softcapping": metadata.optional(key("final_logit_softcapping"), float),
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": metadata.optional(key("rope.freq_base_swa"), float, 10000.0),
            },
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": _gemma4_rotated_share(metadata, tensors, global_head_dim),
                "rope_theta": config["rope_theta"],
            },
        },
        "hidden_size_per_layer_input": per_layer_size,
    }
    if per_layer_size:
        table = tensors.get("per_layer_token_embd.weight")
        if table is None:
            raise CheckpointError(f"{source}: missing tensor 'per_layer_token_embd.weight'")
        fields["vocab_size_per_layer_input"] = int(table.shape[-1])
    if "blk.0.ffn_gate_inp.weight" in tensors:
        fields.update(
            enable_moe_block=True,
            num_experts=metadata.require(key("expert_count"), int),
            top_k_experts=metadata.require(key("expert_used_count"), int),
            moe_intermediate_size=metadata.require(key("expert_feed_forward_length"), int),
        )
    return fields


def _per_layer(metadata: Metadata, name: str, num_layers: int) -> list[int]:
    """A count the converter writes once, or once per layer."""
    value = metadata.get(name)
    values = value if isinstance(value, list) else [value] * num_layers
    if len(values) != num_layers or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_INT_FIELD for v in values
    ):
        raise CheckpointError(
            f"{metadata.source}: GGUF metadata '{name}' should be a positive count, or one per layer"
        )
    return values


def _count(metadata: Metadata, name: str) -> int:
    """A count where absent or 0 means none."""
    return metadata.require(name, int) if metadata.get(name) not in (None, 0) else 0


def _gemma4_rotated_share(metadata: Metadata, tensors: dict[str, Any], head_dim: int) -> float:
    """The share of a full layer's pairs that rotate, from the converter's `rope_freqs`
    (1.0 for each rotated pair, then 1e30 for the rest); all of them without it."""
    tensor = tensors.get("rope_freqs.weight")
    if tensor is None:
        return 1.0
    factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    rotated = int(np.sum(factors == 1.0))
    if factors.size != head_dim // 2 or not (factors[rotated:] >= 1e29).all():
        raise CheckpointError(
            f"{metadata.source}: gemma4 'rope_freqs.weight' is not a run of 1s then 1e30s over {head_dim // 2} pairs"
        )
    return 2 * rotated / head_dim


def _gemma2_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """Gemma 2's settings as llama.cpp reads them: the soft caps (50 and 30 where the file
    is silent), the window (4096) on every other layer from the first, and the attention
    scale, head_dim but hidden/heads for the 46-layer 27B (query_pre_attn_scalar 144)."""
    is_27b = config["num_hidden_layers"] == 46
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": metadata.optional(key("attention.sliding_window"), int, 4096),
        "query_pre_attn_scalar": (
            config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
        ),
        "attn_logit_softcapping": metadata.optional(key("attn_logit_softcapping"), float, 50.0),
        "final_logit_softcapping": metadata.optional(key("final_logit_softcapping"), float, 30.0),
    }
