"""GGUF checkpoints: tiny files written the way llama.cpp's converter writes them
(runtime/gguf_synth.py), loaded with `load_model` and checked against the very weights
they encode, loaded from safetensors."""

import contextlib
import gc
import json
import math
import resource
import shutil
import struct
from types import SimpleNamespace

import runtime  # noqa: F401  (the fast BLAS loads before mlx)
from runtime.checkpoint import load_model
from runtime.config import MAX_LAYERS
from runtime.engine import Engine
from runtime.errors import CheckpointError
from runtime.gguf import read_gguf
from runtime.gguf_reader import MAX_ARRAY_ITEMS
from runtime.gguf_synth import write_gguf
from runtime.gguf_tensors import convert_tensor, decode_tensor, quantization_config
from runtime.grammar import GrammarCompiler, GrammarSpec
from runtime.kv.blocks import BlockPool
from runtime.models.experts import QuantizedExpertLinear
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

import gguf
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from tests.kernels.test_quantized_models import greedy

FAMILIES = [
    "llama", "ministral3", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "phi3", "gemma2", "gemma3_text",
    "gpt_oss", "gemma4_text", "smollm3",
]
EXACT_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]
QUANTIZED_TYPES = [
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q8_0,
    GGMLType.Q5_0,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
]
MLX_LOAD_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0)  # the types mx.load reads
NATIVE_TYPES = (*MLX_LOAD_TYPES, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K)  # repacked
PROMPT = mx.array([[1, 17, 250, 9, 1033, 77, 5, 600] * 3])  # longer than Gemma's window
# K-quants need rows of 256 weights; two heads of 64 keep the q/k permutation non-trivial.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
# A GGUF keeps no Gemma 3 layer pattern or attention scale: llama.cpp hard-codes Gemma
# 3's (one global layer in six, 1/sqrt(head_dim)), so the checkpoint follows them.
GEMMA3_SHAPE = dict(
    num_layers=6,
    sliding_window=8,
    sliding_window_pattern=6,
    query_pre_attn_scalar=64,
    tie_word_embeddings=True,
)
# Nor Gemma 2's: every other layer slides, the scale 1/sqrt(head_dim) below the 27B (a
# window past the test's positions: mlx-lm, the oracle below, runs every layer full).
GEMMA2_SHAPE = dict(num_layers=4, sliding_window=4096, query_pre_attn_scalar=64)
# Gemma 4 with its dense variants' parts at once: keys as values on the full layers (2
# and 5), per-layer inputs, the last two layers reading 3's and 4's K/V with MLPs twice
# as wide. Its routed experts have a test of their own (below): a float16 copy (Q6_K)
# may turn a near tie of the router's the other way.
GEMMA4_DENSE = {
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
    "hidden_size_per_layer_input": 256,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "rope_parameters": {  # neither kind's default base, half of a full layer's pairs turning
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 200000.0},
    },
}
GEMMA4_SHAPE = dict(
    num_layers=6, sliding_window=8, sliding_window_pattern=3, head_dim=64, tie_word_embeddings=True, gemma4=GEMMA4_DENSE
)


@pytest.fixture
def convert(make_checkpoint, tmp_path):
    """convert(family, kind, **options) -> (GGUF file, reference checkpoint dir)."""

    def run(family, kind, **options):
        family_shapes = {
            "gemma3_text": GEMMA3_SHAPE,
            "gemma2": GEMMA2_SHAPE,
            "gemma4_text": GEMMA4_SHAPE,
            "smollm3": dict(num_layers=4),  # its fourth layer without RoPE
        }
        shape = {**SHAPE, **family_shapes.get(family, {})}
        checkpoint = make_checkpoint(family, **shape)
        out = tmp_path / f"{family}-{kind.name}.gguf"
        reference = tmp_path / f"{family}-{kind.name}-reference"
        return write_gguf(checkpoint, out, reference, kind, **options), reference

    return run


