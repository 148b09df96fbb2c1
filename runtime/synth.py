"""Tiny random-weight checkpoints in Hugging Face layout, for tests and benchmarks.

`make_tiny_checkpoint` writes a directory that both cadence and `mlx_lm.load` can
read: config.json, generation_config.json, the demo tokenizer, and safetensors
weights named and shaped exactly as `Decoder` expects (optionally sharded, or
quantized in the mlx-community layout). The same seed gives the same bytes.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

from runtime.config import config_from_dict
from runtime.models import build_model, hunyuan_v1_dense, phi, starcoder2
from runtime.models.layers import CausalLM
from runtime.synth_configs import DTYPES, QWEN_VL_TEXT, hf_config
from runtime.synth_family_fields import QWEN3_5_FAMILIES
from runtime.synth_stored_weights import (
    EXPERT_NAMES,
    apertus_original_weights,
    fused_projections,
    granite4_original_weights,
    lfm2_original_weights,
    nemotron_h_weights,
    per_expert_weights,
    qwen3_5_weights,
    qwen3_next_weights,
    qwen_vl_weights,
    split_kv_b,
    stored_names,
)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

DEMO_DIR = Path(__file__).parent / "demo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MULTIMODAL = ("gemma3", "gemma4", "mistral3")  # the text model's weights under "language_model."
# The multimodal layout's vision tower: a few tensors, to be skipped when loading.
VISION_TENSORS = {
    "vision_tower.vision_model.post_layernorm.weight": (8,),
    "multi_modal_projector.mm_input_projection_weight": (8, 64),
}


def make_tiny_checkpoint(
    out_dir: Path,
    family: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    quantize: tuple[int, int] | None = None,
    quantize_mode: str = "affine",
    dtype: str = "float32",
    seed: int = 0,
    max_position_embeddings: int = 1024,
    rope_scaling: dict[str, Any] | None = None,
    shards: int = 1,
    vocab_size: int | None = None,
    sliding_window: int = 8,
    sliding_window_pattern: int = 2,
    query_pre_attn_scalar: int = 24,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    dense_layers: tuple[int, ...] = (),
    text_family: str = "ministral3",
    gemma4: dict[str, Any] | None = None,
    granite4: dict[str, Any] | None = None,
    nemotron: dict[str, Any] | None = None,
    hf_original: bool | None = None,
) -> Path:
    """Write a random-weight checkpoint of `family` into `out_dir` and return `out_dir`.

    Ministral 3 (`ministral3`) writes its YaRN and query temperature under
    `rope_parameters`, as transformers 5 does, over an original context of 16 so that
    short tests run past it (`rope_scaling` replaces those settings). The multimodal
    `mistral3` nests a `text_family` (`ministral3` or `mistral`) beside a stub vision
    tower.

    Gemma 3 (`gemma3_text`, or the multimodal `gemma3` layout with a stub vision
    tower) takes `sliding_window` and `sliding_window_pattern` (every pattern-th
    layer global; written as `layer_types` too) and `query_pre_attn_scalar`.
    Gemma 4 (`gemma4_text`, `gemma4`) takes the same windows; its full layers' heads
    are twice `head_dim` wide, and `gemma4` holds the variant's own fields (e.g.
    `attention_k_eq_v`, `num_kv_shared_layers`, `hidden_size_per_layer_input`,
    `enable_moe_block`: its experts are `num_experts` of `intermediate_size`).

    The routed-experts families (`qwen3_moe`, `qwen2_moe`, `mixtral`, `gpt_oss`) take
    `num_experts` of `intermediate_size`, `num_experts_per_tok`, and (the Qwens)
    `dense_layers` run by a dense MLP (qwen2_moe's shared expert is twice
    `intermediate_size`); float weights are stored per expert as Hugging Face does,
    quantized ones stacked as mlx-community does (gpt-oss's always stacked, in
    mlx-community's names; its layers alternate a `sliding_window` and full attention).

    Qwen3.5 (`qwen3_5_text`, or the multimodal `qwen3_5` layout with a stub vision
    tower and multi-token-prediction head; `qwen3_5_moe_text` and `qwen3_5_moe` with
    routed experts in every layer) has every fourth layer full attention, the rest
    Gated DeltaNet; so has Qwen3-Next (`qwen3_next`, its experts as `qwen3_moe`'s beside a
    shared expert, its linear-attention projections fused). `hf_original` stores the conv weights, norm offsets and experts as
    Hugging Face's originals do; False as mlx-lm's conversions; None: original unless
    quantized (mlx-community's quantized conversions are mlx-lm's form).

    LFM2 (`lfm2`) has every third layer attention, the rest short convolutions, its
    FFN `intermediate_size` wide after the configs' width adjustment; `hf_original`
    stores its conv weights as Hugging Face's originals do ([C, 1, L]), as above.
    LFM2-MoE (`lfm2_moe`) routes every layer from the `len(dense_layers)`-th among
    `num_experts` of `intermediate_size` (the dense ones twice as wide); an original
    stores each expert apart under Hugging Face's names (w1, w3, w2).

    Qwen's vision-language layouts (`qwen2_vl`, `qwen2_5_vl`: flat configs; `qwen3_vl`,
    `qwen3_vl_moe`: under `text_config`) hold a qwen2, qwen3 or qwen3_moe text model beside
    a stub vision tower; `hf_original` as above names Hugging Face's weights (Qwen3-VL-MoE's
    experts fused) or mlx-vlm's conversion (runtime/models/qwen_vl.py).

    Granite 4.0 (`granitemoehybrid`) is granite-4.0-h-tiny's layout: every third layer
    attention (NoPE), the rest Mamba2, routed experts beside a shared MLP twice
    `intermediate_size`; `granite4` holds the variant's own fields (e.g.
    `{"num_local_experts": 0}` for -h-micro's dense FFN, `layer_types` all "attention"
    and `position_embedding_type` "rope" for -micro's). `hf_original` as LFM2's. Granite 3
    MoE (`granitemoe`) routes every layer's MLP, its experts stored as Granite 4.0's.
    Nemotron-H (`nemotron_h`) is NVIDIA-Nemotron-Nano-9B-v2's layout (Mamba2, attention
    and relu**2 MLP blocks as `hybrid_override_pattern` says); `nemotron` holds the
    variant's own fields (a pattern with E blocks adds Nemotron 3 Nano's expert fields,
    `num_experts` of `intermediate_size`). `hf_original` as LFM2's; its experts apart.
    Falcon-H1 (`falcon_h1`) is Falcon-H1-0.5B's fields and multipliers (`nemotron` holds
    the variant's own); `hf_original` as LFM2's, the random weights being the original's
    (unfolded) or the conversion's (folded) alike.

    DeepSeek's MLA families (`deepseek_v2`: V2-Lite's fields and a scaled-down YaRN;
    `deepseek_v3`: a q LoRA and the sigmoid router over 2 groups; `glm4_moe_lite`) have
    heads of `head_dim` (K that plus half of it rotated), a latent of half `hidden_size`,
    the first layer dense and `num_experts` routed beside shared ones; float weights in
    Hugging Face's layout, quantized ones in mlx-lm's (the router float; V3's and GLM's
    kv_b_proj split per head into `embed_q` and `unembed_out`). `glm4_moe` is GLM-4.5-Air's
    fields with GLM-4.5's q/k norm: GQA rotating half of each head, V3's router over 2
    groups beside one shared expert, its first layer dense.

    `vocab_size` above the demo tokenizer's adds embedding rows no text encodes to
    (a large-vocabulary model, e.g. 151,936 as Qwen's).

    `quantize` is `(group_size, bits)`: every Linear and the embedding whose last
    dimension is a multiple of `group_size` is stored packed, with `.scales` and `.biases`;
    `quantize_mode` names mlx's mode (runtime/config.py: the microscaling ones, e.g.
    `mxfp4` at `(32, 4)` or `nvfp4` at `(16, 4)`, store no `.biases`).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_demo_tokenizer(out_dir)
    tokenizer = demo_tokenizer()
    raw = hf_config(
        family,
        vocab_size=max(vocab_size or 0, tokenizer.get_vocab_size()),
        eos_token_id=eos_ids(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        sliding_window=sliding_window,
        sliding_window_pattern=sliding_window_pattern,
        query_pre_attn_scalar=query_pre_attn_scalar,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        dense_layers=dense_layers,
        text_family=text_family,
        gemma4=gemma4,
        granite4=granite4,
        nemotron=nemotron,
    )
    weights = random_weights(build_model(config_from_dict(raw)), seed)
    weights = {name: w.astype(DTYPES[dtype]) for name, w in weights.items()}
    if family == "phi3":
        weights = fused_projections(weights)
    if family == "glm4":  # gate and up as one, q, k and v apart
        weights = fused_projections(weights, fused=("gate_proj",))
    if family == "mixtral":
        weights = {name.replace(".mlp.", ".block_sparse_moe."): w for name, w in weights.items()}
    if family == "apertus":  # its norms' names, and xIELU's alphas as [1], as Hugging Face stores them
        weights = apertus_original_weights(weights)
    if family == "phi":  # its attention output's and final norm's names
        weights = stored_names(weights, phi.STORED_NAMES)
    if family == "starcoder2":  # its MLP's names
        weights = stored_names(weights, starcoder2.STORED_NAMES)
    if family == "hunyuan_v1_dense":  # its q/k norms' names
        weights = stored_names(weights, hunyuan_v1_dense.STORED_NAMES)
    if family == "gpt_oss":  # mlx-community's names (mlx-lm reads them as they are)
        weights = {
            name.replace(".mlp.gate.", ".mlp.router.").replace(".mlp.switch_mlp.", ".mlp.experts."): w
            for name, w in weights.items()
        }
    if family in EXPERT_NAMES and quantize is None:
        weights = per_expert_weights(weights, EXPERT_NAMES[family])
    if family == "qwen3_next":
        is_original = quantize is None if hf_original is None else hf_original
        weights = qwen3_next_weights(weights, raw, is_original, seed)
    if family in QWEN3_5_FAMILIES:
        is_original = quantize is None if hf_original is None else hf_original
        weights = qwen3_5_weights(weights, is_original, "text_config" in raw, seed)
    if family in ("lfm2", "lfm2_moe") and (quantize is None if hf_original is None else hf_original):
        weights = lfm2_original_weights(weights)
    if family in QWEN_VL_TEXT:
        is_original = quantize is None if hf_original is None else hf_original
        weights = qwen_vl_weights(weights, family, is_original, seed)
    if family in ("granitemoehybrid", "granitemoe") and (quantize is None if hf_original is None else hf_original):
        weights = granite4_original_weights(weights)
    if family == "falcon_h1":  # the final norm's name; an original's conv weights [C, 1, K]
        is_original = quantize is None if hf_original is None else hf_original
        weights = {
            name.replace("model.norm.", "model.final_layernorm."): w.moveaxis(2, 1) if is_original and name.endswith("conv1d.weight") else w
            for name, w in weights.items()
        }
    if family == "nemotron_h":
        weights = nemotron_h_weights(weights, quantize is None if hf_original is None else hf_original)
    if family in MULTIMODAL:
        weights = {f"language_model.{name}": w for name, w in weights.items()}
        rng = np.random.default_rng(seed)
        for name, shape in VISION_TENSORS.items():
            weights[name] = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(DTYPES[dtype])
    if family in ("deepseek_v3", "glm4_moe_lite") and quantize is not None:
        weights = split_kv_b(weights, raw)
    if quantize is not None:
        group_size, bits = quantize
        weights = quantize_weights(weights, group_size, bits, quantize_mode, FLOAT_LAYERS.get(family, ()))
        raw["quantization"] = {"group_size": group_size, "bits": bits, "mode": quantize_mode}
    write_json(out_dir / "config.json", raw)
    write_json(out_dir / "generation_config.json", generation_config(eos_ids(tokenizer)))
    save_weights(out_dir, weights, shards=shards, is_mlx_format=quantize is not None)
    return out_dir


def generation_config(eos_token_ids: list[int]) -> dict[str, Any]:
    return {"eos_token_id": eos_token_ids, "do_sample": False}


def random_weights(model: CausalLM, seed: int) -> dict[str, mx.array]:
    """float32 weights for every parameter of `model`, keyed by checkpoint name.

    Scaled so greedy decoding is far from ties (logit std ~2-3) and does not settle
    into one repeated token within a few dozen steps: linears keep activations near
    unit RMS and norm weights are 1 plus noise. With tied embeddings the head is
    `E @ h`, and an embedding that is large in the residual stream makes the current
    token win; there the embedding is kept small and the final norm scales up instead.
    """
    rng = np.random.default_rng(seed)
    hidden = model.config.hidden_size
    is_tied = model.config.tie_word_embeddings
    embed_std = (0.2 if is_tied else 2.0) / hidden**0.5
    is_gemma = model.config.model_type.startswith("gemma")
    if is_gemma and not is_tied:  # its input embedding is scaled up by sqrt(hidden)
        embed_std /= hidden**0.5
    # Gemma 1-3 store w for a (1 + w) scale; Gemma 4 the scale itself.
    norm_offset = 1.0 if is_gemma and not model.config.model_type.startswith("gemma4") else 0.0
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = {}
    for name, param in params:
        shape = param.shape
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
            if is_tied and name in ("model.norm.weight", "model.embedding_norm.weight"):  # the final norm
                values *= 10.0
            values -= norm_offset
        elif name.endswith(".bias"):
            values = 0.1 * rng.standard_normal(shape)
        elif name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):  # Gemma 4's factors
            values = rng.uniform(0.5, 1.5, shape)
        elif name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: every biased score above 0
            values = rng.uniform(0.0, 0.2, shape)
        elif ".act_fn." in name:  # Apertus's xIELU: beta and eps as released, its alphas near their start
            start = {"alpha_p": 0.2, "alpha_n": -1.0, "beta": 0.5, "eps": -1e-6}[name.rpartition(".")[2]]
            values = np.asarray(start + (0.3 * rng.standard_normal() if "alpha" in name else 0.0))
        elif name.endswith(".sinks"):  # gpt-oss's: beside scores of ~N(0, 1), some dominate
            values = rng.uniform(-1.0, 3.0, shape)
        elif name == "model.embed_tokens.weight":
            values = embed_std * rng.standard_normal(shape)
        elif name == "lm_head.weight":
            values = (3.0 / hidden**0.5) * rng.standard_normal(shape)
        else:  # Linear [out, in]
            values = rng.standard_normal(shape) / shape[-1] ** 0.5
        weights[name] = mx.array(values.astype(np.float32))
    return weights


