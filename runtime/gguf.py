"""Read a GGUF file (llama.cpp's single-file format) as a Hugging Face-style checkpoint.

A GGUF holds what a checkpoint directory spreads over files: the hyperparameters and
the tokenizer as metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...) and the
tensors under llama.cpp's names (`blk.0.attn_q.weight`). `read_gguf` turns one into
the three things a safetensors checkpoint gives: a config.json-shaped dict, weights
under Hugging Face names and a `Tokenizer`, so the model is built by the same code
whatever the file format, and a family needs nothing GGUF-specific beyond a row in
`ARCHITECTURES`.

What llama.cpp's converter (convert_hf_to_gguf.py) changed is undone here: the llama
family's q/k rows were permuted for llama.cpp's interleaved RoPE, Gemma's norm weights
had 1 added, and Llama 3's RoPE scaling became a `rope_freqs` tensor (read back, with the
other RoPE settings, in runtime/gguf_rope.py).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runtime.config import is_token_id
from runtime.errors import CheckpointError
from runtime.gguf_reader import Metadata, check_tensor_layout, open_gguf
from runtime.gguf_rope import ministral3_scaling, rope_scaling
from runtime.gguf_tensors import MODES, NATIVE_BITS, decode_tensor, quantization_config, to_mlx
from runtime.gguf_tokenizer import tokenizer_from_gguf
from runtime.tokenizer import Tokenizer

import attrs
import gguf
import mlx.core as mx
import numpy as np


@attrs.frozen
class Architecture:
    """How one `general.architecture` maps onto a Hugging Face `model_type`."""

    model_type: str
    hf_architecture: str
    is_qk_permuted: bool = False  # the converter permuted q/k rows (llama's RoPE layout)
    norm_shift: float = 0.0  # the converter added this to every `*norm.weight`
    ffn_norm: str = "post_attention_layernorm"  # what llama.cpp's `ffn_norm` was in HF
    ffn_up: str = "mlp.up_proj"  # what llama.cpp's `ffn_up` was (phi3's holds gate and up)
    has_longrope: bool = False  # may hold LongRoPE's factors as `rope_factors_*` tensors
    # Routed experts in every layer (qwen3moe, qwen2moe); llama has them where its
    # metadata counts them (Mixtral).
    has_experts: bool = False


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", is_qk_permuted=True),
    # Ministral 3 (llama's converter with YaRN and the query temperature)
    "mistral3": Architecture("ministral3", "Ministral3ForCausalLM", is_qk_permuted=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM"),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": Architecture("qwen3_moe", "Qwen3MoeForCausalLM", has_experts=True),
    "qwen2moe": Architecture("qwen2_moe", "Qwen2MoeForCausalLM", has_experts=True),
    "gpt-oss": Architecture("gpt_oss", "GptOssForCausalLM", has_experts=True),
    "phi3": Architecture("phi3", "Phi3ForCausalLM", ffn_up="mlp.gate_up_proj", has_longrope=True),
    "gemma2": Architecture(
        "gemma2", "Gemma2ForCausalLM", norm_shift=1.0, ffn_norm="pre_feedforward_layernorm"
    ),
    "gemma3": Architecture(
        "gemma3_text", "Gemma3ForCausalLM", norm_shift=1.0, ffn_norm="pre_feedforward_layernorm"
    ),
    # Gemma 4's norms are stored as they are (its RMSNorm multiplies by w, not 1 + w).
    "gemma4": Architecture("gemma4_text", "Gemma4ForCausalLM", ffn_norm="pre_feedforward_layernorm"),
}

# llama.cpp's per-block tensor names -> Hugging Face's, under `model.layers.N.`.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v in one (split at load)
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # gemma: after attention, before the residual
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Routed experts (qwen3moe, qwen2moe; Mixtral under `llama`, where the metadata counts
# them): the router, then each projection's experts stacked [E, out, in]
# (runtime/models/experts.py).
_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    # qwen2moe's shared expert, and its gate (a [1, hidden] layer stored as a vector).
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Gemma 4's per-layer inputs (E2B, E4B)
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# Gemma 4's own per-block tensors (runtime/models/gemma4.py's names), by llama.cpp's
# name and suffix: its routed experts (gate and up in one tensor, split after
# decoding), their router with its scales (`.scale` tensors), the layer's output scale
# and its per-layer input's gate.
_GEMMA4_NAMES = {
    ("ffn_gate_inp", "weight"): "router.proj.weight",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
    ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj.weight",
    ("ffn_down_exps", "weight"): "experts.switch_glu.down_proj.weight",
    ("pre_ffw_norm_2", "weight"): "pre_feedforward_layernorm_2.weight",
    ("post_ffw_norm_1", "weight"): "post_feedforward_layernorm_1.weight",
    ("post_ffw_norm_2", "weight"): "post_feedforward_layernorm_2.weight",
    ("layer_output_scale", "weight"): "layer_scalar",
    ("inp_gate", "weight"): "per_layer_input_gate.weight",
    ("proj", "weight"): "per_layer_projection.weight",
    ("post_norm", "weight"): "post_per_layer_input_norm.weight",
}


# Phi-3's LongRoPE factors: RoPE settings, not weights (as Llama 3's `rope_freqs`).
_LONGROPE_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})

# The end-of-turn spellings llama.cpp's vocabulary loader recognises (llama-vocab.cpp),
# Gemma 4's among them: the end of its turn, and the tool response it waits for after
# a call (a user-defined token in its files, which llama.cpp stops at all the same).
_END_OF_TURN_TOKENS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<turn|>"}
)
_END_OF_TURN_ANY_TYPE = frozenset({"<|tool_response>"})


@attrs.frozen
class GGUFCheckpoint:
    config: dict[str, Any]  # config.json's fields
    weights: dict[str, mx.array]  # Hugging Face names (quantized ones as weight/scales/biases)
    tokenizer: Tokenizer


def read_gguf(path: Path, progress: Callable[[str], None] = lambda message: None) -> GGUFCheckpoint:
    """Read and check a GGUF file; every failure is a one-line `CheckpointError` naming it."""
    reader = open_gguf(path)
    check_tensor_layout(reader, path)
    metadata = Metadata(reader, str(path))
    if (num_splits := metadata.optional("split.count", int, 1)) != 1:
        raise CheckpointError(
            f"{path}: one part of a GGUF split into {num_splits} files; split files are not "
            "supported (join them with llama.cpp's llama-gguf-split --merge)"
        )
    arch_name = metadata.string("general.architecture")
    if arch_name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        # llama.cpp writes a vision model's projector (mmproj) as architecture 'clip'.
        what = " (a multimodal projector, mmproj: give the language model's GGUF)" * (
            arch_name == "clip"
        )
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture '{arch_name}'{what} (supported: {supported})"
        )
    arch = ARCHITECTURES[arch_name]
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    progress("building the tokenizer from the GGUF metadata")
    tokenizer = tokenizer_from_gguf(metadata, arch_name)
    config = _hf_config(metadata, arch_name, arch, tensors)
    progress(f"converting {len(tensors)} GGUF tensors")
    jobs = []
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight" or (arch.has_longrope and name in _LONGROPE_TENSORS):
            continue  # read into the config's rope_scaling
        hf_name = _hf_name(name, arch, path, has_experts="num_experts_per_tok" in config)
        rows = _row_permutation(hf_name, arch, config)
        shift = arch.norm_shift if hf_name.endswith("norm.weight") else 0.0
        jobs.append((tensor, hf_name, rows, shift, str(path)))
    weights: dict[str, mx.array] = {}
    packing_by_layer: dict[str, tuple[int, str]] = {}
    for (tensor, hf_name, *_), arrays in zip(jobs, _decoded(jobs), strict=True):
        converted = to_mlx(tensor, arrays)
        if hf_name.endswith(".shared_expert_gate.weight") and converted[hf_name].ndim == 1:
            converted[hf_name] = converted[hf_name][None]  # nn.Linear(hidden, 1)'s [1, hidden]
        if hf_name.endswith(".experts.gate_up_proj.weight"):
            converted, hf_name = _split_gate_up(converted), hf_name.replace("gate_up_proj", "switch_glu.up_proj")
            layer = hf_name.removesuffix(".weight")
            if f"{layer}.scales" in converted:
                kind = tensor.tensor_type
                packing_by_layer[layer.replace("up_proj", "gate_proj")] = (NATIVE_BITS[kind], MODES.get(kind, "affine"))
        layer = hf_name.removesuffix(".weight")
        if f"{layer}.scales" in converted:
            kind = tensor.tensor_type
            packing_by_layer[layer] = (NATIVE_BITS[kind], MODES.get(kind, "affine"))
        weights.update(converted)
    if (quantization := quantization_config(packing_by_layer)) is not None:
        config["quantization"] = quantization
    return GGUFCheckpoint(config=config, weights=weights, tokenizer=tokenizer)


def _split_gate_up(converted: dict[str, mx.array]) -> dict[str, mx.array]:
    """Gemma 4's `experts.gate_up_proj` [E, 2I, ...] (weight, and scales and biases where
    packed): the first I rows of each expert are its gate, the rest its up."""
    split = {}
    for name, values in converted.items():
        gate, up = mx.split(values, 2, axis=-2)
        base, _, suffix = name.rpartition(".")
        prefix = base.removesuffix(".gate_up_proj")
        split[f"{prefix}.switch_glu.gate_proj.{suffix}"] = mx.contiguous(gate)
        split[f"{prefix}.switch_glu.up_proj.{suffix}"] = mx.contiguous(up)
    return split


def _decoded(jobs: list[tuple[Any, ...]]) -> Iterator[dict[str, np.ndarray]]:
    """`decode_tensor(*job)` for each job, in order, on a few threads: dequantizing is
    the slow part of a load (the gguf package's numpy K-quant decoders run at ~20-50M
    weights/s a core). At most two results per thread wait, to bound the memory."""
    num_threads = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(num_threads, thread_name_prefix="gguf-decode") as pool:
        pending: deque[Future[dict[str, np.ndarray]]] = deque()
        for job in jobs:
            pending.append(pool.submit(decode_tensor, *job))
            if len(pending) > 2 * num_threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _hf_config(
    metadata: Metadata, arch_name: str, arch: Architecture, tensors: dict[str, Any]
) -> dict[str, Any]:
    """config.json's fields from `{arch}.*` metadata and the tensors present."""

    def key(name: str) -> str:
        return f"{arch_name}.{name}"

    hidden = metadata.require(key("embedding_length"), int)
    ffn_length = key("feed_forward_length")
    if arch.has_experts and metadata.get(ffn_length) is None:
        ffn_length = key("expert_feed_forward_length")  # the dense size, unused, left out
    heads = metadata.require(key("attention.head_count"), int)
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{metadata.source}: missing tensor 'token_embd.weight'")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes run innermost first
    num_tokens = len(metadata.get("tokenizer.ggml.tokens") or ())
    if num_tokens > vocab_size:
        # As llama.cpp refuses it: the tokenizer would give ids the model has no row for,
        # and every chat whose template used one was refused as out of the vocabulary.
        raise CheckpointError(
            f"{metadata.source}: the vocabulary holds {num_tokens} tokens, but "
            f"'token_embd.weight' has rows for {vocab_size}"
        )
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": metadata.require(key("block_count"), int),
        # Gemma 4's may be one a layer, and its KV heads one a layer: read in _gemma4_fields.
        "intermediate_size": None if arch.model_type == "gemma4_text" else metadata.require(ffn_length, int),
        "num_attention_heads": heads,
        "num_key_value_heads": metadata.get(key("attention.head_count_kv"), heads),
        "head_dim": metadata.get(key("attention.key_length"), hidden // heads),
        "rms_norm_eps": float(metadata.require(key("attention.layer_norm_rms_epsilon"), float)),
        "rope_theta": metadata.optional(key("rope.freq_base"), float, 10000.0),
        "max_position_embeddings": metadata.get(key("context_length"), 4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": _eos_ids(metadata),
        "hidden_act": "silu",
    }
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if (bos := metadata.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = bos
    if arch.model_type != "gemma4_text":  # its rope_freqs are its partial rotation, read below
        config["rope_scaling"] = rope_scaling(metadata, key, config, tensors, arch.has_longrope)
    if arch.model_type == "gemma3_text":
        config.update(_gemma3_fields(metadata, key, config))
    if arch.model_type == "gemma2":
        config.update(_gemma2_fields(metadata, key, config))
    if arch.model_type == "phi3":
        config.update(_phi3_fields(metadata, key, config))
    if arch.model_type == "ministral3":
        config["rope_scaling"] = ministral3_scaling(metadata, key, config)
    if arch.model_type == "gemma4_text":  # its RoPE settings are per kind of layer
        config.update(_gemma4_fields(metadata, key, config, tensors))
        del config["rope_theta"]
    elif arch.has_experts or metadata.get(key("expert_count")) not in (None, 0):
        config.update(_expert_fields(metadata, key, arch))
    if arch.model_type == "gpt_oss":
        config.update(_gpt_oss_fields(metadata, key, config))
    return config


def _gpt_oss_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """What gpt-oss's config.json says and llama.cpp hard-codes: biased attention, every
    other layer sliding from the first (its swa pattern of 2), the SwiGLU clamp at 7;
    YaRN untruncated, as the model was trained (llama.cpp rounds the ramp's bounds,
    as mlx-lm does: see tests/runtime/test_gpt_oss.py)."""
    scaling = config["rope_scaling"]
    return {
        "attention_bias": True,
        "sliding_window": metadata.require(key("attention.sliding_window"), int),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(config["num_hidden_layers"])
        ],
        "swiglu_limit": 7.0,
        "rope_scaling": None if scaling is None else {**scaling, "truncate": False},
    }


def _expert_fields(metadata: Metadata, key: Callable[[str], str], arch: Architecture) -> dict[str, Any]:
    """Routed experts in every layer, as llama.cpp runs them: renormalised over the chosen
    for qwen3moe and Mixtral (which its converter writes as `llama`), raw probabilities
    beside a shared expert for qwen2moe."""
    if not arch.has_experts and arch.model_type != "llama":
        raise CheckpointError(f"{metadata.source}: routed experts are not supported for this architecture")
    num_experts = metadata.require(key("expert_count"), int)
    top_k = metadata.require(key("expert_used_count"), int)
    if arch.model_type == "gpt_oss":
        return {
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
            "intermediate_size": metadata.require(key("expert_feed_forward_length"), int),
        }
    if arch.model_type == "llama":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
        }
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": metadata.require(key("expert_feed_forward_length"), int),
        "norm_topk_prob": arch.model_type == "qwen3_moe",  # llama.cpp's qwen2moe: raw probabilities
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch.model_type == "qwen2_moe":
        shared = metadata.require(key("expert_shared_feed_forward_length"), int)
        fields["shared_expert_intermediate_size"] = shared
    return fields


