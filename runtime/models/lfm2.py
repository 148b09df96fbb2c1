"""LFM2 (`lfm2`: Liquid AI's LFM2-350M to 2.6B): a hybrid of gated short-convolution
layers and GQA attention layers, as mlx-lm's `lfm2` runs it.

    layer i: attention where `full_attn_idxs` (else `layer_types`) names it, else a
             short convolution
    h = x + mixer(operator_norm(x));  out = h + feed_forward(ffn_norm(h))
    logits = embed_tokens^T embedding_norm(h_L)   (always tied)

Short convolution: in_proj -> B, C, x (each `hidden_size` wide); a causal depthwise
conv (kernel `conv_L_cache`) over B * x; C times it; out_proj. The conv's last
L - 1 inputs are the row's recurrent state, held by the storage (`kv.convolve`:
runtime/kv/recurrent.py); `conv_bias` puts a bias on in_proj, the conv and out_proj.
Attention: q and k RMS-normed per head (`q_layernorm`, `k_layernorm`), RoPE over the
whole head (hidden_size / heads wide), no biases; only these layers store K/V.

The FFN is SwiGLU (w1 gate, w3 up, w2 down) whose width is `block_ff_dim` (else
`intermediate_size`), adjusted where `block_auto_adjust_ff_dim` says so: 2/3 of it,
times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of` (LFM2-350M's 6656
-> 4608).

Module names are the checkpoints' own (the same in Hugging Face's and mlx-lm's). Hugging
Face's originals store the conv weight as [C, 1, L], mlx-lm's conversions as [C, L, 1];
both load, told apart by its shape as mlx-lm does.

LFM2-MoE (`lfm2_moe`: LFM2-8B-A1B) has the same layers; its first `num_dense_layers`
FFNs are SwiGLU MLPs `intermediate_size` wide (no adjustment), the rest route each token
to `num_experts_per_tok` of `num_experts` SwiGLU experts of `moe_intermediate_size`
(runtime/models/experts.py) by sigmoid scores: `expert_bias` (`use_expert_bias`) added
for choosing only, the chosen scores divided by their sum (plus 1e-6) where
`norm_topk_prob` says, times `routed_scaling_factor`. Hugging Face's originals name the
MLPs' projections w1 (gate), w3 (up), w2 (down), each expert's apart
(`feed_forward.experts.{e}.w1`); mlx-lm's conversions gate_proj, up_proj, down_proj,
the experts stacked (`feed_forward.switch_mlp`); both load.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV, split_heads
from runtime.kv.recurrent import STATE_BYTES
from runtime.models.experts import ExpertMLPs, Experts, stack_experts
from runtime.models.layers import CausalLM, GatedMLP, RMSNorm, RoPE, kept_rows

import mlx.core as mx
import mlx.nn as nn

from kernels.swiglu import swiglu

# transformers' Lfm2Config defaults, for the fields a config may leave out (mlx-lm
# requires most of them; the releases write them).
DEFAULTS = {
    "block_auto_adjust_ff_dim": True,
    "block_multiple_of": 256,
    "block_ffn_dim_multiplier": 1.0,
    "conv_L_cache": 3,
    "conv_bias": False,
}
DEFAULT_ROPE_THETA = 1_000_000.0
DEFAULT_NORM_EPS = 1e-5


def unwrap_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """LFM2's names for the shared fields -> the ones runtime/config.py reads: `norm_eps`,
    the FFN width `block_ff_dim` (mlx-lm's and transformers' first choice), its own rope
    theta default; tied always (mlx-lm's `lfm2` has no output head of its own)."""
    renamed = {**raw, "tie_word_embeddings": True, "rms_norm_eps": raw.get("norm_eps", DEFAULT_NORM_EPS)}
    if raw.get("block_ff_dim") is not None:
        renamed["intermediate_size"] = raw["block_ff_dim"]
    parameters = raw.get("rope_parameters")
    if "rope_theta" not in raw and not (isinstance(parameters, dict) and "rope_theta" in parameters):
        renamed["rope_theta"] = DEFAULT_ROPE_THETA
    return renamed


def read_config(fields: ConfigFields) -> dict[str, Any]:
    source, num_layers, hidden = fields.source, fields.get("num_hidden_layers", int), fields.get("hidden_size", int)
    if fields.get("block_dim", int, hidden) != hidden:
        raise CheckpointError(f"{source}: block_dim must equal hidden_size ({hidden})")
    is_conv = _conv_layers(fields, num_layers)
    if all(is_conv):  # the KV pools' sizing, and every released config, has one
        raise CheckpointError(f"{source}: an LFM2 model needs at least one attention layer")
    kernel = fields.get("conv_L_cache", int)
    if kernel < 2:
        raise CheckpointError(f"{source}: conv_L_cache must be at least 2, got {kernel}")
    is_moe = fields.raw["model_type"] == "lfm2_moe"
    return {
        # The dense FFNs' width: LFM2-MoE's as it is said (transformers and mlx-lm adjust only LFM2's).
        "intermediate_size": fields.get("intermediate_size", int) if is_moe else _ffn_width(fields),
        "qk_norm": True,
        "tie_word_embeddings": True,
        "num_kv_layers": is_conv.count(False),
        "recurrent_row_bytes": is_conv.count(True) * (kernel - 1) * hidden * STATE_BYTES,
        "extra": {
            "conv_layers": tuple(is_conv),
            "conv_kernel": kernel,
            "conv_bias": fields.get("conv_bias", bool),
            "experts": _experts(fields, num_layers) if is_moe else None,
            "expert_bias": is_moe and fields.get("use_expert_bias", bool, True),
            "routed_scaling": fields.get("routed_scaling_factor", float, 1.0) if is_moe else 1.0,
        },
    }


def _conv_layers(fields: ConfigFields, num_layers: int) -> list[bool]:
    """Per layer, whether it is a short convolution: all but `full_attn_idxs`, else
    all but the "full_attention" entries of `layer_types` (mlx-lm's order)."""
    indices = fields.get("full_attn_idxs", list, None)
    if indices is not None:
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in indices):
            raise CheckpointError(f"{fields.source}: full_attn_idxs needs layer indices below {num_layers}")
        return [i not in indices for i in range(num_layers)]
    layer_types = fields.get("layer_types", list, None)
    if layer_types is None:
        raise CheckpointError(f"{fields.source}: missing required field 'full_attn_idxs' (or 'layer_types')")
    if len(layer_types) != num_layers or not all(kind in ("conv", "full_attention") for kind in layer_types):
        raise CheckpointError(
            f"{fields.source}: layer_types needs {num_layers} entries of 'conv' or 'full_attention'"
        )
    return [kind != "full_attention" for kind in layer_types]


