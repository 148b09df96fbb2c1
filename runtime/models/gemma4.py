"""Gemma 4 (`gemma4_text`, and the language model of the multimodal `gemma4`): E2B, E4B,
26B-A4B and 31B.

Gemma 3's layer (four norms, GELU-tanh MLP, sliding and full layers, q/k norms) with,
each checked against mlx-lm's `gemma4_text` and transformers' `modeling_gemma4`:
- plain RMSNorms (`x / rms(x) * w`, not Gemma 3's 1 + w), and a weightless one on v;
- attention scores unscaled (the q/k norms set their size);
- full layers with heads of their own width (`global_head_dim`, 512), their own KV
  head count where keys are values (`attention_k_eq_v`: no v_proj, v is the raw k,
  then v's norm; `num_global_key_value_heads`), rotating only a quarter of their
  pairs (`rope_type: proportional`: the first pairs at the periods of the full width,
  the rest not at all); sliding layers rotate fully at their own `rope_theta`;
- each layer's output multiplied by its `layer_scalar`;
- logits capped at `final_logit_softcapping` (c * tanh(z / c));
- E2B/E4B: per-layer inputs (a second embedding of every token, one
  `hidden_size_per_layer_input` slice per layer, mixed with a projection of the
  embedding and gated into each layer's output), and KV sharing: the last
  `num_kv_shared_layers` layers store no K/V but attend over the last earlier layer's
  of their kind (`ForwardKV.attend_shared`), with MLPs twice as wide
  (`use_double_wide_mlp`);
- 26B-A4B: routed experts beside the dense MLP (`enable_moe_block`), GeGLU experts
  picked by a router over an unweighted norm of the layer's input, scaled by `scale`
  and `per_expert_scale`.

The embedding is scaled by sqrt(hidden_size) as mlx-lm does (exactly; transformers
rounds the factor to the weights' dtype). The multimodal layout's vision and audio
towers are skipped (runtime/models/multimodal.py).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, read_sliding_layers
from runtime.errors import CheckpointError
from runtime.kv.base import CausalNoCache, ForwardKV, split_heads
from runtime.models import multimodal
from runtime.models.experts import ExpertMLPs, Experts
from runtime.models.layers import CausalLM, GatedMLP, RMSNorm, RoPE, kept_rows

import attrs
import mlx.core as mx
import mlx.nn as nn

from kernels.fused_blocks import NormedLayers
from kernels.swiglu import gelu_tanh

# transformers' Gemma4TextConfig defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 512,
    "max_position_embeddings": 131_072,
    "vocab_size": 262_144,
}
SLIDING_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}
ROTATES_PART_OF_A_HEAD = True  # its full layers' `partial_rotary_factor` (runtime/config.py)
FULL_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}


@attrs.frozen
class Gemma4Settings:
    """What Gemma 4's layers need beyond ModelConfig (in `extra["gemma4"]`)."""

    layer_shapes: tuple[tuple[int, int], ...]  # every layer's (KV heads, head dim)
    keys_are_values: tuple[bool, ...]  # per layer: no v_proj (full layers, attention_k_eq_v)
    kv_sources: tuple[int | None, ...]  # per layer: the earlier layer whose K/V it reads
    ropes: tuple[dict[str, Any], ...]  # per layer: its rope_parameters entry
    double_wide: tuple[bool, ...]  # per layer: an MLP of twice intermediate_size
    per_layer_size: int  # hidden_size_per_layer_input; 0: no per-layer inputs
    per_layer_vocab: int
    final_softcap: float | None
    experts: Experts | None