def _phi3_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """Phi-3's window, its pre-LongRoPE context, and how much of a head RoPE rotates
    (Phi-4-mini's 0.75)."""
    rotated = metadata.optional(key("rope.dimension_count"), int, config["head_dim"])
    fields: dict[str, Any] = {
        "sliding_window": metadata.optional(key("attention.sliding_window"), int),
        # Half a dimension over, so int(head_dim * factor), as the family reads it, gives
        # `rotated` back: 30 / 44 * 44 is 29.999... in floating point.
        "partial_rotary_factor": (rotated + 0.5) / config["head_dim"],
    }
    original = metadata.optional(key("rope.scaling.original_context_length"), int)
    if original is not None:
        fields["original_max_position_embeddings"] = original
    return fields


def _eos_ids(metadata: Metadata) -> list[int]:
    """EOS, and the end-of-turn tokens llama.cpp also stops at: those the file names, and
    control tokens spelled as a known end of turn (Hugging Face lists them in
    generation_config.json, which a GGUF does not carry)."""
    ids: list[int] = []
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{name}")
        # One past the vocabulary is no token (as for the tokenizer's special tokens):
        # kept, it made llguidance refuse every structured-output request.
        if is_token_id(value, len(tokens)) and value not in ids:
            ids.append(value)
    types = metadata.get("tokenizer.ggml.token_type") or []
    for token_id, (token, token_type) in enumerate(zip(tokens, types, strict=False)):
        is_end_of_turn = (
            token in _END_OF_TURN_TOKENS and token_type == gguf.TokenType.CONTROL
        ) or token in _END_OF_TURN_ANY_TYPE
        if is_end_of_turn and token_id not in ids:
            ids.append(token_id)
    return ids


