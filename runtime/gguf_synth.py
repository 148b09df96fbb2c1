"""Tiny GGUF files for tests: a `runtime.synth` checkpoint converted the way llama.cpp's
convert_hf_to_gguf.py converts a Hugging Face one.

`write_gguf` keeps llama.cpp's conventions that `runtime.gguf` must undo: tensor names
(gpt-oss's sinks as `attn_sinks`, its experts' biases in F32),
the llama family's q/k row permutation, Gemma's norm weights stored as 1 + w, 1-D
tensors kept in F32, and a tokenizer spelled as `tokenizer.ggml.*` metadata. It also
writes a reference checkpoint directory holding exactly the values the GGUF encodes
(its quantized weights dequantized), so a test can compare a model loaded from the
GGUF with the same weights loaded from safetensors.

The `gguf` package has no quantizer for the K-quants, so their blocks are random bytes
(kept small enough that every 16-bit scale is finite); the reference holds what they
decode to, which is all a loader test needs.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from runtime.synth import EXPERT_NAMES, save_weights

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

_ARCH_OF = {
    "llama": "llama",
    "smollm3": "smollm3",
    "ministral3": "mistral3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "llama",  # llama.cpp's converter writes Mixtral as llama with experts
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt-oss",
    "gemma4_text": "gemma4",
}
# Gemma 4's own tensors, as its converter names them (runtime/gguf.py reads them back).
_GEMMA4_NAMES = {
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj.weight": "ffn_gate_up_exps.weight",
    "experts.switch_glu.down_proj.weight": "ffn_down_exps.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # phi3's
    "mlp.gate_up_proj": "ffn_up",  # phi3's: gate and up in one
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "post_feedforward_layernorm": "post_ffw_norm",
    "pre_feedforward_layernorm": "ffn_norm",
}
_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "model.embed_tokens_per_layer": "per_layer_token_embd",
    "model.per_layer_model_projection": "per_layer_model_proj",
    "model.per_layer_projection_norm": "per_layer_proj_norm",
}


def write_gguf(
    checkpoint: Path,
    out_file: Path,
    reference_dir: Path,
    tensor_type: GGMLType = GGMLType.F32,
    *,
    types_by_name: dict[str, GGMLType] | None = None,
    pre_tokenizer: str = "gpt-2",
    seed: int = 0,
) -> Path:
    """Convert the float32 checkpoint directory `checkpoint` to `out_file`, storing every
    matrix as `tensor_type`, or as `types_by_name[fragment]` when its Hugging Face name
    contains `fragment` (a mixed file, as llama.cpp's Q4_K_M is); write the reference
    checkpoint to `reference_dir`."""
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    model_type = config["model_type"]
    arch = _ARCH_OF[model_type]
    weights = {
        name: np.array(value.astype(mx.float32))
        for name, value in mx.load(str(checkpoint / "model.safetensors")).items()  # type: ignore[union-attr]
    }
    if model_type in EXPERT_NAMES:
        weights = _stacked_experts(weights, EXPERT_NAMES[model_type])
    if arch == "gemma4":
        weights = _gemma4_gate_up(weights)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out_file), arch)
    _write_hparams(writer, arch, config)
    _write_byte_level_vocab(writer, checkpoint, pre_tokenizer, config["vocab_size"])
    reference = {}
    for name, value in weights.items():
        is_vector = name.endswith(".shared_expert_gate.weight")  # [1, hidden]: llama.cpp's [hidden]
        if is_vector:
            value = value[0]
        matches = [kind for part, kind in (types_by_name or {}).items() if part in name]
        is_matrix = value.ndim in (2, 3) and not name.endswith(".bias")  # experts' biases are [E, out]
        kind = (matches or [tensor_type])[0] if is_matrix else GGMLType.F32
        stored, reference[name] = _stored(value, kind, rng)
        if is_vector:
            reference[name] = reference[name][None]
        if name.endswith(".experts.gate_up_proj.weight"):  # as Gemma 4's model holds them
            prefix = name.removesuffix(".gate_up_proj.weight")
            gate, up = np.split(reference.pop(name), 2, axis=-2)
            reference[f"{prefix}.switch_glu.gate_proj.weight"] = gate
            reference[f"{prefix}.switch_glu.up_proj.weight"] = up
        if arch in ("llama", "mistral3", "smollm3") and ".self_attn.q_proj." in name:
            stored = _llama_permute(stored, config["num_attention_heads"])
        elif arch in ("llama", "mistral3", "smollm3") and ".self_attn.k_proj." in name:
            stored = _llama_permute(stored, config["num_key_value_heads"])
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            stored = stored + 1  # Gemma3RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w
        writer.add_tensor(gguf_name(_gpt_oss_names(name) if arch == "gpt-oss" else name, arch), stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference_dir.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copyfile(file, reference_dir / file.name)
    save_weights(reference_dir, {name: mx.array(w) for name, w in reference.items()})
    return out_file


def _gpt_oss_names(name: str) -> str:
    """mlx-community's gpt-oss names (runtime.synth's) -> the other families' own."""
    return name.replace(".mlp.router.", ".mlp.gate.").replace(".mlp.experts.", ".mlp.switch_mlp.")