def unwrap_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The multimodal `gemma4` config -> its text model's (`gemma4_text`)."""
    if raw.get("model_type") != "gemma4":
        return raw
    return {**multimodal.text_config(raw, source, "gemma4_text"), "model_type": "gemma4_text"}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    source = fields.source
    if fields.raw.get("use_bidirectional_attention") == "all":
        raise CheckpointError(f"{source}: gemma4 with bidirectional attention is not supported")
    activation = fields.get("hidden_activation", str, "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{source}: gemma4 hidden_activation '{activation}' is not supported")
    if fields.get("attention_bias", bool, False):
        raise CheckpointError(f"{source}: gemma4 with attention_bias is not supported")
    num_layers = fields.get("num_hidden_layers", int)
    is_sliding = read_sliding_layers(fields)
    if is_sliding is None:  # transformers' default: five sliding layers to one full
        is_sliding = [(i + 1) % 6 != 0 for i in range(num_layers)]
    if is_sliding and is_sliding[-1]:  # transformers forces it, with a warning
        is_sliding = [*is_sliding[:-1], False]
    window = fields.get("sliding_window", int)
    heads, kv_heads = fields.get("num_attention_heads", int), fields.get("num_key_value_heads", int)
    head_dim = fields.get("head_dim", int)
    # transformers' default where it is left out; null (mlx-lm): the sliding layers' width
    full_dim = fields.get("global_head_dim", int, 512) if fields.raw.get("global_head_dim", 0) is not None else head_dim
    keys_are_values = fields.get("attention_k_eq_v", bool, False)
    full_kv_heads = (fields.get("num_global_key_value_heads", int, None) if keys_are_values else None) or kv_heads
    for name, count in (("num_key_value_heads", kv_heads), ("num_global_key_value_heads", full_kv_heads)):
        if count <= 0 or heads % count:
            raise CheckpointError(f"{source}: num_attention_heads ({heads}) is not a multiple of {name} ({count})")
    shapes = tuple((kv_heads, head_dim) if s else (full_kv_heads, full_dim) for s in is_sliding)
    num_kv_layers, sources = _kv_sharing(fields, is_sliding)
    per_layer_size = _count(fields, "hidden_size_per_layer_input", 256)
    return {
        "qk_norm": True,
        "layer_windows": tuple(window if s else None for s in is_sliding),
        "layer_kv_shapes": shapes[:num_kv_layers],
        "num_kv_layers": num_kv_layers,
        "extra": {
            "gemma4": Gemma4Settings(
                layer_shapes=shapes,
                keys_are_values=tuple(keys_are_values and not s for s in is_sliding),
                kv_sources=sources,
                ropes=_ropes(fields, is_sliding),
                double_wide=tuple(
                    fields.get("use_double_wide_mlp", bool, False) and i >= num_kv_layers for i in range(num_layers)
                ),
                per_layer_size=per_layer_size,
                per_layer_vocab=fields.get("vocab_size_per_layer_input", int, 262_144) if per_layer_size else 0,
                final_softcap=fields.get("final_logit_softcapping", float, None),
                experts=_experts(fields),
            ),
        },
    }


def _count(fields: ConfigFields, name: str, default: int) -> int:
    """A size where 0 (or null) means none."""
    value = fields.raw.get(name, default)
    if value is None or (value == 0 and not isinstance(value, bool)):
        return 0
    return ConfigFields({name: value}, fields.source).get(name, int)


def _kv_sharing(fields: ConfigFields, is_sliding: list[bool]) -> tuple[int, tuple[int | None, ...]]:
    """(layers that store K/V, each layer's source): a shared layer reads the last
    storing layer of its kind."""
    num_layers = len(is_sliding)
    num_shared = _count(fields, "num_kv_shared_layers", 0)
    if not 0 <= num_shared < num_layers:
        raise CheckpointError(
            f"{fields.source}: num_kv_shared_layers ({num_shared}) must be in 0..{num_layers - 1}"
        )
    first_shared = num_layers - num_shared
    last_of_kind = {is_sliding[i]: i for i in range(first_shared)}
    sources: list[int | None] = [None] * first_shared
    for i in range(first_shared, num_layers):
        if is_sliding[i] not in last_of_kind:
            kind = "sliding" if is_sliding[i] else "full"
            raise CheckpointError(f"{fields.source}: KV-shared layer {i} is {kind}, and no earlier {kind} layer stores K/V")
        sources.append(last_of_kind[is_sliding[i]])
    return first_shared, tuple(sources)


