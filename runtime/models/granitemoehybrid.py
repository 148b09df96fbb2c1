"""Granite 4.0 (`granitemoehybrid`: IBM's granite-4.0-350m to -micro, all attention; the
"-h-" ones, e.g. -h-micro and -h-tiny, a hybrid of Mamba2 and attention layers), as
mlx-lm's `granitemoehybrid` and transformers' `modeling_granitemoehybrid` run it.

    layer i: Mamba2 where `layer_types` says "mamba", attention where "attention"
    h = x + mixer(input_layernorm(x)) * m;  out = h + ffn(post_attention_layernorm(h)) * m

with Granite 3's multipliers (runtime/models/granite.py): the embedding times
`embedding_multiplier`, attention scaled by `attention_multiplier`, each block's output
times `residual_multiplier` (m), logits divided by `logits_scaling`. Attention is GQA
with head_dim = hidden / heads, rotated where `position_embedding_type` is "rope"
(the "-h-" releases say "nope": no positions at all; transformers reads a config that
leaves it out so too). Only these layers store K/V.

Mamba2 (transformers' Bamba mixer): in_proj -> gate z, xBC, dt; a causal depthwise conv
(kernel `mamba_d_conv`, `mamba_conv_bias`) over xBC, SiLU -> x [H, Dh], B, C
[G, Ds] (each group serving H / G adjacent heads); dt = softplus(dt + dt_bias) clipped
to `time_step_limit` (mlx-lm's (0.001, 100) where left out); the scan
(`kv.ssm_scan`: runtime/kv/ssm_scan.py) from A = -exp(A_log), plus x D; then
RMSNorm(y * silu(z)) over the whole width (no groups, unlike mamba2's), out_proj. The
conv's last inputs and the scan's state are the row's recurrent state
(runtime/kv/recurrent.py).

The FFN: with `num_local_experts` > 0 (-h-tiny, -h-small), each token's top
`num_experts_per_tok` experts by router logit, weighted by the softmax of those
logits alone (`block_sparse_moe`), plus a shared SwiGLU MLP every token runs
(`shared_mlp`, `shared_intermediate_size` wide, gate and up stacked in `input_linear`);
else that shared MLP alone, which mlx-lm's conversions store as `mlp`
(gate_proj, up_proj, down_proj). Hugging Face's originals store it as `shared_mlp`,
each layer's experts as `block_sparse_moe.input_linear` [E, 2 I, hidden] (gate rows
first) and `output_linear`, and conv weights [C, 1, K]; both forms load, told apart as
mlx-lm's sanitize does.

Granite 3 MoE (`granitemoe`: granite-3.0-1b-a400m, -3b-a800m, 3.1's) is the same
decoder with every layer rotated attention and routed experts alone (no shared MLP),
as mlx-lm's `granitemoe` runs it.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.kv.recurrent import STATE_BYTES
from runtime.models import granite, llama
from runtime.models.experts import ExpertMLPs, Experts
from runtime.models.layers import Attention, GatedMLP, RMSNorm, RoPE, kept_rows
from runtime.models.qwen3_5 import silu

import mlx.core as mx
import mlx.nn as nn

from kernels.swiglu import swiglu

DEFAULT_TIME_STEP_LIMIT = (0.001, 100.0)  # mlx-lm's (transformers' Bamba mixer clips nothing)


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    source, num_layers = fields.source, fields.get("num_hidden_layers", int)
    multipliers = granite.read_multipliers(fields)
    if fields.raw["model_type"] == "granitemoe":  # Granite 3 MoE: rotated attention and experts alone
        is_mamba, position_type = [False] * num_layers, "rope"
        num_experts, shared_width = fields.get("num_local_experts", int), None
    else:
        is_mamba = _mamba_layers(fields, num_layers)
        position_type = fields.get("position_embedding_type", str, None)
        num_experts = fields.raw.get("num_local_experts") or 0
        shared_width = fields.get("shared_intermediate_size", int, None)
        if num_experts and shared_width is None:
            raise CheckpointError(f"{source}: missing required field 'shared_intermediate_size'")
    if all(is_mamba):  # the KV pools' sizing, and every released config, has one
        raise CheckpointError(f"{source}: a Granite 4.0 model needs at least one attention layer")
    if position_type not in (None, "rope", "nope"):
        raise CheckpointError(f"{source}: position_embedding_type must be 'rope' or 'nope', got {position_type!r}")
    if num_experts == 0 and shared_width is None:
        shared_width = fields.get("intermediate_size", int)
    mamba = _mamba(fields) if any(is_mamba) else None
    row_state = 0 if mamba is None else (mamba["conv_kernel"] - 1) * mamba["conv_dim"] + mamba["state_size"]
    bias = fields.get("attention_bias", bool, False)
    return {
        # The dense FFN is the shared MLP's width (transformers'; the releases say the same in both).
        "intermediate_size": fields.get("intermediate_size", int) if num_experts else shared_width,
        "qkv_bias": bias,
        "o_bias": bias,
        "num_kv_layers": is_mamba.count(False),
        "recurrent_row_bytes": is_mamba.count(True) * row_state * STATE_BYTES,
        "extra": {
            **multipliers,
            "mamba_layers": tuple(is_mamba),
            "mamba": mamba,
            "rotates": position_type == "rope",
            "experts": _experts(fields, shared_width) if num_experts else None,
        },
    }


def _mamba_layers(fields: ConfigFields, num_layers: int) -> list[bool]:
    layer_types = fields.get("layer_types", list, None)
    if layer_types is None:  # transformers would make every layer Mamba2: refused above
        return [True] * num_layers
    if len(layer_types) != num_layers or not all(kind in ("mamba", "attention") for kind in layer_types):
        raise CheckpointError(f"{fields.source}: layer_types needs {num_layers} entries of 'mamba' or 'attention'")
    return [kind == "mamba" for kind in layer_types]


def _mamba(fields: ConfigFields) -> dict[str, Any]:
    """The Mamba2 layers' shape (transformers' defaults where a config leaves a field out)."""
    source, hidden = fields.source, fields.get("hidden_size", int)
    heads, groups = fields.get("mamba_n_heads", int), fields.get("mamba_n_groups", int, 1)
    head_dim = fields.raw.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = fields.get("mamba_expand", int, 2) * hidden // heads
    head_dim = ConfigFields({"mamba_d_head": head_dim}, source).get("mamba_d_head", int)
    return mamba_shape(
        source,
        heads,
        head_dim,
        groups,
        fields.get("mamba_d_state", int),
        fields.get("mamba_d_conv", int, 4),
        conv_bias=fields.get("mamba_conv_bias", bool, True),
        proj_bias=fields.get("mamba_proj_bias", bool, False),
        time_step_limit=read_time_step_limit(fields, DEFAULT_TIME_STEP_LIMIT),
        norm_groups=1,  # the gated norm runs over the whole width
    )


def mamba_shape(
    source: str,
    heads: int,
    head_dim: int,
    groups: int,
    state_dim: int,
    kernel: int,
    *,
    field_names: tuple[str, str, str] = ("mamba_n_heads", "mamba_n_groups", "mamba_d_conv"),
    **options: Any,
) -> dict[str, Any]:
    """A Mamba2 mixer's shape as `Mamba2` and the budget read it (heads, groups, the conv's
    channels, the state's size) beside a family's `options` (biases, `time_step_limit`,
    `norm_groups`, ...); the heads and the conv's kernel checked, named as the config
    names them (`field_names`: its heads', groups' and kernel's fields)."""
    heads_name, groups_name, kernel_name = field_names
    if groups < 1 or heads % groups:
        raise CheckpointError(f"{source}: {heads_name} ({heads}) is not a multiple of {groups_name} ({groups})")
    if kernel < 2:
        raise CheckpointError(f"{source}: {kernel_name} must be at least 2, got {kernel}")
    width = heads * head_dim
    return {
        "heads": heads,
        "head_dim": head_dim,
        "groups": groups,
        "state_dim": state_dim,
        "conv_kernel": kernel,
        "conv_dim": width + 2 * groups * state_dim,
        "state_size": width * state_dim,
        **options,
    }


def read_time_step_limit(fields: ConfigFields, default: tuple[float, float]) -> tuple[float, float]:
    """`time_step_limit` [low, high], dt's clip (`default` where left out)."""
    source = fields.source
    limit = fields.raw.get("time_step_limit", default)
    if not (
        isinstance(limit, list | tuple)
        and len(limit) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in limit)
        and 0 <= limit[0] <= limit[1]
    ):
        raise CheckpointError(f"{source}: time_step_limit must be [low, high] with 0 <= low <= high, got {limit!r}")
    return (float(limit[0]), float(limit[1]))