def _experts(fields: ConfigFields, num_layers: int) -> Experts:
    """LFM2-MoE's experts (transformers' defaults where a config leaves them out): every
    layer from `num_dense_layers` on routes."""
    num_dense = fields.raw.get("num_dense_layers", 2)
    if not isinstance(num_dense, int) or isinstance(num_dense, bool) or not 0 <= num_dense <= num_layers:
        raise CheckpointError(f"{fields.source}: num_dense_layers must be 0 to {num_layers}, got {num_dense!r}")
    return Experts.read(
        fields,
        num_experts=fields.get("num_experts", int),
        intermediate_size=fields.get("moe_intermediate_size", int),
        normalize=fields.get("norm_topk_prob", bool, True),
        dense_layers=range(num_dense),
    )


def _ffn_width(fields: ConfigFields) -> int:
    width = fields.get("intermediate_size", int)  # block_ff_dim's, where given (unwrap_config)
    if not fields.get("block_auto_adjust_ff_dim", bool):
        return int(width)
    width = int(2 * width / 3)
    multiplier = fields.get("block_ffn_dim_multiplier", float, None)
    if multiplier is not None:
        width = int(multiplier * width)
    multiple = fields.get("block_multiple_of", int)
    width = multiple * ((width + multiple - 1) // multiple)
    if width <= 0:
        raise CheckpointError(f"{fields.source}: the adjusted FFN width is {width}")
    return width


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, kv_layer: int):
        super().__init__()
        self.kv_layer = kv_layer
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.out_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        self.q_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.k_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.rope = RoPE(d, config.rope_theta, config.rope_scaling)

    def __call__(self, x: mx.array, kv: ForwardKV) -> mx.array:
        B, T, _ = x.shape
        N, H, Hkv, D = B * T, self.num_heads, self.num_kv_heads, self.head_dim
        if "qkv_proj" in self:  # stacked at load on the CPU (runtime/cpu_weights.py)
            q, k, v = split_heads(self.qkv_proj(x), H, Hkv)
        else:
            q, k, v = (p(x).reshape(N, -1, D) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = self.rope(self.q_layernorm(q), kv.positions)
        k = self.rope(self.k_layernorm(k), kv.positions)
        out = kv.attend(self.kv_layer, q, k, v, D**-0.5)  # [N, H, D]
        return self.out_proj(out.reshape(B, T, -1))


class ShortConv(nn.Module):
    def __init__(self, config: ModelConfig, state_layer: int):
        super().__init__()
        self.state_layer = state_layer
        hidden, kernel, bias = config.hidden_size, config.extra["conv_kernel"], config.extra["conv_bias"]
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        B, T, hidden = x.shape
        gate_in, gate_out, inputs = mx.split(self.in_proj(x).reshape(B * T, 3 * hidden), 3, axis=-1)
        # Every token is convolved (the row's state is its last inputs); only `keep` goes on.
        conv = kv.convolve(self.state_layer, gate_in * inputs, self.conv.weight[:, :, 0])
        if "bias" in self.conv:
            conv = conv + self.conv.bias
        return self.out_proj(kept_rows((gate_out * conv).reshape(B, T, hidden), keep))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)  # gate
        self.w3 = nn.Linear(hidden, width, bias=False)  # up
        self.w2 = nn.Linear(width, hidden, bias=False)  # down

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class SigmoidRoutedExperts(nn.Module):
    """LFM2-MoE's sparse FFN: sigmoid scores choose (with `expert_bias`) and weigh
    (without it) each token's experts in `switch_mlp`."""

    def __init__(self, hidden: int, experts: Experts, has_bias: bool, scaling: float):
        super().__init__()
        self.gate = nn.Linear(hidden, experts.num_experts, bias=False)
        self.switch_mlp = ExpertMLPs(hidden, experts)
        if has_bias:
            self.expert_bias = mx.zeros((experts.num_experts,))
        self.top_k, self.normalize, self.scaling = experts.top_k, experts.normalize, scaling

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        scores = mx.sigmoid(self.gate(tokens).astype(mx.float32))
        choosing = scores + self.expert_bias.astype(mx.float32) if "expert_bias" in self else scores
        chosen = mx.argpartition(choosing, kth=-self.top_k, axis=-1)[:, -self.top_k :]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.normalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-6)
        outputs = self.switch_mlp(tokens, chosen)  # [N, k, hidden]
        y = (outputs * (weights * self.scaling)[..., None].astype(outputs.dtype)).sum(axis=-2)
        return y.reshape(x.shape)