@pytest.mark.parametrize("kind", EXACT_TYPES + QUANTIZED_TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_the_same_weights_loaded_from_safetensors(convert, family, kind):
    path, reference_dir = convert(family, kind)
    from_gguf, reference = load_model(path), load_model(reference_dir)
    for field in ("model_type", "hidden_size", "num_key_value_heads", "head_dim", "vocab_size"):
        assert getattr(from_gguf.config, field) == getattr(reference.config, field)
    assert from_gguf.config.tie_word_embeddings == reference.config.tie_word_embeddings
    assert from_gguf.config.layer_windows == reference.config.layer_windows
    assert from_gguf.config.extra == reference.config.extra
    assert set(from_gguf.config.eos_token_ids) == set(reference.config.eos_token_ids)
    expected = reference.model(PROMPT)
    logits = from_gguf.model(PROMPT)
    if kind in EXACT_TYPES:
        assert mx.array_equal(logits, expected)
    else:  # the repacked types through the quantized kernels, Q6_K a float16 copy
        scale = float(mx.abs(expected).max())
        assert float(mx.abs(logits - expected).max()) < 5e-3 * scale


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_from_a_gguf_matches_mlx_lm_on_the_original(convert, family):
    """Through the engine (paged KV, prefill in chunks of 8 across Gemma's window of 8)."""
    path, reference_dir = convert(family, GGMLType.F32)
    engine = Engine(load_model(path), max_batch=1)
    pool = BlockPool(
        engine.kv.num_blocks, engine.kv.block_size, is_caching=True, layout=engine.kv.layout
    )
    policy = FcfsScheduler(1, pool, engine.max_context, 8, 64, 0)
    prompt = [int(t) for t in PROMPT[0].tolist()]
    request = SequenceParams(prompt_tokens=tuple(prompt), max_tokens=16, ignore_eos=True)
    tokens = list(run_offline(engine, policy, {"a": request})["a"].tokens)
    model, _ = mlx_lm.load(str(reference_dir))
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
    assert tokens == expected


@pytest.mark.parametrize("kind", [GGMLType.F32, GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda k: k.name)
def test_gemma4_routed_experts_from_a_gguf(make_checkpoint, tmp_path, kind):
    """Its experts' gate and up in one tensor (split after decoding, packed or not), the
    router's `.scale` tensors, the greedy tokens of mlx-lm on the original."""
    shape = {**GEMMA4_SHAPE, "gemma4": {**GEMMA4_DENSE, "enable_moe_block": True}}
    checkpoint = make_checkpoint("gemma4_text", **SHAPE, **shape)
    path = write_gguf(checkpoint, tmp_path / "moe.gguf", tmp_path / "reference", kind)
    from_gguf, reference = load_model(path), load_model(tmp_path / "reference")
    assert from_gguf.config.extra == reference.config.extra
    assert from_gguf.config.extra["gemma4"].experts.num_experts == 4
    expected = reference.model(PROMPT)
    assert float(mx.abs(from_gguf.model(PROMPT) - expected).max()) <= 1e-3 * float(mx.abs(expected).max())
    if kind == GGMLType.F32:
        prompt = [int(t) for t in PROMPT[0].tolist()]
        model, _ = mlx_lm.load(str(tmp_path / "reference"))
        expected_tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
        assert greedy(from_gguf, prompt, 8) == expected_tokens
        # Gate and up that do not halve: named, not an mlx split error.
        fused = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_gate_up_exps.weight")
        odd = np.asarray(fused.data)[:, 1:]  # [E, 2I - 1, hidden]
        cut = rewritten(path, tmp_path / "odd.gguf", tensors={fused.name: np.ascontiguousarray(odd)})
        assert "GGUF tensor 'blk.0.ffn_gate_up_exps.weight'" in one_line_error(cut)


def test_a_vocabulary_past_the_tokenizers_is_padded_as_llama_cpps_converter_pads_it(
    make_checkpoint, tmp_path
):
    """llama.cpp refuses a file with fewer tokens than embedding rows; its converter
    pads the list with UNUSED "[PAD<id>]" tokens, and cadence loads such a file."""
    checkpoint = make_checkpoint("llama", **SHAPE, vocab_size=3000)
    path = write_gguf(checkpoint, tmp_path / "padded.gguf", tmp_path / "padded-reference")
    fields = gguf.GGUFReader(path).fields
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields["tokenizer.ggml.token_type"]
    assert len(tokens.data) == 3000 == len(types.data)
    assert bytes(tokens.parts[tokens.data[-1]]).decode() == "[PAD2999]"
    assert int(types.parts[types.data[-1]][0]) == gguf.TokenType.UNUSED
    loaded = load_model(path)
    assert loaded.config.vocab_size == 3000
    text = "def f(x): return x"
    assert loaded.tokenizer.encode(text) == load_model(checkpoint).tokenizer.encode(text)


def test_q4_0_q4_1_q8_0_stay_mlx_quantized_layers_when_the_dtype_is_kept(convert):
    types = {"mlp.down_proj": GGMLType.Q8_0, "embed_tokens": GGMLType.Q6_K}
    path, reference_dir = convert("llama", GGMLType.Q4_0, types_by_name=types)
    loaded = load_model(path, keep_dtype=True)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert (layer.self_attn.q_proj.bits, layer.self_attn.q_proj.group_size) == (4, 32)
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear) and layer.mlp.down_proj.bits == 8
    assert isinstance(loaded.model.model.embed_tokens, nn.Embedding)  # Q6_K: expanded
    reference = load_model(reference_dir, keep_dtype=True)  # as stored: q_proj not stacked
    q_proj = reference.model.model.layers[0].self_attn.q_proj.weight.astype(mx.float32)
    packed = layer.self_attn.q_proj
    scales, biases = packed.scales.astype(mx.float32), packed.biases.astype(mx.float32)
    weight = mx.dequantize(packed.weight, scales, biases, group_size=32, bits=4)
    assert float(mx.abs(weight - q_proj).max()) < 1e-6  # un-permuted and exact


def test_k_quant_and_q5_layers_stay_quantized_with_the_files_groups(convert):
    """A Q4_K_M-like mix: Q4_K as 4 bits and Q5_K / Q5_0 as 8, group 32 (float32 scales
    for the K-quants, whose d x sc float16 cannot hold); Q6_K expanded to float16."""
    types = {"mlp.down_proj": GGMLType.Q5_K, "self_attn.v_proj": GGMLType.Q5_0, "embed_tokens": GGMLType.Q6_K}
    path, reference_dir = convert("llama", GGMLType.Q4_K, types_by_name=types)
    layer = load_model(path, keep_dtype=True).model.model.layers[0]
    reference = load_model(reference_dir, keep_dtype=True).model.model.layers[0]
    for name, module, bits, scales in (
        ("q_proj", layer.self_attn.q_proj, 4, mx.float32),
        ("v_proj", layer.self_attn.v_proj, 8, mx.float32),
        ("down_proj", layer.mlp.down_proj, 8, mx.float32),
    ):
        assert isinstance(module, nn.QuantizedLinear), name
        assert (module.bits, module.group_size, module.scales.dtype) == (bits, 32, scales), name
    packed = layer.mlp.down_proj
    weight = mx.dequantize(packed.weight, packed.scales, packed.biases, group_size=32, bits=8)
    assert mx.array_equal(weight, reference.mlp.down_proj.weight.astype(mx.float32))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_q4_0_and_q8_0_experts_stay_quantized_and_exact(convert, family):
    """A file's stacked experts ([E, out, in] blocks) are repacked as they are, one
    quantized layer per projection, with the file's values."""
    types = {"switch_mlp.down_proj": GGMLType.Q8_0}
    path, reference_dir = convert(family, GGMLType.Q4_0, types_by_name=types)
    experts = load_model(path, keep_dtype=True).model.model.layers[1].mlp.switch_mlp
    reference = load_model(reference_dir, keep_dtype=True).model.model.layers[1].mlp.switch_mlp
    for name, bits in (("gate_proj", 4), ("up_proj", 4), ("down_proj", 8)):
        packed = getattr(experts, name)
        assert isinstance(packed, QuantizedExpertLinear) and (packed.bits, packed.group_size) == (bits, 32)
        weight = mx.dequantize(
            packed.weight, packed.scales.astype(mx.float32), packed.biases.astype(mx.float32),
            group_size=32, bits=bits,
        )
        assert weight.shape == (4, *getattr(reference, name).weight.shape[1:])
        assert float(mx.abs(weight - getattr(reference, name).weight).max()) < 1e-6, name


def test_repacked_blocks_equal_what_mlx_load_makes_of_the_file(tmp_path):
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "blocks.gguf"), "llama")
    values = {}
    for kind in MLX_LOAD_TYPES:
        values[kind] = rng.standard_normal((6, 96)).astype(np.float32)
        writer.add_tensor(kind.name, gguf.quants.quantize(values[kind], kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    by_mlx: dict = mx.load(str(tmp_path / "blocks.gguf"))  # type: ignore[assignment]
    for tensor in gguf.GGUFReader(tmp_path / "blocks.gguf").tensors:
        ours = convert_tensor(tensor, f"{tensor.name}.weight", None, 0.0, source="test")
        for suffix in ("weight", "scales", "biases"):
            theirs = by_mlx[tensor.name if suffix == "weight" else f"{tensor.name}.{suffix}"]
            assert mx.array_equal(ours[f"{tensor.name}.{suffix}"], theirs), (tensor.name, suffix)


def random_blocks(kind, shape, rng):
    """`shape` weights of `kind` as random blocks: every byte random but the float16 d
    (and dmin, m), drawn finite, so every code, sub-scale and fifth bit is exercised."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block_size, block_bytes), dtype=np.uint8)
    num_halves = {GGMLType.Q4_K: 2, GGMLType.Q5_K: 2, GGMLType.Q4_1: 2, GGMLType.Q5_1: 2}.get(kind, 1)
    halves = rng.standard_normal((*blocks.shape[:-1], num_halves)).astype(np.float16)
    blocks[..., : 2 * num_halves] = halves.view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


@pytest.mark.parametrize("kind", NATIVE_TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("shape", [(6, 512), (3, 4, 256)], ids=["matrix", "stacked experts"])
def test_repacked_blocks_dequantize_to_exactly_what_the_gguf_package_decodes(kind, shape):
    """The affine groups are the file's: mlx's dequantize of the repacked weight, scales
    and biases gives the gguf package's float32 values bit for bit."""
    blocks = random_blocks(kind, shape, np.random.default_rng(int(kind)))
    tensor = SimpleNamespace(name="t", tensor_type=kind, data=blocks, shape=tuple(reversed(shape)))
    ours = decode_tensor(tensor, "t.weight", None, 0.0, source="test")
    assert ours["t.weight"].dtype == np.uint32 and ours["t.weight"].shape[:-1] == shape[:-1]
    bits = {GGMLType.Q4_0: 4, GGMLType.Q4_1: 4, GGMLType.Q4_K: 4}.get(kind, 8)
    assert ours["t.weight"].shape[-1] == shape[-1] * bits // 32
    assert ours["t.scales"].shape == (*shape[:-1], shape[-1] // 32)
    weight, scales, biases = (mx.array(ours[f"t.{name}"]) for name in ("weight", "scales", "biases"))
    got = mx.dequantize(weight, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits)
    expected = gguf.quants.dequantize(blocks, kind)
    assert got.shape == expected.shape
    assert np.array_equal(np.array(got), expected.astype(np.float32))


@pytest.mark.parametrize("shape", [(6, 512), (3, 4, 256)], ids=["matrix", "stacked experts"])
def test_mxfp4_blocks_are_mlxs_mxfp4_with_their_nibbles_reordered(shape):
    """gpt-oss's experts: mlx's mxfp4 dequantize of the repacked words and exponents gives
    the gguf package's values bit for bit, every exponent included (0 and 1 are
    denormal scales in ggml's decoding)."""
    rng = np.random.default_rng(7)
    rows = int(np.prod(shape[:-1])) * shape[-1] // 32
    blocks = rng.integers(0, 256, size=(rows, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(rows) % 256  # every exponent
    blocks = blocks.reshape(*shape[:-1], -1)
    tensor = SimpleNamespace(name="t", tensor_type=GGMLType.MXFP4, data=blocks, shape=tuple(reversed(shape)))
    ours = decode_tensor(tensor, "t.weight", None, 0.0, source="test")
    assert set(ours) == {"t.weight", "t.scales"}  # no biases: a microscaling mode
    assert ours["t.weight"].shape == (*shape[:-1], shape[-1] // 8) and ours["t.scales"].dtype == np.uint8
    weight, exponents = mx.array(ours["t.weight"]), mx.array(ours["t.scales"])
    got = mx.dequantize(weight, exponents, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    expected = gguf.quants.dequantize(blocks, GGMLType.MXFP4)
    assert np.array_equal(np.array(got), expected.astype(np.float32))


def test_a_gpt_oss_gguf_keeps_its_mxfp4_experts_beside_other_types(convert):
    """As llama.cpp's gpt-oss files (MXFP4 experts, the rest Q8_0): the experts load as
    mlx's mxfp4, the rest as 8-bit affine, the logits those of the values they hold."""
    mxfp4 = {"mlp.experts.": GGMLType.MXFP4}
    path, reference_dir = convert("gpt_oss", GGMLType.Q8_0, types_by_name=mxfp4)
    loaded = load_model(path, keep_dtype=True)
    quantization = loaded.config.quantization
    assert (quantization.bits, quantization.mode) == (8, "affine")
    experts = {layer: packing for layer, packing in quantization.per_layer.items() if ".switch_mlp." in layer}
    assert len(experts) == 3 * 2 and set(experts.values()) == {(32, 4, "mxfp4")}
    assert loaded.model.model.layers[0].mlp.switch_mlp.up_proj.mode == "mxfp4"
    expected = load_model(reference_dir).model(PROMPT)
    scale = float(mx.abs(expected).max())
    assert float(mx.abs(loaded.model(PROMPT) - expected).max()) < 5e-3 * scale


def test_gpt_oss_settings_a_gguf_leaves_out_are_llama_cpps(convert):
    path, _ = convert("gpt_oss", GGMLType.F32)
    config = load_model(path).config
    assert config.layer_windows == (8, None)  # its swa pattern: every other layer, from the first
    assert config.extra["experts"].swiglu_limit == 7.0 and config.extra["attention_sinks"]
    assert config.qkv_bias and config.o_bias


def rewritten(path, out, metadata=(), tensors=(), dropped=()):
    """A copy of `path` with the `metadata` values {key: (value, type, item type)} and the
    `tensors` {name: array} replaced or added, and the keys and tensors `dropped` left out."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    replaced = dict(metadata)
    for field in reader.fields.values():
        if field.name in replaced:
            writer.add_key_value(field.name, *replaced[field.name])
        elif field.name not in dropped and not field.name.startswith(
            ("GGUF.", "general.architecture")
        ):
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for key, value in replaced.items():
        if key not in reader.fields:
            writer.add_key_value(key, *value)
    for tensor in reader.tensors:
        if tensor.name not in (*dict(tensors), *dropped):
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    for name, values in dict(tensors).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_quantized_vector_is_expanded_not_repacked(tmp_path):
    """A norm stored as Q4_0/Q8_0 (no converter writes one) once failed to reshape."""
    values = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    kinds = (*MLX_LOAD_TYPES, GGMLType.Q5_0, GGMLType.Q5_1)  # those the gguf package writes
    tensors = {kind.name: (gguf.quants.quantize(values, kind), kind) for kind in kinds}
    path = minimal_gguf(tmp_path / "vectors.gguf", "llama", tensors)
    for tensor in gguf.GGUFReader(path).tensors:
        ours = convert_tensor(tensor, "norm.weight", None, 0.0, source="test")
        expected = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        assert list(ours) == ["norm.weight"] and ours["norm.weight"].shape == (128,)
        assert np.array_equal(np.array(ours["norm.weight"]), expected.astype(np.float16))


def with_rope_freqs(path, factors, out):
    """`path` rewritten with a `rope_freqs.weight` tensor, as the converter adds for Llama 3."""
    return rewritten(path, out, tensors={"rope_freqs.weight": factors})


@pytest.mark.parametrize("family", ["llama", "smollm3"])
def test_a_rotation_of_part_of_each_head_is_refused_where_heads_rotate_whole(convert, tmp_path, family):
    """llama.cpp rotates `rope.dimension_count` of a head; read as whole heads, a file
    rotating fewer ran every token off with no word."""
    path, _ = convert(family, GGMLType.F32)
    arch = "llama" if family == "llama" else "smollm3"
    rotated = {f"{arch}.rope.dimension_count": (8, V.UINT32, V.UINT32)}
    message = one_line_error(rewritten(path, tmp_path / "part.gguf", metadata=rotated))
    assert f"{arch}.rope.dimension_count is 8, but a head has 64 dimensions" in message


def test_llama3_rope_freqs_become_its_rope_scaling(convert, tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    path, _ = convert("llama", GGMLType.F32)
    head_dim = 64
    freqs = 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi * freqs
    smooth = (8192 / wavelen - 1.0) / 3.0

    def factors_for(factor):
        middle = 1 / ((1 - smooth) / factor + smooth)
        return np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, factor, middle))

    factors = factors_for(8.0).astype(np.float32)
    llama3 = with_rope_freqs(path, factors, tmp_path / "llama3.gguf")
    assert read_gguf(llama3).config["rope_scaling"] == scaling
    assert load_model(llama3).config.rope_scaling == scaling
    other = with_rope_freqs(path, factors * 1.5, tmp_path / "other.gguf")
    assert "'rope_freqs.weight' is not Llama 3 RoPE scaling" in one_line_error(other)
    # Empty (max() of nothing) or zeros (a division by zero) raised out of the loader;
    # an infinite factor, with the factors it implies, is no scaling either.
    for name, values in [
        ("empty", np.zeros(0, np.float32)),
        ("zeros", factors * 0),
        ("infinite", factors_for(np.inf).astype(np.float32)),
        # 2% off: another scaling, which run as Llama 3's would turn every token off a little
        ("near", factors * np.float32(1.02)),
    ]:
        damaged = with_rope_freqs(path, values, tmp_path / f"{name}.gguf")
        assert "'rope_freqs.weight' is not Llama 3 RoPE scaling" in one_line_error(damaged)


def test_a_huge_head_dim_beside_rope_freqs_is_refused_before_its_factors_are_computed(convert, tmp_path):
    """Llama 3's factors were recomputed for every pair of the stated head dimension
    before their count was compared: a key_length of 2**31 - 1 asked for 2**30 of them."""
    path, _ = convert("llama", GGMLType.F32)
    factors = np.ones(32, np.float32)
    huge = {"llama.attention.key_length": (2**31 - 1, V.UINT32, V.UINT32)}
    damaged = rewritten(path, tmp_path / "huge.gguf", metadata=huge, tensors={"rope_freqs.weight": factors})
    with address_space_cap(2 << 30):
        assert "'rope_freqs.weight' is not Llama 3 RoPE scaling" in one_line_error(damaged)


def test_a_block_count_beyond_any_model_is_refused_before_per_layer_lists_are_built(convert, tmp_path):
    """A Gemma 3 file without a sliding window is global in every layer: the layer list
    for a block_count of 2**32 - 1 was 32 GB, built before the count was checked."""
    path, _ = convert("gemma3_text", GGMLType.F32)
    huge = {"gemma3.block_count": (2**32 - 1, V.UINT32, V.UINT32)}
    damaged = rewritten(path, tmp_path / "deep.gguf", metadata=huge, dropped=["gemma3.attention.sliding_window"])
    with address_space_cap(2 << 30):
        message = one_line_error(damaged)
    assert f"'gemma3.block_count' is 4294967295, more than {MAX_LAYERS}" in message


def test_a_file_that_states_its_alignment_loads(convert, tmp_path):
    """The gguf package reads a stated `general.alignment` as a numpy uint32, and the
    layout check's ceiling division of it overflowed: any such file, valid or not."""
    path, _ = convert("qwen2", GGMLType.F32)
    stated = rewritten(path, tmp_path / "aligned.gguf", metadata={"general.alignment": (32, V.UINT32, V.UINT32)})
    assert read_gguf(stated).config == read_gguf(path).config


def broken_copy(path, tmp_path, cut):
    out = tmp_path / "broken.gguf"
    out.write_bytes(path.read_bytes()[:cut])
    return out


def minimal_gguf(path, arch, tensors):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (values, kind) in tensors.items():
        writer.add_tensor(name, values, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_line_error(path) -> str:
    with pytest.raises(CheckpointError) as caught:
        load_model(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize("fraction", [0.001, 0.5, 0.999])
def test_a_truncated_file_is_a_one_line_error(convert, tmp_path, fraction):
    path, _ = convert("qwen2", GGMLType.Q4_0)
    cut = int(path.stat().st_size * fraction)
    assert "truncated" in one_line_error(broken_copy(path, tmp_path, cut))


def test_an_unsupported_architecture_is_named(tmp_path):
    path = minimal_gguf(
        tmp_path / "phi.gguf", "phi2", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)}
    )
    message = one_line_error(path)
    assert "unsupported GGUF architecture 'phi2'" in message and "phi3" in message
    assert "mmproj" not in message


def test_a_qwen3_next_gguf_is_refused_naming_the_checkpoints_that_load(tmp_path):
    tensors = {"token_embd.weight": (np.zeros((8, 32), np.float32), None)}
    message = one_line_error(minimal_gguf(tmp_path / "next.gguf", "qwen3next", tensors))
    assert "unsupported GGUF architecture 'qwen3next' (Qwen3-Next is served from its Hugging Face" in message


def test_a_multimodal_projector_file_is_named_as_one(tmp_path):
    """llama.cpp's mmproj files say architecture 'clip'; the error said only that."""
    tensors = {"v.patch_embd.weight": (np.zeros((8, 32), np.float32), None)}
    message = one_line_error(minimal_gguf(tmp_path / "mmproj.gguf", "clip", tensors))
    assert "'clip' (a multimodal projector, mmproj: give the language model's GGUF)" in message


def test_one_part_of_a_split_file_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "model-00001-of-00002.gguf"), "llama")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "split into 2 files" in one_line_error(tmp_path / "model-00001-of-00002.gguf")


def test_an_unsupported_tensor_type_is_named(convert):
    path, _ = convert(
        "llama", GGMLType.F32, types_by_name={"layers.1.mlp.up_proj": GGMLType.IQ4_NL}
    )
    message = one_line_error(path)
    assert "'blk.1.ffn_up.weight'" in message and "IQ4_NL" in message


def test_an_unsupported_tokenizer_is_named(convert, tmp_path):
    path, _ = convert("qwen3", GGMLType.F32, pre_tokenizer="falcon")
    assert "unsupported GGUF pre-tokenizer 'falcon'" in one_line_error(path)


def test_a_file_that_is_not_gguf_and_a_missing_one(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all")
    assert "not a checkpoint directory or a GGUF file" in one_line_error(tmp_path / "fake.gguf")
    with pytest.raises(CheckpointError, match="no such file"):
        load_model(tmp_path / "missing.gguf")


def headed_gguf(path, metadata_bytes, num_kv=1):
    """A GGUF file of no tensors whose metadata section is `metadata_bytes`, as written."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, num_kv) + metadata_bytes)
    return path


def gguf_string(text):
    return struct.pack("<Q", len(text)) + text.encode()


@pytest.mark.parametrize(
    "value",
    [
        struct.pack("<IIQ", 9, 0, 10**6) + bytes(64),  # an array of 10**6 uint8
        struct.pack("<IIQ", 9, 9, 10**6) + bytes(64),  # an array of 10**6 arrays
        struct.pack("<IQ", 8, 2**40) + b"abc",  # a string of 2**40 bytes
    ],
    ids=["uint8 array", "nested array", "string"],
)
def test_a_value_longer_than_the_rest_of_the_file_is_refused_before_it_is_read(tmp_path, value):
    """The gguf package's reader clamps a read at the end of the file and goes on: an
    array's declared count was iterated element by element (2**62 never finished)."""
    path = headed_gguf(tmp_path / "long.gguf", gguf_string("general.architecture") + value)
    message = one_line_error(path)
    assert "truncated" in message and ("past the end" in message or "rest of the file" in message)


@pytest.mark.parametrize("arrays", [1, 2], ids=["one array", "two arrays"])
def test_more_array_elements_than_any_vocabulary_are_refused_before_they_are_read(tmp_path, arrays):
    """The gguf package's reader keeps each element as a numpy view of its own: a 16 MB
    file of 2 million empty strings took 3.2 GB and 82 s before it was refused."""
    count = MAX_ARRAY_ITEMS // arrays + 1
    array = struct.pack("<IIQ", 9, 0, count) + bytes(count)  # uint8s the file does hold
    metadata = b"".join(gguf_string(f"array.{i}") + array for i in range(arrays))
    path = headed_gguf(tmp_path / "long.gguf", metadata, num_kv=arrays)
    assert f"more than the {MAX_ARRAY_ITEMS} array elements" in one_line_error(path)


@pytest.mark.parametrize(
    "moved_to",
    [
        lambda tensors, reader: tensors["blk.0.attn_k.weight"],  # the same bytes as attn_k
        lambda tensors, reader: tensors["blk.0.attn_v.weight"] + 2,  # misaligned
        lambda tensors, reader: 2**64 - reader.data_offset + 64,  # wraps into the metadata
    ],
    ids=["overlapping", "misaligned", "wrapped round"],
)
def test_tensor_data_where_llama_cpp_would_refuse_it_is_named(convert, tmp_path, moved_to):
    """llama.cpp requires each tensor's data right after the one before it; the gguf
    package's reader takes any offset, and such files loaded as garbage weights."""
    path, _ = convert("qwen2", GGMLType.F32)
    damaged = tmp_path / "moved.gguf"
    shutil.copy(path, damaged)
    reader = gguf.GGUFReader(damaged, "r+")
    offsets = {tensor.name: tensor.field.parts[-1] for tensor in reader.tensors}
    new_offset = moved_to({name: int(offset[0]) for name, offset in offsets.items()}, reader)
    offsets["blk.0.attn_v.weight"][0] = new_offset
    reader.data.flush()
    del reader
    message = one_line_error(damaged)
    assert f"tensor 'blk.0.attn_v.weight' has its data at offset {new_offset}" in message


V = gguf.GGUFValueType


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("qwen2.attention.head_count", (0, V.UINT32, V.UINT32), "must be a positive finite number, got 0"),
        # NaN and inf passed `value <= 0`: a blank reply, or non-finite logits at run time
        ("qwen2.attention.layer_norm_rms_epsilon", (math.inf, V.FLOAT32, V.FLOAT32), "got inf"),
        ("qwen2.rope.freq_base", (math.nan, V.FLOAT32, V.FLOAT32), "got nan"),
        ("split.count", ("1", V.STRING, V.STRING), "'split.count' should be int"),
        ("tokenizer.ggml.merges", (["zzz yyy"], V.ARRAY, V.STRING), "unusable BPE vocabulary"),
        (
            "tokenizer.ggml.token_type",
            (1, V.INT32, V.INT32),
            "'tokenizer.ggml.token_type' should be list",
        ),
        (
            "tokenizer.chat_template",
            (5, V.UINT32, V.UINT32),
            "'tokenizer.chat_template' should be str",
        ),
        (
            "tokenizer.chat_template",
            ("{% if %}", V.STRING, V.STRING),
            "chat template does not compile (",
        ),
        ("tokenizer.ggml.merges", (["zzz"], V.ARRAY, V.STRING), "malformed merge 'zzz'"),
        (
            "tokenizer.ggml.merges",
            ([1, 2], V.ARRAY, V.INT32),
            "'tokenizer.ggml.merges' should be an array of str",
        ),
        (
            "tokenizer.ggml.token_type",
            (["1"] * 2048, V.ARRAY, V.STRING),
            "'tokenizer.ggml.token_type' should be an array of int",
        ),
        ("qwen2.rope.freq_base", ("1e6", V.STRING, V.STRING), "should be float, got '1e6'"),
        ("qwen2.rope.scaling.type", ("xpos", V.STRING, V.STRING), "RoPE scaling type 'xpos'"),
        ("tokenizer.ggml.pre", (["qwen2"], V.ARRAY, V.STRING), "should be str, got ['qwen2']"),
        ("tokenizer.ggml.add_bos_token", ("false", V.STRING, V.STRING), "should be bool"),
        (
            "tokenizer.ggml.token_type",
            ([1, 1, 1], V.ARRAY, V.INT32),
            "token_type does not match the vocabulary",
        ),
        # GGUF has a bool type: `true` is no count of 1
        ("qwen2.attention.head_count", (True, V.BOOL, V.BOOL), "'qwen2.attention.head_count' should be int, got True"),
        # were named as config.json's fields, or blamed on rope.dimension_count
        ("qwen2.attention.key_length", ("x", V.STRING, V.STRING), "'qwen2.attention.key_length' should be int, got 'x'"),
        ("qwen2.attention.head_count_kv", (1.5, V.FLOAT32, V.FLOAT32), "'qwen2.attention.head_count_kv' should be int"),
        ("qwen2.attention.head_count_kv", (0, V.UINT32, V.UINT32), "'qwen2.attention.head_count_kv' must be a positive"),
        ("qwen2.context_length", ([1, 2], V.ARRAY, V.INT32), "'qwen2.context_length' should be int, got [1, 2]"),
        # past a config field's 32 bits: named as config.json's max_position_embeddings, hidden_size
        ("qwen2.context_length", (2**31, V.UINT64, V.UINT64), "'qwen2.context_length' is 2147483648, more than 2147483647"),
        ("qwen2.embedding_length", (2**40, V.UINT64, V.UINT64), "'qwen2.embedding_length' is 1099511627776, more than 2147483647"),
    ],
    ids=[
        "no heads",
        "infinite eps",
        "nan rope base",
        "split count as text",
        "merge of unknown tokens",
        "token types not a list",
        "template not text",
        "template not jinja",
        "malformed merge",
        "merges of numbers",
        "token types of text",
        "rope base as text",
        "xpos rope scaling",
        "pre-tokenizer as an array",
        "add_bos as text",
        "token types not one a token",
        "head count as a boolean",
        "key length as text",
        "kv head count as a float",
        "no kv heads",
        "context length as an array",
        "context length past 32 bits",
        "hidden size past 32 bits",
    ],
)
def test_bad_metadata_is_a_one_line_error(convert, tmp_path, key, value, expected):
    path, _ = convert("qwen2", GGMLType.F32)
    damaged = rewritten(path, tmp_path / "damaged.gguf", metadata={key: value})
    assert expected in one_line_error(damaged)


@contextlib.contextmanager
def address_space_cap(extra_bytes):
    """At most `extra_bytes` more address space than the process has now, where the
    system says how much that is (Linux): a huge allocation is a MemoryError, not a
    machine out of memory."""
    try:
        with open("/proc/self/status") as status:
            in_use = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except OSError:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (in_use + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.attention.head_count_kv"])
def test_a_huge_head_count_is_refused_before_the_rows_are_permuted(convert, tmp_path, key):
    """The q/k rows' order was built from the head count before the tensor's rows were
    counted: a 4-byte count of 2**32 - 1 asked for a list of 2**37 entries. (Past 2**31 - 1
    a count is now refused as it is read; the largest one read still reaches this check.)"""
    path, _ = convert("llama", GGMLType.F32)
    huge = (2**31 - 1, V.UINT32, V.UINT32)
    damaged = rewritten(path, tmp_path / "heads.gguf", metadata={key: huge})
    with address_space_cap(2 << 30):
        message = one_line_error(damaged)
    assert "rows, expected 2147483647 heads of" in message


def test_a_tensor_of_more_dimensions_is_named_by_its_shape_not_as_truncated(convert, tmp_path):
    path, _ = convert("qwen2", GGMLType.F32)
    q_proj = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    values = np.asarray(q_proj.data)
    damaged = rewritten(
        path, tmp_path / "3d.gguf", tensors={q_proj.name: values.reshape(2, -1, values.shape[-1])}
    )
    rows, columns = values.shape
    assert f"has shape (2, {rows // 2}, {columns})" in one_line_error(damaged)


def test_the_quantization_config_defaults_to_4_bits_and_names_the_other_layers():
    layers = {
        "model.layers.0.mlp.down_proj": (8, "affine"),
        "model.layers.0.mlp.up_proj": (4, "affine"),
        "model.layers.0.mlp.switch_mlp.up_proj": (4, "mxfp4"),
    }
    assert quantization_config(layers) == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8, "mode": "affine"},
        "model.layers.0.mlp.switch_mlp.up_proj": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    }
    assert quantization_config({"lm_head": (8, "affine")}) == {"group_size": 32, "bits": 8, "mode": "affine"}
    experts = {"model.layers.0.mlp.switch_mlp.up_proj": (4, "mxfp4"), "lm_head": (8, "affine")}
    assert quantization_config(experts) == {
        "group_size": 32, "bits": 4, "mode": "mxfp4", "lm_head": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert quantization_config({}) is None


def test_a_tensor_with_fewer_rows_than_its_shape_is_named_truncated():
    """GGUFReader's own reshape refuses a short file first; a reader that hands over a
    short array must not turn into a wrong-shaped weight either."""
    short = SimpleNamespace(
        name="blk.0.ffn_down.weight",
        tensor_type=GGMLType.F32,
        shape=[4, 3],
        data=np.zeros((2, 4), np.float32),
    )
    with pytest.raises(CheckpointError, match="'blk.0.ffn_down.weight' is truncated"):
        decode_tensor(short, "model.layers.0.mlp.down_proj.weight", None, 0.0, "x.gguf")
    whole = SimpleNamespace(**{**vars(short), "data": np.zeros((3, 4), np.float32)})
    got = decode_tensor(whole, "w", None, 0.0, "x.gguf")
    assert got["w"].shape == (3, 4)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe", "qwen2_moe", "mixtral", "gemma4_text"])
def test_the_config_read_from_a_gguf_is_the_checkpoints_config_json(convert, family):
    path, reference_dir = convert(family, GGMLType.F32)
    config = read_gguf(path).config
    expected = json.loads((reference_dir / "config.json").read_text())
    shared = (set(config) & set(expected)) - {"rms_norm_eps"}  # stored as a float32
    rope = "rope_parameters" if family == "gemma4_text" else "rope_theta"  # Gemma 4's per kind of layer
    assert {"max_position_embeddings", "num_hidden_layers", rope} <= shared
    assert {k: config[k] for k in shared} == {k: expected[k] for k in shared}
    assert config["rms_norm_eps"] == pytest.approx(expected["rms_norm_eps"], rel=1e-6)


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("llama", {"head_dim": 32}),  # q/k rows un-permuted per head of 32, not 64
        ("qwen3", {"head_dim": 32}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                    "beta_fast": 16.0, "beta_slow": 2.0}}),
    ],
    ids=["llama-head-dim", "qwen3-head-dim", "linear-rope", "yarn-rope", "yarn-betas"],
)
def test_settings_the_gguf_states_reach_the_model(make_checkpoint, tmp_path, family, options):
    checkpoint = make_checkpoint(family, **SHAPE, **options)
    path = write_gguf(checkpoint, tmp_path / "model.gguf", tmp_path / "reference")
    from_gguf, reference = load_model(path), load_model(tmp_path / "reference")
    assert from_gguf.config.head_dim == reference.config.head_dim
    assert from_gguf.config.rope_scaling == reference.config.rope_scaling
    assert mx.array_equal(from_gguf.model(PROMPT), reference.model(PROMPT))


