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

from runtime.config import MAX_LAYERS, is_token_id
from runtime.errors import CheckpointError
from runtime.gguf_families import add_family_fields
from runtime.gguf_reader import Metadata, check_tensor_layout, open_gguf
from runtime.gguf_rope import rope_scaling
from runtime.gguf_tensors import MODES, NATIVE_BITS, decode_tensor, quantization_config, to_mlx
from runtime.gguf_tokenizer import tokenizer_from_gguf
from runtime.models import FAMILIES
from runtime.models.gemma4 import split_gate_up
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
    # SmolLM3 (llama's converter; every fourth layer without RoPE, as llama.cpp hard-codes it
    # and as smollm3.py derives it where a config is silent)
    "smollm3": Architecture("smollm3", "SmolLM3ForCausalLM", is_qk_permuted=True),
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

# gpt-oss's (harmony's) ends of a reply. Its <|end|> closes a message, its reasoning's
# among them, and the reply goes on: where both are EOS, llama.cpp drops <|end|>.
_HARMONY_ENDS = frozenset({"<|return|>", "<|call|>"})

# The end-of-turn spellings llama.cpp's vocabulary loader recognises (llama-vocab.cpp):
# Llama 3.1's <|eom_id|> (after a tool call) and <|end_of_text|>, which its files do not
# name beside <|eot_id|>, and Gemma 4's: the end of its turn, and the tool response it
# waits for after a call (a user-defined token in its files, which llama.cpp stops at
# all the same).
_END_OF_TURN_TOKENS = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|end|>", "<end_of_turn>"}
    | {"<|endoftext|>", "<EOT>", "<turn|>"}
    | _HARMONY_ENDS
)
_END_OF_TURN_ANY_TYPE = frozenset({"<|tool_response>"})


# Qwen3-Next's GGUF: its linear-attention layers' tensors are llama.cpp's own layout,
# which no conversion here reads; the family loads from its safetensors checkpoints.
HYBRID_REFUSAL = " (Qwen3-Next is served from its Hugging Face or mlx-community checkpoint, not a GGUF)"


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
        ) + HYBRID_REFUSAL * (arch_name == "qwen3next")
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
        rows = _row_permutation(hf_name, arch, config, len(tensor.data), f"{path}: GGUF tensor '{name}'")
        shift = arch.norm_shift if hf_name.endswith("norm.weight") else 0.0
        jobs.append((tensor, hf_name, rows, shift, str(path)))
    weights: dict[str, mx.array] = {}
    packing_by_layer: dict[str, tuple[int, str]] = {}
    for (tensor, hf_name, *_), arrays in zip(jobs, _decoded(jobs), strict=True):
        converted = to_mlx(tensor, arrays)
        if hf_name.endswith(".shared_expert_gate.weight") and converted[hf_name].ndim == 1:
            converted[hf_name] = converted[hf_name][None]  # nn.Linear(hidden, 1)'s [1, hidden]
        if hf_name.endswith(".experts.gate_up_proj.weight"):  # Gemma 4's: two layers in one tensor
            try:
                converted = {n: part for name, value in converted.items() for n, part in split_gate_up(name, value).items()}
            except CheckpointError as error:
                raise CheckpointError(f"{path}: GGUF tensor '{tensor.name}': {error}") from None
        kind = tensor.tensor_type
        for packed in (name.removesuffix(".scales") for name in converted if name.endswith(".scales")):
            packing_by_layer[packed] = (NATIVE_BITS[kind], MODES.get(kind, "affine"))
        weights.update(converted)
    if (quantization := quantization_config(packing_by_layer)) is not None:
        config["quantization"] = quantization
    return GGUFCheckpoint(config=config, weights=weights, tokenizer=tokenizer)


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
    # Bounded before the families' per-layer lists (32 GB at 2**32 - 1).
    num_layers = metadata.require(key("block_count"), int, most=MAX_LAYERS)
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
        "num_hidden_layers": num_layers,
        # Gemma 4's may be one a layer, and its KV heads one a layer: read in _gemma4_fields.
        "intermediate_size": None if arch.model_type == "gemma4_text" else metadata.require(ffn_length, int),
        "num_attention_heads": heads,
        # Checked here, named by their GGUF keys: unchecked, a key_length of text was
        # "rope.dimension_count is 16, but a head has x dimensions" (Gemma 4's KV heads
        # may be one a layer, read in _gemma4_fields).
        "num_key_value_heads": metadata.get(key("attention.head_count_kv"), heads)
        if arch.model_type == "gemma4_text"
        else metadata.optional(key("attention.head_count_kv"), int, heads),
        "head_dim": metadata.optional(key("attention.key_length"), int, hidden // heads),
        "rms_norm_eps": float(metadata.require(key("attention.layer_norm_rms_epsilon"), float)),
        "rope_theta": metadata.optional(key("rope.freq_base"), float, 10000.0),
        "max_position_embeddings": metadata.optional(key("context_length"), int, 4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": _eos_ids(metadata),
        "hidden_act": "silu",
    }
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if (bos := metadata.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = bos
    if arch.model_type != "gemma4_text":  # its rope_freqs are its partial rotation
        config["rope_scaling"] = rope_scaling(metadata, key, config, tensors, arch.has_longrope)
    add_family_fields(config, metadata, key, tensors, has_experts=arch.has_experts)
    # llama.cpp rotates `rope.dimension_count` of each head; a family that rotates whole
    # heads (all but those that say otherwise) would run every token off on fewer.
    rotated = metadata.optional(key("rope.dimension_count"), int, config["head_dim"])
    rotates_part = getattr(FAMILIES[arch.model_type], "ROTATES_PART_OF_A_HEAD", False)
    if not rotates_part and rotated != config["head_dim"]:
        raise CheckpointError(
            f"{metadata.source}: {key('rope.dimension_count')} is {rotated}, but a head has "
            f"{config['head_dim']} dimensions; rotating part of a head is not supported for "
            f"'{arch_name}'"
        )
    return config


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
    if _HARMONY_ENDS.issubset(tokens[i] for i in ids):
        ids = [i for i in ids if tokens[i] != "<|end|>"]
    return ids


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


def _row_permutation(
    hf_name: str, arch: Architecture, config: dict[str, Any], num_rows: int, what: str
) -> list[int] | None:
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
    if heads * d != num_rows:  # checked before the list is built: a head count of 2**32 - 1 took all the memory
        raise CheckpointError(f"{what} has {num_rows} rows, expected {heads} heads of {d}")
    return [h * d + 2 * i + p for h in range(heads) for p in range(2) for i in range(d // 2)]