# Layers mlx-lm's conversions leave unquantized (they are no nn.Linear in its model), by
# the end of their weight's name.
FLOAT_LAYERS = {
    family: (".mlp.gate.weight",) for family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "glm4_moe")
}
FLOAT_LAYERS["nemotron_h"] = ("mixer.gate.weight",)  # its router is no Linear: mlx-lm's convert leaves it float


def quantize_weights(
    weights: dict[str, mx.array], group_size: int, bits: int, mode: str = "affine", unquantized: tuple[str, ...] = ()
) -> dict[str, mx.array]:
    """mlx-community layout: `X.weight` packed uint32 plus `X.scales` and (affine) `X.biases`;
    weights whose names end in one of `unquantized` stay as they are."""
    out = {}
    for name, w in weights.items():
        prefix = name.removesuffix(".weight")
        # 3 dimensions: stacked experts, quantized along their inputs as mlx-lm does.
        is_matrix = name.endswith(".weight") and w.ndim in (2, 3) and "norm" not in name
        is_matrix = is_matrix and not name.endswith(unquantized)
        if is_matrix and w.shape[-1] % group_size == 0:
            packed, scales, *biases = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
            out[name], out[f"{prefix}.scales"] = packed, scales
            if biases:
                out[f"{prefix}.biases"] = biases[0]
        else:
            out[name] = w
    return out