def test_gemma3_layer_pattern_and_local_rope_base_are_read_when_the_file_states_them(
    convert, tmp_path
):
    path, _ = convert("gemma3_text", GGMLType.F32)
    pattern = [True, False, True, True, True, False]
    stated = rewritten(
        path,
        tmp_path / "stated.gguf",
        metadata={
            "gemma3.attention.sliding_window_pattern": (pattern, V.ARRAY, V.BOOL),
            "gemma3.rope.freq_base_swa": (5000.0, V.FLOAT32, V.FLOAT32),
        },
    )
    config = read_gguf(stated).config
    assert config["layer_types"] == [
        "sliding_attention" if is_sliding else "full_attention" for is_sliding in pattern
    ]
    assert config["rope_local_base_freq"] == 5000.0
    assert load_model(stated).config.layer_windows == (8, None, 8, 8, 8, None)
    default = read_gguf(path).config  # llama.cpp's hard-coded Gemma 3 values
    assert "layer_types" not in default and default["rope_local_base_freq"] == 10000.0
    # A pattern of numbers, or text, loaded as every layer sliding.
    numbers = rewritten(
        path,
        tmp_path / "numbers.gguf",
        metadata={"gemma3.attention.sliding_window_pattern": ([5] * 6, V.ARRAY, V.INT32)},
    )
    assert "should be a list of booleans" in one_line_error(numbers)


