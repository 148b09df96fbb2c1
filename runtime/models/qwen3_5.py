"""Qwen3.5 (`qwen3_5`; its text model `qwen3_5_text`; with routed experts `qwen3_5_moe`,
`qwen3_5_moe_text`): a hybrid of Gated DeltaNet linear-attention layers and gated
full-attention layers, as mlx-lm's `qwen3_5` and `qwen3_5_moe` run it.

    layer i: linear attention, or full attention where `layer_types` says
             "full_attention" (without it: every `full_attention_interval`-th layer)
    h = x + mixer(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h))

Full attention: q_proj gives each head's query and a gate side by side; the output is
multiplied by sigmoid(gate) before o_proj; q and k are RMS-normed per head and RoPE
turns only the first `partial_rotary_factor` of each head. Its rope is an "mrope" over
(temporal, height, width) positions; for text all three are the token's position, so
every section turns by the same angle and it is plain RoPE on the rotated part.
Only these layers store K/V (`num_kv_layers`, indexed among themselves).

Linear attention (Gated DeltaNet): per token, in_proj_qkv -> a causal depthwise conv
(kernel `linear_conv_kernel_dim`) -> SiLU -> q, k (L2-normed, q scaled by Dk^-0.5), v;
a decay g = exp(-exp(A_log) softplus(a + dt_bias)) (passed as its log) and a write strength
beta = sigmoid(b); the delta rule's state [Hv, Dv, Dk] gives y, RMS-normed and gated
by silu(z). The conv inputs and the state are a row's recurrent state, held by the
storage (`kv.convolve`, `kv.delta_rule`: runtime/kv/recurrent.py).

Checkpoints: Hugging Face's originals store conv1d weights as [C, 1, K] and the
decoder norms (input, post-attention, final, q and k; not the gated one) as offsets
from 1; mlx-lm's conversions store [C, K, 1] and the scales. Both load, told apart by
the conv weights' shape as mlx-lm does. The multimodal layout (`text_config`,
`model.language_model.` names) loads its text model; the vision tower and the
multi-token-prediction head (`mtp.`) are dropped.

With routed experts, every layer's MLP routes among `num_experts` of
`moe_intermediate_size` beside a gated shared expert, as qwen2_moe's
(runtime/models/experts.py). Hugging Face's originals store each layer's experts fused
(`mlp.experts.gate_up_proj` [E, 2 I, hidden], gate rows first, and `mlp.experts.down_proj`),
older exports one tensor per expert; both are stacked into `switch_mlp` at load.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.kv.recurrent import STATE_BYTES
from runtime.models import llama, multimodal
from runtime.models.experts import Experts, feed_forward, stack_experts
from runtime.models.layers import RMSNorm, RoPE, kept_rows

import mlx.core as mx
import mlx.nn as nn

from kernels.fused_blocks import NormedLayers
from kernels.poly_exp import poly_exp
from kernels.swiglu import swiglu

ROTATES_PART_OF_A_HEAD = True  # `partial_rotary_factor` (0.25 in the releases)
DEFAULT_PARTIAL_ROTARY = 0.25  # mlx-lm's and transformers' default
# Stored as offsets from 1 in Hugging Face's originals (mlx-lm's sanitize adds the 1).
OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by sigmoid of q_proj's other half."""

    def __init__(self, config: ModelConfig, kv_layer: int):
        super().__init__()
        self.kv_layer = kv_layer
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = config.head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * d, bias=bias)  # query, gate
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)
        rotary = config.extra["rotary_dims"]
        self.rope = RoPE(rotary, config.rope_theta, config.rope_scaling)
        # YaRN's gain on q and k (mscale) is on their rotated part alone, as transformers and
        # mlx-lm apply it: the rest of each head keeps its scale, so the attention's scale
        # cannot take it as a whole head's rotation lets it (runtime/models/layers.py).
        gain = math.sqrt(self.rope.attention_factor)
        self._rotated_gain = None if gain == 1.0 else mx.concatenate([mx.full((rotary,), gain), mx.ones((d - rotary,))])

    def __call__(self, x: mx.array, kv: ForwardKV) -> mx.array:
        B, T, _ = x.shape
        N, H, Hkv, D = B * T, self.num_heads, self.num_kv_heads, self.head_dim
        if "qkv_proj" in self:  # stacked at load on the CPU (runtime/cpu_weights.py)
            query_gate, k, v = mx.split(self.qkv_proj(x), [2 * H * D, (2 * H + Hkv) * D], axis=-1)
        else:
            query_gate, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = mx.split(query_gate.reshape(N, H, 2 * D), 2, axis=-1)
        q, k = self.q_norm(q), self.k_norm(k.reshape(N, Hkv, D))
        if self._rotated_gain is not None:
            q, k = q * self._rotated_gain.astype(q.dtype), k * self._rotated_gain.astype(k.dtype)
        q, k = self.rope(q, kv.positions), self.rope(k, kv.positions)
        out = kv.attend(self.kv_layer, q, k, v.reshape(N, Hkv, D), D**-0.5)  # [N, H, D]
        return self.o_proj(sigmoid_gated(out, gate).reshape(B, T, -1))