def _ropes(fields: ConfigFields, is_sliding: list[bool]) -> tuple[dict[str, Any], ...]:
    parameters = fields.get("rope_parameters", dict, None) or {}
    ropes = {}
    for kind, default, types in (
        ("sliding_attention", SLIDING_ROPE, ("default",)),
        ("full_attention", FULL_ROPE, ("default", "proportional")),
    ):
        entry = parameters.get(kind, default)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{fields.source}: rope_parameters.{kind} should be an object")
        checked = ConfigFields(entry, f"{fields.source}: rope_parameters.{kind}")
        rope_type = checked.get("rope_type", str, "default")
        if rope_type not in types:
            raise CheckpointError(f"{checked.source}: unsupported rope_type '{rope_type}'")
        theta = checked.get("rope_theta", float, default["rope_theta"])
        factor = checked.get("partial_rotary_factor", float, 1.0)
        scale = checked.get("factor", float, 1.0)
        if theta <= 0 or not 0 < factor <= 1 or scale <= 0:
            raise CheckpointError(f"{checked.source}: rope_theta, partial_rotary_factor and factor must be positive")
        ropes[kind] = {"rope_type": rope_type, "rope_theta": theta, "partial_rotary_factor": factor, "factor": scale}
    return tuple(ropes["sliding_attention" if s else "full_attention"] for s in is_sliding)


def _experts(fields: ConfigFields) -> Experts | None:
    if not fields.get("enable_moe_block", bool, False):
        return None
    num_experts, top_k = fields.get("num_experts", int), fields.get("top_k_experts", int)
    if not 0 < top_k <= num_experts:
        raise CheckpointError(f"{fields.source}: top_k_experts ({top_k}) must be in 1..num_experts ({num_experts})")
    num_layers = fields.get("num_hidden_layers", int)
    return Experts(
        num_experts,
        top_k,
        fields.get("moe_intermediate_size", int),
        normalize=True,
        sparse_layers=(True,) * num_layers,
        activation="gelu_tanh",
    )