def _gemma3_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """What Gemma 3's config.json says and its GGUF leaves to llama.cpp's code: the local
    RoPE base (10,000), one global layer in six, and the attention scale (head_dim, but
    hidden/heads for the 62-layer 27B), as llama.cpp hard-codes them, unless the file
    states them (newer converters write a per-layer sliding pattern and the local base)."""
    is_27b = config["num_hidden_layers"] == 62
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": metadata.require(key("attention.sliding_window"), int),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": metadata.optional(key("rope.freq_base_swa"), float, 10000.0),
        "query_pre_attn_scalar": (
            config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
        ),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    pattern = metadata.get(key("attention.sliding_window_pattern"))
    if isinstance(pattern, list) and len(pattern) == config["num_hidden_layers"]:
        if not all(isinstance(is_sliding, bool) for is_sliding in pattern):
            raise CheckpointError(
                f"{metadata.source}: GGUF metadata '{key('attention.sliding_window_pattern')}' "
                "should be a list of booleans, one per layer"
            )
        fields["layer_types"] = [
            "sliding_attention" if is_sliding else "full_attention" for is_sliding in pattern
        ]
    return fields


def _gemma4_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any], tensors: dict[str, Any]
) -> dict[str, Any]:
    """Gemma 4's config.json fields, as llama.cpp's converter writes them: the per-layer
    sliding pattern, head widths and KV head counts per kind of layer, a RoPE base per
    kind, how much of a full layer's head rotates (its `rope_freqs`: 1 for a rotated pair,
    1e30 for the rest), the shared-KV layers, the MLP widths (doubled from the first
    shared layer where `use_double_wide_mlp`), per-layer inputs and routed experts; what
    it writes no key for is read from the tensors (experts from `ffn_gate_inp`, keys as
    values from a full layer with no `attn_v`)."""
    source = metadata.source
    num_layers = config["num_hidden_layers"]
    pattern = metadata.require(key("attention.sliding_window_pattern"), list)
    if len(pattern) != num_layers or not all(isinstance(p, bool) for p in pattern):
        raise CheckpointError(
            f"{source}: GGUF metadata '{key('attention.sliding_window_pattern')}' should be a list of "
            f"{num_layers} booleans"
        )
    full = [i for i, sliding in enumerate(pattern) if not sliding]
    sliding_layers = [i for i, sliding in enumerate(pattern) if sliding]
    kv_heads = _per_layer(metadata, key("attention.head_count_kv"), num_layers)
    by_kind = {kind: {kv_heads[i] for i in layers} for kind, layers in (("full", full), ("sliding", sliding_layers))}
    if any(len(counts) > 1 for counts in by_kind.values()):
        raise CheckpointError(f"{source}: layers of one kind differ in KV head count: {kv_heads}")
    head_dim = metadata.require(key("attention.key_length_swa"), int)
    global_head_dim = metadata.require(key("attention.key_length"), int)
    if metadata.optional(key("rope.dimension_count_swa"), int, head_dim) != head_dim:
        raise CheckpointError(f"{source}: gemma4 sliding layers rotating part of their heads are not supported")
    keys_are_values = bool(full) and f"blk.{full[0]}.attn_v.weight" not in tensors
    sliding_kv = by_kind["sliding"].pop() if by_kind["sliding"] else config["num_key_value_heads"]
    full_kv = by_kind["full"].pop() if by_kind["full"] else sliding_kv
    if full_kv != sliding_kv and not keys_are_values:
        raise CheckpointError(
            f"{source}: full layers with {full_kv} KV heads and sliding ones with {sliding_kv}, "
            "but full layers store values (transformers' Gemma 4 gives both the same count then)"
        )
    num_shared = _count(metadata, key("attention.shared_kv_layers"))
    widths = _per_layer(metadata, key("feed_forward_length"), num_layers)
    first_shared = num_layers - num_shared
    doubled = [w * 2 if i >= first_shared else w for i, w in enumerate([widths[0]] * num_layers)]
    if widths != [widths[0]] * num_layers and widths != doubled:
        raise CheckpointError(
            f"{source}: GGUF metadata '{key('feed_forward_length')}' {widths} is neither one width "
            "nor one doubled from the first KV-shared layer"
        )
    per_layer_size = _count(metadata, key("embedding_length_per_layer_input"))
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": widths[0],
        "use_double_wide_mlp": widths != [widths[0]] * num_layers,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_key_value_heads": sliding_kv,
        "num_global_key_value_heads": full_kv,
        "attention_k_eq_v": keys_are_values,
        "sliding_window": metadata.require(key("attention.sliding_window"), int),
        "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
        "num_kv_shared_layers": num_shared,
        "final_logit_softcapping": metadata.optional(key("final_logit_softcapping"), float),
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": metadata.optional(key("rope.freq_base_swa"), float, 10000.0),
            },
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": _gemma4_rotated_share(metadata, tensors, global_head_dim),
                "rope_theta": config["rope_theta"],
            },
        },
        "hidden_size_per_layer_input": per_layer_size,
    }
    if per_layer_size:
        table = tensors.get("per_layer_token_embd.weight")
        if table is None:
            raise CheckpointError(f"{source}: missing tensor 'per_layer_token_embd.weight'")
        fields["vocab_size_per_layer_input"] = int(table.shape[-1])
    if "blk.0.ffn_gate_inp.weight" in tensors:
        fields.update(
            enable_moe_block=True,
            num_experts=metadata.require(key("expert_count"), int),
            top_k_experts=metadata.require(key("expert_used_count"), int),
            moe_intermediate_size=metadata.require(key("expert_feed_forward_length"), int),
        )
    return fields