def save_weights(
    out_dir: Path, weights: dict[str, mx.array], *, shards: int = 1, is_mlx_format: bool = False
) -> None:
    """`model.safetensors`, or `shards` files plus `model.safetensors.index.json`."""
    metadata = {"format": "mlx" if is_mlx_format else "pt"}
    if shards <= 1:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata=metadata)
        return
    names = list(weights)
    total = sum(weights[n].nbytes for n in names)
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for name in names:  # fill shards in order, each up to ~1/shards of the bytes
        groups[min(shards - 1, done * shards // max(total, 1))].append(name)
        done += weights[name].nbytes
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        filename = f"model-{i:05d}-of-{shards:05d}.safetensors"
        shard = {n: weights[n] for n in group}
        mx.save_safetensors(str(out_dir / filename), shard, metadata=metadata)
        weight_map.update(dict.fromkeys(group, filename))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json(out_dir / "model.safetensors.index.json", index)


def copy_demo_tokenizer(out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO_DIR / name, Path(out_dir) / name)


@functools.cache
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))


def eos_ids(tokenizer: Tokenizer) -> list[int]:
    """`<|im_end|>` (ends a chat turn) and `<|endoftext|>` (ends a document)."""
    ids = []
    for token in ("<|im_end|>", "<|endoftext|>"):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token} token")
        ids.append(token_id)
    return ids


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
