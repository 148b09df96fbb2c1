"""gpt-oss (`gpt_oss`: OpenAI's gpt-oss-20b and gpt-oss-120b): llama's pre-norm decoder
with routed experts (runtime/models/experts.py), and

- q, k, v and o biases (`attention_bias`);
- a learned sink per query head: a logit in each softmax's sum that multiplies no
  value, so a head can attend to nothing (`self_attn.sinks`, every attention path);
- layers alternating a 128-token sliding window and full attention (`layer_types`);
- YaRN RoPE (factor 32 over an original context of 4,096, `truncate` false);
- a biased router whose top `num_experts_per_tok` logits are softmaxed, and biased
  experts whose SwiGLU is clamped at `swiglu_limit` (7).

Three weight layouts load:
- mlx-community's conversions: `mlp.router`, `mlp.experts.{gate,up,down}_proj` stacked
  [E, out, in] (quantized, or float);
- OpenAI's release: `mlp.experts.gate_up_proj_blocks` / `_scales` in MXFP4 (mlx's
  `mxfp4` layout once the blocks are read as uint32 words) and `_bias`, gate and up
  interleaved row by row; config.json's `quantization_config` says mxfp4;
- transformers' float layout: `mlp.experts.gate_up_proj` [E, in, 2 I] and `down_proj`
  [E, I, out], transposed against ours, gate and up interleaved along the last axis.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models import llama
from runtime.models.experts import Experts

import mlx.core as mx

build = llama.Decoder

DEFAULTS = {"sliding_window": 128, "hidden_act": "silu", "attention_bias": True}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    experts = Experts.read(
        fields,
        num_experts=fields.get("num_local_experts", int),
        intermediate_size=fields.get("intermediate_size", int),
        normalize=True,  # a softmax over the chosen logits: the full softmax renormalised
        biases=True,
        swiglu_limit=fields.get("swiglu_limit", float, 7.0),
    )
    return {**llama.read_config(fields), "extra": {"experts": experts, "attention_sinks": True}}


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Any of the three layouts -> ours: `mlp.gate` routes, `mlp.switch_mlp` holds the
    experts (as the other routed-experts families)."""
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        block, is_expert, rest = name.partition(".mlp.experts.")
        if is_expert:
            out.update(_expert_tensors(f"{block}.mlp.switch_mlp", rest, w))
        else:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = w
    return out


def _expert_tensors(prefix: str, rest: str, w: mx.array) -> dict[str, mx.array]:
    """One stored experts tensor (`rest` is its name after `mlp.experts.`) in our names."""
    projection, _, suffix = rest.partition(".")
    if suffix:  # mlx-community's: already ours
        return {f"{prefix}.{rest}": w}
    if projection.endswith("_blocks"):  # OpenAI's MXFP4: [E, out, in / 32, 16] bytes
        if w.dtype != mx.uint8 or w.ndim != 4:
            raise CheckpointError(f"tensor '{rest}' should be uint8 [E, out, groups, 16], got {w.dtype} {w.shape}")
        words = mx.view(w, mx.uint32).reshape(*w.shape[:2], -1)  # mlx's packing: 8 weights a word
        return _gate_up_split(prefix, projection.removesuffix("_blocks"), "weight", words)
    if projection.endswith("_scales"):
        return _gate_up_split(prefix, projection.removesuffix("_scales"), "scales", w)
    if projection.endswith("_bias"):
        return _gate_up_split(prefix, projection.removesuffix("_bias"), "bias", w, axis=-1)
    if projection in ("gate_up_proj", "down_proj"):  # transformers' float layout: [E, in, out]
        if w.ndim != 3:
            raise CheckpointError(f"tensor '{rest}' should be [E, in, out], got {w.shape}")
        return _gate_up_split(prefix, projection, "weight", mx.contiguous(w.swapaxes(1, 2)))
    raise CheckpointError(f"unexpected experts tensor '{rest}' for gpt_oss")


def _gate_up_split(
    prefix: str, projection: str, suffix: str, w: mx.array, axis: int = 1
) -> dict[str, mx.array]:
    """`gate_up_proj`'s rows alternate gate, up (along `axis`): even to gate_proj, odd
    to up_proj; `down_proj` is kept whole."""
    if projection == "down_proj":
        return {f"{prefix}.down_proj.{suffix}": w}
    if projection != "gate_up_proj" or w.shape[axis] % 2:
        raise CheckpointError(f"unexpected experts tensor '{projection}' of shape {w.shape} for gpt_oss")
    index = [slice(None)] * w.ndim
    parts = {}
    for name, start in (("gate_proj", 0), ("up_proj", 1)):
        index[axis] = slice(start, None, 2)
        parts[f"{prefix}.{name}.{suffix}"] = mx.contiguous(w[tuple(index)])
    return parts