def _per_layer(metadata: Metadata, name: str, num_layers: int) -> list[int]:
    """A count the converter writes once, or once per layer."""
    value = metadata.get(name)
    values = value if isinstance(value, list) else [value] * num_layers
    if len(values) != num_layers or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise CheckpointError(
            f"{metadata.source}: GGUF metadata '{name}' should be a positive count, or one per layer"
        )
    return values


def _count(metadata: Metadata, name: str) -> int:
    """A count where absent or 0 means none."""
    return metadata.require(name, int) if metadata.get(name) not in (None, 0) else 0


def _gemma4_rotated_share(metadata: Metadata, tensors: dict[str, Any], head_dim: int) -> float:
    """The share of a full layer's pairs that rotate, from the converter's `rope_freqs`
    (1.0 for each rotated pair, then 1e30 for the rest); all of them without it."""
    tensor = tensors.get("rope_freqs.weight")
    if tensor is None:
        return 1.0
    factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    rotated = int(np.sum(factors == 1.0))
    if factors.size != head_dim // 2 or not (factors[rotated:] >= 1e29).all():
        raise CheckpointError(
            f"{metadata.source}: gemma4 'rope_freqs.weight' is not a run of 1s then 1e30s over {head_dim // 2} pairs"
        )
    return 2 * rotated / head_dim