def _experts(fields: ConfigFields, shared_width: int | None) -> Experts:
    """Every layer's: `num_local_experts` beside a shared MLP `shared_width` wide, if any."""
    return Experts.read(
        fields,
        num_experts=fields.get("num_local_experts", int),
        intermediate_size=fields.get("intermediate_size", int),
        normalize=True,  # a softmax over the chosen logits: the chosen probabilities over their sum
        shared_intermediate_size=shared_width,
    )


class GatedRMSNorm(nn.Module):
    """RMSNorm(y * silu(z)) over the whole width (transformers' BambaRMSNormGated), or
    over each of `groups` equal parts (Nemotron-H's Zamba2RMSNormGated)."""

    def __init__(self, dims: int, eps: float, groups: int = 1):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps, self.groups = eps, groups

    def __call__(self, y: mx.array, z: mx.array) -> mx.array:
        gated = swiglu(z, y)
        if self.groups == 1:
            return mx.fast.rms_norm(gated, self.weight, self.eps)
        parts = gated.reshape(*gated.shape[:-1], self.groups, -1)
        return mx.fast.rms_norm(parts, None, self.eps).reshape(gated.shape) * self.weight


class Mamba2(nn.Module):
    def __init__(self, config: ModelConfig, state_layer: int):
        super().__init__()
        m = config.extra["mamba"]
        self.state_layer = state_layer
        self.num_heads, self.head_dim, self.num_groups = m["heads"], m["head_dim"], m["groups"]
        self.state_dim, self.time_step_limit = m["state_dim"], m["time_step_limit"]
        self.width = width = m["heads"] * m["head_dim"]
        conv_dim, hidden = m["conv_dim"], config.hidden_size
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, m["conv_kernel"], groups=conv_dim, bias=m["conv_bias"])
        self.in_proj = nn.Linear(hidden, width + conv_dim + m["heads"], bias=m["proj_bias"])
        self.split_at = [width, width + conv_dim]  # gate z, xBC, dt
        self.dt_bias = mx.ones((m["heads"],))
        self.A_log = mx.zeros((m["heads"],))
        self.D = mx.ones((m["heads"],))
        if m.get("gated_norm", True):  # else silu(z) * y alone (Falcon-H1's)
            self.norm = GatedRMSNorm(width, config.rms_norm_eps, m["norm_groups"])
        self.out_proj = nn.Linear(width, hidden, bias=m.get("out_bias", m["proj_bias"]))

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        B, T, _ = x.shape
        N, H, Dh, G, Ds = B * T, self.num_heads, self.head_dim, self.num_groups, self.state_dim
        gate, xBC, dt = mx.split(self.in_proj(x).reshape(N, -1), self.split_at, axis=-1)
        # Every token is convolved and scanned (the row's state); only `keep` goes on.
        xBC = kv.convolve(self.state_layer, xBC, self.conv1d.weight[:, :, 0])
        if "bias" in self.conv1d:
            xBC = xBC + self.conv1d.bias
        inputs, Bs, Cs = mx.split(silu(xBC), [self.width, self.width + G * Ds], axis=-1)
        dt = nn.softplus(dt.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        dt = mx.clip(dt, *self.time_step_limit)
        log_decay = dt * -mx.exp(self.A_log.astype(mx.float32))
        heads = inputs.reshape(N, H, Dh)
        y = kv.ssm_scan(self.state_layer, heads, dt, Bs.reshape(N, G, Ds), Cs.reshape(N, G, Ds), log_decay)
        y = (y + heads * self.D.astype(heads.dtype)[:, None]).reshape(B, T, -1)
        y, gate = kept_rows(y, keep), kept_rows(gate.reshape(B, T, -1), keep)
        return self.out_proj(self.norm(y, gate) if "norm" in self else swiglu(gate, y))


class TopKGating(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class SparseMoE(nn.Module):
    """Each token's top k experts by router logit, weighted by the softmax of those k."""

    def __init__(self, hidden: int, experts: Experts):
        super().__init__()
        self.router = TopKGating(hidden, experts.num_experts)
        self.switch_mlp = ExpertMLPs(hidden, experts)
        self.top_k = experts.top_k

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router.layer(tokens).astype(mx.float32)
        chosen = mx.argpartition(logits, kth=-self.top_k, axis=-1)[:, -self.top_k :]
        weights = mx.softmax(mx.take_along_axis(logits, chosen, axis=-1), axis=-1)
        outputs = self.switch_mlp(tokens, chosen)  # [N, k, hidden]
        return (outputs * weights[..., None].astype(outputs.dtype)).sum(axis=-2).reshape(x.shape)


class SharedMLP(nn.Module):
    """The SwiGLU every token runs beside the experts: gate and up stacked in input_linear."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * width, bias=False)
        self.output_linear = nn.Linear(width, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(swiglu(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        is_mamba = config.extra["mamba_layers"]
        index = sum(1 for i in range(layer) if is_mamba[i] == is_mamba[layer])  # among its kind
        if is_mamba[layer]:
            self.mamba = Mamba2(config, index)
        else:
            scaling = config.rope_scaling if config.extra["rotates"] else llama.NO_ROTATION
            rope = RoPE(config.head_dim, config.rope_theta, scaling)
            self.self_attn = Attention(
                config,
                index,
                scale=config.extra["attention_multiplier"] * rope.attention_factor,
                rope=rope,
                qkv_bias=config.qkv_bias,
                o_bias=config.o_bias,
            )
        experts: Experts | None = config.extra["experts"]
        if experts is None:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        else:
            self.block_sparse_moe = SparseMoE(config.hidden_size, experts)
            if experts.shared_intermediate_size is not None:  # Granite 3 MoE has none
                self.shared_mlp = SharedMLP(config.hidden_size, experts.shared_intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.residual_multiplier = config.extra["residual_multiplier"]

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        m = self.residual_multiplier
        normed = self.input_layernorm(x)
        mixer = self.mamba if "mamba" in self else self.self_attn
        h = kept_rows(x, keep) + mixer(normed, kv, keep) * m
        normed = self.post_attention_layernorm(h)
        if "mlp" in self:
            ffn = self.mlp(normed)
        elif "shared_mlp" in self:
            ffn = self.block_sparse_moe(normed) + self.shared_mlp(normed)
        else:
            ffn = self.block_sparse_moe(normed)
        return h + ffn * m

    def plan_blocks(self) -> None:
        """None: the one-op blocks would add the branch without its multiplier."""


def build(config: ModelConfig) -> granite.Granite:
    return granite.Granite(config, DecoderLayer)


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """A Hugging Face original's conv weights [C, 1, K] -> [C, K, 1]; its `shared_mlp` of
    a dense model -> `mlp`'s gate, up and down; its experts' `input_linear` [E, 2 I,
    hidden] -> `switch_mlp`'s gate and up, `output_linear` -> down. A conversion's
    names are left as they are."""
    renamed = {}
    for name, w in weights.items():
        if name.endswith(".mamba.conv1d.weight") and w.ndim == 3 and w.shape[-1] != 1:
            w = w.moveaxis(2, 1)
        renamed[name] = w
    is_dense = config.extra["experts"] is None
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        # Each tensor moved only where stored (and gate and up only where they halve): one
        # left out, or of a wrong shape, is then named by the load's checks.
        if is_dense and _halves(renamed.get(f"{prefix}.shared_mlp.input_linear.weight"), axis=0):
            gate, up = mx.split(renamed.pop(f"{prefix}.shared_mlp.input_linear.weight"), 2, axis=0)
            renamed[f"{prefix}.mlp.gate_proj.weight"], renamed[f"{prefix}.mlp.up_proj.weight"] = gate, up
        if is_dense:
            _move(renamed, f"{prefix}.shared_mlp.output_linear.weight", f"{prefix}.mlp.down_proj.weight")
        moe = f"{prefix}.block_sparse_moe"
        if not is_dense and _halves(renamed.get(f"{moe}.input_linear.weight"), axis=-2):
            gate, up = mx.split(renamed.pop(f"{moe}.input_linear.weight"), 2, axis=-2)
            # copied: the expert kernel reads whole rows
            renamed[f"{moe}.switch_mlp.gate_proj.weight"] = mx.contiguous(gate)
            renamed[f"{moe}.switch_mlp.up_proj.weight"] = mx.contiguous(up)
        if not is_dense:
            _move(renamed, f"{moe}.output_linear.weight", f"{moe}.switch_mlp.down_proj.weight")
    if config.tie_word_embeddings:  # some checkpoints ship a copy of the tied head
        renamed.pop("lm_head.weight", None)
    return renamed


def _move(weights: dict[str, mx.array], name: str, to: str) -> None:
    if name in weights:
        weights[to] = weights.pop(name)


def _halves(w: mx.array | None, axis: int) -> bool:
    """Whether `w` is stored and splits into gate and up halves along `axis`."""
    return w is not None and w.ndim >= 2 and w.shape[axis] % 2 == 0
