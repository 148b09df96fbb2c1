"""NVIDIA Nemotron-H (`nemotron_h`: Nemotron-H 4B/8B/47B/56B, NVIDIA-Nemotron-Nano-9B-v2
and -12B-v2, Nemotron 3 Nano 30B-A3B), as mlx-lm's `nemotron_h` and transformers'
`modeling_nemotron_h` run it.

A stack of single-mixer blocks, each `out = x + mixer(norm(x))`, the mixer per layer
from `hybrid_override_pattern` (one character a layer; transformers' newer
`layers_block_type` names them): M Mamba2, * attention, - an MLP, E routed experts.

Mamba2 is Granite 4.0's mixer (runtime/models/granitemoehybrid.py: the conv and scan
state through `kv.convolve` and `kv.ssm_scan`) with Nemotron-H's fields: `mamba_num_heads`
x `mamba_head_dim`, `n_groups` groups of B and C (`ssm_state_size`), `conv_kernel`,
`use_conv_bias`, `use_bias` on in_proj and out_proj (transformers'), dt clipped to
`time_step_limit` (no clip where left out or null), and the gated RMSNorm taken over
each of the `n_groups` parts (Zamba2RMSNormGated), unlike Granite's whole width.
Attention is GQA without positions (no RoPE), `head_dim` wide (else the older configs'
`attention_head_dim`, else transformers' 128; mlx-lm's hidden / heads differs), scaled
by head_dim**-0.5; only these layers store K/V. The MLP is up_proj, relu(x)**2, down_proj: no gate.

The experts (Nemotron 3 Nano's "E"): sigmoid router scores plus
`e_score_correction_bias` choose, the scores alone weigh. With `n_group` > 1 only the
`topk_group` groups of largest top-2 sums are chosen from (transformers' masks the rest
out). The k weights are divided by their sum (+1e-20) where `norm_topk_prob` says, then
times `routed_scaling_factor`. Each expert is a relu**2 MLP of `moe_intermediate_size`
(`switch_mlp.fc1` up, `fc2` down); a shared one of
`moe_shared_expert_intermediate_size` every token runs is added. A latent projection
(`moe_latent_size`) is refused.

Weights: `backbone.embeddings`, `backbone.layers.N.{norm,mixer}`, `backbone.norm_f`,
`lm_head`, in Hugging Face's originals and mlx-lm's conversions alike; originals store
conv weights [C, 1, K] and each expert apart (`mixer.experts.{e}.up_proj`), and an
MTP head (`mtp.*`) that is dropped, as both references do.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.kv.recurrent import STATE_BYTES
from runtime.models import llama
from runtime.models.deepseek_v2 import Routing, choose_experts
from runtime.models.experts import ExpertLinear, Experts, stack_experts
from runtime.models.granitemoehybrid import Mamba2, mamba_shape, read_time_step_limit
from runtime.models.layers import Attention, RMSNorm, RoPE, kept_rows

import mlx.core as mx
import mlx.nn as nn

DEFAULT_HEAD_DIM = 128  # transformers' NemotronHConfig's
NO_CLIP = (0.0, float("inf"))  # transformers' default time_step_limit (mlx-lm's too)
# transformers' `layers_block_type` names (its older spellings too) -> the pattern's characters
BLOCK_NAMES = {
    "mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E",
}


def unwrap_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The layer count from the pattern where left out (transformers derives it),
    `layer_norm_epsilon` as the norms' epsilon, and the heads' width: `head_dim`, else the
    older configs' `attention_head_dim` (Nemotron-H 4B's 128 beside 3072 / 32), else
    transformers' default 128, never hidden_size / heads."""
    pattern = _pattern(raw, source)
    filled = {"num_hidden_layers": len(pattern), **raw}
    if raw.get("head_dim") is None:
        filled["head_dim"] = raw.get("attention_head_dim", DEFAULT_HEAD_DIM)
    if "layer_norm_epsilon" in raw:
        filled["rms_norm_eps"] = raw["layer_norm_epsilon"]
    return filled


def _pattern(raw: dict[str, Any], source: str) -> str:
    pattern = raw.get("hybrid_override_pattern")
    if pattern is None:
        names = raw.get("layers_block_type") or raw.get("layer_types")
        if not isinstance(names, list) or not all(isinstance(n, str) and n in BLOCK_NAMES for n in names):
            raise CheckpointError(
                f"{source}: nemotron_h needs hybrid_override_pattern, or layers_block_type of "
                f"{', '.join(sorted(BLOCK_NAMES))}"
            )
        pattern = "".join(BLOCK_NAMES[n] for n in names)
    elif isinstance(pattern, list) and all(isinstance(c, str) for c in pattern):
        pattern = "".join(pattern)
    if not isinstance(pattern, str) or not pattern or set(pattern) - set("M*-E"):
        raise CheckpointError(
            f"{source}: hybrid_override_pattern must be characters M, *, - and E, got {pattern!r}"
        )
    return pattern