# mlx's CPU sigmoid and exp are scalar (~15 ms for the silu of a 150-token chunk's
# [150, 6144] convolution output, ~10 ms for an attention layer's [150, 4096] gate): a
# prompt spent about a third of its time in them. On the CPU in float32 the silu goes
# through the SwiGLU kernel (times ones: ~0.4 ms) and the gate's sigmoid through the
# polynomial exp made of mx ops (~4 ms); both agree with mlx's to ~1e-6.


def _on_cpu_float32(x: mx.array) -> bool:
    return mx.default_device() == mx.cpu and x.dtype == mx.float32


def silu(x: mx.array) -> mx.array:
    return swiglu(x, mx.ones_like(x)) if _on_cpu_float32(x) else nn.silu(x)


def sigmoid_gated(x: mx.array, gate: mx.array) -> mx.array:
    """x * sigmoid(gate)."""
    if _on_cpu_float32(gate):
        return x / (1.0 + poly_exp(-gate))
    return x * mx.sigmoid(gate)


class GatedRMSNorm(nn.Module):
    """RMSNorm of y, times silu(z), in float32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, y: mx.array, z: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(y, self.weight, self.eps).astype(mx.float32)
        return swiglu(z.astype(mx.float32), normed).astype(y.dtype)  # silu(z) * normed


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, state_layer: int):
        super().__init__()
        lin = config.extra["linear"]
        self.state_layer = state_layer
        self.num_k_heads, self.num_v_heads = lin["num_key_heads"], lin["num_value_heads"]
        self.k_dim, self.v_dim = lin["key_head_dim"], lin["value_head_dim"]
        key_size, value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.split_at = [key_size, 2 * key_size]
        channels = 2 * key_size + value_size
        hidden = config.hidden_size
        self.conv1d = nn.Conv1d(channels, channels, lin["conv_kernel"], groups=channels, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_size, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_size, hidden, bias=False)

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        B, T, _ = x.shape
        N, Hk, Hv, Dk, Dv = B * T, self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim
        mixed = kv.convolve(self.state_layer, self.in_proj_qkv(x).reshape(N, -1), self.conv1d.weight[:, :, 0])
        q, k, v = mx.split(silu(mixed), self.split_at, axis=-1)
        # L2-normed, q also by Dk^-0.5, through rms_norm as mlx-lm does (its eps on the
        # mean, not the sum, of squares: scaled to match).
        eps = 1e-6 / Dk
        q = mx.fast.rms_norm(q.reshape(N, Hk, Dk), None, eps) / Dk
        k = mx.fast.rms_norm(k.reshape(N, Hk, Dk), None, eps) * Dk**-0.5
        if Hv > Hk:  # each key head serves Hv / Hk value heads, adjacent
            q, k = mx.repeat(q, Hv // Hk, axis=1), mx.repeat(k, Hv // Hk, axis=1)
        a = self.in_proj_a(x).reshape(N, Hv)
        log_decay = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias)
        beta = mx.sigmoid(self.in_proj_b(x).reshape(N, Hv))
        y = kv.delta_rule(self.state_layer, q, k, v.reshape(N, Hv, Dv), log_decay, beta)
        y = self.norm(y, self.in_proj_z(x).reshape(N, Hv, Dv))
        return self.out_proj(kept_rows(y.reshape(B, T, -1), keep))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        is_linear = config.extra["linear_layers"]
        index = sum(1 for i in range(layer) if is_linear[i] == is_linear[layer])  # among its kind
        if is_linear[layer]:
            self.linear_attn = GatedDeltaNet(config, index)
        else:
            self.self_attn = GatedAttention(config, index)
        self.mlp = feed_forward(config, layer)  # dense, or routed experts (qwen3_5_moe)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    mlp_block: NormedLayers | None = None  # the MLP's residual block as one op, where planned

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        normed = self.input_layernorm(x)
        if "linear_attn" in self:
            mixed = self.linear_attn(normed, kv, keep)
        else:
            mixed = kept_rows(self.self_attn(normed, kv), keep)
        h = kept_rows(x, keep) + mixed
        out = self.mlp.as_block(h, self.mlp_block)
        return out if out is not None else h + self.mlp(self.post_attention_layernorm(h))

    def plan_blocks(self) -> None:
        self.mlp_block = self.mlp.block_operands(self.post_attention_layernorm)


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, DecoderLayer)


def unwrap_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The multimodal `qwen3_5` (`qwen3_5_moe`) config -> its text model's (`qwen3_5_text`,
    `qwen3_5_moe_text`); a flat config (mlx-lm reads one as its own text config) is the
    text model's."""
    text_type = raw["model_type"].removesuffix("_text") + "_text"
    if "text_config" in raw:
        raw = multimodal.text_config(raw, source, text_type)
    text = {**raw, "model_type": text_type}
    if "intermediate_size" not in text and "moe_intermediate_size" in text:
        # The experts model's releases give no dense size (transformers' config has none):
        # every layer routes, so no layer runs one.
        text["intermediate_size"] = text["moe_intermediate_size"]
    return text


