"""DeepSeek-V2 (`deepseek_v2`: DeepSeek-V2-Lite(-Chat), DeepSeek-Coder-V2-Lite): Multi-head
Latent Attention (MLA) and routed experts beside shared ones, checked against
transformers' `modeling_deepseek_v2` and mlx-lm's `deepseek_v2` (deepseek_v3.py reuses it).

MLA: a token's keys and values come from one latent of `kv_lora_rank` (512):

    q = q_proj(x), or q_b_proj(norm(q_a_proj(x))) with a `q_lora_rank`   [H, nope + rope]
    latent, k_rope = kv_a_proj_with_mqa(x)                        [kv_lora_rank], [rope]
    k_nope, v = kv_b_proj(kv_a_layernorm(latent))                 [H, nope], [H, v_head_dim]
    k = [k_nope, RoPE(k_rope) for every head];  q = [q_nope, RoPE(q_rope)]

RoPE turns only the last `qk_rope_head_dim` of q and k, in interleaved pairs (2i, 2i + 1)
where cadence pairs halves: their rows of q_proj (q_b_proj) and kv_a_proj_with_mqa are
reordered at load, evens then odds (as glm4.py), which leaves every score as it is
(transformers permutes the rotated values instead, to the same effect; its
`rope_interleave: false` means halves, and nothing is reordered). Under YaRN,
DeepSeek's code multiplies the rotated parts by mscale(mscale) / mscale(mscale_all_dim)
(1 in the releases) and the softmax scale, 1 / sqrt(nope + rope), by mscale(mscale_all_dim)².

KV: the paged store keeps K and V per head at one width, so K is stored whole (nope +
rope, 192) and V zero-padded to it (128 -> 192; the padded output columns are dropped;
where V is the wider, q and k are padded instead), and the existing attention runs unchanged. That is 2 x H x 192 values a token and layer
against the 576 of the latent form (kv_lora_rank + rope) that DeepSeek's own inference
caches: V2-Lite's 16 heads store 6,144, 10.7 times as many (324 KiB a token in bf16 over
its 27 layers, against 30 KiB). The budget counts what is stored: `head_dim` is that
width and every head a KV head.

MoE: layer i routes when i >= `first_k_dense_replace` and i % `moe_layer_freq` == 0, or
where transformers 5's `mlp_layer_types` says "sparse" (else the dense MLP of
`intermediate_size`): softmax scores; `topk_method` "greedy" takes the top
`num_experts_per_tok`, "group_limited_greedy" first keeps the `topk_group` of `n_group`
groups whose best score is highest (the others' experts never chosen); the weights are the chosen scores times
`routed_scaling_factor` (divided by their sum instead where `norm_topk_prob` says, as
DeepSeek's code does; no release says so). `n_shared_experts` experts' worth of SwiGLU
(`shared_experts`, ungated) every token runs is added.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.models import llama
from runtime.models.experts import ExpertMLPs, Experts, stack_experts
from runtime.models.layers import GatedMLP, RMSNorm, RoPE, kept_rows

import attrs
import mlx.core as mx
import mlx.nn as nn

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's, fixed in DeepSeek's code
EXPERT_NAMES = {name: name for name in ("gate_proj", "up_proj", "down_proj")}  # stored: ours
TOPK_METHODS = ("greedy", "group_limited_greedy")


@attrs.frozen
class LatentShape:
    """MLA's widths (`ModelConfig.extra["mla"]`)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    nope_dims: int  # qk_nope_head_dim: the part of q and k without RoPE
    rope_dims: int  # qk_rope_head_dim
    value_dims: int  # v_head_dim
    # q_a_layernorm's and kv_a_layernorm's: fixed in DeepSeek's code, rms_norm_eps in GLM's
    norm_eps: float = LATENT_NORM_EPS
    # The rotated dimensions pair as (2i, 2i + 1), as every release's; transformers'
    # `rope_interleave: false` pairs halves, cadence's own order (mlx-lm ignores the field).
    interleaved: bool = True

    @property
    def stored_dims(self) -> int:
        """Each stored K and V head's width: the wider of q.k's and v's, the other zero-padded."""
        return max(self.nope_dims + self.rope_dims, self.value_dims)