def test_a_gemma3_file_without_a_sliding_window_attends_fully_in_every_layer(convert, tmp_path):
    """llama.cpp's converter leaves gemma3.attention.sliding_window out where config.json
    has every layer global (`sliding_window_pattern` 1: Rnj-1), and llama.cpp then runs
    no layer sliding, a pattern in the file or not; such a file was refused."""
    path, reference_dir = convert("gemma3_text", GGMLType.F32)
    pattern = [True, False, True, True, True, False]
    silent = rewritten(
        path,
        tmp_path / "silent.gguf",
        metadata={"gemma3.attention.sliding_window_pattern": (pattern, V.ARRAY, V.BOOL)},
        dropped=["gemma3.attention.sliding_window"],
    )
    reference = tmp_path / "all-full"
    shutil.copytree(reference_dir, reference)
    config = json.loads((reference / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention"] * 6}))
    loaded = load_model(silent)
    assert loaded.config.layer_windows == (None,) * 6
    assert mx.allclose(loaded.model(PROMPT), load_model(reference).model(PROMPT), atol=1e-5).item()


def test_gemma3_final_logit_softcapping_in_the_file_caps_the_logits(convert, tmp_path):
    """llama.cpp's converter writes gemma3.final_logit_softcapping where config.json sets
    one (Rnj-1, a Gemma 3 of EssentialAI's), and llama.cpp applies it; it was read as
    none, every logit uncapped."""
    path, _ = convert("gemma3_text", GGMLType.F32)
    plain = load_model(path).model(PROMPT)
    stated = rewritten(
        path, tmp_path / "capped.gguf", metadata={"gemma3.final_logit_softcapping": (0.5, V.FLOAT32, V.FLOAT32)}
    )
    assert mx.allclose(load_model(stated).model(PROMPT), mx.tanh(plain / 0.5) * 0.5, atol=1e-5).item()
    assert mx.abs(plain).max().item() > 0.5


def test_llama_attention_biases_are_loaded_and_un_permuted(convert, tmp_path):
    """convert_hf_to_gguf.py permutes the q/k biases' rows as it does the weights'."""
    path, reference_dir = convert("llama", GGMLType.F32)
    rng = np.random.default_rng(1)
    biases, stored = {}, {}
    sizes = {"q": (256, 4), "k": (128, 2), "v": (128, None), "o": (256, None)}
    gguf_names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}
    for layer in range(2):
        for short, (size, heads) in sizes.items():
            values = rng.standard_normal(size).astype(np.float32)
            biases[f"model.layers.{layer}.self_attn.{short}_proj.bias"] = mx.array(values)
            if heads is not None:  # HF row h*d + p*(d/2) + i is GGUF row h*d + 2*i + p
                values = values.reshape(heads, 2, -1).swapaxes(1, 2).reshape(-1)
            stored[f"blk.{layer}.{gguf_names[short]}.bias"] = values
    with_biases = rewritten(path, tmp_path / "biased.gguf", tensors=stored)
    assert read_gguf(with_biases).config["attention_bias"] is True
    assert read_gguf(path).config["attention_bias"] is False
    reference = tmp_path / "biased-reference"
    shutil.copytree(reference_dir, reference)
    config = json.loads((reference / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    weights = mx.load(str(reference / "model.safetensors"))
    mx.save_safetensors(str(reference / "model.safetensors"), {**weights, **biases})
    expected = load_model(reference).model(PROMPT)
    assert mx.allclose(load_model(with_biases).model(PROMPT), expected, atol=1e-5).item()


def token_types(path):
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.token_type"]
    return [int(field.parts[i][0]) for i in field.data]


def test_only_control_tokens_spelled_as_an_end_of_turn_stop_generation(convert, tmp_path):
    path, _ = convert("qwen2", GGMLType.F32)
    assert read_gguf(path).config["eos_token_id"] == [2, 0]  # <|im_end|>, then <|endoftext|>
    types = token_types(path)
    types[0] = gguf.TokenType.USER_DEFINED  # <|endoftext|> as plain added text
    retyped = rewritten(
        path,
        tmp_path / "retyped.gguf",
        metadata={"tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32)},
    )
    assert read_gguf(retyped).config["eos_token_id"] == [2]


def respelled(path, out, tokens):
    """A copy of the file at `out` whose tokens `tokens` names (id -> (spelling, type))
    are spelled and typed so."""
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    spellings = [bytes(field.parts[i]).decode() for i in field.data]
    types = token_types(path)
    for token_id, (spelling, kind) in tokens.items():
        spellings[token_id], types[token_id] = spelling, kind
    metadata = {
        "tokenizer.ggml.tokens": (spellings, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
    }
    return rewritten(path, out, metadata=metadata)


def test_gemma4s_end_of_turn_and_its_wait_for_a_tool_response_stop_generation(convert, tmp_path):
    """As llama.cpp's vocabulary loader: `<turn|>` (a control token) and `<|tool_response>`
    (user-defined in Gemma 4's files), beside the file's EOS."""
    path, _ = convert("gemma4_text", GGMLType.F32)
    ends = {0: ("<turn|>", gguf.TokenType.CONTROL), 1: ("<|tool_response>", gguf.TokenType.USER_DEFINED)}
    renamed = respelled(path, tmp_path / "gemma4.gguf", ends)
    assert set(read_gguf(renamed).config["eos_token_id"]) == {*read_gguf(path).config["eos_token_id"], 0, 1}


def with_id_past_the_vocabulary(convert, tmp_path, key):
    """(a qwen2 file, its copy whose `key` names the first id past the vocabulary, that id)."""
    path, _ = convert("qwen2", GGMLType.F32)
    past = len(token_types(path))
    damaged = rewritten(path, tmp_path / "past.gguf", metadata={key: (past, V.UINT32, V.UINT32)})
    return path, damaged, past


def test_a_special_token_id_past_the_vocabulary_is_no_special_token(convert, tmp_path):
    path, damaged, _ = with_id_past_the_vocabulary(convert, tmp_path, "tokenizer.ggml.bos_token_id")
    tokenizer = read_gguf(damaged).tokenizer
    assert tokenizer.bos_token_id is None
    assert tokenizer.encode("hi") == read_gguf(path).tokenizer.encode("hi")


def test_a_boolean_special_token_id_is_no_special_token(convert, tmp_path):
    """GGUF has a bool type; `true` is not token 1, as config.json's `true` is no EOS."""
    path, _ = convert("qwen2", GGMLType.F32)
    damaged = rewritten(
        path, tmp_path / "bool.gguf", metadata={"tokenizer.ggml.bos_token_id": (True, V.BOOL, V.BOOL)}
    )
    tokenizer = read_gguf(damaged).tokenizer
    assert tokenizer.bos_token_id is None
    assert tokenizer.encode("hi") == read_gguf(path).tokenizer.encode("hi")


def test_an_eos_id_past_the_vocabulary_is_no_eos_and_grammars_still_compile(convert, tmp_path):
    """Kept, an EOS id past the vocabulary made llguidance refuse every grammar."""
    _, damaged, past = with_id_past_the_vocabulary(convert, tmp_path, "tokenizer.ggml.eos_token_id")
    loaded = load_model(damaged)
    assert past not in loaded.config.eos_token_ids
    compiler = GrammarCompiler(
        loaded.tokenizer, loaded.config.vocab_size, loaded.config.eos_token_ids
    )
    assert compiler.compile(GrammarSpec("regex", "[a-z]+", "guided_regex")) is not None


@pytest.mark.parametrize("key", ["eot_token_id", "eom_token_id"])
def test_the_end_of_turn_and_end_of_message_ids_a_gguf_names_stop_generation(convert, tmp_path, key):
    """As llama.cpp stops at them: Llama 3.1's <|eom_id|> after a tool call among them."""
    path, _ = convert("qwen2", GGMLType.F32)
    named = rewritten(path, tmp_path / "named.gguf", metadata={f"tokenizer.ggml.{key}": (5, V.UINT32, V.UINT32)})
    assert 5 in read_gguf(named).config["eos_token_id"]
    assert 5 not in read_gguf(path).config["eos_token_id"]


def test_gemma4_rope_freqs_of_another_length_than_half_a_full_head_are_refused(convert, tmp_path):
    """Read as they come, fewer 1s than a head has pairs rotated a smaller share of it."""
    path, _ = convert("gemma4_text", GGMLType.F32)
    pairs = gguf.GGUFReader(path).fields["gemma4.attention.key_length"].contents() // 2
    damaged = with_rope_freqs(path, np.ones(pairs - 2, dtype=np.float32), tmp_path / "short.gguf")
    assert f"is not a run of 1s then 1e30s over {pairs} pairs" in one_line_error(damaged)


def test_gemma4_kv_head_counts_not_one_a_layer_are_named(convert, tmp_path):
    path, _ = convert("gemma4_text", GGMLType.F32)
    key = "gemma4.attention.head_count_kv"
    damaged = rewritten(path, tmp_path / "short.gguf", metadata={key: ([1], V.ARRAY, V.UINT32)})
    assert f"'{key}' should be a positive count, or one per layer" in one_line_error(damaged)


def test_gemma4_per_layer_counts_past_32_bits_are_named_by_their_key(convert, tmp_path):
    path, _ = convert("gemma4_text", GGMLType.F32)
    key = "gemma4.feed_forward_length"
    widths = gguf.GGUFReader(path).fields[key].contents()
    huge = [2**31] + list(widths[1:]) if isinstance(widths, list) else 2**31
    kind = V.ARRAY if isinstance(huge, list) else V.UINT64
    damaged = rewritten(path, tmp_path / "huge.gguf", metadata={key: (huge, kind, V.UINT64)})
    assert f"'{key}' should be a positive count, or one per layer" in one_line_error(damaged)


def test_at_most_2_31_minus_1_a_count_is_read_as_it_is(convert, tmp_path):
    # The bound's edge: 2**31 - 1 passes the GGUF check and fails later on what it is.
    path, _ = convert("qwen2", GGMLType.F32)
    key = "qwen2.context_length"
    damaged = rewritten(path, tmp_path / "edge.gguf", metadata={key: (2**31 - 1, V.UINT64, V.UINT64)})
    loaded = load_model(damaged)
    assert loaded.config.max_position_embeddings == 2**31 - 1


def test_a_rope_scaling_type_of_none_is_plain_rope(convert, tmp_path):
    """llama.cpp's converters may write the type "none" where nothing is scaled."""
    path, _ = convert("qwen2", GGMLType.F32)
    plain = rewritten(path, tmp_path / "none.gguf", metadata={"qwen2.rope.scaling.type": ("none", V.STRING, V.STRING)})
    assert read_gguf(plain).config["rope_scaling"] is None


def test_a_vocabulary_longer_than_the_embedding_is_refused(convert, tmp_path):
    """llama.cpp refuses it too: the tokenizer would give ids the model has no row for."""
    path, _ = convert("qwen2", GGMLType.F32)
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    tokens = field.contents() + ["<extra>"]
    damaged = rewritten(
        path,
        tmp_path / "longer.gguf",
        metadata={
            "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
            "tokenizer.ggml.token_type": (token_types(path) + [4], V.ARRAY, V.INT32),
        },
    )
    message = one_line_error(damaged)
    assert f"holds {len(tokens)} tokens" in message and "rows for 2048" in message


def test_a_file_without_token_embeddings_is_named(convert, tmp_path):
    path, _ = convert("qwen2", GGMLType.F32)
    damaged = rewritten(path, tmp_path / "no-embd.gguf", dropped=["token_embd.weight"])
    assert "missing tensor 'token_embd.weight'" in one_line_error(damaged)


def test_settings_a_gguf_leaves_out_take_their_defaults(convert, tmp_path):
    """llama.cpp's for the KV heads (all the heads), the head size (hidden / heads) and
    the RoPE base (10,000); a context length as a config.json without one gets."""
    path, _ = convert("qwen2", GGMLType.F32)
    bare = rewritten(
        path,
        tmp_path / "bare.gguf",
        dropped=[
            "qwen2.attention.head_count_kv",
            "qwen2.attention.key_length",
            "qwen2.context_length",
            "qwen2.rope.freq_base",
        ],
    )
    config = read_gguf(bare).config
    assert config["num_key_value_heads"] == config["num_attention_heads"] == 4
    assert config["head_dim"] == 256 // 4
    assert config["max_position_embeddings"] == 4096
    assert config["rope_theta"] == 10000.0


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("blk.0.attn_q.scale", "unexpected GGUF tensor 'blk.0.attn_q.scale'"),
        ("rope_factors_long.weight", "'rope_factors_long.weight' for this architecture"),
        ("blk.0.ffn_gate_inp.weight", "'blk.0.ffn_gate_inp.weight' for this architecture"),
    ],
    ids=["not a weight or bias", "unknown global", "mixture-of-experts router"],
)
def test_a_tensor_the_architecture_has_no_place_for_is_named(convert, tmp_path, name, expected):
    path, _ = convert("qwen2", GGMLType.F32)
    extra = rewritten(path, tmp_path / "extra.gguf", tensors={name: np.zeros(8, np.float32)})
    assert expected in one_line_error(extra)


@pytest.mark.parametrize(
    ("family", "name", "expected"),
    [
        ("llama", "blk.0.ffn_gate_exps.weight", "'blk.0.ffn_gate_exps.weight' for this architecture"),
        # llama.cpp's converters once wrote Mixtral's experts one tensor each.
        ("mixtral", "blk.0.ffn_gate.0.weight", "unexpected GGUF tensor 'blk.0.ffn_gate.0.weight'"),
    ],
    ids=["experts in a dense file", "per-expert mixtral"],
)
def test_expert_tensors_where_the_file_counts_no_experts_or_in_the_old_layout_are_named(
    convert, tmp_path, family, name, expected
):
    path, _ = convert(family, GGMLType.F32)
    extra = rewritten(path, tmp_path / "extra.gguf", tensors={name: np.zeros((4, 8), np.float32)})
    assert expected in one_line_error(extra)


def test_a_qwen3moe_file_without_its_expert_count_is_named(convert, tmp_path):
    path, _ = convert("qwen3_moe", GGMLType.F32)
    bare = rewritten(path, tmp_path / "bare.gguf", dropped=["qwen3moe.expert_count"])
    assert "missing GGUF metadata 'qwen3moe.expert_count'" in one_line_error(bare)


def test_a_moe_file_without_its_unused_dense_size_loads(convert, tmp_path):
    path, reference_dir = convert("qwen3_moe", GGMLType.F32)
    bare = rewritten(path, tmp_path / "bare.gguf", dropped=["qwen3moe.feed_forward_length"])
    config = read_gguf(bare).config
    assert config["intermediate_size"] == config["moe_intermediate_size"] == SHAPE["intermediate_size"]
    assert mx.array_equal(load_model(bare).model(PROMPT), load_model(reference_dir).model(PROMPT))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_expert_count_of_0_is_a_dense_model(convert, tmp_path, family):
    """Some converters write the count as 0 for a dense model: no experts, as llama.cpp reads it."""
    path, _ = convert(family, GGMLType.F32)
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    zero = rewritten(path, tmp_path / "zero.gguf", metadata={f"{arch}.expert_count": (0, V.UINT32, V.UINT32)})
    assert read_gguf(zero).config["model_type"] == family


def test_experts_counted_for_an_architecture_without_them_are_refused(convert, tmp_path):
    path, _ = convert("qwen2", GGMLType.F32)
    count = (4, V.UINT32, V.UINT32)
    counted = rewritten(path, tmp_path / "counted.gguf", metadata={"qwen2.expert_count": count})
    assert "routed experts are not supported for this architecture" in one_line_error(counted)


def test_gemma3_27b_scales_attention_by_hidden_size_over_heads(convert, tmp_path):
    """As llama.cpp hard-codes it: the 62-layer 27B by hidden / heads (5376 / 32 = 168,
    not its head size of 128), every other Gemma 3 by its head size."""
    path, _ = convert("gemma3_text", GGMLType.F32)  # hidden 256, 4 heads

    def scale(num_layers):
        metadata = {
            "gemma3.block_count": (num_layers, V.UINT32, V.UINT32),
            "gemma3.attention.key_length": (128, V.UINT32, V.UINT32),
            "gemma3.rope.dimension_count": (128, V.UINT32, V.UINT32),  # whole heads, as the file has
        }
        out = rewritten(path, tmp_path / f"{num_layers}.gguf", metadata=metadata)
        return read_gguf(out).config["query_pre_attn_scalar"]

    assert scale(62) == 256 // 4
    assert scale(6) == scale(61) == 128


def test_loading_a_gguf_reports_its_steps(convert):
    path, _ = convert("qwen2", GGMLType.F32)
    lines: list[str] = []
    load_model(path, on_progress=lines.append)
    num_tensors = len(gguf.GGUFReader(path).tensors)
    assert lines[:3] == [
        f"reading {path.resolve()}",
        "building the tokenizer from the GGUF metadata",
        f"converting {num_tensors} GGUF tensors",
    ]


def test_bf16_weights_stay_bfloat16_when_the_dtype_is_kept(convert):
    path, _ = convert("qwen2", GGMLType.BF16)
    layer = load_model(path, keep_dtype=True).model.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == mx.bfloat16
    assert layer.mlp.down_proj.weight.dtype == mx.bfloat16


def test_a_row_order_for_another_number_of_rows_is_refused():
    tensor = SimpleNamespace(
        name="blk.0.attn_q.weight",
        tensor_type=GGMLType.F32,
        shape=[4, 3],
        data=np.zeros((3, 4), np.float32),
    )
    with pytest.raises(CheckpointError, match="has 3 rows, expected 2"):
        decode_tensor(tensor, "model.layers.0.self_attn.q_proj.weight", [1, 0], 0.0, "x.gguf")
    got = decode_tensor(tensor, "w", [2, 0, 1], 0.0, "x.gguf")
    assert got["w"].shape == (3, 4)


def test_text_metadata_that_is_not_utf8_is_a_one_line_error(tmp_path):
    value = struct.pack("<IQ", 8, 6) + b"\xffllama"  # a string of 6 bytes, not UTF-8
    path = headed_gguf(tmp_path / "bytes.gguf", gguf_string("general.architecture") + value)
    message = one_line_error(path)
    assert "unreadable metadata 'general.architecture'" in message and "utf-8" in message


def test_missing_required_metadata_is_named(tmp_path):
    value = struct.pack("<I", 8) + gguf_string("qwen2")
    path = headed_gguf(tmp_path / "bare.gguf", gguf_string("general.architecture") + value)
    assert "missing GGUF metadata 'tokenizer.ggml.model'" in one_line_error(path)


def test_a_float_setting_stored_as_an_integer_loads_as_that_float(convert, tmp_path):
    path, _ = convert("qwen2", GGMLType.F32)
    stated = rewritten(
        path,
        tmp_path / "integer-base.gguf",
        metadata={"qwen2.rope.freq_base": (500000, V.UINT32, V.UINT32)},
    )
    rope_theta = read_gguf(stated).config["rope_theta"]
    assert rope_theta == 500000.0 and isinstance(rope_theta, float)


def test_f16_and_expanded_weights_stay_float16_when_the_dtype_is_kept(convert):
    """Only a shifted norm (Gemma's 1 + w) is computed in float32."""
    path, _ = convert("llama", GGMLType.F16, types_by_name={"mlp.down_proj": GGMLType.Q6_K})
    layer = load_model(path, keep_dtype=True).model.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == mx.float16
    assert layer.mlp.down_proj.weight.dtype == mx.float16  # Q6_K, expanded


def test_blocks_that_do_not_decode_as_their_type_are_named():
    """A row of 100 bytes is no whole number of Q6_K blocks (210 bytes each)."""
    tensor = SimpleNamespace(
        name="blk.0.ffn_down.weight",
        tensor_type=GGMLType.Q6_K,
        shape=[256, 2],
        data=np.zeros((2, 100), np.uint8),
    )
    with pytest.raises(CheckpointError, match="'blk.0.ffn_down.weight' does not decode as Q6_K"):
        decode_tensor(tensor, "model.layers.0.mlp.down_proj.weight", None, 0.0, "x.gguf")


@pytest.mark.parametrize(
    ("item_type", "item_bytes"),
    [(V.UINT8, 1), (V.UINT32, 4), (V.STRING, 8), (V.ARRAY, 12)],  # zeros: "", an empty array
    ids=["uint8", "uint32", "string", "array"],
)
def test_an_arrays_declared_count_is_held_to_the_bytes_left_exactly(
    tmp_path, item_type, item_bytes
):
    """Each element takes at least its type's size (a string its length, an array its
    type and count): an array that ends where the file ends is read, one declaring an
    element more is refused by its count before any element is read."""
    architecture = gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("qwen2")

    def array_of(count):
        header = struct.pack("<IIQ", V.ARRAY, item_type, count)
        path = tmp_path / f"{count}.gguf"
        return headed_gguf(
            path,
            architecture + gguf_string("general.tags") + header + bytes(4 * item_bytes),
            num_kv=2,
        )

    assert "missing GGUF metadata 'tokenizer.ggml.model'" in one_line_error(array_of(4))
    message = one_line_error(array_of(5))
    assert (
        "truncated" in message
        and "declares 5 elements, more than the rest of the file holds" in message
    )


def test_a_tensor_type_the_gguf_package_does_not_know_is_named_unsupported(tmp_path):
    tensors = {"token_embd.weight": (np.zeros((8, 32), np.float32), None)}
    path = minimal_gguf(tmp_path / "new-type.gguf", "qwen2", tensors)
    reader = gguf.GGUFReader(path, "r+")
    reader.tensors[0].field.parts[4][0] = 99  # its type, as a newer llama.cpp might write one
    reader.data.flush()
    del reader
    message = one_line_error(path)
    assert "unsupported GGUF tensor type" in message
    assert "(99 is not a valid GGMLQuantizationType)" in message  # numpy's repr unwrapped


def test_a_metadata_value_type_the_gguf_package_does_not_know_is_named_as_one(tmp_path):
    """Not as a tensor type (both are enum errors from the gguf package)."""
    value = gguf_string("general.architecture") + struct.pack("<I", 99) + gguf_string("qwen2")
    message = one_line_error(headed_gguf(tmp_path / "new-value.gguf", value, num_kv=1))
    assert "unsupported GGUF metadata value type (99 is not a valid GGUFValueType)" in message
    assert "tensor" not in message


@pytest.mark.parametrize("kind", [GGMLType.F16, GGMLType.Q8_0], ids=lambda k: k.name)
def test_loading_a_gguf_holds_the_model_once(make_checkpoint, tmp_path, monkeypatch, kind):
    """The weights read from the file are dropped as the model takes them: held to the
    end of the load, mlx's peak was 2.0x the final weights for F16 and 3.1x for Q8_0
    (1.18x and 1.04x now), and some were left in its cache."""
    monkeypatch.setenv("CADENCE_HUGE_PAGES", "off")  # copies there are outside mlx's count
    checkpoint = make_checkpoint("llama", **{**SHAPE, "num_layers": 8})
    path = write_gguf(checkpoint, tmp_path / "eight.gguf", tmp_path / "reference", kind)
    gc.collect()  # earlier tests' arrays freed now, not into the cache mid-load
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # what earlier tests left alive
    loaded = load_model(path)
    final = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
    assert mx.get_peak_memory() - held < 1.3 * final and mx.get_cache_memory() == 0


@pytest.mark.parametrize("kind", [GGMLType.F32, GGMLType.Q8_0], ids=lambda k: k.name)
def test_phi3s_longrope_and_window_come_from_its_gguf(make_checkpoint, tmp_path, kind):
    """llama.cpp's Phi-3 keeps q/k/v and gate/up fused (`attn_qkv`, `ffn_up`), its
    LongRoPE factors as the tensors `rope_factors_long`/`_short` and the attention
    factor and the pre-scaling context as metadata, and the window as metadata."""
    checkpoint = tmp_path / "phi3"
    shutil.copytree(make_checkpoint("phi3", **SHAPE, max_position_embeddings=4096), checkpoint)
    raw = json.loads((checkpoint / "config.json").read_text())
    scaling = {
        "type": "longrope",
        "short_factor": [1.0] * 32,
        "long_factor": [1.0 + i / 4 for i in range(32)],
    }
    raw.update(rope_scaling=scaling, original_max_position_embeddings=256, sliding_window=8)
    (checkpoint / "config.json").write_text(json.dumps(raw))
    path = write_gguf(checkpoint, tmp_path / "phi3.gguf", tmp_path / "reference", kind)
    names = {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight", "rope_factors_long.weight"} <= names
    from_gguf, reference = load_model(path), load_model(tmp_path / "reference")
    assert from_gguf.config.layer_windows == reference.config.layer_windows == (8, 8)
    got, want = from_gguf.config.rope_scaling, reference.config.rope_scaling
    assert got["long_factor"] == want["long_factor"] and got["short_factor"] == want["short_factor"]
    assert got["attention_factor"] == pytest.approx(want["attention_factor"])
    assert want["attention_factor"] == pytest.approx(math.sqrt(1.5))  # 1 + ln 16 / ln 256
    expected = reference.model(PROMPT)
    if kind == GGMLType.F32:
        assert mx.allclose(from_gguf.model(PROMPT), expected, atol=1e-5).item()
    else:
        scale = float(mx.abs(expected).max())
        assert float(mx.abs(from_gguf.model(PROMPT) - expected).max()) < 5e-3 * scale
    factor = {"phi3.rope.scaling.attn_factor": (1.25, V.FLOAT32, V.FLOAT32)}
    stated = rewritten(path, tmp_path / "factor.gguf", metadata=factor)
    assert read_gguf(stated).config["rope_scaling"]["attention_factor"] == 1.25
    dropped = rewritten(path, tmp_path / "short.gguf", dropped=("rope_factors_short.weight",))
    assert "without 'rope_factors_short.weight'" in one_line_error(dropped)
    # Phi-4-mini rotates 48 of 64 (its 32 factors then are 24: the file here is wrong)
    partial = rewritten(
        path, tmp_path / "partial.gguf", metadata={"phi3.rope.dimension_count": (48, V.UINT32, V.UINT32)}
    )
    assert "needs 'short_factor', a list of 24 positive numbers" in one_line_error(partial)
    # 30 of 44 (as 30 / 44 * 44 is 29.999... in floating point, 30 must still come back)
    stated = {
        "phi3.rope.dimension_count": (30, V.UINT32, V.UINT32),
        "phi3.attention.key_length": (44, V.UINT32, V.UINT32),
    }
    thirty = rewritten(path, tmp_path / "30.gguf", metadata=stated)
    assert "a list of 15 positive numbers" in one_line_error(thirty)
    odd = rewritten(
        path, tmp_path / "odd.gguf", metadata={"phi3.rope.dimension_count": (47, V.UINT32, V.UINT32)}
    )
    assert "rotates 47 of a head's 64 dimensions" in one_line_error(odd)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("qwen3.rope.scaling.attn_factor", 2.0),
        ("qwen3.rope.scaling.yarn_attn_factor", 0.5),
        ("qwen3.rope.scaling.yarn_ext_factor", 0.0),
    ],
)
def test_yarn_whose_magnitude_llama_cpp_reads_otherwise_is_refused_by_name(make_checkpoint, tmp_path, key, value):
    checkpoint = make_checkpoint("qwen3", **SHAPE, rope_scaling=YARN)
    path = write_gguf(checkpoint, tmp_path / "yarn.gguf", tmp_path / "reference")
    changed = rewritten(path, tmp_path / "changed.gguf", {key: (value, V.FLOAT32, V.FLOAT32)})
    assert f"YaRN with '{key}' = {value!r} is not supported" in one_line_error(changed)
    neutral = rewritten(path, tmp_path / "neutral.gguf", {key: (1.0, V.FLOAT32, V.FLOAT32)})
    assert load_model(neutral).config.rope_scaling == load_model(tmp_path / "reference").config.rope_scaling


def test_a_yarn_log_multiplier_reads_as_mscale_1_over_it_and_0_as_none(make_checkpoint, tmp_path):
    checkpoint = make_checkpoint("qwen3", **SHAPE, rope_scaling=YARN)
    path = write_gguf(checkpoint, tmp_path / "yarn.gguf", tmp_path / "reference")
    key = "qwen3.rope.scaling.yarn_log_multiplier"
    half = read_gguf(rewritten(path, tmp_path / "half.gguf", {key: (0.5, V.FLOAT32, V.FLOAT32)})).config
    assert half["rope_scaling"] == {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}
    zero = read_gguf(rewritten(path, tmp_path / "zero.gguf", {key: (0.0, V.FLOAT32, V.FLOAT32)})).config
    assert zero["rope_scaling"] == read_gguf(path).config["rope_scaling"] == YARN


def test_a_ministral3_gguf_without_a_temperature_runs_none_past_its_original_context(convert, tmp_path):
    path, reference_dir = convert("ministral3", GGMLType.F32)
    silent = rewritten(path, tmp_path / "silent.gguf", dropped=("mistral3.attention.temperature_scale",))
    scaling = read_gguf(silent).config["rope_scaling"]
    assert (scaling["llama_4_scaling_beta"], scaling["original_max_position_embeddings"]) == (0.0, 16)
    with_temperature, without = load_model(path).model(PROMPT), load_model(silent).model(PROMPT)
    assert mx.array_equal(with_temperature[:, :16], without[:, :16])
    assert not mx.allclose(with_temperature[:, 16:], without[:, 16:], atol=1e-3).item()
    textual = rewritten(path, tmp_path / "text.gguf", {"mistral3.attention.temperature_scale": ("0.1", V.STRING, V.STRING)})
    assert "'mistral3.attention.temperature_scale' should be float" in one_line_error(textual)


def test_a_gemma2_gguf_below_the_27b_scales_by_head_dim_not_hidden_over_heads(make_checkpoint, tmp_path):
    small = make_checkpoint("gemma2", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, num_layers=4)
    config = read_gguf(write_gguf(small, tmp_path / "small.gguf", tmp_path / "small")).config
    assert (config["head_dim"], config["query_pre_attn_scalar"]) == (32, 32)  # hidden / heads: 16


def test_a_ministral3_gguf_without_its_original_context_takes_its_context_length(convert, tmp_path):
    path, _ = convert("ministral3", GGMLType.F32)
    assert read_gguf(path).config["rope_scaling"]["original_max_position_embeddings"] == 16
    silent = rewritten(path, tmp_path / "silent.gguf", dropped=("mistral3.rope.scaling.original_context_length",))
    config = read_gguf(silent).config
    assert config["max_position_embeddings"] == config["rope_scaling"]["original_max_position_embeddings"] == 1024


def test_gemma2_settings_a_gguf_leaves_out_are_llama_cpps(convert, make_checkpoint, tmp_path):
    path, _ = convert("gemma2", GGMLType.F32)
    caps = ("gemma2.attn_logit_softcapping", "gemma2.final_logit_softcapping", "gemma2.attention.sliding_window")
    config = read_gguf(rewritten(path, tmp_path / "silent.gguf", dropped=caps)).config
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert (config["sliding_window"], config["query_pre_attn_scalar"]) == (4096, 64)  # head_dim
    # The 27B (46 layers) scales by hidden / heads (144 there), not head_dim.
    big = make_checkpoint("gemma2", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, num_layers=46)
    config = read_gguf(write_gguf(big, tmp_path / "27b.gguf", tmp_path / "27b")).config
    assert (config["head_dim"], config["query_pre_attn_scalar"]) == (32, 16)


def test_a_harmony_gguf_stops_at_return_and_call_not_at_the_end_of_a_message(convert, tmp_path):
    """gpt-oss's <|end|> closes its reasoning message and the reply goes on: llama.cpp
    stops at <|return|> and <|call|> and, where a vocabulary holds both, not at <|end|>.
    Taken as an end of turn, every reply stopped after its reasoning."""
    path, _ = convert("gpt_oss", GGMLType.F32)
    tokens = list(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents())
    # The demo's three added tokens, respelled (a BPE token a merge names cannot be).
    end, done, call = (tokens.index(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    spellings = {end: "<|end|>", done: "<|return|>", call: "<|call|>"}
    control = {token_id: (s, gguf.TokenType.CONTROL) for token_id, s in spellings.items()}
    harmony = respelled(path, tmp_path / "harmony.gguf", control)
    eos = read_gguf(harmony).config["eos_token_id"]
    assert done in eos and call in eos and end not in eos


@pytest.mark.parametrize("spelling", ["<|eom_id|>", "<|end_of_text|>"])
def test_llama_3_1s_other_ends_stop_generation_as_in_llama_cpp(convert, tmp_path, spelling):
    """Llama 3.1 files name <|eot_id|> alone (its generation_config.json's other EOS ids,
    <|eom_id|> after a tool call and <|end_of_text|>, are not carried): llama.cpp stops
    at them by their spelling, and a reply here ran on past them."""
    path, _ = convert("llama", GGMLType.F32)
    tokens = list(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents())
    token_id = tokens.index("<|im_start|>")  # an added token, respelled
    llama31 = respelled(path, tmp_path / "llama31.gguf", {token_id: (spelling, gguf.TokenType.CONTROL)})
    assert token_id in read_gguf(llama31).config["eos_token_id"]
    assert token_id not in read_gguf(path).config["eos_token_id"]


def test_a_phi3_gguf_window_of_0_is_no_window_as_llama_cpps_phi_4(convert, tmp_path):
    """llama.cpp's converter writes a window of 0 for Phi-4, whose config.json's
    sliding_window is null ("to distinguish Phi-4 from other PHI3 models"); its
    files were refused ("field 'sliding_window' must be positive")."""
    path, reference_dir = convert("phi3", GGMLType.F32)
    key = "phi3.attention.sliding_window"
    phi4 = rewritten(path, tmp_path / "phi4.gguf", metadata={key: (0, V.UINT32, V.UINT32)})
    loaded = load_model(phi4)
    assert loaded.config.layer_windows == ()
    assert mx.array_equal(loaded.model(PROMPT), load_model(reference_dir).model(PROMPT))