def _gemma4_gate_up(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Gemma 4's experts as its converter writes them: gate and up in one tensor
    [E, 2I, hidden], gate first (transformers' `experts.gate_up_proj`)."""
    out = {}
    for name, value in weights.items():
        if name.endswith(".experts.switch_glu.gate_proj.weight"):
            prefix = name.removesuffix(".switch_glu.gate_proj.weight")
            up = weights[f"{prefix}.switch_glu.up_proj.weight"]
            out[f"{prefix}.gate_up_proj.weight"] = np.concatenate([value, up], axis=-2)
        elif not name.endswith(".experts.switch_glu.up_proj.weight"):
            out[name] = value
    return out


def _write_gemma4_hparams(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """As llama.cpp's Gemma4Model.set_gguf_parameters writes them (over the common ones)."""
    arch, num_layers = "gemma4", config["num_hidden_layers"]
    is_sliding = [kind == "sliding_attention" for kind in config["layer_types"]]
    full_kv = config.get("num_global_key_value_heads") or config["num_key_value_heads"]
    rope = config["rope_parameters"]
    global_head_dim = config["global_head_dim"]
    writer.add_array(f"{arch}.attention.sliding_window_pattern", is_sliding)
    writer.add_array(
        f"{arch}.attention.head_count_kv",
        [config["num_key_value_heads"] if s else full_kv for s in is_sliding],
    )
    writer.add_sliding_window(config["sliding_window"])
    writer.add_uint32(f"{arch}.attention.key_length", global_head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", global_head_dim)
    writer.add_uint32(f"{arch}.attention.key_length_swa", config["head_dim"])
    writer.add_uint32(f"{arch}.attention.value_length_swa", config["head_dim"])
    writer.add_uint32(f"{arch}.rope.dimension_count", global_head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count_swa", config["head_dim"])
    writer.add_float32(f"{arch}.rope.freq_base", rope["full_attention"]["rope_theta"])
    writer.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    writer.add_uint32(f"{arch}.attention.shared_kv_layers", config["num_kv_shared_layers"])
    writer.add_uint32(f"{arch}.embedding_length_per_layer_input", config["hidden_size_per_layer_input"])
    if config.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    width = config["intermediate_size"]
    if config["use_double_wide_mlp"]:
        first_shared = num_layers - config["num_kv_shared_layers"]
        writer.add_array(
            f"{arch}.feed_forward_length", [width * 2 if i >= first_shared else width for i in range(num_layers)]
        )
    else:
        writer.add_feed_forward_length(width)
    if config["enable_moe_block"]:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    pairs = global_head_dim // 2
    rotated = int(rope["full_attention"].get("partial_rotary_factor", 1.0) * global_head_dim // 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (pairs - rotated), dtype=np.float32))


def gguf_name(hf_name: str, arch: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    stem, _, suffix = hf_name.rpartition(".")
    if arch == "gemma4" and stem.startswith("model.layers."):
        _, _, layer, module = hf_name.split(".", 3)
        if module in _GEMMA4_NAMES:
            return f"blk.{layer}.{_GEMMA4_NAMES[module]}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    if suffix == "sinks":  # gpt-oss's, a parameter of the attention
        return f"blk.{stem.split('.')[2]}.attn_sinks.weight"
    _, _, layer, module = stem.split(".", 3)  # model.layers.N.<module>
    module = module.replace("block_sparse_moe.", "mlp.")  # Mixtral's experts block
    if module == "post_attention_layernorm":
        short = "post_attention_norm" if arch in ("gemma2", "gemma3", "gemma4", "gpt-oss") else "ffn_norm"
    else:
        short = _LAYER_NAMES[module]
    return f"blk.{layer}.{short}.{suffix}"


def _stored(
    value: np.ndarray, kind: GGMLType, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(what the GGUF stores for `value` as `kind`, the float32 values that decodes to)."""
    if kind == GGMLType.F32:
        return value, value
    if kind == GGMLType.F16:
        half = value.astype(np.float16)
        return half, half.astype(np.float32)
    try:
        blocks = gguf.quants.quantize(value, kind)
    except NotImplementedError:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        row_bytes = value.shape[-1] // block_size * block_bytes
        # Bytes below 0x20 keep every float16 scale finite and under 2**-7.
        blocks = rng.integers(0, 0x20, size=(*value.shape[:-1], row_bytes), dtype=np.uint8)
    return blocks, gguf.quants.dequantize(blocks, kind).astype(np.float32)


def _stacked_experts(weights: dict[str, np.ndarray], names: dict[str, str]) -> dict[str, np.ndarray]:
    """As the converter writes them: each projection's experts as one [E, out, in] tensor
    (`ffn_*_exps`); Mixtral's stay under `block_sparse_moe`, as mlx-lm reads them."""
    ours = {stored: our for our, stored in names.items()}
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in weights.items():
        block, is_expert, rest = name.partition(".experts.")
        if not is_expert:
            out[name] = value
            continue
        expert, stored, _ = rest.split(".")
        experts.setdefault(f"{block}.switch_mlp.{ours[stored]}.weight", {})[int(expert)] = value
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _llama_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotate-half rows interleaved."""
    head_dim = rows.shape[0] // num_heads
    return (
        rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _write_hparams(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "gemma4":
        return _write_gemma4_hparams(writer, config)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    if arch == "mistral3":  # transformers 5's rope_parameters, as Ministral 3's config has them
        config = {**config, "rope_theta": config["rope_parameters"]["rope_theta"],
                  "rope_scaling": config["rope_parameters"]}
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if scaling.get("rope_type") == "yarn":  # as convert_hf_to_gguf.py's TextModel writes it
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if "beta_fast" in scaling:
            writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    if arch == "mistral3":  # and its Ministral3Model
        writer.add_rope_scaling_yarn_log_mul(scaling["mscale_all_dim"])
        writer.add_attn_temperature_scale(scaling["llama_4_scaling_beta"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":  # as convert_hf_to_gguf.py's Gemma2Model
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    if num_experts is not None:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "gpt-oss":  # as convert_hf_to_gguf.py's GptOssModel
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_sliding_window(config["sliding_window"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "phi3":  # as convert_hf_to_gguf.py's Phi3MiniModel writes them
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        if config.get("sliding_window") is not None:
            writer.add_sliding_window(config["sliding_window"])
        if scaling.get("type", scaling.get("rope_type")) in ("longrope", "su"):
            context = config["max_position_embeddings"] / config["original_max_position_embeddings"]
            original = config["original_max_position_embeddings"]
            attention_factor = math.sqrt(1 + math.log(context) / math.log(original))
            writer.add_rope_scaling_attn_factors(attention_factor if context > 1 else 1.0)
            for name in ("long", "short"):
                factors = np.array(scaling[f"{name}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{name}.weight", factors)


def _write_byte_level_vocab(
    writer: gguf.GGUFWriter, checkpoint: Path, pre: str, vocab_size: int
) -> None:
    """As llama.cpp's _set_vocab_gpt2: every id's token, CONTROL for special added tokens,
    USER_DEFINED for other added ones, the merges as "left right"; ids past the
    tokenizer's, up to the model's `vocab_size` rows, as UNUSED "[PAD<id>]" tokens
    (llama.cpp refuses a file whose token list is shorter than its embedding)."""
    raw = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = dict(raw["model"]["vocab"])
    added = {token["content"]: token for token in raw["added_tokens"]}
    vocab.update({content: token["id"] for content, token in added.items()})
    tokens = sorted(vocab, key=vocab.__getitem__)
    types = []
    for token in tokens:
        if token in added:
            types.append(
                gguf.TokenType.CONTROL if added[token]["special"] else gguf.TokenType.USER_DEFINED
            )
        else:
            types.append(gguf.TokenType.NORMAL)
    for token_id in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{token_id}]")
        types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if isinstance(config.get(name), str):
            add(vocab[config[name]])
    if isinstance(config.get("add_bos_token"), bool):
        writer.add_add_bos_token(config["add_bos_token"])
    if isinstance(config.get("chat_template"), (str, list)):  # a list: named templates
        writer.add_chat_template(config["chat_template"])