def _gemma2_fields(
    metadata: Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """Gemma 2's settings as llama.cpp reads them: the soft caps (50 and 30 where the file
    is silent), the window (4096) on every other layer from the first, and the attention
    scale, head_dim but hidden/heads for the 46-layer 27B (query_pre_attn_scalar 144)."""
    is_27b = config["num_hidden_layers"] == 46
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": metadata.optional(key("attention.sliding_window"), int, 4096),
        "query_pre_attn_scalar": (
            config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
        ),
        "attn_logit_softcapping": metadata.optional(key("attn_logit_softcapping"), float, 50.0),
        "final_logit_softcapping": metadata.optional(key("final_logit_softcapping"), float, 30.0),
    }


def _hf_name(name: str, arch: Architecture, path: Path, *, has_experts: bool) -> str:
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    is_block = len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit()
    gemma4_name = _GEMMA4_NAMES.get((parts[-1], suffix)) if arch.model_type == "gemma4_text" else None
    if is_block and gemma4_name is not None:
        return f"model.layers.{int(parts[1])}.{gemma4_name}"
    if suffix not in ("weight", "bias") or not stem:
        raise CheckpointError(f"{path}: unexpected GGUF tensor '{name}'")
    if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        if parts[2] == "attn_sinks" and arch.model_type == "gpt_oss":  # a parameter, no layer
            return f"model.layers.{int(parts[1])}.self_attn.sinks"
        own = {"ffn_norm": arch.ffn_norm, "ffn_up": arch.ffn_up}
        names = {**_LAYER_NAMES, **_EXPERT_NAMES} if has_experts else _LAYER_NAMES
        hf = own.get(parts[2], names.get(parts[2]))
        if hf is not None:
            return f"model.layers.{int(parts[1])}.{hf}.{suffix}"
    raise CheckpointError(f"{path}: unexpected GGUF tensor '{name}' for this architecture")


def _row_permutation(hf_name: str, arch: Architecture, config: dict[str, Any]) -> list[int] | None:
    """Row order that undoes llama.cpp's q/k permutation, or None to keep the rows.

    The converter regroups each head's rows from Hugging Face's halves [x0..x(d/2-1),
    y0..y(d/2-1)] to pairs [x0, y0, x1, y1, ...] for its interleaved RoPE; HF row
    `h*d + p*(d/2) + i` sits at GGUF row `h*d + 2*i + p`.
    """
    if not arch.is_qk_permuted:
        return None
    if ".self_attn.q_proj." in hf_name:
        heads = config["num_attention_heads"]
    elif ".self_attn.k_proj." in hf_name:
        heads = config["num_key_value_heads"]
    else:
        return None
    d = config["head_dim"]
    return [h * d + 2 * i + p for h in range(heads) for p in range(2) for i in range(d // 2)]
