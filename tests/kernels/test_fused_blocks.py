"""The residual blocks as one op (kernels/fused_blocks.py): equal to their parts bit for
bit, close to the mx-op definition, and run by the models on quantized weights and on
float32 / 16-bit weights packed in panels."""

import importlib.util

from runtime.checkpoint import load_model
from runtime.models.gemma3 import Gemma3Layer
from runtime.models.llama import DecoderLayer

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kernels import fused_blocks
from kernels.cpu_extension import cpu_extension
from kernels.dense_matmul import pack_panels
from tests.kernels.fresh_python import last_line
from tests.kernels.test_paged_attention import BLOCK, make_step
from tests.kernels.test_quantized_models import PROMPT, greedy

IS_BUILT = importlib.util.find_spec("kernels._cpu_ext") is not None
pytestmark = pytest.mark.skipif(not IS_BUILT, reason="the C++ kernels were not built here")


def quantized(n, k, group_size, bits, seed, with_bias=False):
    rng = np.random.default_rng(seed)
    w, scales, biases = mx.quantize(
        mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.2), group_size=group_size, bits=bits
    )
    bias = mx.array(rng.standard_normal(n).astype(np.float32)) if with_bias else mx.zeros((0,))
    return (w, scales.astype(mx.float32), biases.astype(mx.float32), bias, group_size, bits)


def panels(n, k, dtype, seed, with_bias=False):
    rng = np.random.default_rng(seed)
    weight = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.2).astype(dtype)
    bias = mx.array(rng.standard_normal(n).astype(np.float32)) if with_bias else mx.zeros((0,))
    return (pack_panels(weight), bias, n)


def linear_by_parts(x, layer):
    ext = cpu_extension()
    if len(layer) == 3:
        w_panels, bias, n = layer
        y = ext.panel_matmul(x, w_panels, n)
    else:
        w, scales, biases, bias, group_size, bits = layer
        y = ext.matmul(x, w, scales, biases, group_size, bits)
    return y + bias if bias.size else y


# Each block's two layers: quantized (two layouts), in panels (three dtypes), and mixed.
LAYERS = {
    "4-bit g32, 4-bit g32": lambda n1, k1, n2, k2, bias: (
        quantized(n1, k1, 32, 4, 1, bias), quantized(n2, k2, 32, 4, 2, bias)
    ),
    "8-bit g64, 4-bit g128": lambda n1, k1, n2, k2, bias: (
        quantized(n1, k1, 64, 8, 1, bias), quantized(n2, k2, 128, 4, 2, bias)
    ),
    "panels f32": lambda n1, k1, n2, k2, bias: (
        panels(n1, k1, mx.float32, 1, bias), panels(n2, k2, mx.float32, 2, bias)
    ),
    "panels f16, bf16": lambda n1, k1, n2, k2, bias: (
        panels(n1, k1, mx.float16, 1, bias), panels(n2, k2, mx.bfloat16, 2, bias)
    ),
    "panels, 4-bit": lambda n1, k1, n2, k2, bias: (
        panels(n1, k1, mx.bfloat16, 1, bias), quantized(n2, k2, 32, 4, 2, bias)
    ),
}


def inputs(rows, k, seed):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((1, rows, k)).astype(np.float32))
    norm = mx.array(1.0 + 0.1 * rng.standard_normal(k).astype(np.float32))
    return x, norm


@pytest.mark.parametrize("activation", fused_blocks.ACTIVATIONS)
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("rows", [1, 3, 16, 31])
def test_the_mlp_block_equals_its_parts_exactly(rows, layers, activation):
    ext = cpu_extension()
    # Panels take any width (152: a last panel half full); a group size must divide a row.
    I = 152 if "bit" not in layers else 384  # noqa: E741
    K = 256
    x, norm = inputs(rows, K, seed=rows)
    gate_up, down = LAYERS[layers](2 * I, K, K, I, False)
    halves = ext.silu_mul_halves if activation == "silu" else ext.gelu_tanh_mul_halves
    parts = x + linear_by_parts(halves(linear_by_parts(ext.rms_norm(x, norm, 1e-5), gate_up)), down)
    before = ext.num_block_calls()
    block = fused_blocks.NormedLayers(norm, 1e-5, gate_up, down)
    fused = fused_blocks.mlp_block(x, block, activation)
    mx.eval(fused)
    assert ext.num_block_calls() == before + 1
    assert fused.shape == x.shape
    assert mx.array_equal(fused, parts).item()
    reference = fused_blocks.reference_mlp_block(x, block, activation)
    assert mx.allclose(fused, reference, atol=1e-4, rtol=1e-4).item()


