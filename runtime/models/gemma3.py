"""Gemma 3 text (`gemma3_text`), and the language model of the multimodal `gemma3`.

Where it departs from llama, each checked against mlx-lm's `gemma3_text` and
transformers' `modeling_gemma3`:
- the embedding is scaled by sqrt(hidden_size) rounded to bfloat16, as mlx-lm does
  (transformers rounds it to the weights' dtype: bfloat16 in every Gemma 3 release);
- RMSNorm multiplies by (1 + w), and each layer has four of them: before and after
  attention, before and after the MLP (the "after" ones norm the branch, not the sum);
- q and k get a per-head RMSNorm (1 + w) before RoPE;
- the MLP is GELU with the tanh approximation;
- attention scores are scaled by query_pre_attn_scalar**-0.5, not head_dim**-0.5;
- sliding (local) layers see their last `sliding_window` positions and rotate with
  `rope_local_base_freq`; full (global) layers rotate with `rope_theta` and its scaling;
- which layers slide comes from `layer_types`, or from `sliding_window_pattern` in
  older configs (every pattern-th layer is global);
- logits are capped at c * tanh(z / c), c = `final_logit_softcapping`, where it is set
  (null in Google's releases; Rnj-1, a Gemma 3 of EssentialAI's, sets it), as
  transformers caps them;
- embeddings are tied as config.json says, or where it does not say, when the weights
  hold no lm_head (as mlx-lm, which ties exactly then; transformers' default is tied).

The multimodal layout keeps the text model's config under `text_config` and its
weights under `language_model.` (`model.language_model.` in newer exports); the
vision tower and projector are skipped with one log line.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, is_positive_number, read_sliding_layers
from runtime.errors import CheckpointError
from runtime.kv.base import ForwardKV
from runtime.models import multimodal
from runtime.models.layers import Attention, CausalLM, GatedMLP, OffsetRMSNorm, RoPE, kept_rows

import mlx.core as mx
import mlx.nn as nn

from kernels.fused_blocks import NormedLayers

# transformers' Gemma3TextConfig defaults, for fields a config may leave out
# (multimodal configs often leave out most of `text_config`).
DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "max_position_embeddings": 131_072,
    "vocab_size": 262_208,
}


def unwrap_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The multimodal `gemma3` config -> its text model's config (`gemma3_text`)."""
    if raw.get("model_type") != "gemma3":
        return raw
    return {**multimodal.text_config(raw, source, "gemma3_text"), "model_type": "gemma3_text"}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    if fields.raw.get("attn_logit_softcapping") is not None:
        raise CheckpointError(f"{fields.source}: gemma3 with attn_logit_softcapping is not supported")
    # Null in Google's Gemma 3 configs; Rnj-1 (a Gemma 3 of EssentialAI's) sets one, and
    # transformers caps its logits with it, as Gemma 2's.
    final_cap = fields.raw.get("final_logit_softcapping")
    if final_cap is not None and not is_positive_number(final_cap):
        raise CheckpointError(
            f"{fields.source}: gemma3's final_logit_softcapping must be a positive number or null, got {final_cap!r}"
        )
    if fields.raw.get("use_bidirectional_attention"):
        raise CheckpointError(f"{fields.source}: gemma3 with bidirectional attention is not supported")
    activation = fields.get("hidden_activation", str, "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{fields.source}: gemma3 hidden_activation '{activation}' is not supported")
    is_sliding = read_sliding_layers(fields)
    if is_sliding is None:
        pattern = fields.get("sliding_window_pattern", int, 6)
        is_sliding = [(i + 1) % pattern != 0 for i in range(fields.get("num_hidden_layers", int))]
    window = fields.get("sliding_window", int)
    local_base = fields.get("rope_local_base_freq", float)
    overrides: dict[str, Any] = {}
    # transformers 5 writes rope settings per layer type under rope_parameters.
    rope = fields.get("rope_parameters", dict, None) or {}
    if isinstance(rope.get("sliding_attention"), dict):
        local = ConfigFields(rope["sliding_attention"], f"{fields.source}: rope_parameters.sliding_attention")
        local_base = local.get("rope_theta", float, local_base)
        # Its sliding layers' RoPE is plain; a scaling named for them was dropped unseen.
        if (kind := rope["sliding_attention"].get("rope_type", "default")) != "default":
            raise CheckpointError(f"{fields.source}: unsupported sliding-layer rope_type '{kind}'")
    if isinstance(full := rope.get("full_attention"), dict):
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") not in ("default", "linear"):
            raise CheckpointError(f"{fields.source}: unsupported rope_type '{scaling['rope_type']}'")
        rope_full = ConfigFields(full, f"{fields.source}: rope_parameters.full_attention")
        overrides["rope_theta"] = rope_full.get("rope_theta", float, fields.get("rope_theta", float))
        if scaling.get("rope_type") == "linear":
            rope_full.get("factor", float)  # RoPE divides by it
        overrides["rope_scaling"] = scaling if scaling.get("rope_type") == "linear" else None
    return {
        **overrides,
        "qk_norm": True,
        "layer_windows": tuple(window if sliding else None for sliding in is_sliding),
        "extra": {
            "query_pre_attn_scalar": fields.get("query_pre_attn_scalar", float),
            "rope_local_base_freq": local_base,
            "final_logit_softcapping": float(final_cap or 0.0),  # 0: no cap
        },
    }


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Multimodal names -> text-model names; the vision tower's tensors are dropped."""
    return multimodal.text_weights(weights, "gemma3")