def read_config(fields: ConfigFields) -> dict[str, Any]:
    return read_hybrid(fields, _experts(fields))


def read_hybrid(fields: ConfigFields, experts: Experts | None) -> dict[str, Any]:
    """The hybrid decoder's settings (Qwen3-Next's too), its MLPs' routed `experts` or None."""
    llama.check_activation(fields)
    source, num_layers = fields.source, fields.get("num_hidden_layers", int)
    if not fields.get("attn_output_gate", bool, True):
        raise CheckpointError(f"{source}: attn_output_gate=false is not supported")
    is_linear = _linear_layers(fields, num_layers)
    if all(is_linear):  # the KV pools' sizing, and every released config, has one
        raise CheckpointError(f"{source}: a hybrid Qwen model needs at least one full_attention layer")
    lin = {
        "num_key_heads": fields.get("linear_num_key_heads", int),
        "num_value_heads": fields.get("linear_num_value_heads", int),
        "key_head_dim": fields.get("linear_key_head_dim", int),
        "value_head_dim": fields.get("linear_value_head_dim", int),
        "conv_kernel": fields.get("linear_conv_kernel_dim", int, 4),
    }
    if lin["num_value_heads"] % lin["num_key_heads"] or lin["conv_kernel"] < 2:
        raise CheckpointError(
            f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads, "
            "and linear_conv_kernel_dim at least 2"
        )
    head_dim = fields.get("head_dim", int, None) or fields.get("hidden_size", int) // fields.get(
        "num_attention_heads", int
    )
    channels = 2 * lin["num_key_heads"] * lin["key_head_dim"] + lin["num_value_heads"] * lin["value_head_dim"]
    row_state = (lin["conv_kernel"] - 1) * channels + lin["num_value_heads"] * lin["value_head_dim"] * lin["key_head_dim"]
    bias = fields.get("attention_bias", bool, False)
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
        "num_kv_layers": is_linear.count(False),
        "recurrent_row_bytes": is_linear.count(True) * row_state * STATE_BYTES,
        "extra": {
            "experts": experts,
            "linear_layers": tuple(is_linear),
            "linear": lin,
            "rotary_dims": int(head_dim * _partial_rotary_factor(fields)),
        },
    }