def read_config(fields: ConfigFields) -> dict[str, Any]:
    source = fields.source
    pattern = _pattern(fields.raw, source)
    num_layers = fields.get("num_hidden_layers", int)
    if num_layers != len(pattern):
        raise CheckpointError(
            f"{source}: num_hidden_layers is {num_layers}, but hybrid_override_pattern has {len(pattern)} layers"
        )
    if "*" not in pattern:  # the KV pools' sizing, and every released config, has one
        raise CheckpointError(f"{source}: a Nemotron-H model needs at least one attention layer (*)")
    for name, wanted in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if (activation := fields.get(name, str, wanted)) != wanted:
            raise CheckpointError(f"{source}: {name} '{activation}' is not supported")
    mamba = _mamba(fields) if "M" in pattern else None
    row_state = 0 if mamba is None else (mamba["conv_kernel"] - 1) * mamba["conv_dim"] + mamba["state_size"]
    bias = fields.get("attention_bias", bool, False)
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "num_kv_layers": pattern.count("*"),
        "recurrent_row_bytes": pattern.count("M") * row_state * STATE_BYTES,
        "extra": {
            "pattern": pattern,
            "mamba": mamba,
            "experts": _experts(fields, pattern) if "E" in pattern else None,
            # the router's (n_group, topk_group, routed_scaling_factor)
            "routing": (
                fields.get("n_group", int, 1),
                fields.get("topk_group", int, 1),
                fields.get("routed_scaling_factor", float, 1.0),
            ),
        },
    }


def _mamba(fields: ConfigFields) -> dict[str, Any]:
    source = fields.source
    heads, head_dim = fields.get("mamba_num_heads", int), fields.get("mamba_head_dim", int)
    groups, state_dim = fields.get("n_groups", int), fields.get("ssm_state_size", int)
    # transformers' None clips nothing, as its default (0, inf) does
    limit = fields.raw.get("time_step_limit")
    if isinstance(limit, list):  # infinity as transformers 5 and mlx-lm's convert tag it
        limit = [math.inf if v == {"__float__": "Infinity"} else v for v in limit]
    limit = NO_CLIP if limit is None else read_time_step_limit(ConfigFields({"time_step_limit": limit}, source), NO_CLIP)
    return mamba_shape(
        source,
        heads,
        head_dim,
        groups,
        state_dim,
        fields.get("conv_kernel", int, 4),
        field_names=("mamba_num_heads", "n_groups", "conv_kernel"),
        conv_bias=fields.get("use_conv_bias", bool, True),
        proj_bias=fields.get("use_bias", bool, False),
        time_step_limit=limit,
        norm_groups=groups,  # the gated norm runs over each group's heads apart
    )


def _experts(fields: ConfigFields, pattern: str) -> Experts:
    source = fields.source
    if fields.raw.get("moe_latent_size") is not None:
        raise CheckpointError(f"{source}: moe_latent_size (a latent expert projection) is not supported")
    num_experts = fields.get("n_routed_experts", int)
    groups, top_groups = fields.get("n_group", int, 1), fields.get("topk_group", int, 1)
    if groups < 1 or num_experts % groups or not 1 <= top_groups <= groups:
        raise CheckpointError(
            f"{source}: n_routed_experts ({num_experts}) in n_group ({groups}) groups, "
            f"topk_group ({top_groups}) of them, do not divide"
        )
    has_shared = fields.raw.get("n_shared_experts", 1) != 0  # transformers runs one always; 0 none
    shared = fields.get("moe_shared_expert_intermediate_size", int) if has_shared else None
    experts = Experts.read(
        fields,
        num_experts=num_experts,
        intermediate_size=fields.get("moe_intermediate_size", int),
        normalize=fields.get("norm_topk_prob", bool, True),
        dense_layers=[i for i, kind in enumerate(pattern) if kind != "E"],
        shared_intermediate_size=shared,
    )
    if experts.top_k > top_groups * num_experts // groups:
        raise CheckpointError(
            f"{source}: num_experts_per_tok ({experts.top_k}) is more than the topk_group groups' "
            f"{top_groups * num_experts // groups} experts"
        )
    return experts


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))**2): the "-" layers', and the experts' shared one."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(mx.square(nn.relu(self.up_proj(x))))


