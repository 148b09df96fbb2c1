"""RoPE settings from a GGUF file's metadata and tensors, as config.json's `rope_scaling`
would state them: linear, Llama 3's (recovered from its `rope_freqs` factors), Phi-3's
LongRoPE (its factor tensors), YaRN (with llama.cpp's magnitude correction), and
Ministral 3's query temperature beside them. runtime/gguf.py calls these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from runtime.errors import CheckpointError
from runtime.files import shortened
from runtime.gguf_reader import Metadata

import numpy as np


def rope_scaling(
    metadata: Metadata,
    key: Callable[[str], str],
    config: dict[str, Any],
    tensors: dict[str, Any],
    has_longrope: bool,
) -> dict[str, Any] | None:
    """config.json's `rope_scaling` for the file's `{arch}.rope.*` metadata and RoPE
    tensors (None: plain RoPE); an unsupported kind is a `CheckpointError`."""
    kind = metadata.get(key("rope.scaling.type"))
    if has_longrope and "rope_factors_long.weight" in tensors:
        return _longrope_scaling(metadata, key, tensors)
    if kind in (None, "none") and "rope_freqs.weight" not in tensors:
        return None
    if kind == "linear":
        return {
            "rope_type": "linear",
            "factor": float(metadata.require(key("rope.scaling.factor"), float)),
        }
    if kind == "yarn":
        return _yarn_scaling(metadata, key)
    if "rope_freqs.weight" in tensors:
        return _llama3_scaling(metadata, key, config, tensors["rope_freqs.weight"])
    raise CheckpointError(f"{metadata.source}: unsupported RoPE scaling type '{kind}'")


# YaRN settings llama.cpp reads otherwise than transformers would (or not at all, for
# these architectures), each with the value that means "as transformers derives it".
_YARN_NEUTRAL = {
    "rope.scaling.attn_factor": 1.0,
    "rope.scaling.yarn_attn_factor": 1.0,
    "rope.scaling.yarn_ext_factor": 1.0,
}


def _yarn_scaling(metadata: Metadata, key: Callable[[str], str]) -> dict[str, Any]:
    """YaRN as llama.cpp's converters write it for Qwen, llama and Ministral 3 files: the
    factor, the original context and the ramp's bounds. llama.cpp scales q and k by
    1 + 0.1 ln(factor), or with a `yarn_log_multiplier` m (Ministral 3's `mscale_all_dim`)
    by that over 1 + 0.1 m ln(factor): transformers' `mscale` 1 over `mscale_all_dim` m.
    A file changing the scale otherwise is refused."""
    for name, neutral in _YARN_NEUTRAL.items():
        value = metadata.get(key(name))  # any value but the neutral one, a string too
        if value is not None and value != neutral:
            raise CheckpointError(
                f"{metadata.source}: YaRN with '{key(name)}' = {shortened(repr(value))} is not supported"
            )
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(metadata.require(key("rope.scaling.factor"), float)),
    }
    log_multiplier = metadata.get(key("rope.scaling.yarn_log_multiplier"))
    if log_multiplier not in (None, 0, 0.0):
        scaling["mscale"] = 1.0
        scaling["mscale_all_dim"] = float(metadata.require(key("rope.scaling.yarn_log_multiplier"), float))
    if (context := metadata.optional(key("rope.scaling.original_context_length"), int)) is not None:
        scaling["original_max_position_embeddings"] = int(context)
    for name, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if (value := metadata.optional(key(f"rope.scaling.{name}"), float)) is not None:
            scaling[field] = float(value)
    return scaling


def ministral3_scaling(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """Ministral 3's RoPE settings with its query temperature: beta from
    `attention.temperature_scale` (none: 0, no temperature) over the original context,
    as llama.cpp reads them for `mistral3`."""
    scaling = dict(config["rope_scaling"] or {"rope_type": "default"})
    context = metadata.optional(key("rope.scaling.original_context_length"), int, config["max_position_embeddings"])
    beta = metadata.get(key("attention.temperature_scale"), 0.0)
    if beta != 0:
        # Stored as float32: read back as the shortest decimal it holds (0.1, not 0.10000000149).
        beta = float(str(np.float32(metadata.require(key("attention.temperature_scale"), float))))
    return {**scaling, "original_max_position_embeddings": context, "llama_4_scaling_beta": float(beta)}


def _longrope_scaling(
    metadata: Metadata, key: Callable[[str], str], tensors: dict[str, Any]
) -> dict[str, Any]:
    """Phi-3's `rope_scaling`, from the factor tensors and attention factor its converter
    wrote; runtime/models/phi3.py checks them as it checks a config.json's."""
    if "rope_factors_short.weight" not in tensors:
        raise CheckpointError(
            f"{metadata.source}: 'rope_factors_long.weight' without 'rope_factors_short.weight'"
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": [float(x) for x in tensors["rope_factors_long.weight"].data.reshape(-1)],
        "short_factor": [float(x) for x in tensors["rope_factors_short.weight"].data.reshape(-1)],
    }
    if (factor := metadata.optional(key("rope.scaling.attn_factor"), float)) is not None:
        scaling["attention_factor"] = factor
    return scaling


def _llama3_scaling(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any], tensor: Any
) -> dict[str, Any]:
    """Llama 3's `rope_scaling`, recovered from the per-frequency factors the converter
    wrote as `rope_freqs`: the largest factor is `factor`, and the other fields are
    Meta's published values (the file keeps only the context length), checked here by
    recomputing every factor."""
    factors = [float(x) for x in tensor.data.reshape(-1)]
    if not factors or not all(0 < f < math.inf for f in factors):  # max() and 1/f below
        raise CheckpointError(
            f"{metadata.source}: tensor 'rope_freqs.weight' is not Llama 3 RoPE scaling "
            "(empty, or factors that are not positive finite numbers)"
        )
    old_context = metadata.optional(key("rope.scaling.original_context_length"), int, 8192)
    scaling = {
        "rope_type": "llama3",
        "factor": max(factors),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(old_context),
    }
    head_dim = int(config["head_dim"])
    # Counted first: recomputed for a key_length of 2**31 - 1, the factors took minutes.
    is_llama3 = len(factors) == (head_dim + 1) // 2 and all(
        math.isclose(a, b, rel_tol=1e-4)
        for a, b in zip(factors, _llama3_factors(scaling, head_dim, config["rope_theta"]), strict=True)
    )
    if not is_llama3:
        raise CheckpointError(
            f"{metadata.source}: tensor 'rope_freqs.weight' is not Llama 3 RoPE scaling "
            "with low/high frequency factors 1 and 4"
        )
    return scaling


def _llama3_factors(scaling: dict[str, Any], dims: int, base: float) -> list[float]:
    """The per-frequency divisors convert_hf_to_gguf.py writes for llama3 scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * base ** (i / dims)
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out