@attrs.frozen
class Routing:
    """How a DeepSeek router picks and weighs experts (`ModelConfig.extra["routing"]`)."""

    sigmoid: bool  # sigmoid scores (V3), else a softmax (V2)
    num_groups: int  # experts in `num_groups` groups, only the `top_groups` best eligible
    top_groups: int
    group_by_top2: bool  # a group's score: its two best scores' sum (V3), else its best (V2)
    correction_bias: bool  # V3's e_score_correction_bias, added for choosing only
    normalize: bool  # the chosen weights divided by their sum
    scaling: float  # then times this (routed_scaling_factor)
    normalize_eps: float = 0.0  # added to that sum (transformers' Nemotron-H: 1e-20)


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    method = fields.get("topk_method", str, "greedy")
    if method not in TOPK_METHODS:
        raise CheckpointError(
            f"{fields.source}: topk_method '{method}' is not supported (supported: {', '.join(TOPK_METHODS)})"
        )
    experts = read_experts(fields)
    normalize = experts is not None and experts.top_k > 1 and fields.get("norm_topk_prob", bool, False)
    groups = fields.get("n_group", int, 1) if method == "group_limited_greedy" else 1
    routing = Routing(
        sigmoid=False,
        num_groups=groups,
        top_groups=fields.get("topk_group", int, 1) if groups > 1 else 1,
        group_by_top2=False,
        correction_bias=False,
        normalize=normalize,
        # DeepSeek's V2 code scales the weights it does not normalise.
        scaling=1.0 if normalize else fields.get("routed_scaling_factor", float, 1.0),
    )
    return read_latent_config(fields, experts, routing)


def read_latent_config(fields: ConfigFields, experts: Experts | None, routing: Routing) -> dict[str, Any]:
    """What V2 and V3 share: MLA's widths, every head its own stored K/V head."""
    mla = LatentShape(
        q_lora_rank=fields.get("q_lora_rank", int, None),
        kv_lora_rank=fields.get("kv_lora_rank", int),
        nope_dims=fields.get("qk_nope_head_dim", int),
        rope_dims=fields.get("qk_rope_head_dim", int),
        value_dims=fields.get("v_head_dim", int),
        interleaved=fields.get("rope_interleave", bool, True),
    )
    if mla.rope_dims % 2:
        raise CheckpointError(f"{fields.source}: qk_rope_head_dim must be even, got {mla.rope_dims}")
    if experts is not None:
        check_routing(fields, experts, routing)
    bias = fields.get("attention_bias", bool, False)
    return {
        "num_key_value_heads": fields.get("num_attention_heads", int),
        "head_dim": mla.stored_dims,
        "qkv_bias": bias,  # q_a_proj's and kv_a_proj_with_mqa's, as DeepSeek's code
        "o_bias": bias,
        "extra": {"mla": mla, "experts": experts, "routing": routing},
    }


def read_experts(fields: ConfigFields) -> Experts | None:
    """Routed experts where `n_routed_experts` is given; the layers `mlp_layer_types`
    (transformers 5's) says "dense", else those before `first_k_dense_replace` and those
    off `moe_layer_freq`, run the dense MLP."""
    num_experts = fields.get("n_routed_experts", int, None)
    if num_experts is None:
        return None
    # Null or 0: no shared experts (SGLang and vLLM read 0 so; the releases have 1 or 2).
    is_zero = fields.raw.get("n_shared_experts") == 0 and fields.raw.get("n_shared_experts") is not False
    shared = None if is_zero else fields.get("n_shared_experts", int, None)
    width = fields.get("moe_intermediate_size", int)
    return Experts.read(
        fields,
        num_experts=num_experts,
        intermediate_size=width,
        normalize=False,  # the Routing's
        dense_layers=dense_layers(fields),
        shared_intermediate_size=None if shared is None else width * shared,
    )


def dense_layers(fields: ConfigFields) -> list[int]:
    num_layers = fields.get("num_hidden_layers", int)
    layer_types = fields.get("mlp_layer_types", list, None)
    if layer_types is not None:
        if len(layer_types) != num_layers or not all(kind in ("dense", "sparse") for kind in layer_types):
            raise CheckpointError(f"{fields.source}: mlp_layer_types needs {num_layers} entries of 'dense' or 'sparse'")
        return [i for i, kind in enumerate(layer_types) if kind == "dense"]
    first_sparse = fields.raw.get("first_k_dense_replace") or 0
    if not isinstance(first_sparse, int) or isinstance(first_sparse, bool) or first_sparse < 0:
        raise CheckpointError(f"{fields.source}: first_k_dense_replace must be a whole number, got {first_sparse!r}")
    every = fields.get("moe_layer_freq", int, 1)
    return [i for i in range(num_layers) if i < first_sparse or i % every]


def sigmoid_routing(fields: ConfigFields, experts: Experts | None) -> Routing:
    """DeepSeek-V3's router, as its config (and GLM-4.5's, GLM-4.7-Flash's) sets it."""
    return Routing(
        sigmoid=True,
        num_groups=fields.get("n_group", int, 1),
        top_groups=fields.get("topk_group", int, 1),
        group_by_top2=True,
        correction_bias=True,
        normalize=experts is not None and experts.top_k > 1 and fields.get("norm_topk_prob", bool, True),
        scaling=fields.get("routed_scaling_factor", float, 1.0),
    )