def test_a_post_norm_is_applied_to_each_blocks_output_before_the_add():
    """Gemma's layers: x + rms_norm(block(x), post_norm), in both blocks, as the parts."""
    ext = cpu_extension()
    x, norm = inputs(3, 256, seed=3)
    post = mx.array(np.linspace(0.5, 1.5, 256, dtype=np.float32))
    gate_up, down = LAYERS["panels, 4-bit"](2 * 384, 256, 256, 384, False)
    mlp = linear_by_parts(ext.gelu_tanh_mul_halves(linear_by_parts(ext.rms_norm(x, norm, 1e-6), gate_up)), down)
    block = fused_blocks.NormedLayers(norm, 1e-6, gate_up, down, post_norm=post)
    fused = fused_blocks.mlp_block(x, block, "gelu_tanh")
    assert mx.array_equal(fused, x + ext.rms_norm(mlp, post, 1e-6)).item()
    reference = fused_blocks.reference_mlp_block(x, block, "gelu_tanh")
    assert mx.allclose(fused, reference, atol=1e-4, rtol=1e-4).item()

    step, _, keys, values, q, _, _ = make_step([5, 17], [1, 1], 2, 4)
    N, H, D = q.shape
    x, norm = inputs(N, 128, seed=N)
    post = mx.array(np.linspace(1.5, 0.5, 128, dtype=np.float32))
    qkv, o = LAYERS["panels f32"]((H + 4) * D, 128, 128, H * D, False)
    inv_freqs = mx.exp(mx.arange(0, -(D // 2), -1, dtype=mx.float32) * 0.7)
    index = (step.tables, step.row_of_token, step.positions)
    attended, _, _ = ext.paged_attention_rotary(
        linear_by_parts(ext.rms_norm(x, norm, 1e-6), qkv), mx.array(keys), mx.array(values),
        *index, inv_freqs, H, 2, BLOCK, 8, 0.25, 1.0,
    )
    want = x + ext.rms_norm(linear_by_parts(attended, o), post, 1e-6)
    got = ext.residual_attention(
        x, norm, 1e-6, qkv, o, mx.array(keys), mx.array(values), *index, inv_freqs, H, 2, BLOCK,
        8, 0.25, 1.0, post_norm=post,
    )[0]
    assert mx.array_equal(got, want).item()


def test_a_block_runs_by_parts_from_32_rows_or_off_the_cpu():
    x, _ = inputs(32, 64, seed=0)
    assert fused_blocks.kernel_for(x) is None  # many rows: by parts
    assert fused_blocks.kernel_for(x[:, :31]) is not None
    assert fused_blocks.kernel_for(x.astype(mx.float16)[:, :1]) is None


def test_cadence_cpu_blocks_off_runs_every_block_by_parts(monkeypatch):
    x, _ = inputs(1, 64, seed=0)
    monkeypatch.setattr(fused_blocks, "IS_ON", False)  # what CADENCE_CPU_BLOCKS=off sets at import
    assert fused_blocks.kernel_for(x) is None


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [([5, 17, 0, 30], [1, 1, 1, 1]), ([9, 0], [1, 13]), ([40], [1])])
def test_the_attention_block_equals_its_parts_exactly(shape, with_bias, layers):
    """norm, qkv (+ bias), the rotary attention op with its K/V write, o (+ bias), + x."""
    ext = cpu_extension()
    starts, num_new = shape
    step, _, keys, values, q, _, _ = make_step(starts, num_new, 2, 4)
    N, H, D = q.shape
    K = 128
    x, norm = inputs(N, K, seed=N)
    qkv, o = LAYERS[layers]((H + 4) * D, K, K, H * D, with_bias)
    inv_freqs = mx.exp(mx.arange(0, -(D // 2), -1, dtype=mx.float32) * 0.7)
    index = (step.tables, step.row_of_token, step.positions)
    attended, want_keys, want_values = ext.paged_attention_rotary(
        linear_by_parts(ext.rms_norm(x, norm, 1e-5), qkv), mx.array(keys), mx.array(values),
        *index, inv_freqs, H, 2, BLOCK, 0, 0.25, 1.5,
    )
    want = x + linear_by_parts(attended, o)
    mx.eval(want, want_keys, want_values)
    got, got_keys, got_values = ext.residual_attention(
        x, norm, 1e-5, qkv, o, mx.array(keys), mx.array(values), *index, inv_freqs, H, 2, BLOCK,
        0, 0.25, 1.5,
    )
    mx.eval(got, got_keys, got_values)
    assert not mx.array_equal(got_keys, keys).item()  # the new tokens' K/V were written
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(got_keys, want_keys).item() and mx.array_equal(got_values, want_values).item()


@pytest.mark.parametrize("shape", [([5, 17, 0, 30], [1, 1, 1, 1]), ([9, 0], [1, 13])])
def test_the_attention_block_with_per_head_norms_equals_qwen3s_parts_exactly(shape):
    """qwen3 by parts: split the heads, RMSNorm each q and k head, RoPE, the write op."""
    ext = cpu_extension()
    starts, num_new = shape
    step, _, keys, values, q, _, _ = make_step(starts, num_new, 2, 4)
    N, H, D = q.shape
    x, norm = inputs(N, 128, seed=N)
    qkv, o = LAYERS["4-bit g32, 4-bit g32"]((H + 4) * D, 128, 128, H * D, False)
    rng = np.random.default_rng(7)
    q_norm, k_norm = (mx.array(1.0 + 0.2 * rng.standard_normal(D).astype(np.float32)) for _ in range(2))
    inv_freqs = mx.exp(mx.arange(0, -(D // 2), -1, dtype=mx.float32) * 0.7)
    index = (step.tables, step.row_of_token, step.positions)
    heads = linear_by_parts(ext.rms_norm(x, norm, 1e-5), qkv).reshape(N, H + 4, D)
    q_part, k_part, v_part = heads[:, :H], heads[:, H : H + 2], heads[:, H + 2 :]
    rotate = lambda t: ext.rope(t, step.positions, inv_freqs, 1.0)  # noqa: E731
    attended, want_keys, _ = ext.paged_attention_write(
        rotate(ext.rms_norm(q_part, q_norm, 1e-6)), rotate(ext.rms_norm(k_part, k_norm, 1e-6)),
        v_part, mx.array(keys), mx.array(values), *index, 2, BLOCK, 0, 0.25,
    )
    want = x + linear_by_parts(attended.reshape(1, N, H * D), o)
    got, got_keys, _ = ext.residual_attention(
        x, norm, 1e-5, qkv, o, mx.array(keys), mx.array(values), *index, inv_freqs, H, 2, BLOCK,
        0, 0.25, 1.0, (q_norm, k_norm, 1e-6),
    )
    mx.eval(got, got_keys, want, want_keys)
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(got_keys, want_keys).item()
    without = ext.residual_attention(
        x, norm, 1e-5, qkv, o, mx.array(keys), mx.array(values), *index, inv_freqs, H, 2, BLOCK,
        0, 0.25, 1.0,
    )[0]
    assert not mx.allclose(without, got).item()  # the norms did something


def test_a_table_outside_the_pool_gives_nan_and_writes_nothing():
    ext = cpu_extension()
    step, _, keys, values, q, _, _ = make_step([5], [1], 2, 4)
    N, H, D = q.shape
    x, norm = inputs(N, 64, seed=0)
    qkv, o = quantized((H + 4) * D, 64, 32, 4, seed=3), quantized(64, H * D, 32, 4, seed=4)
    bad_tables = mx.full(step.tables.shape, 10_000, dtype=mx.int32)
    out, got_keys, _ = ext.residual_attention(
        x, norm, 1e-5, qkv, o, mx.array(keys), mx.array(values), bad_tables, step.row_of_token,
        step.positions, mx.ones((D // 2,)), H, 2, BLOCK, 0, 0.25, 1.0,
    )
    mx.eval(out, got_keys)
    assert mx.isnan(out).all().item()
    assert mx.array_equal(got_keys, keys).item()


def test_mismatched_operands_are_refused_at_build_time():
    ext = cpu_extension()
    x, norm = inputs(1, 64, seed=0)
    gate_up, down = quantized(128, 64, 32, 4, seed=1), quantized(64, 64, 32, 4, seed=2)
    with pytest.raises(ValueError, match="down must be"):
        ext.residual_mlp(x, norm, 1e-5, gate_up, quantized(64, 32, 32, 4, seed=2), "silu")
    with pytest.raises(ValueError, match="norm_weight"):
        ext.residual_mlp(x, norm[:32], 1e-5, gate_up, down, "silu")
    with pytest.raises(ValueError, match="activation"):
        ext.residual_mlp(x, norm, 1e-5, gate_up, down, "relu")


def test_a_strided_quantized_weight_is_refused_when_queued_not_in_the_kernel_threads():
    """The kernels read w in place; a view that is not dense raises in mx.eval (on the
    caller's thread) instead of ending the process from the stream's thread."""
    ext = cpu_extension()
    x, norm = inputs(1, 64, seed=0)
    gate_up, down = quantized(128, 64, 32, 4, seed=1), quantized(64, 64, 32, 4, seed=2)
    wide = mx.concatenate([gate_up[0], gate_up[0]], axis=1)  # [128, 16]: every other half
    strided = (wide[:, : gate_up[0].shape[1]], *gate_up[1:])
    out = ext.residual_mlp(x, norm, 1e-5, strided, down, "silu")
    with pytest.raises(RuntimeError, match="row-contiguous"):
        mx.eval(out)
    fine = ext.residual_mlp(x, norm, 1e-5, gate_up, down, "silu")
    mx.eval(fine)  # the stream still runs
    assert mx.isfinite(fine).all().item()


def planned_layers(model):
    return [m for m in model.modules() if isinstance(m, (DecoderLayer, Gemma3Layer))]


WEIGHTS = {"4-bit": dict(quantize=(64, 4)), "float16": dict(dtype="float16"), "float32": {}}


FAMILY_SHAPES = {
    "llama": {},
    "qwen2": {},  # biases on q, k and v
    "qwen3": dict(head_dim=32),  # per-head q/k norms
    # offset norms, a norm after each block, GELU, windowed layers (window 8) beside global ones
    "gemma3_text": dict(head_dim=32, num_layers=4, num_kv_heads=1, sliding_window=8),
}


@pytest.mark.parametrize("weights", WEIGHTS)  # quantized kernels; panels of 16 and 32 bits
@pytest.mark.parametrize("family", FAMILY_SHAPES)
def test_a_model_decodes_through_the_blocks_with_the_same_tokens_and_logits(
    make_checkpoint, family, weights
):
    shape = dict(hidden_size=128, intermediate_size=256, **WEIGHTS[weights])
    path = make_checkpoint(family, **shape, **FAMILY_SHAPES[family])
    loaded = load_model(path)
    layers = planned_layers(loaded.model)
    assert layers and all(layer.attention_block and layer.mlp_block for layer in layers)
    ext = cpu_extension()
    before, copies = ext.num_block_calls(), ext.num_pool_copies()
    fused_tokens = greedy(loaded)
    assert ext.num_block_calls() >= before + 2 * len(layers) * 20  # every decode step
    # Two ops a layer: a step is queued while the one before it still runs, and its K/V
    # writes must still take the pools over (take_pool, kernels/cpu/attention_ops.h).
    assert ext.num_pool_copies() == copies
    tokens = mx.array([PROMPT[:3]])  # CausalNoCache: attention by parts, the MLP fused
    fused_logits = loaded.model(tokens)
    mx.eval(fused_logits)
    for layer in layers:
        layer.attention_block = layer.mlp_block = None
    before = ext.num_block_calls()
    assert greedy(loaded) == fused_tokens
    assert mx.array_equal(loaded.model(tokens), fused_logits).item()
    assert ext.num_block_calls() == before


def test_the_blocks_are_not_planned_without_the_kernels(make_checkpoint, monkeypatch):
    from kernels import cpu_extension as loader

    monkeypatch.setitem(loader._state, "module", None)
    monkeypatch.setitem(loader._state, "status", "CPU kernels off for the test")
    path = make_checkpoint("llama", quantize=(64, 4), hidden_size=128, intermediate_size=256)
    layers = planned_layers(load_model(path).model)
    assert layers and not any(layer.attention_block or layer.mlp_block for layer in layers)


def test_a_block_runs_by_parts_off_the_cpu_or_over_rows_of_no_width(monkeypatch):
    x, _ = inputs(1, 64, seed=0)
    assert fused_blocks.kernel_for(mx.zeros((1, 1, 0))) is None
    monkeypatch.setattr(fused_blocks.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert fused_blocks.kernel_for(x) is None


def test_only_layers_and_norms_the_kernels_take_as_they_are_make_a_block():
    from kernels.dense_matmul import KernelLinear, PanelLinear
    from kernels.quantized_linear import KernelQuantizedLinear

    panel = PanelLinear.adopt(KernelLinear.adopt(nn.Linear(64, 64, bias=True)))
    four_bit = KernelQuantizedLinear.adopt(nn.QuantizedLinear(64, 64, bias=False, group_size=32, bits=4))
    assert fused_blocks.kernel_layer(panel) is not None and fused_blocks.kernel_layer(four_bit) is not None
    norm = mx.ones((64,))
    assert fused_blocks.normed_layers(norm, 1e-5, panel, four_bit) is not None
    half_bias = PanelLinear.adopt(KernelLinear.adopt(nn.Linear(64, 64, bias=True)))
    half_bias.bias = half_bias.bias.astype(mx.float16)
    three_bit = KernelQuantizedLinear.adopt(nn.QuantizedLinear(64, 64, bias=False, group_size=32, bits=3))
    half_scales = KernelQuantizedLinear.adopt(nn.QuantizedLinear(64, 64, bias=False, group_size=32, bits=4))
    half_scales.scales = half_scales.scales.astype(mx.float16)
    for layer in (half_bias, three_bit, half_scales, nn.Linear(64, 64)):
        assert fused_blocks.kernel_layer(layer) is None
        assert fused_blocks.normed_layers(norm, 1e-5, panel, layer) is None
    for bad_norm in (norm.astype(mx.float16), norm.reshape(1, 64)):
        assert fused_blocks.normed_layers(bad_norm, 1e-5, panel, four_bit) is None
        assert fused_blocks.normed_layers(norm, 1e-5, panel, four_bit, post_norm=bad_norm) is None



def test_per_head_norms_the_kernels_do_not_take_keep_the_block_by_parts():
    from kernels.dense_matmul import KernelLinear, PanelLinear

    panel = PanelLinear.adopt(KernelLinear.adopt(nn.Linear(64, 64)))
    norm, head_norm = mx.ones((64,)), mx.ones((16,))
    assert fused_blocks.normed_layers(norm, 1e-5, panel, panel, (head_norm, head_norm, 1e-5)) is not None
    for bad in (head_norm.astype(mx.float16), head_norm.reshape(1, 16)):
        assert fused_blocks.normed_layers(norm, 1e-5, panel, panel, (bad, head_norm, 1e-5)) is None
        assert fused_blocks.normed_layers(norm, 1e-5, panel, panel, (head_norm, bad, 1e-5)) is None

@pytest.mark.parametrize(("value", "is_on"), [("off", False), ("0", False), ("No", False), ("", True), ("on", True)])
def test_cadence_cpu_blocks_is_read_at_import(value, is_on):
    script = "from kernels import fused_blocks; print(fused_blocks.IS_ON)"
    assert last_line(script, {"CADENCE_CPU_BLOCKS": value}) == str(is_on)


def test_a_post_norm_of_another_eps_than_the_blocks_norm_keeps_the_block_by_parts(make_checkpoint):
    """The op norms the block's input and output with one eps."""
    from runtime.models.layers import OffsetRMSNorm

    shape = dict(hidden_size=128, intermediate_size=256, **FAMILY_SHAPES["gemma3_text"])
    layer = planned_layers(load_model(make_checkpoint("gemma3_text", **shape)).model)[0]
    attention, mlp = layer.self_attn, layer.mlp
    assert attention.block_operands(layer.input_layernorm, layer.post_attention_layernorm) is not None
    assert mlp.block_operands(layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) is not None
    other_eps = OffsetRMSNorm(128, 1e-3)
    assert attention.block_operands(layer.input_layernorm, other_eps) is None
    assert mlp.block_operands(layer.pre_feedforward_layernorm, other_eps) is None
