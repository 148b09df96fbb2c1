"""TII Falcon-H1 (`falcon_h1`: Falcon-H1-0.5B to -34B, Base and Instruct), as transformers'
`modeling_falcon_h1` runs it (mlx-lm's `falcon_h1` for the conversions' layout).

Every layer runs attention and a Mamba2 mixer side by side on the same normed input, then
a SwiGLU MLP:

    n = input_layernorm(x)
    h = x + mamba(n) * ssm_out + attn(n * attention_in) * attention_out
    out = h + feed_forward(pre_ff_layernorm(h))

Attention is GQA of `head_dim`, RoPE (`rope_theta`), keys times `key_multiplier`. The
Mamba2 mixer is Granite 4.0's (runtime/models/granitemoehybrid.py; the conv and scan
state through `kv.convolve` and `kv.ssm_scan`) `mamba_d_ssm` wide (else `mamba_expand`
x hidden), its in_proj's output times `ssm_in_multiplier` and per part (z, x, B, C, dt)
by `ssm_multipliers`; dt unclipped; then silu(z) * y (`mamba_rms_norm` false, as
released; true is refused). The MLP's gate times `mlp_multipliers[0]`, its output times
`mlp_multipliers[1]`; the embedding times `embedding_multiplier`, the logits times
`lm_head_multiplier`. Every layer stores K/V and keeps a recurrent state.

Every multiplier acts on a linear map's input or output, so a Hugging Face original's
are folded into its weights at load, as llama.cpp's converter does (and mlx-lm's, which
skips `key_multiplier` and v's `attention_in_multiplier`); mlx-lm's conversions hold them
folded already (told apart by the conv weights' [C, 1, K] shape, as mlx-lm does). A tied
head then reads the folded embedding: its logits are scaled by lm_head / embedding.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.kv.recurrent import STATE_BYTES
from runtime.models import llama
from runtime.models.granitemoehybrid import Mamba2, mamba_shape
from runtime.models.layers import Attention, GatedMLP, RMSNorm, RoPE, kept_rows

import mlx.core as mx
import mlx.nn as nn

SCALARS = (
    "attention_in_multiplier", "attention_out_multiplier", "embedding_multiplier", "key_multiplier",
    "lm_head_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
)


def read_config(fields: ConfigFields) -> dict[str, Any]:
    source = fields.source
    llama.check_activation(fields)
    if fields.get("mamba_rms_norm", bool, False):
        raise CheckpointError(f"{source}: mamba_rms_norm=true (a gated norm in the Mamba2 mixer) is not supported")
    multipliers: dict[str, Any] = {}
    for name in SCALARS:
        value = fields.raw.get(name, 1.0)
        if not is_positive_number(value):
            raise CheckpointError(f"{source}: falcon_h1's {name} must be a positive number, got {value!r}")
        multipliers[name] = float(value)
    for name, count in (("mlp_multipliers", 2), ("ssm_multipliers", 5)):
        values = fields.raw.get(name, [1.0] * count)
        if not (isinstance(values, list) and len(values) == count and all(is_positive_number(v) for v in values)):
            raise CheckpointError(f"{source}: falcon_h1's {name} must be {count} positive numbers, got {values!r}")
        multipliers[name] = tuple(float(v) for v in values)
    mamba = _mamba(fields)
    num_layers = fields.get("num_hidden_layers", int)
    row_state = (mamba["conv_kernel"] - 1) * mamba["conv_dim"] + mamba["state_size"]
    bias = fields.get("attention_bias", bool, False)
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "recurrent_row_bytes": num_layers * row_state * STATE_BYTES,
        "extra": {"mamba": mamba, "multipliers": multipliers},
    }


def _mamba(fields: ConfigFields) -> dict[str, Any]:
    source, hidden = fields.source, fields.get("hidden_size", int)
    heads, head_dim = fields.get("mamba_n_heads", int), fields.get("mamba_d_head", int)
    width = fields.get("mamba_d_ssm", int, None) or fields.get("mamba_expand", int, 2) * hidden
    groups, state_dim = fields.get("mamba_n_groups", int, 1), fields.get("mamba_d_state", int)
    if heads * head_dim != width:
        raise CheckpointError(
            f"{source}: mamba_n_heads x mamba_d_head ({heads} x {head_dim}) is not mamba_d_ssm ({width})"
        )
    return mamba_shape(
        source,
        heads,
        head_dim,
        groups,
        state_dim,
        fields.get("mamba_d_conv", int, 4),
        conv_bias=fields.get("mamba_conv_bias", bool, True),
        proj_bias=fields.get("mamba_proj_bias", bool, False),
        out_bias=fields.get("projectors_bias", bool, False),
        time_step_limit=(0.0, float("inf")),  # transformers' and mlx-lm's: no clip
        norm_groups=groups,
        gated_norm=False,
    )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.mamba = Mamba2(config, layer)
        rope = RoPE(config.head_dim, config.rope_theta, config.rope_scaling)
        self.self_attn = Attention(
            config, layer, scale=config.head_dim**-0.5, rope=rope, qkv_bias=config.qkv_bias, o_bias=config.o_bias
        )
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`
        (the multipliers folded into the weights)."""
        normed = self.input_layernorm(x)
        h = kept_rows(x, keep) + self.mamba(normed, kv, keep) + self.self_attn(normed, kv, keep)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1(llama.Decoder):
    def __init__(self, config: ModelConfig):
        super().__init__(config, DecoderLayer)

    def project(self, h: mx.array) -> mx.array:
        if "lm_head" in self:
            return self.lm_head(h)
        m = self.config.extra["multipliers"]  # the embedding holds its multiplier folded in
        return self.model.embed_tokens.as_linear(h) * (m["lm_head_multiplier"] / m["embedding_multiplier"])


