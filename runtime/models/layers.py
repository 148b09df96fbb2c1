"""The pieces every family builds from: RoPE variants, norms, attention, gated MLPs.

Module and parameter names follow the Hugging Face checkpoints, so weights load by
name. Attention goes through the one cache entry, `kv.attend(layer, q, k, v, scale)`;
a layer never branches on storage, on prefill versus decode, or on its window (the
storage knows which layers are windowed, see runtime/kv/layout.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from runtime.config import LLAMA3_ROPE_DEFAULTS, ModelConfig
from runtime.errors import CheckpointError
from runtime.kv.base import CausalNoCache, ForwardKV, split_heads

import mlx.core as mx
import mlx.nn as nn

from kernels.fused_blocks import NormedLayers, mlp_block, normed_layers
from kernels.norm_rope import inverse_frequencies, rms_norm, rope
from kernels.swiglu import gelu_tanh, gelu_tanh_halves, swiglu, swiglu_halves


class RoPE(nn.Module):
    """Rotary embedding with per-token offsets; default, linear, llama3, YaRN and
    LongRoPE scaling.

    `attention_factor` is what YaRN and LongRoPE multiply the rotated q and k by,
    squared: the attention's scale takes it (q·k scaled by f twice is the logits scaled
    by f²), so the rotation stays one op."""

    def __init__(self, dims: int, base: float, scaling: dict[str, Any] | None):
        super().__init__()
        if dims < 2:  # its frequencies divide by the pairs: a head of one was a ZeroDivisionError
            raise CheckpointError(f"RoPE would rotate {dims} of each head's dimensions; it needs at least 2")
        self.dims = dims
        self.base: float | None = base
        self.scale = 1.0
        self.attention_factor = 1.0
        self._freqs: mx.array | None = None
        scaling = scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            self.scale = 1.0 / float(scaling["factor"])
        elif kind == "llama3":
            self._freqs = _llama3_freqs(dims, base, scaling)
            self.base = None
        elif kind == "longrope":  # runtime/models/phi3.py reads and checks it
            self._freqs = mx.array(scaling["long_factor"], dtype=mx.float32) * base ** (
                mx.arange(0, dims, 2, dtype=mx.float32) / dims
            )
            self.base = None
            # Absent where phi3 folded it into q_proj (partial rotation).
            self.attention_factor = float(scaling.get("attention_factor", 1.0)) ** 2
        elif kind == "none":  # a NoPE layer (SmolLM3's): every period infinite, every angle 0
            self._freqs = mx.full((dims // 2,), mx.inf)
            self.base = None
        elif kind == "proportional":  # Gemma 4's full layers: runtime/models/gemma4.py reads it
            self._freqs = _proportional_freqs(dims, base, scaling)
            self.base = None
        elif kind == "yarn":  # runtime/config.py checks it and fills in its context
            self._freqs = _yarn_freqs(dims, base, scaling)
            self.base = None
            self.attention_factor = yarn_attention_factor(scaling) ** 2
        self._inv_freqs = inverse_frequencies(dims, self.base, self._freqs)  # not a parameter

    @property
    def inv_freqs(self) -> mx.array:
        """[dims / 2] float32: angle i of position p is (p * scale) * inv_freqs[i]."""
        return self._inv_freqs

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [N, H, D], token n at positions[n] (int32 [N])."""
        return rope(
            x,
            positions,
            dims=self.dims,
            base=self.base,
            scale=self.scale,
            freqs=self._freqs,
            inv_freqs=self._inv_freqs,
        )