def check_routing(fields: ConfigFields, experts: Experts, routing: Routing) -> None:
    """Groups that split the experts evenly, and enough experts in the kept groups (and in
    each group, where a group is scored by its two best)."""
    groups, kept = routing.num_groups, routing.top_groups
    if experts.num_experts % groups or kept > groups:
        raise CheckpointError(
            f"{fields.source}: n_group ({groups}) must divide the {experts.num_experts} experts "
            f"and be at least topk_group ({kept})"
        )
    if routing.group_by_top2 and groups > 1 and experts.num_experts // groups < 2:
        raise CheckpointError(
            f"{fields.source}: n_group ({groups}) leaves groups of fewer than the 2 experts each group is scored by"
        )
    if experts.top_k > kept * experts.num_experts // groups:
        raise CheckpointError(
            f"{fields.source}: num_experts_per_tok ({experts.top_k}) is more than the experts "
            f"of topk_group ({kept}) groups"
        )


def yarn_magnitude(factor: float, mscale: float) -> float:
    """DeepSeek's yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        mla: LatentShape = config.extra["mla"]
        self.layer, self.mla = layer, mla
        H, hidden = config.num_attention_heads, config.hidden_size
        self.num_heads = H
        q_dims = mla.nope_dims + mla.rope_dims
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * q_dims, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps=mla.norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, H * q_dims, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + mla.rope_dims, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps=mla.norm_eps)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, H * (mla.nope_dims + mla.value_dims), bias=False)
        self.o_proj = nn.Linear(H * mla.value_dims, hidden, bias=config.o_bias)
        self.rope = RoPE(mla.rope_dims, config.rope_theta, config.rope_scaling)
        scaling = config.rope_scaling or {}
        factor = float(scaling.get("factor") or 1.0)
        all_dims = float(scaling.get("mscale_all_dim") or 0.0)
        self.scale = q_dims**-0.5 * yarn_magnitude(factor, all_dims) ** 2 if all_dims else q_dims**-0.5
        # What q_rope . k_rope is multiplied by: both rotated parts' factor, on q alone.
        rotated = yarn_magnitude(factor, float(scaling.get("mscale") or 1.0)) / yarn_magnitude(factor, all_dims)
        self.rope_factor = rotated**2 if scaling.get("rope_type", scaling.get("type")) == "yarn" else 1.0

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """As `Attention`: attends from every token of x [B, T, hidden], projects out `keep`."""
        B, T, _ = x.shape
        N, H, mla = B * T, self.num_heads, self.mla
        q = self.q_proj(x) if "q_proj" in self else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = mx.split(q.reshape(N, H, -1), [mla.nope_dims], axis=-1)
        latent, k_rope = mx.split(self.kv_a_proj_with_mqa(x).reshape(N, -1), [mla.kv_lora_rank], axis=-1)
        k_nope, v = mx.split(self.kv_b_proj(self.kv_a_layernorm(latent)).reshape(N, H, -1), [mla.nope_dims], axis=-1)
        q_rope = self.rope(mx.contiguous(q_rope), kv.positions)
        if self.rope_factor != 1.0:
            q_rope = q_rope * self.rope_factor
        k_rope = self.rope(mx.contiguous(k_rope).reshape(N, 1, -1), kv.positions)
        q = mx.concatenate([q_nope, q_rope], axis=-1)
        k = mx.concatenate([k_nope, mx.broadcast_to(k_rope, (N, H, mla.rope_dims))], axis=-1)
        width = mla.stored_dims
        q, k, v = (_widened(part, width) for part in (q, k, v))
        out = kv.attend(self.layer, q, k, v, self.scale)[..., : mla.value_dims]  # [N, H, v]
        return self.o_proj(kept_rows(out.reshape(B, T, -1), keep))


def _widened(x: mx.array, width: int) -> mx.array:
    """x [N, H, d] zero-padded to [N, H, width]: a zero adds nothing to a score, and a
    value's zero columns come out as zero columns, dropped."""
    pad = width - x.shape[-1]
    return x if pad == 0 else mx.pad(x, [(0, 0), (0, 0), (0, pad)])