def _feed_forward(config: ModelConfig, layer: int) -> nn.Module:
    experts: Experts | None = config.extra["experts"]
    if experts is None:
        return FeedForward(config.hidden_size, config.intermediate_size)
    if not experts.sparse_layers[layer]:
        return GatedMLP(config.hidden_size, config.intermediate_size)  # mlx-lm's names (rename_weights)
    return SigmoidRoutedExperts(config.hidden_size, experts, config.extra["expert_bias"], config.extra["routed_scaling"])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        is_conv = config.extra["conv_layers"]
        index = sum(1 for i in range(layer) if is_conv[i] == is_conv[layer])  # among its kind
        if is_conv[layer]:
            self.conv = ShortConv(config, index)
        else:
            self.self_attn = Attention(config, index)
        self.feed_forward = _feed_forward(config, layer)
        self.operator_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        normed = self.operator_norm(x)
        if "conv" in self:
            mixed = self.conv(normed, kv, keep)
        else:
            mixed = kept_rows(self.self_attn(normed, kv), keep)
        h = kept_rows(x, keep) + mixed
        return h + self.feed_forward(self.ffn_norm(h))


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.embedding_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # the final norm

    @property
    def norm(self) -> RMSNorm:  # the name CausalLM.hidden applies the final norm by
        return self.embedding_norm


class Decoder(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = DecoderBody(config)


build = Decoder


# LFM2-MoE's MLP projections as Hugging Face names them -> as mlx-lm's conversions do.
MOE_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MOE_PROJECTION = re.compile(r"(\.feed_forward\.(?:experts\.\d+\.)?)(w[123])\.")


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """A Hugging Face original's conv weights [C, 1, L] -> mlx-lm's [C, L, 1]; LFM2-MoE's
    w1/w3/w2 -> gate_proj/up_proj/down_proj, each expert's stacked into `switch_mlp`."""
    renamed = {
        name: w.moveaxis(2, 1) if name.endswith(".conv.conv.weight") and w.ndim == 3 and w.shape[-1] > w.shape[1] else w
        for name, w in weights.items()
    }
    if (experts := config.extra["experts"]) is None:
        return renamed
    renamed = {
        _MOE_PROJECTION.sub(lambda m: m.group(1) + MOE_PROJECTIONS[m.group(2)] + ".", name): w
        for name, w in renamed.items()
    }
    names = {name: name for name in MOE_PROJECTIONS.values()}
    stack_experts(renamed, experts, layer_prefix="model.layers.{layer}.feed_forward", names=names)
    return renamed