def _add_residual(x: mx.array, y: mx.array) -> mx.array:
    """x + y; in float16 summed in float32 and clipped, as the references do (Gemma's
    residual stream outgrows float16's range)."""
    if x.dtype != mx.float16:
        return x + y
    bound = float(mx.finfo(mx.float16).max)
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class Gemma3Layer(nn.Module):
    """Also Gemma 2's (gemma2.py): the same four norms, without q/k norms, with capped scores."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        extra = config.extra
        if config.layer_windows[layer] is None:
            rope = RoPE(config.head_dim, config.rope_theta, config.rope_scaling)
        else:
            rope = RoPE(config.head_dim, extra["rope_local_base_freq"], None)
        self.self_attn = Attention(
            config,
            layer,
            scale=extra["query_pre_attn_scalar"] ** -0.5 * rope.attention_factor,  # YaRN's, else 1
            rope=rope,
            qk_norm=OffsetRMSNorm if config.qk_norm else None,  # Gemma 2 has none
            softcap=extra.get("attn_logit_softcapping", 0.0),  # Gemma 2's
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, activation="gelu_tanh")
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(hidden, eps)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden, eps)

    # Each residual block as one op where the CPU kernels allow (kernels/fused_blocks.py),
    # its post-norm inside it: planned once the CPU weights are in place, else None.
    attention_block: NormedLayers | None = None
    mlp_block: NormedLayers | None = None

    def __call__(self, x: mx.array, kv: ForwardKV, keep: mx.array | None = None) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`."""
        h = self.self_attn.as_block(x, kv, self.attention_block)
        if h is None:
            attended = self.self_attn(self.input_layernorm(x), kv, keep)
            h = _add_residual(kept_rows(x, keep), self.post_attention_layernorm(attended))
        else:
            h = kept_rows(h, keep)
        out = self.mlp.as_block(h, self.mlp_block)
        if out is None:
            out = _add_residual(h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))))
        return out

    def plan_blocks(self) -> None:
        attn, mlp = self.self_attn, self.mlp
        self.attention_block = attn.block_operands(self.input_layernorm, self.post_attention_layernorm)
        self.mlp_block = mlp.block_operands(self.pre_feedforward_layernorm, self.post_feedforward_layernorm)


class Gemma3Body(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [Gemma3Layer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = Gemma3Body(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def project(self, h: mx.array) -> mx.array:
        """Logits, each z capped to c * tanh(z / c) where `final_logit_softcapping` c is set."""
        logits = super().project(h)
        cap = self.config.extra.get("final_logit_softcapping")
        return mx.tanh(logits / cap) * cap if cap else logits

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.model.embed_tokens(tokens)
        # Rounded first: on the CPU h is float32, and the exact factor (sqrt(1152) is
        # 33.94 against bfloat16's 34.0) moved every logit by ~5e-3 from mlx-lm's.
        return h * mx.array(self.config.hidden_size**0.5, dtype=mx.bfloat16).astype(h.dtype)


build = Gemma3