build = FalconH1


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """`final_layernorm` -> `norm`; a Hugging Face original's conv weights [C, 1, K] ->
    [C, K, 1] and its multipliers folded into the weights (module docstring)."""
    conv = weights.get("model.layers.0.mamba.conv1d.weight")
    is_original = conv is not None and conv.ndim == 3 and conv.shape[-1] > conv.shape[1]
    renamed = {}
    for name, w in weights.items():
        name = name.replace("model.final_layernorm.", "model.norm.", 1)
        if is_original:
            w = _folded(name, w, config)
        renamed[name] = w
    return renamed


def _folded(name: str, w: mx.array, config: ModelConfig) -> mx.array:
    """An original's tensor `name` with the multipliers on its input and output folded in."""
    m = config.extra["multipliers"]
    attention_in, (gate, down) = m["attention_in_multiplier"], m["mlp_multipliers"]
    if name.endswith(".mamba.conv1d.weight") and w.ndim == 3:
        return w.moveaxis(2, 1)
    scales = {
        "model.embed_tokens.weight": m["embedding_multiplier"],
        "lm_head.weight": m["lm_head_multiplier"],
        ".self_attn.q_proj.weight": attention_in,
        ".self_attn.k_proj.weight": attention_in * m["key_multiplier"],
        ".self_attn.k_proj.bias": m["key_multiplier"],
        ".self_attn.v_proj.weight": attention_in,
        ".self_attn.o_proj.weight": m["attention_out_multiplier"],
        ".self_attn.o_proj.bias": m["attention_out_multiplier"],
        ".mamba.out_proj.weight": m["ssm_out_multiplier"],
        ".mamba.out_proj.bias": m["ssm_out_multiplier"],
        ".feed_forward.gate_proj.weight": gate,
        ".feed_forward.down_proj.weight": down,
    }
    for suffix, scale in scales.items():
        if name.endswith(suffix):
            return w * scale
    if name.endswith((".mamba.in_proj.weight", ".mamba.in_proj.bias")):
        parts = _in_proj_scales(config)  # per output row: z, x, B, C, dt
        if w.ndim and w.shape[0] == parts.shape[0]:  # else the load names its shape
            scale = parts * (m["ssm_in_multiplier"] if name.endswith(".weight") else 1.0)
            return w * (scale[:, None] if w.ndim == 2 else scale).astype(w.dtype)
    return w


def _in_proj_scales(config: ModelConfig) -> mx.array:
    """`ssm_multipliers` spread over in_proj's output rows: z and x `d_ssm` each, B and C
    groups x state each, dt a row per head."""
    mamba, factors = config.extra["mamba"], config.extra["multipliers"]["ssm_multipliers"]
    width, bc = mamba["heads"] * mamba["head_dim"], mamba["groups"] * mamba["state_dim"]
    sizes = (width, width, bc, bc, mamba["heads"])
    return mx.concatenate([mx.full((size,), factor) for size, factor in zip(sizes, factors, strict=True)])