def _experts(fields: ConfigFields) -> Experts | None:
    """Routed experts in every layer (mlx-lm's and transformers' qwen3_5_moe: neither
    reads `mlp_only_layers` or `decoder_sparse_step`), or None for the dense model."""
    if not fields.raw.get("num_experts"):
        return None
    shared = fields.raw.get("shared_expert_intermediate_size")
    return Experts.read(
        fields,
        num_experts=fields.get("num_experts", int),
        intermediate_size=fields.get("moe_intermediate_size", int),
        normalize=fields.get("norm_topk_prob", bool, True),
        shared_intermediate_size=fields.get("shared_expert_intermediate_size", int) if shared else None,
    )


def _linear_layers(fields: ConfigFields, num_layers: int) -> list[bool]:
    """Per layer, whether it is linear attention: `layer_types`, else every
    `full_attention_interval`-th layer full (mlx-lm reads only the interval; the
    released configs say the same in both)."""
    layer_types = fields.get("layer_types", list, None)
    if layer_types is not None:
        kinds = ("linear_attention", "full_attention")
        if len(layer_types) != num_layers or not all(kind in kinds for kind in layer_types):
            raise CheckpointError(
                f"{fields.source}: layer_types needs {num_layers} entries of "
                "'linear_attention' or 'full_attention'"
            )
        return [kind == "linear_attention" for kind in layer_types]
    interval = fields.get("full_attention_interval", int, 4)
    if interval < 1:
        raise CheckpointError(f"{fields.source}: full_attention_interval must be at least 1")
    return [(i + 1) % interval != 0 for i in range(num_layers)]


def _partial_rotary_factor(fields: ConfigFields) -> float:
    parameters = fields.get("rope_parameters", dict, None) or {}
    factor = parameters.get("partial_rotary_factor", fields.raw.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
    if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise CheckpointError(f"{fields.source}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    return float(factor)


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Multimodal names -> the text model's, the vision tower and the multi-token
    prediction head dropped; a Hugging Face original's conv weights and norm offsets
    -> mlx-lm's form."""
    weights = multimodal.text_weights(weights, "qwen3_5")
    weights = {
        name: w for name, w in weights.items() if not name.startswith(("mtp.", "model.visual.", "visual."))
    }
    if (experts := config.extra["experts"]) is not None:
        _stack_experts(weights, experts, config.num_hidden_layers)
    return from_original(weights)


def from_original(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A Hugging Face original's conv weights [C, 1, K] and norm offsets -> mlx-lm's form,
    in place; a conversion (conv weights [C, K, 1]) is left as it is."""
    is_original = any(name.endswith("conv1d.weight") and w.shape[-1] != 1 for name, w in weights.items())
    if not is_original:
        return weights
    for name, w in weights.items():
        if name.endswith("conv1d.weight"):
            weights[name] = w.moveaxis(2, 1)
        elif name.endswith(OFFSET_NORMS) and w.ndim == 1:
            weights[name] = w + 1.0
    return weights


EXPERT_NAMES = {name: name for name in ("gate_proj", "up_proj", "down_proj")}  # stored: ours


def _stack_experts(weights: dict[str, mx.array], experts: Experts, num_layers: int) -> None:
    """A layer's experts as stored (fused, or one tensor each) -> `switch_mlp`, in place."""
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp"
        if (gate_up := weights.pop(f"{prefix}.experts.gate_up_proj", None)) is not None:
            gate, up = mx.split(gate_up, 2, axis=-2)  # copied: the expert kernel reads whole rows
            weights[f"{prefix}.switch_mlp.gate_proj.weight"] = mx.contiguous(gate)
            weights[f"{prefix}.switch_mlp.up_proj.weight"] = mx.contiguous(up)
        if (down := weights.pop(f"{prefix}.experts.down_proj", None)) is not None:
            weights[f"{prefix}.switch_mlp.down_proj.weight"] = down
    stack_experts(weights, experts, layer_prefix="model.layers.{layer}.mlp", names=EXPERT_NAMES)