def rename_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Multimodal names -> the text model's; Hugging Face's stacked experts
    (`experts.gate_up_proj` [E, 2I, hidden], `experts.down_proj`) -> `experts.switch_glu.*`,
    as mlx-community stores them; the shared layers' K/V projections, which they never
    run, dropped."""
    weights = multimodal.text_weights(weights, "gemma4")
    settings: Gemma4Settings = config.extra["gemma4"]
    renamed: dict[str, mx.array] = {}
    for name, tensor in weights.items():
        if name.endswith(".experts.gate_up_proj"):
            renamed.update(split_gate_up(name, tensor))
        elif name.endswith(".experts.down_proj"):
            renamed[name.removesuffix(".down_proj") + ".switch_glu.down_proj.weight"] = tensor
        elif not _unused(name, settings):
            renamed[name] = tensor
    return renamed


def split_gate_up(name: str, tensor: mx.array) -> dict[str, mx.array]:
    """`X.experts.gate_up_proj[.part]` [E, 2I, ...], each expert's gate rows first (a
    weight, or a packed one's weight, scales and biases) -> `X.experts.switch_glu.gate_proj`
    and `.up_proj` (`.weight` where the name has no part, as Hugging Face's)."""
    base, _, part = name.partition(".experts.gate_up_proj")
    part = part or ".weight"
    if tensor.ndim < 2 or tensor.shape[-2] % 2:
        raise CheckpointError(
            f"tensor '{name}' of shape {tuple(tensor.shape)} does not split into gate and up "
            "halves (an even number of rows, [E, 2I, ...])"
        )
    gate, up = mx.split(tensor, 2, axis=-2)
    return {
        f"{base}.experts.switch_glu.gate_proj{part}": mx.contiguous(gate),
        f"{base}.experts.switch_glu.up_proj{part}": mx.contiguous(up),
    }


def _unused(name: str, settings: Gemma4Settings) -> bool:
    """A tensor the model has no place for: a shared layer's K/V projection or norm,
    or a rotary table some exports keep."""
    if "self_attn.rotary_emb" in name:
        return True
    parts = name.split(".")
    if "layers" not in parts or not any(f".self_attn.{p}" in name for p in ("k_proj", "v_proj", "k_norm", "v_norm")):
        return False
    index = parts[parts.index("layers") + 1]
    return index.isdigit() and int(index) < len(settings.kv_sources) and settings.kv_sources[int(index)] is not None


def _rms_unweighted(x: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, None, eps)


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        settings: Gemma4Settings = config.extra["gemma4"]
        self.layer = layer
        self.source = settings.kv_sources[layer]  # None: it stores its own K/V
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = settings.layer_shapes[layer]
        self.eps = config.rms_norm_eps
        hidden, H, Hkv, D = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(hidden, H * D, bias=False)
        self.q_norm = RMSNorm(D, eps=self.eps)
        if self.source is None:
            self.k_proj = nn.Linear(hidden, Hkv * D, bias=False)
            if not settings.keys_are_values[layer]:
                self.v_proj = nn.Linear(hidden, Hkv * D, bias=False)
            self.k_norm = RMSNorm(D, eps=self.eps)
        self.o_proj = nn.Linear(H * D, hidden, bias=False)
        self.rope = RoPE(D, settings.ropes[layer]["rope_theta"], settings.ropes[layer])

    def __call__(
        self, x: mx.array, kv: ForwardKV, stored: dict[int, tuple[mx.array, mx.array]], keep: mx.array | None
    ) -> mx.array:
        """Attends from every token of x [B, T, hidden]; a storing layer leaves its K/V in
        `stored` for the shared layers after it. Projects out the tokens `keep`."""
        B, T, _ = x.shape
        N, H, Hkv, D = B * T, self.num_heads, self.num_kv_heads, self.head_dim
        if "qkv_proj" in self:  # stacked at load on the CPU (runtime/cpu_weights.py)
            q, k, v = split_heads(self.qkv_proj(x), H, Hkv)
        else:
            q = self.q_proj(x).reshape(N, H, D)
            if self.source is None:
                k = self.k_proj(x).reshape(N, Hkv, D)
                v = self.v_proj(x).reshape(N, Hkv, D) if "v_proj" in self else k
        q = self.rope(self.q_norm(q), kv.positions)
        if self.source is None:
            k = self.rope(self.k_norm(k), kv.positions)
            v = _rms_unweighted(v, self.eps)
            stored[self.layer] = (k, v)
            out = kv.attend(self.layer, q, k, v, 1.0)
        else:
            out = kv.attend_shared(self.source, q, *stored[self.source], 1.0)
        return self.o_proj(kept_rows(out.reshape(B, T, -1), keep))


class Gemma4Router(nn.Module):
    """Each token's top k experts, from an unweighted norm of its input times `scale`;
    their softmaxed scores times each chosen expert's `per_expert_scale`."""

    def __init__(self, hidden: int, experts: Experts, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden, experts.num_experts, bias=False)
        self.scale = mx.ones((hidden,))
        self.per_expert_scale = mx.ones((experts.num_experts,))
        self.top_k, self.eps, self.root = experts.top_k, eps, hidden**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [N, hidden] -> (experts [N, k], weights [N, k])."""
        scores = self.proj(mx.fast.rms_norm(x, self["scale"] * self.root, self.eps))
        chosen = mx.argpartition(scores, kth=-self.top_k, axis=-1)[:, -self.top_k :]
        weights = mx.softmax(mx.take_along_axis(scores, chosen, axis=-1), axis=-1)
        return chosen, weights * self["per_expert_scale"][chosen]


class Gemma4Experts(nn.Module):
    def __init__(self, hidden: int, experts: Experts):
        super().__init__()
        self.switch_glu = ExpertMLPs(hidden, experts)

    def __call__(self, x: mx.array, chosen: mx.array, weights: mx.array) -> mx.array:
        outputs = self.switch_glu(x, chosen)  # [N, k, hidden]
        return (outputs * weights[..., None].astype(outputs.dtype)).sum(axis=-2)


class Gemma4Layer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        settings: Gemma4Settings = config.extra["gemma4"]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer)
        width = config.intermediate_size * (2 if settings.double_wide[layer] else 1)
        self.mlp = GatedMLP(hidden, width, activation="gelu_tanh")
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps=eps)
        if settings.experts is not None:
            self.router = Gemma4Router(hidden, settings.experts, eps)
            self.experts = Gemma4Experts(hidden, settings.experts)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps=eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps=eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps=eps)
        if settings.per_layer_size:
            self.per_layer_input_gate = nn.Linear(hidden, settings.per_layer_size, bias=False)
            self.per_layer_projection = nn.Linear(settings.per_layer_size, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps=eps)
        self.layer_scalar = mx.ones((1,))

    # The dense MLP's residual block as one op where the CPU kernels allow
    # (kernels/fused_blocks.py), planned once the CPU weights are in place. Attention
    # has none: the op norms no v, and the layers with experts add theirs inside it.
    mlp_block: NormedLayers | None = None

    def plan_blocks(self) -> None:
        if "experts" not in self:
            self.mlp_block = self.mlp.block_operands(self.pre_feedforward_layernorm, self.post_feedforward_layernorm)

    def __call__(
        self,
        x: mx.array,
        kv: ForwardKV,
        stored: dict[int, tuple[mx.array, mx.array]],
        per_layer_input: mx.array | None,
        keep: mx.array | None = None,
    ) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden], or [B, S, hidden] at the tokens `keep`."""
        attended = self.self_attn(self.input_layernorm(x), kv, stored, keep)
        h = kept_rows(x, keep) + self.post_attention_layernorm(attended)
        fused = self.mlp.as_block(h, self.mlp_block)
        if fused is not None:
            h = fused
        else:
            mlp = self.mlp(self.pre_feedforward_layernorm(h))
            if "experts" in self:  # routed experts beside the dense MLP, both normed
                tokens = h.reshape(-1, h.shape[-1])
                routed = self.experts(self.pre_feedforward_layernorm_2(tokens), *self.router(tokens))
                mlp = self.post_feedforward_layernorm_1(mlp) + self.post_feedforward_layernorm_2(routed.reshape(h.shape))
            h = h + self.post_feedforward_layernorm(mlp)
        if per_layer_input is not None:
            gate = gelu_tanh(self.per_layer_input_gate(h), kept_rows(per_layer_input, keep))
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self["layer_scalar"]


class Gemma4Body(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        settings: Gemma4Settings = config.extra["gemma4"]
        hidden, layers = config.hidden_size, config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = [Gemma4Layer(config, i) for i in range(layers)]
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        if settings.per_layer_size:
            self.embed_tokens_per_layer = nn.Embedding(settings.per_layer_vocab, layers * settings.per_layer_size)
            self.per_layer_model_projection = nn.Linear(hidden, layers * settings.per_layer_size, bias=False)
            self.per_layer_projection_norm = RMSNorm(settings.per_layer_size, eps=config.rms_norm_eps)


class Gemma4(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.settings: Gemma4Settings = config.extra["gemma4"]
        self.model = Gemma4Body(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens) * self.config.hidden_size**0.5

    def hidden(self, tokens: mx.array, kv: ForwardKV | None = None, keep: mx.array | None = None) -> mx.array:
        """CausalLM.hidden, with the K/V shared layers read and the per-layer inputs."""
        if kv is None:
            batch, length = tokens.shape
            kv = CausalNoCache(batch, length, windows=self.config.layer_windows)
        h = self.embed(tokens)
        per_layer = self._per_layer_inputs(tokens, h)
        stored: dict[int, tuple[mx.array, mx.array]] = {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            inputs = None if per_layer is None else per_layer[..., i, :]
            h = layer(h, kv, stored, inputs, keep if i == last else None)
        return self.model.norm(h)

    def _per_layer_inputs(self, tokens: mx.array, h: mx.array) -> mx.array | None:
        """[B, T, layers, per-layer size]: each token's own slice of the second embedding
        (scaled by its width's root), plus a normed projection of its embedding, over sqrt 2."""
        size = self.settings.per_layer_size
        if not size:
            return None
        body, shape = self.model, (*tokens.shape, len(self.model.layers), size)
        identity = body.embed_tokens_per_layer(tokens).reshape(shape) * size**0.5
        context = body.per_layer_model_projection(h) * self.config.hidden_size**-0.5
        context = body.per_layer_projection_norm(context.reshape(shape))
        return (context + identity) * 2.0**-0.5

    def project(self, h: mx.array) -> mx.array:
        logits = super().project(h)
        cap = self.settings.final_softcap
        return mx.tanh(logits / cap) * cap if cap else logits


build = Gemma4
