"""How a tiny checkpoint's weights are stored where a family's checkpoints differ from
our module names (runtime/synth.py calls these): Hugging Face originals' names and
shapes (per-expert tensors, fused projections, conv weights, norm offsets) and mlx-lm's
conversions' (DeepSeek-V3's split kv_b_proj)."""

from __future__ import annotations

from typing import Any

from runtime.models import FAMILIES, apertus, phi

import mlx.core as mx
import numpy as np


def stored_names(weights: dict[str, mx.array], names: dict[str, str]) -> dict[str, mx.array]:
    """Our names as the checkpoint stores them (`names`: stored part -> ours)."""
    return phi.renamed(weights, {ours: theirs for theirs, ours in names.items()})


def apertus_original_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return {
        name: w.reshape(1) if name.endswith((".alpha_p", ".alpha_n")) else w
        for name, w in stored_names(weights, apertus.NORM_NAMES).items()
    }


def fused_projections(
    weights: dict[str, mx.array], fused: tuple[str, ...] = ("q_proj", "gate_proj")
) -> dict[str, mx.array]:
    """Phi-3's layout: q, k, v as one `qkv_proj`, gate and up as one `gate_up_proj`
    (GLM-4's: the latter alone, `fused` naming the groups' first layers)."""
    groups = {
        "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    }
    merged = {first: groups[first] for first in fused}
    absorbed = {part for _, parts in merged.values() for part in parts[1:]}
    out = {}
    for name, w in weights.items():
        layer, _, projection = name.rpartition(".")[0].rpartition(".")
        if projection in merged:
            into, parts = merged[projection]
            parts_weights = [weights[f"{layer}.{part}.weight"] for part in parts]
            out[f"{layer}.{into}.weight"] = mx.concatenate(parts_weights)
        elif projection not in absorbed:
            out[name] = w
    return out


def split_kv_b(weights: dict[str, mx.array], raw: dict[str, Any]) -> dict[str, mx.array]:
    """DeepSeek-V3's kv_b_proj as mlx-lm's conversions store it: per head, the key rows
    transposed (`embed_q` [H, kv_lora_rank, nope]) and the value rows (`unembed_out`)."""
    H, nope = raw["num_attention_heads"], raw["qk_nope_head_dim"]
    out = {}
    for name, w in weights.items():
        if not name.endswith(".kv_b_proj.weight"):
            out[name] = w
            continue
        heads = w.reshape(H, -1, w.shape[-1])
        attention = name.removesuffix(".kv_b_proj.weight")
        out[f"{attention}.embed_q.weight"] = mx.contiguous(heads[:, :nope].swapaxes(1, 2))
        out[f"{attention}.unembed_out.weight"] = mx.contiguous(heads[:, nope:])
    return out


def lfm2_original_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """LFM2's weights as Hugging Face's originals store them: conv weights [C, 1, L];
    LFM2-MoE's MLPs as w1/w3/w2, each expert's apart."""
    from runtime.models.lfm2 import MOE_PROJECTIONS

    stored = {ours: theirs for theirs, ours in MOE_PROJECTIONS.items()}
    out = {}
    for name, w in per_expert_weights(weights, stored).items():
        if name.endswith(".conv.conv.weight"):
            w = w.moveaxis(2, 1)
        block, _, projection = name.rpartition(".")[0].rpartition(".")
        if ".feed_forward" in block and projection in stored:
            name = f"{block}.{stored[projection]}.weight"
        out[name] = w
    return out


def granite4_original_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Granite 4.0's weights as Hugging Face's originals store them: conv weights [C, 1, K];
    a dense model's MLP as `shared_mlp` (gate and up stacked in `input_linear`); each layer's
    experts as `block_sparse_moe.input_linear` [E, 2 I, hidden] (gate rows first) and
    `output_linear`."""
    out = {}
    for name, w in weights.items():
        if name.endswith(".mamba.conv1d.weight"):
            out[name] = w.moveaxis(2, 1)
        elif name.endswith((".mlp.gate_proj.weight", ".switch_mlp.gate_proj.weight")):
            block = name.removesuffix(".gate_proj.weight")
            stacked = mx.concatenate([w, weights[f"{block}.up_proj.weight"]], axis=-2)
            into = block.replace(".mlp", ".shared_mlp").replace(".switch_mlp", "")
            out[f"{into}.input_linear.weight"] = stacked
            out[f"{into}.output_linear.weight"] = weights[f"{block}.down_proj.weight"]
        elif not name.endswith((".up_proj.weight", ".down_proj.weight")):
            out[name] = w
    return out


def nemotron_h_weights(weights: dict[str, mx.array], is_original: bool) -> dict[str, mx.array]:
    """Nemotron-H's names (`backbone.embeddings`, `backbone.layers`, `backbone.norm_f`), as
    both forms store them; an original's conv weights [C, 1, K] and experts apart
    (`mixer.experts.{e}.up_proj`, `down_proj`)."""
    out = {}
    for name, w in weights.items():
        name = name.replace("model.embed_tokens.", "backbone.embeddings.").replace("model.norm.", "backbone.norm_f.")
        name = name.replace("model.layers.", "backbone.layers.")
        if is_original and name.endswith(".conv1d.weight"):
            w = w.moveaxis(2, 1)
        if is_original and ".switch_mlp." in name:
            stored = "up_proj" if ".fc1." in name else "down_proj"
            prefix = name.split(".switch_mlp.")[0]
            for e in range(w.shape[0]):
                out[f"{prefix}.experts.{e}.{stored}.weight"] = w[e]
            continue
        out[name] = w
    return out


def qwen3_5_weights(
    weights: dict[str, mx.array], is_original: bool, is_multimodal: bool, seed: int
) -> dict[str, mx.array]:
    """Qwen3.5's weights as stored: a Hugging Face original's conv weights [C, 1, K], norm
    offsets from 1 and fused experts (runtime/models/qwen3_5.py), else mlx-lm's form; the
    multimodal layout's names (the original's `model.language_model.`, a conversion's
    `language_model.model.`) beside a stub vision tower and MTP head, to be dropped."""
    from runtime.models.qwen3_5 import OFFSET_NORMS

    out = {}
    if is_original:  # the experts fused per layer: gate and up rows in one tensor
        for name in [n for n in weights if n.endswith(".switch_mlp.gate_proj.weight")]:
            prefix = name.removesuffix(".switch_mlp.gate_proj.weight")
            up = weights.pop(f"{prefix}.switch_mlp.up_proj.weight")
            weights[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([weights.pop(name), up], axis=-2)
            weights[f"{prefix}.experts.down_proj"] = weights.pop(f"{prefix}.switch_mlp.down_proj.weight")
    for name, w in weights.items():
        if is_original and name.endswith("conv1d.weight"):
            w = w.moveaxis(2, 1)
        elif is_original and name.endswith(OFFSET_NORMS):
            w = w - 1.0
        if is_multimodal:
            name = name.replace("model.", "model.language_model." if is_original else "language_model.model.", 1)
            if not is_original and name == "lm_head.weight":
                name = "language_model.lm_head.weight"
        out[name] = w
    if is_multimodal:
        rng = np.random.default_rng(seed)
        stubs = ("model.visual.merger.norm.weight", "mtp.norm.weight") if is_original else ("vision_tower.merger.norm.weight",)
        for name in stubs:
            out[name] = mx.array(rng.standard_normal((8,)).astype(np.float32))
    return out


def qwen_vl_weights(weights: dict[str, mx.array], family: str, is_original: bool, seed: int) -> dict[str, mx.array]:
    """Qwen's vision-language weights as stored (runtime/models/qwen_vl.py), beside a stub
    vision tower: Hugging Face's Qwen2-VL and Qwen2.5-VL releases as the text model's
    (`visual.*` beside), Qwen3-VL's under `model.language_model.` (`model.visual.*`; the
    MoE's experts fused); mlx-vlm's conversions under `language_model.` (`vision_tower.*`,
    too narrow for a quantization group, as its conversions leave it unquantized)."""
    out = {}
    for name, w in weights.items():
        if not is_original:
            name = f"language_model.{name}"
        elif family in ("qwen3_vl", "qwen3_vl_moe"):
            name = name.replace("model.", "model.language_model.", 1)
        out[name] = w
    if is_original and family == "qwen3_vl_moe":  # [E, hidden, 2 I], gate columns first; down [E, I, hidden]
        for name in [n for n in out if n.endswith(".switch_mlp.gate_proj.weight")]:
            prefix = name.removesuffix(".switch_mlp.gate_proj.weight")
            up = out.pop(f"{prefix}.switch_mlp.up_proj.weight")
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([out.pop(name), up], axis=-2).swapaxes(1, 2)
            out[f"{prefix}.experts.down_proj"] = out.pop(f"{prefix}.switch_mlp.down_proj.weight").swapaxes(1, 2)
    tower = "vision_tower" if not is_original else "visual" if family in ("qwen2_vl", "qwen2_5_vl") else "model.visual"
    rng = np.random.default_rng(seed)
    stubs = [("merger.ln_q.weight", (8,)), ("blocks.0.attn.qkv.weight", (24, 8))]
    if family in ("qwen3_vl", "qwen3_vl_moe"):  # deepstack's mergers are the vision tower's
        stubs.append(("deepstack_merger_list.0.norm.weight", (8,)))
    for stub, shape in stubs:
        out[f"{tower}.{stub}"] = mx.array(rng.standard_normal(shape).astype(np.float32))
    return out


def qwen3_next_weights(
    weights: dict[str, mx.array], raw: dict[str, Any], is_original: bool, seed: int
) -> dict[str, mx.array]:
    """Qwen3-Next's weights as stored (runtime/models/qwen3_next.py): each Gated DeltaNet
    layer's projections fused as `in_proj_qkvz` and `in_proj_ba`, grouped per key head;
    a Hugging Face original's experts one tensor each, conv weights [C, 1, K], norm
    offsets from 1 and a stub MTP head, else mlx-lm's form."""
    from runtime.models.qwen3_5 import OFFSET_NORMS

    Hk, Dk, Dv = raw["linear_num_key_heads"], raw["linear_key_head_dim"], raw["linear_value_head_dim"]
    per_key = raw["linear_num_value_heads"] // Hk
    out = {}
    for name, w in weights.items():
        prefix, _, projection = name.removesuffix(".weight").rpartition(".")
        if projection == "in_proj_qkv":
            hidden = w.shape[-1]
            q, k, v = (p.reshape(Hk, -1, hidden) for p in mx.split(w, [Hk * Dk, 2 * Hk * Dk]))
            z = weights[f"{prefix}.in_proj_z.weight"].reshape(Hk, per_key * Dv, hidden)
            out[f"{prefix}.in_proj_qkvz.weight"] = mx.concatenate([q, k, v, z], axis=1).reshape(-1, hidden)
        elif projection == "in_proj_b":
            b, a = (weights[f"{prefix}.in_proj_{x}.weight"].reshape(Hk, per_key, -1) for x in "ba")
            out[f"{prefix}.in_proj_ba.weight"] = mx.concatenate([b, a], axis=1).reshape(-1, w.shape[-1])
        elif projection in ("in_proj_z", "in_proj_a"):
            continue
        elif is_original and name.endswith("conv1d.weight"):
            out[name] = w.moveaxis(2, 1)
        elif is_original and name.endswith(OFFSET_NORMS):
            out[name] = w - 1.0
        else:
            out[name] = w
    if not is_original:
        return out
    out = per_expert_weights(out, EXPERT_NAMES["qwen3_moe"])
    out["mtp.norm.weight"] = mx.array(np.random.default_rng(seed).standard_normal((8,)).astype(np.float32))
    return out


# The per-expert names Hugging Face stores, by ours, for the routed-experts families.
EXPERT_NAMES = {
    family: {ours: stored for stored, ours in FAMILIES[family].EXPERT_NAMES.items()}
    for family in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "glm4_moe", "olmoe")
}


def per_expert_weights(weights: dict[str, mx.array], names: dict[str, str]) -> dict[str, mx.array]:
    """Stacked experts (`X.switch_mlp.gate_proj.weight` [E, out, in]) as Hugging Face
    stores them, one tensor per expert (`X.experts.{e}.{name}.weight`)."""
    out = {}
    for name, w in weights.items():
        block, is_stacked, rest = name.partition(".switch_mlp.")
        if not is_stacked:
            out[name] = w
            continue
        projection, _, suffix = rest.partition(".")
        for e in range(w.shape[0]):
            out[f"{block}.experts.{e}.{names[projection]}.{suffix}"] = w[e]
    return out