class Router(nn.Module):
    """The routing scores' weight and bias (not a Linear: the conversions keep it unquantized)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, hidden))
        self.e_score_correction_bias = mx.zeros((num_experts,))


class ReluSquaredExperts(nn.Module):
    """E relu**2 MLPs, their projections stacked: fc1 up, fc2 down."""

    def __init__(self, hidden: int, experts: Experts):
        super().__init__()
        self.fc1 = ExpertLinear(hidden, experts.intermediate_size, experts.num_experts)
        self.fc2 = ExpertLinear(experts.intermediate_size, hidden, experts.num_experts)

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        """x [N, hidden], experts [N, k] -> each pair's output [N, k, hidden]."""
        num_tokens, k = experts.shape
        hidden = mx.square(nn.relu(self.fc1(x, experts)))  # [N, k, I]
        pairs = experts.reshape(num_tokens * k, 1)  # each pair's hidden row, its one expert
        return self.fc2(hidden.reshape(num_tokens * k, -1), pairs).reshape(num_tokens, k, -1)


class MoE(nn.Module):
    def __init__(self, hidden: int, experts: Experts, groups: int, top_groups: int, scaling: float):
        super().__init__()
        self.gate = Router(hidden, experts.num_experts)
        self.switch_mlp = ReluSquaredExperts(hidden, experts)
        if experts.shared_intermediate_size is not None:
            self.shared_experts = ReluSquaredMLP(hidden, experts.shared_intermediate_size)
        self.top_k = experts.top_k
        # DeepSeek-V3's router (sigmoid, correction bias, groups by their top-2 sums), as
        # transformers' Nemotron-H runs it: the weights' sum plus 1e-20.
        self.routing = Routing(
            sigmoid=True,
            num_groups=groups,
            top_groups=top_groups,
            group_by_top2=True,
            correction_bias=True,
            normalize=experts.normalize,
            scaling=scaling,
            normalize_eps=1e-20,
        )

    def route(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """tokens [N, hidden] -> the chosen experts [N, k] and their weights [N, k]."""
        logits = tokens.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T
        return choose_experts(logits, self.routing, self.top_k, self.gate.e_score_correction_bias)

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        chosen, weights = self.route(tokens)
        outputs = self.switch_mlp(tokens, chosen)  # [N, k, hidden]
        y = (outputs * weights[..., None].astype(outputs.dtype)).sum(axis=-2)
        if "shared_experts" in self:
            y = y + self.shared_experts(tokens)
        return y.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        pattern: str = config.extra["pattern"]
        self.kind = kind = pattern[layer]
        index = pattern[:layer].count(kind)  # among its kind: a state or K/V layer's
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer: nn.Module
        if kind == "M":
            self.mixer = Mamba2(config, index)
        elif kind == "*":
            self.mixer = Attention(
                config,
                index,
                scale=config.head_dim**-0.5,
                rope=RoPE(config.head_dim, config.rope_theta, llama.NO_ROTATION),
                qkv_bias=config.qkv_bias,
                o_bias=config.o_bias,
            )
        elif kind == "-":
            self.mixer = ReluSquaredMLP(config.hidden_size, config.intermediate_size)
        else:
            experts: Experts = config.extra["experts"]
            routing = config.extra["routing"]
            self.mixer = MoE(config.hidden_size, experts, *routing)

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`."""
        normed = self.norm(x)
        if self.kind in ("M", "*"):  # every token mixed (the state, the K/V); `keep` goes on
            mixed = self.mixer(normed, kv, keep)
        else:
            mixed = self.mixer(kept_rows(normed, keep))
        return kept_rows(x, keep) + mixed


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, Block)


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """`backbone.embeddings` / `.layers` / `.norm_f` -> `model.embed_tokens` / `.layers`
    / `.norm`; an original's conv weights [C, 1, K] -> [C, K, 1], its experts stacked into
    `switch_mlp` (per expert, or transformers 5's stacked `experts.up_proj`); `mtp.*` dropped."""
    renamed = {}
    for name, w in weights.items():
        if name.startswith("mtp."):
            continue
        name = name.replace("backbone.embeddings.", "model.embed_tokens.", 1)
        name = name.replace("backbone.layers.", "model.layers.", 1).replace("backbone.norm_f.", "model.norm.", 1)
        if name.endswith(".mixer.conv1d.weight") and w.ndim == 3 and w.shape[-1] != 1:
            w = w.moveaxis(2, 1)
        for stored, ours in (("up_proj", "fc1"), ("down_proj", "fc2")):
            if name.endswith(f".mixer.experts.{stored}") and w.ndim == 3:
                name = name.replace(f".experts.{stored}", f".switch_mlp.{ours}.weight")
        renamed[name] = w
    if (experts := config.extra["experts"]) is not None:
        names = {"up_proj": "fc1", "down_proj": "fc2"}
        stack_experts(renamed, experts, layer_prefix="model.layers.{layer}.mixer", names=names)
    if config.tie_word_embeddings:  # some checkpoints ship a copy of the tied head
        renamed.pop("lm_head.weight", None)
    return renamed
