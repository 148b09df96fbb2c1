"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini (`phi3`): llama's decoder with q, k and v
stored as one `qkv_proj` and gate and up as one `gate_up_proj`, split at load.

    qkv_proj     [(H + 2 Hkv) D, hidden]  ->  q_proj [H D], k_proj [Hkv D], v_proj [Hkv D]
    gate_up_proj [2 F, hidden]            ->  gate_proj [F] (the first half), up_proj [F]

The split rows keep their packing: a quantized layer's groups run along its inputs,
so its `.scales` and `.biases` split with its rows. On the CPU the projections are
stacked again for one matmul (runtime/cpu_weights.py).

RoPE: default, linear, or LongRoPE (`longrope`, or `su` in older configs) with its
long factors at every length and its attention factor, as mlx-lm runs it
(transformers uses the short factors while a sequence is within
`original_max_position_embeddings`). RoPE may rotate only the first
`partial_rotary_factor` of each head (Phi-4-mini's 0.75); LongRoPE's factor then
scales that part alone, so it is folded into q_proj's rotated rows at load.
`sliding_window` is applied to every layer, as
transformers does (mlx-lm ignores it), where it is shorter than the model's context:
Phi-3-mini-4k's 2047.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number, rope_fields
from runtime.errors import CheckpointError
from runtime.models import llama

import mlx.core as mx

build = llama.Decoder
ROPE_TYPES = ("longrope", "su")  # beside default and linear (runtime/config.py)
ROTATES_PART_OF_A_HEAD = True  # `partial_rotary_factor` (runtime/config.py refuses it elsewhere)


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    source = fields.source
    head_dim = fields.get("head_dim", int, None) or (
        fields.get("hidden_size", int) // fields.get("num_attention_heads", int)
    )
    rotary_dims = int(head_dim * fields.get("partial_rotary_factor", float, 1.0))
    if rotary_dims % 2 or not 2 <= rotary_dims <= head_dim:
        raise CheckpointError(
            f"{source}: partial_rotary_factor rotates {rotary_dims} of a head's {head_dim} "
            "dimensions; it needs an even number, at least 2 and at most the head"
        )
    if fields.get("attention_bias", bool, False):
        raise CheckpointError(f"{source}: attention_bias=true is not supported for phi3")
    context = fields.get("max_position_embeddings", int, 4096)
    window = fields.get("sliding_window", int, None)
    num_layers = fields.get("num_hidden_layers", int)
    windows = (window,) * num_layers if window is not None and window < context else ()
    settings: dict[str, Any] = {"qkv_bias": False, "o_bias": False, "layer_windows": windows}
    extra: dict[str, Any] = {"rotary_dims": rotary_dims}
    scaling = _rope_scaling(fields, rotary_dims)
    _, shared_scaling = rope_fields(fields)
    is_yarn = (shared_scaling or {}).get("rope_type", (shared_scaling or {}).get("type")) == "yarn"
    if is_yarn and rotary_dims < head_dim:  # its factor would reach the unrotated part too
        raise CheckpointError(f"{source}: rope_scaling yarn with partial_rotary_factor is not supported")
    if scaling is not None and rotary_dims < head_dim:
        # LongRoPE's factor scales the rotated part of q and k, not the rest: folded into
        # q's rotated rows at load (`rename_weights`), not into the attention's scale.
        gain = scaling.pop("attention_factor") ** 2
        if gain != 1.0:  # (a context no longer than the original: nothing to fold)
            extra["rotated_query_gain"] = gain
    if scaling is not None:
        settings["rope_scaling"] = scaling
    return {**settings, "extra": extra}


def _rope_scaling(fields: ConfigFields, rotary_dims: int) -> dict[str, Any] | None:
    """LongRoPE's settings, checked, in the form `layers.RoPE` reads; None otherwise."""
    _, scaling = rope_fields(fields)  # config.json's, or transformers 5's rope_parameters
    if scaling is None or scaling.get("rope_type", scaling.get("type")) not in ROPE_TYPES:
        return None
    source = fields.source
    half = rotary_dims // 2
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = scaling.get(name)
        if not (
            isinstance(values, list)
            and len(values) == half
            and all(is_positive_number(v) for v in values)
        ):
            raise CheckpointError(
                f"{source}: rope_scaling longrope needs '{name}', a list of {half} positive numbers"
            )
        factors[name] = [float(v) for v in values]
    original = scaling.get(
        "original_max_position_embeddings", fields.raw.get("original_max_position_embeddings")
    )
    if not (is_positive_number(original) and isinstance(original, int)):
        raise CheckpointError(
            f"{source}: rope_scaling longrope needs a positive integer "
            f"original_max_position_embeddings, got {original!r}"
        )
    context = fields.get("max_position_embeddings", int, 4096)
    factor = context / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:  # transformers' and mlx-lm's default
        attention_factor = (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
    elif not is_positive_number(attention_factor):
        raise CheckpointError(
            f"{source}: rope_scaling longrope's attention_factor must be a positive number, "
            f"got {attention_factor!r}"
        )
    return {"rope_type": "longrope", **factors, "attention_factor": float(attention_factor)}


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """The fused projections split into llama's names; everything else as stored."""
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    ffn = config.intermediate_size
    fused = {
        "self_attn.qkv_proj": (
            ("self_attn.q_proj", 0, q_rows),
            ("self_attn.k_proj", q_rows, q_rows + kv_rows),
            ("self_attn.v_proj", q_rows + kv_rows, q_rows + 2 * kv_rows),
        ),
        "mlp.gate_up_proj": (("mlp.gate_proj", 0, ffn), ("mlp.up_proj", ffn, 2 * ffn)),
    }
    gain = config.extra.get("rotated_query_gain")
    renamed = {}
    for name, tensor in weights.items():
        layer, _, part = name.rpartition(".")  # part: weight, scales or biases
        prefix, _, projection = layer.rpartition(".layers.")
        index, _, module = projection.partition(".")
        if module not in fused:
            renamed[name] = tensor
            continue
        rows = fused[module][-1][2]
        if tensor.ndim != 2 or tensor.shape[0] != rows:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {rows} rows"
            )
        for split, lo, hi in fused[module]:
            renamed[f"{prefix}.layers.{index}.{split}.{part}"] = tensor[lo:hi]
    if gain is not None:
        _scale_rotated_queries(renamed, config, gain)
    return renamed


def _scale_rotated_queries(weights: dict[str, mx.array], config: ModelConfig, gain: float) -> None:
    """Multiply q_proj's rows that RoPE rotates by `gain`, in place: LongRoPE's factor f
    on the rotated part of q and of k is f² on their product, which `gain` carries.
    A quantized layer's rows are scaled through its scales and biases."""
    rows = mx.arange(config.num_attention_heads * config.head_dim) % config.head_dim
    row_gain = mx.where(rows < config.extra["rotary_dims"], gain, 1.0)[:, None]
    for name in [name for name in weights if name.endswith("self_attn.q_proj.weight")]:
        layer = name.removesuffix(".weight")
        if f"{layer}.scales" not in weights:
            weights[name] = (weights[name] * row_gain).astype(weights[name].dtype)
            continue
        if weights[f"{layer}.scales"].dtype == mx.uint8:  # microscaling: power-of-two scales
            raise CheckpointError(
                f"{layer}: a partial-rotary LongRoPE model's q_proj must be float or "
                "affine-quantized, not microscaling"
            )
        for part in ("scales", "biases"):
            if f"{layer}.{part}" in weights:
                stored = weights[f"{layer}.{part}"]
                weights[f"{layer}.{part}"] = (stored * row_gain).astype(stored.dtype)