def _llama3_freqs(dims: int, base: float, scaling: dict) -> mx.array:
    factor = float(scaling["factor"])
    low, high, old_context = (float(scaling.get(k, v)) for k, v in LLAMA3_ROPE_DEFAULTS.items())
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > old_context / low, freqs * factor, freqs)
    is_medium = (wavelens > old_context / high) & (wavelens < old_context / low)
    smooth = (old_context / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(is_medium, smooth_freqs, freqs)


def _proportional_freqs(dims: int, base: float, scaling: dict) -> mx.array:
    """Gemma 4's partial rotation: the first `partial_rotary_factor` of the pairs turn at
    the periods a full rotation of `dims` gives them (times `factor`), the rest not at all
    (an infinite period), so the rotation keeps the head's width and layout."""
    angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dims // 2)
    periods = float(scaling.get("factor", 1.0)) * base ** (mx.arange(0, 2 * angles, 2, dtype=mx.float32) / dims)
    return mx.concatenate([periods, mx.full((dims // 2 - angles,), mx.inf)])


def _yarn_freqs(dims: int, base: float, scaling: dict) -> mx.array:
    """YaRN's per-dimension periods, as transformers computes them: dimensions that turn
    more than `beta_fast` times over the original context keep their frequency, those
    turning fewer than `beta_slow` times are slowed by `factor`, and a linear ramp
    blends the ones between."""
    factor = float(scaling["factor"])
    context = float(scaling["original_max_position_embeddings"])

    def dimension_turning(times: float) -> float:  # where a dimension turns `times` over the context
        return dims * math.log(context / (times * 2 * math.pi)) / (2 * math.log(base))

    low = dimension_turning(float(scaling.get("beta_fast") or 32))
    high = dimension_turning(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):  # gpt-oss's configs say false
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as transformers: the ramp below divides by their difference
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0.0, 1.0)
    periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    kept = 1.0 - ramp  # each dimension's share of its original frequency
    return 1.0 / (kept / periods + (1.0 - kept) / (factor * periods))


def yarn_attention_factor(scaling: dict) -> float:
    """What YaRN multiplies the rotated q and k by: the config's `attention_factor`, else
    from `factor` (and `mscale` over `mscale_all_dim` where both are given), as
    transformers reads it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def magnitude(mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return magnitude(float(mscale)) / magnitude(float(mscale_all_dim))
    return magnitude()


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter), through `kernels.norm_rope.rms_norm`."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)

    def rms_weight(self) -> mx.array:
        """What x / rms(x) is multiplied by (the residual blocks take it as it is)."""
        return self["weight"]


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the stored weight is an offset from 1, `x / rms(x) * (1 + w)`."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, 1.0 + self.weight, self.eps)

    def rms_weight(self) -> mx.array:
        """What x / rms(x) is multiplied by: 1 + w, computed once (the same float32 add
        each call makes)."""
        weight = 1.0 + self.weight
        mx.eval(weight)
        return weight


AnyRMSNorm = RMSNorm | OffsetRMSNorm


Norm = Callable[[int, float], nn.Module]


def kept_rows(x: mx.array, keep: mx.array | None) -> mx.array:
    """x [B, T, ...] at the tokens `keep` [S] int32 only, or all of x when None."""
    return x if keep is None else x[:, keep]


QueryScale = Callable[[mx.array], mx.array]  # positions [N] int32 -> each query's factor [N]


class AttentionTemperature:
    """Ministral 3's query scale (transformers' `get_llama_4_attn_scale`): a rotated query
    at position p is multiplied by 1 + beta * log(1 + floor(p / context)), so it is 1
    within the original context and grows by steps past it."""

    def __init__(self, beta: float, context: int):
        self.beta, self.context = beta, context

    def __call__(self, positions: mx.array) -> mx.array:
        steps = mx.floor(positions.astype(mx.float32) / self.context)
        return 1.0 + self.beta * mx.log(1.0 + steps)


class Attention(nn.Module):
    """Grouped-query attention; the family chooses biases, q/k norms, scale and RoPE."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        *,
        scale: float,
        rope: RoPE,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: Norm | None = None,
        query_scale: QueryScale | None = None,
        softcap: float = 0.0,
        sinks: bool = False,
        qk_norm_after_rope: bool = False,
    ):
        super().__init__()
        self.layer = layer
        self.qk_norm_after_rope = qk_norm_after_rope  # Hunyuan's: q and k normed once rotated
        self.query_scale = query_scale
        self.softcap = softcap  # > 0: scores capped at softcap * tanh(s / softcap) (Gemma 2)
        if sinks:  # a learned logit per head in each softmax's sum, with no value (gpt-oss)
            self.sinks = mx.zeros((config.num_attention_heads,))
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.scale = scale
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(d, config.rms_norm_eps)
            self.k_norm = qk_norm(d, config.rms_norm_eps)
        self.rope = rope

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """Attends from every token of x [B, T, hidden], storing each one's K/V; projects
        out only the tokens `keep` (all when None): [B, S, hidden]."""
        B, T, _ = x.shape
        N = B * T  # the engine's ragged step is one flat batch: B = 1, T = N
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if "qkv_proj" in self:  # stacked at load on the CPU (runtime/cpu_weights.py)
            if not self.has_score_rules and "q_norm" not in self:  # one op rotates, stores and attends
                out = kv.attend_stacked(self.layer, self.qkv_proj(x), self.rope, H, Hkv, self.scale)
                return self.o_proj(kept_rows(out, keep))
            q, k, v = split_heads(self.qkv_proj(x), H, Hkv)
        else:
            q = self.q_proj(x).reshape(N, H, D)
            k = self.k_proj(x).reshape(N, Hkv, D)
            v = self.v_proj(x).reshape(N, Hkv, D)
        if "q_norm" in self and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope(q, kv.positions)  # [N, H, D], each token at its own position
        k = self.rope(k, kv.positions)  # [N, Hkv, D]
        if "q_norm" in self and self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        # A layer with no norm before it (EXAONE 4's first) projects the embedding as looked
        # up: an mxfp4 one gives bfloat16, and v stayed so where the norms made k float32.
        v = v.astype(k.dtype)
        if self.query_scale is not None:
            q = q * self.query_scale(kv.positions).astype(q.dtype)[:, None, None]
        out = kv.attend(self.layer, q, k, v, self.scale, self.softcap, self.get("sinks"))  # [N, H, D]
        return self.o_proj(kept_rows(out.reshape(B, T, -1), keep))

    @property
    def has_score_rules(self) -> bool:
        """Whether queries are scaled by position, scores capped or sinks added: the
        stacked and fused ops do none of these."""
        return self.query_scale is not None or bool(self.softcap) or "sinks" in self

    def block_operands(self, norm: AnyRMSNorm, post_norm: AnyRMSNorm | None = None) -> NormedLayers | None:
        """x + [post_norm](self(norm(x))) as one op's operands (kernels/fused_blocks.py), or
        None where the weights do not allow it (see `normed_layers`)."""
        if "qkv_proj" not in self or (post_norm is not None and post_norm.eps != norm.eps):
            return None
        if self.has_score_rules or self.qk_norm_after_rope:  # the op norms q and k before RoPE
            return None
        qk_norm = None
        if "q_norm" in self:  # per-head norms of one eps (the config's)
            qk_norm = (self.q_norm.rms_weight(), self.k_norm.rms_weight(), self.q_norm.eps)
        post = None if post_norm is None else post_norm.rms_weight()
        return normed_layers(norm.rms_weight(), norm.eps, self.qkv_proj, self.o_proj, qk_norm, post)

    def as_block(self, x: mx.array, kv: ForwardKV, block: NormedLayers | None) -> mx.array | None:
        """The residual block of `block_operands` over x, or None: then run it by parts."""
        if block is None:
            return None
        H, Hkv = self.num_heads, self.num_kv_heads
        return kv.residual_attention(self.layer, x, block, self.rope, H, Hkv, self.scale)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (llama, qwen) or GELU-tanh (gemma)."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        is_gelu = self.activation == "gelu_tanh"
        if "gate_up_proj" in self:  # stacked at load on the CPU (runtime/cpu_weights.py)
            gate_up = self.gate_up_proj(x)
            return self.down_proj(gelu_tanh_halves(gate_up) if is_gelu else swiglu_halves(gate_up))
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gelu_tanh(gate, up) if is_gelu else swiglu(gate, up))

    def block_operands(self, norm: AnyRMSNorm, post_norm: AnyRMSNorm | None = None) -> NormedLayers | None:
        """h + [post_norm](self(norm(h))) as one op's operands (kernels/fused_blocks.py), or
        None where the weights do not allow it (see `normed_layers`)."""
        if "gate_up_proj" not in self or (post_norm is not None and post_norm.eps != norm.eps):
            return None
        post = None if post_norm is None else post_norm.rms_weight()
        return normed_layers(norm.rms_weight(), norm.eps, self.gate_up_proj, self.down_proj, post_norm=post)

    def as_block(self, h: mx.array, block: NormedLayers | None) -> mx.array | None:
        """The residual block of `block_operands` over h, or None: then run it by parts."""
        return None if block is None else mlp_block(h, block, self.activation)


class CausalLM(nn.Module):
    """tokens [B, T] int32 -> logits [B, T, vocab]. Families fill `self.model` with
    `embed_tokens`, `layers` (each `layer(h, kv)`) and `norm`, and may override `embed`."""

    model: Any

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config

    def __call__(self, tokens: mx.array, kv: ForwardKV | None = None) -> mx.array:
        return self.project(self.hidden(tokens, kv))

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens)

    def hidden(
        self, tokens: mx.array, kv: ForwardKV | None = None, keep: mx.array | None = None
    ) -> mx.array:
        """tokens [B, T] -> final normed hidden states [B, T, hidden]; no vocab projection.

        `keep` [S] int32: only these tokens' states are wanted, [B, S, hidden]. The last
        layer still attends from (and stores the K/V of) every token, but projects out
        and runs its MLP for these alone: in a step of prompt chunks that is ~1/L of
        the matmuls skipped, since only a row's newest token samples.
        """
        if kv is None:
            batch, length = tokens.shape
            kv = CausalNoCache(batch, length, windows=self.config.layer_windows)
        h = self.embed(tokens)
        *body, last = self.model.layers
        for layer in body:
            h = layer(h, kv)
        return self.model.norm(last(h, kv, keep))

    def project(self, h: mx.array) -> mx.array:
        """Final hidden states [..., hidden] -> logits [..., vocab]."""
        if "lm_head" in self:
            return self.lm_head(h)
        return self.model.embed_tokens.as_linear(h)