class Router(nn.Module):
    """The experts' scores' logits, and V3's per-expert correction bias. Not an nn.Linear:
    it stays in float wherever the rest is quantized, as DeepSeek's conversions keep it."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool):
        super().__init__()
        self.weight = mx.zeros((num_experts, hidden))
        if correction_bias:
            self.e_score_correction_bias = mx.zeros((num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self["weight"].T


class LatentExperts(nn.Module):
    """DeepSeek's sparse MLP: `gate` routes each token to `top_k` of `switch_mlp`'s experts
    (see `Routing`), and `shared_experts` every token runs is added."""

    def __init__(self, hidden: int, experts: Experts, routing: Routing):
        super().__init__()
        self.gate = Router(hidden, experts.num_experts, routing.correction_bias)
        self.switch_mlp = ExpertMLPs(hidden, experts)
        if experts.shared_intermediate_size is not None:
            self.shared_experts = GatedMLP(hidden, experts.shared_intermediate_size)
        self.top_k, self.routing = experts.top_k, routing

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        chosen, weights = self.route(tokens)
        outputs = self.switch_mlp(tokens, chosen)  # [N, k, hidden]
        y = (outputs * weights[..., None].astype(outputs.dtype)).sum(axis=-2)
        if "shared_experts" in self:
            y = y + self.shared_experts(tokens)
        return y.reshape(x.shape)

    def route(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """tokens [N, hidden] -> each one's experts [N, k] and their weights [N, k] float32."""
        bias = self.gate["e_score_correction_bias"] if self.routing.correction_bias else None
        return choose_experts(self.gate(tokens).astype(mx.float32), self.routing, self.top_k, bias)



def choose_experts(
    logits: mx.array, r: Routing, top_k: int, correction_bias: mx.array | None
) -> tuple[mx.array, mx.array]:
    """A DeepSeek-style router's choice: float32 logits [N, E] -> each token's experts
    [N, k] and their weights [N, k] (the correction bias, where given, for choosing only)."""
    scores = mx.sigmoid(logits) if r.sigmoid else mx.softmax(logits, axis=-1)
    choosing = scores
    if correction_bias is not None:
        choosing = scores + correction_bias.astype(mx.float32)
    if r.num_groups > 1:  # the groups outside the best `top_groups` never chosen
        grouped = choosing.reshape(choosing.shape[0], r.num_groups, -1)
        if r.group_by_top2:
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
        else:
            group_scores = grouped.max(axis=-1, keepdims=True)
        dropped = mx.argpartition(group_scores, kth=r.num_groups - r.top_groups - 1, axis=-2)
        dropped = dropped[:, : r.num_groups - r.top_groups]
        # -inf as DeepSeek's reference code: transformers and mlx-lm write 0, which a
        # kept expert's biased score (V3's) can fall below, choosing a dropped one.
        grouped = mx.put_along_axis(grouped, dropped, mx.array(-mx.inf), axis=-2)
        choosing = grouped.reshape(choosing.shape)
    chosen = mx.argpartition(choosing, kth=-top_k, axis=-1)[:, -top_k :]
    weights = mx.take_along_axis(scores, chosen, axis=-1)
    if r.normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + r.normalize_eps)
    return chosen, weights * r.scaling


class LatentLayer(nn.Module):
    """Pre-norm as llama's: h = x + attn(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = LatentAttention(config, layer)
        experts: Experts | None = config.extra["experts"]
        if experts is not None and experts.sparse_layers[layer]:
            self.mlp: nn.Module = LatentExperts(config.hidden_size, experts, config.extra["routing"])
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        h = kept_rows(x, keep) + self.self_attn(self.input_layernorm(x), kv, keep)
        return h + self.mlp(self.post_attention_layernorm(h))


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, LatentLayer)


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Per-expert tensors stacked into `switch_mlp`; the rotated rows of q_proj (q_b_proj)
    and kv_a_proj_with_mqa (weight, quantized scales and biases, bias) reordered from
    interleaved pairs to halves, unless the config says they pair halves already."""
    experts: Experts | None = config.extra["experts"]
    if experts is not None:
        stack_experts(weights, experts, layer_prefix="model.layers.{layer}.mlp", names=EXPERT_NAMES)
    mla: LatentShape = config.extra["mla"]
    q_rows = mla.nope_dims + mla.rope_dims
    for name in list(weights) if mla.interleaved else ():
        layer, _, _ = name.rpartition(".")
        if layer.endswith((".self_attn.q_proj", ".self_attn.q_b_proj")):
            weights[name] = _halves_order(name, weights[name], q_rows, mla.nope_dims, mla.rope_dims)
        elif layer.endswith(".self_attn.kv_a_proj_with_mqa"):
            rows = mla.kv_lora_rank + mla.rope_dims
            weights[name] = _halves_order(name, weights[name], rows, mla.kv_lora_rank, mla.rope_dims)
    return weights


def _halves_order(name: str, tensor: mx.array, block: int, start: int, dims: int) -> mx.array:
    """`tensor`'s rows, in each block of `block` rows those in [start, start + dims) as
    evens then odds."""
    if tensor.ndim < 1 or tensor.shape[0] % block:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, not whole heads of {block} rows")
    rotated = mx.concatenate([mx.arange(start, start + dims, 2), mx.arange(start + 1, start + dims, 2)])
    within = mx.concatenate([mx.arange(start), rotated, mx.arange(start + dims, block)])
    rows = (mx.arange(tensor.shape[0] // block)[:, None] * block + within[None, :]).reshape(-1)
    return mx.take(tensor, rows, axis=0)
