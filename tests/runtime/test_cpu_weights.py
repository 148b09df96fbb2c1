"""runtime/cpu_weights.py: the form the weights take on the CPU, what the start-up log says of
it, and stacking the layers that read one input (q, k, v; gate, up)."""

import gc
import math
import os

from runtime import cpu_weights
from runtime.checkpoint import load_model
from runtime.errors import CheckpointError

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from kernels import cpu_extension as loader
from kernels.dense_matmul import KernelLinear
from kernels.quantized_linear import KernelQuantizedLinear
from tests.kernels.test_quantized_matmul import needs_kernels, run_with_isa_cap
from tests.kernels.test_quantized_models import PROMPT, SHAPE


def quantized_layer(n, k, bits=4, group=64, bias=False, seed=0):
    linear = nn.Linear(k, n, bias=bias)
    linear.weight = mx.random.normal((n, k), key=mx.random.key(seed))
    if bias:
        linear.bias = mx.random.normal((n,), key=mx.random.key(seed + 100))
    return KernelQuantizedLinear.adopt(nn.QuantizedLinear.from_linear(linear, group, bits))


def dense_layer(n, k, seed=0):
    linear = nn.Linear(k, n)
    linear.weight = mx.random.normal((n, k), key=mx.random.key(seed))
    return KernelLinear.adopt(linear)


@needs_kernels
@pytest.mark.parametrize("kind", ["quantized", "quantized with biases", "dense"])
@pytest.mark.parametrize("rows", [1, 3, 40])  # the row kernel, and the sgemm past 32 rows
def test_a_stacked_layer_computes_its_layers_side_by_side(kind, rows):
    if kind == "dense":
        layers = [dense_layer(n, 128, seed=i) for i, n in enumerate((64, 32, 32))]
    else:
        bias = kind.endswith("biases")
        layers = [quantized_layer(n, 128, bias=bias, seed=i) for i, n in enumerate((64, 32, 32))]
    stacked = cpu_weights.stack_rows(layers)
    assert type(stacked) is type(layers[0])
    x = mx.random.normal((rows, 128), key=mx.random.key(9))
    want = mx.concatenate([layer(x) for layer in layers], axis=-1)
    assert mx.allclose(stacked(x), want, rtol=1e-5, atol=1e-5).item()


@needs_kernels
def test_layers_that_differ_are_not_stacked():
    q4, q8 = quantized_layer(64, 128), quantized_layer(64, 128, bits=8)
    assert cpu_weights.stack_rows([q4, q8]) is None  # another layout
    assert cpu_weights.stack_rows([q4, quantized_layer(64, 128, bias=True)]) is None
    # Of one group size and bits but another mode: mxfp4's codes and exponents are no affine codes.
    linear = nn.Linear(128, 64)
    affine, mxfp4 = (
        KernelQuantizedLinear.adopt(nn.QuantizedLinear.from_linear(linear, 32, 4, mode=mode))
        for mode in ("affine", "mxfp4")
    )
    assert cpu_weights.stack_rows([mxfp4, affine]) is None
    assert cpu_weights.stack_rows([dense_layer(64, 128), q4]) is None
    plain = nn.Linear(128, 64)  # not adopted by the kernels: left as it is
    assert cpu_weights.stack_rows([plain, plain]) is None


@needs_kernels
@pytest.mark.parametrize(
    ("family", "extra"),
    [("qwen2", dict(quantize=(64, 4))), ("gemma3_text", dict(head_dim=32, num_layers=2)), ("llama", {})],
)
def test_loading_stacks_every_layer_and_the_logits_stay_the_same(make_checkpoint, monkeypatch, family, extra):
    """qwen2 has q/k/v biases; gemma3 norms q and k per head after the split; llama is float32."""
    path = make_checkpoint(family, **SHAPE, **extra)
    stacked = load_model(path)
    for layer in stacked.model.model.layers:
        assert set(layer.self_attn.children()) >= {"qkv_proj"} and "q_proj" not in layer.self_attn
        assert "gate_up_proj" in layer.mlp and "up_proj" not in layer.mlp
    assert "q_proj" in load_model(path, keep_dtype=True).model.model.layers[0].self_attn
    monkeypatch.setattr(cpu_weights, "_stack_projections", lambda model: None)
    separate = load_model(path)
    assert "q_proj" in separate.model.model.layers[0].self_attn
    tokens = mx.array([PROMPT])
    want = separate.model(tokens)
    assert mx.allclose(stacked.model(tokens), want, rtol=1e-4, atol=1e-4 * mx.abs(want).max().item()).item()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_checkpoint_keeps_16_bit_weights_with_the_float32_results(make_checkpoint, dtype):
    """The default keeps the linear weights in 16 bits; the panel kernel widens them
    exactly as it reads them, so every step size gives the float32 expansion's logits
    bit for bit (both run the same kernel, in the same order)."""
    path = make_checkpoint("qwen2", dtype=dtype, **SHAPE)
    lines = []
    kept = load_model(path, on_progress=lines.append)
    expanded = load_model(path, cpu_quantize="float32")
    layer = kept.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == getattr(mx, dtype)
    assert layer.self_attn.qkv_proj.bias.dtype == mx.float32
    assert layer.input_layernorm.weight.dtype == mx.float32
    assert expanded.model.model.layers[0].self_attn.qkv_proj.weight.dtype == mx.float32
    assert any(f"linear {dtype} (cadence panel kernel)" in line for line in lines)
    assert any(line.startswith("weights:") and line.endswith("; other weights float32") for line in lines)
    short = mx.array([PROMPT[:5]])
    assert mx.array_equal(kept.model(short), expanded.model(short)).item()
    long = mx.array([(PROMPT * 4)[:40]])  # past a tile's 12 rows and the row kernel's 32
    assert mx.array_equal(kept.model(long), expanded.model(long)).item()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_dense_kernel_widens_16_bit_weights_exactly(dtype):
    from kernels.cpu_extension import cpu_extension

    ext = cpu_extension()
    specials = [0.0, -0.0, 6e-8, -6e-8, 3e-5, 1.0, -2.5, 0.333, 1000.0, 60000.0]  # subnormals too
    w = mx.array([specials * 7] * 9 + [[1.0] * 70], dtype=getattr(mx, dtype))  # K = 70: a tail
    for rows in (1, 3, 6):
        x = mx.random.normal((rows, 70), key=mx.random.key(rows))
        assert mx.array_equal(ext.dense_matmul(x, w), ext.dense_matmul(x, w.astype(mx.float32))).item()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_panel_kernel_widens_16_bit_weights_exactly(dtype):
    from kernels.cpu_extension import cpu_extension
    from kernels.dense_matmul import pack_panels

    ext = cpu_extension()
    specials = [0.0, -0.0, 6e-8, -6e-8, 3e-5, 1.0, -2.5, 0.333, 1000.0, 60000.0]  # subnormals too
    w = mx.array([specials * 7] * 9 + [[1.0] * 70], dtype=getattr(mx, dtype))  # 10 columns: a partial panel
    for rows in (1, 3, 13):
        x = mx.random.normal((rows, 70), key=mx.random.key(rows))
        half, full = pack_panels(w), pack_panels(w.astype(mx.float32))
        assert mx.array_equal(ext.panel_matmul(x, half, 10), ext.panel_matmul(x, full, 10)).item()


WIDEN_SCRIPT = """
import runtime
import mlx.core as mx
from kernels.cpu_extension import cpu_extension
ext = cpu_extension()
w = mx.array([[0.0, -0.0, 6e-8, -6e-8, 3e-5, 1.0, -2.5, 0.333, 1000.0, 60000.0] * 7] * 5)
x = mx.random.normal((3, 70))
for dtype in (mx.float16, mx.bfloat16):
    half = w.astype(dtype)
    assert mx.array_equal(ext.dense_matmul(x, half), ext.dense_matmul(x, half.astype(mx.float32))).item()
print(ext.isa())
"""


@needs_kernels
@pytest.mark.parametrize("cap", ["baseline", "avx2"])
def test_every_instruction_set_widens_16_bit_weights_exactly(cap):
    assert "avx512" not in run_with_isa_cap(WIDEN_SCRIPT, cap)


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setitem(loader._state, "module", None)
    monkeypatch.setitem(loader._state, "status", "CPU kernels off for the test")


def test_the_float32_fallback_keeps_the_quantized_layers_biases(make_checkpoint, kernels_off):
    """qwen2's q/k/v biases survive the expansion to float32 (kernels off)."""
    path = make_checkpoint("qwen2", quantize=(64, 4), **SHAPE)
    expanded, kept = load_model(path), load_model(path, keep_dtype=True)
    attention = expanded.model.model.layers[0].self_attn
    assert type(attention.q_proj) is nn.Linear and attention.q_proj.bias.dtype == mx.float32
    assert mx.array_equal(attention.q_proj.bias, kept.model.model.layers[0].self_attn.q_proj.bias).item()
    tokens = mx.array([PROMPT])
    want = kept.model(tokens)
    assert mx.allclose(expanded.model(tokens), want, rtol=1e-4, atol=1e-4 * mx.abs(want).max().item()).item()


def test_a_quantized_model_stays_packed_when_its_float32_expansion_would_not_fit(
    make_checkpoint, kernels_off, monkeypatch
):
    """Without the kernels, a 4-bit model expands to float32 only when 8x its packed
    weights fit in 60% of the memory."""
    path = make_checkpoint("llama", quantize=(64, 4), **SHAPE)
    expanded = load_model(path)
    assert not any(isinstance(m, nn.QuantizedLinear) for m in expanded.model.modules())
    float32_bytes = sum(p.nbytes for _, p in tree_flatten(expanded.model.parameters()))
    monkeypatch.setattr(cpu_weights, "_physical_memory", lambda: int(float32_bytes / 0.6))
    packed = load_model(path)
    assert isinstance(packed.model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    monkeypatch.setattr(cpu_weights, "_physical_memory", lambda: int(2 * float32_bytes / 0.6))
    assert type(load_model(path).model.model.layers[0].mlp.up_proj) is nn.Linear
    # 5% to spare will do: besides the expanded weights, only the scales and biases count.
    monkeypatch.setattr(cpu_weights, "_physical_memory", lambda: int(1.05 * float32_bytes / 0.6))
    assert type(load_model(path).model.model.layers[0].mlp.up_proj) is nn.Linear


def test_a_quantized_model_expands_where_the_memory_size_cannot_be_read(
    make_checkpoint, kernels_off, monkeypatch
):
    sysconf = os.sysconf

    def unreadable(name):
        if name in ("SC_PAGE_SIZE", "SC_PHYS_PAGES"):
            raise ValueError(f"unrecognized configuration name {name!r}")
        return sysconf(name)

    monkeypatch.setattr(os, "sysconf", unreadable)
    loaded = load_model(make_checkpoint("llama", quantize=(64, 4), **SHAPE))
    assert type(loaded.model.model.layers[0].mlp.up_proj) is nn.Linear


def test_the_float32_fallback_expands_every_layer_and_says_so(make_checkpoint, kernels_off):
    lines = []
    load_model(make_checkpoint("llama", quantize=(64, 4), **SHAPE), on_progress=lines.append)
    assert lines[lines.index("CPU kernels off for the test") + 1:] == [
        "expanding weights to float32 for the CPU",
        "weights: embedding float32 (matmul) x1, linear float32 (matmul) x15; other weights float32",
    ]


def test_a_microscaling_layer_is_described_by_its_mode(make_checkpoint):
    path = make_checkpoint("llama", quantize=(32, 4), quantize_mode="mxfp4", **SHAPE)
    lines = []
    load_model(path, keep_dtype=True, on_progress=lines.append)
    kept = next(line for line in lines if line.startswith("weights kept as stored"))
    assert "linear mxfp4 (mlx quantized_matmul)" in kept and "bit g32" not in kept


@needs_kernels
def test_load_time_quantization_leaves_layers_whose_rows_do_not_fill_groups(make_checkpoint):
    """hidden 96 is not a multiple of the group (64): only down_proj (256 wide) is quantized."""
    path = make_checkpoint("qwen2", dtype="bfloat16", hidden_size=96, intermediate_size=256)
    layer = load_model(path, cpu_quantize="8").model.model.layers[0]
    assert type(layer.mlp.down_proj) is KernelQuantizedLinear and layer.mlp.down_proj.bits == 8
    assert not isinstance(layer.self_attn.qkv_proj, nn.QuantizedLinear)
    assert not isinstance(layer.mlp.gate_up_proj, nn.QuantizedLinear)


@needs_kernels
@pytest.mark.parametrize(
    ("stored", "cpu_quantize", "said"),
    [
        (dict(dtype="bfloat16"), "off", [
            "keeping the 16-bit weights of linear layers (float32 compute)",
            "weights: embedding bfloat16 (cadence kernel, sgemm) x1, "
            "linear bfloat16 (cadence panel kernel) x9; other weights float32",
        ]),
        (dict(dtype="bfloat16"), "8", [
            "quantizing weights to 8 bits for the CPU",
            "weights: embedding 8-bit g64 (cadence kernel) x1, "
            "linear 8-bit g64 (cadence kernel) x9; other weights float32",
        ]),
        (dict(dtype="bfloat16"), "float32", [
            "expanding weights to float32 for the CPU",
            "weights: embedding float32 (cadence kernel, sgemm) x1, "
            "linear float32 (cadence panel kernel) x9; other weights float32",
        ]),
        # The norms of a bfloat16 checkpoint's quantized layers are widened too.
        (dict(dtype="bfloat16", quantize=(64, 4)), "off", [
            "weights: embedding 4-bit g64 (cadence kernel) x1, "
            "linear 4-bit g64 (cadence kernel) x9; other weights float32",
        ]),
        # Stored quantized stays as stored whatever --cpu-quantize asks: no layer is
        # quantized again and the log says nothing of quantizing.
        (dict(dtype="bfloat16", quantize=(64, 4)), "8", [
            "weights: embedding 4-bit g64 (cadence kernel) x1, "
            "linear 4-bit g64 (cadence kernel) x9; other weights float32",
        ]),
    ],
    ids=["16-bit", "quantized at load", "expanded", "stored quantized", "stored quantized, 8 asked"],
)
def test_the_start_up_log_names_the_form_the_weights_take(
    make_checkpoint, stored, cpu_quantize, said
):
    """After the kernel status, a line for the path taken (if any), then the layers."""
    lines = []
    path = make_checkpoint("llama", **SHAPE, **stored)
    load_model(path, cpu_quantize=cpu_quantize, on_progress=lines.append)
    assert lines[lines.index(loader.kernel_status()) + 1:] == said


MOE_SHAPE = dict(SHAPE, head_dim=32, num_layers=3, dense_layers=(1,))


@needs_kernels
@pytest.mark.parametrize(
    ("stored", "cpu_quantize", "experts"),
    [
        (dict(dtype="bfloat16"), "off", "experts bfloat16 (cadence kernel) x6"),
        (dict(dtype="bfloat16"), "4", "experts 4-bit g64 (cadence kernel) x6"),
        (dict(dtype="bfloat16"), "float32", "experts float32 (cadence kernel) x6"),
        (dict(quantize=(64, 8)), "off", "experts 8-bit g64 (cadence kernel) x6"),
    ],
    ids=["16-bit", "quantized at load", "expanded", "stored quantized"],
)
def test_routed_experts_take_the_form_the_linear_layers_take(make_checkpoint, stored, cpu_quantize, experts):
    """Kept in 16 bits, quantized at load or expanded as the linear layers are, and run
    by the expert kernel (kernels/expert_matmul.py); two sparse layers of three
    projections."""
    lines = []
    path = make_checkpoint("qwen3_moe", **MOE_SHAPE, **stored)
    loaded = load_model(path, cpu_quantize=cpu_quantize, on_progress=lines.append)
    assert experts in lines[-1]
    before = loader.cpu_extension().num_expert_calls()
    mx.eval(loaded.model(mx.array([PROMPT])))
    assert loader.cpu_extension().num_expert_calls() == before + 6


@needs_kernels
def test_16_bit_experts_give_the_float32_expansions_logits(make_checkpoint):
    """The dense row kernel widens 16-bit experts exactly as it reads them."""
    path = make_checkpoint("mixtral", dtype="bfloat16", **SHAPE)
    kept = load_model(path)
    expanded = load_model(path, cpu_quantize="float32")
    experts = kept.model.model.layers[0].mlp.switch_mlp
    assert experts.gate_proj.weight.dtype == mx.bfloat16
    assert expanded.model.model.layers[0].mlp.switch_mlp.gate_proj.weight.dtype == mx.float32
    for tokens in (PROMPT[:3], (PROMPT * 4)[:40]):  # decode-sized, and many rows an expert
        assert mx.array_equal(kept.model(mx.array([tokens])), expanded.model(mx.array([tokens]))).item()


def test_on_a_gpu_the_weights_are_left_as_stored(make_checkpoint, monkeypatch):
    model = load_model(make_checkpoint("llama", quantize=(64, 4), **SHAPE), keep_dtype=True).model
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    lines = []
    assert cpu_weights.prepare_for_cpu(model, keep_dtype=False, progress=lines.append) is model
    assert lines == []
    assert type(model.model.layers[0].mlp.up_proj) is nn.QuantizedLinear


@needs_kernels
def test_the_log_counts_the_weights_moved_onto_2_mb_pages(make_checkpoint, monkeypatch):
    monkeypatch.setattr(cpu_weights, "move_weights_to_huge_pages", lambda model: 6 * 2**20)
    lines = []
    load_model(make_checkpoint("llama", **SHAPE), on_progress=lines.append)
    assert "weights on 2 MB pages where Linux grants them: 6 MB" in lines


# Eight layers, so that one layer's transient copy is an eighth of the model.
EIGHT_LAYERS = dict(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=1024)


@needs_kernels
@pytest.mark.parametrize(
    ("dtype", "cpu_quantize", "bound"),
    [
        ("float32", "off", 1.2),  # stacked, then packed into panels
        ("bfloat16", "off", 1.2),  # kept in 16 bits, stacked, packed
        ("bfloat16", "float32", 1.2),  # expanded, stacked, packed
        ("bfloat16", "4", 1.3),  # quantized at load from float32 transients
    ],
)
def test_loading_holds_one_layer_in_two_forms_not_the_model(
    make_checkpoint, monkeypatch, dtype, cpu_quantize, bound
):
    """mlx's peak allocation while loading stays near the final weights: each layer's
    stored form is freed once its final one is built. The stored weights held to the end
    of the load (the dict read, a list of the replaced layers, one eval of the whole
    model) measured 2.5x the final weights here, 4.3x for the 4-bit quantization; one
    layer at a time, 1.06x and 1.19x (the panels packed by the extension, with no
    transient copy).
    mlx's own count, not the resident memory: repeatable on a busy machine."""
    monkeypatch.setenv("CADENCE_HUGE_PAGES", "off")  # copies there are outside mlx's count
    path = make_checkpoint("llama", dtype=dtype, **EIGHT_LAYERS)
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # what earlier tests left alive
    loaded = load_model(path, cpu_quantize=cpu_quantize)
    final = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
    assert mx.get_peak_memory() - held < bound * final


@needs_kernels
def test_loading_leaves_no_freed_weights_in_mlxs_cache(make_checkpoint, monkeypatch):
    """mlx keeps freed buffers for reuse, and nothing later has the stored weights' sizes."""
    monkeypatch.setenv("CADENCE_HUGE_PAGES", "off")
    gc.collect()  # earlier tests' arrays freed now, not into the cache mid-load
    mx.clear_cache()
    loaded = load_model(make_checkpoint("llama", dtype="bfloat16", **EIGHT_LAYERS))
    final = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
    assert mx.get_active_memory() >= final and mx.get_cache_memory() == 0


@pytest.mark.parametrize(
    ("options", "hint"),
    [
        ({}, True),  # 16 bits kept for the kernels
        ({"cpu_quantize": "4"}, False),  # already as small as it gets
        ({"keep_dtype": True}, False),
        ({"kernels": "off"}, True),  # the float32 fallback
    ],
    ids=["16-bit", "4-bit", "kept", "kernels-off"],
)
def test_weights_larger_than_the_memory_available_are_refused_before_they_are_read(
    make_checkpoint, monkeypatch, request, options, hint
):
    """Past the memory, a load ran until Linux killed it, or mlx crashed inside its eval."""
    if options.pop("kernels", None) == "off":
        request.getfixturevalue("kernels_off")
    elif not loader.cpu_extension():
        pytest.skip("the C++ kernels were not built here")
    path = make_checkpoint("llama", dtype="bfloat16", **EIGHT_LAYERS)
    final = sum(p.nbytes for _, p in tree_flatten(load_model(path, **options).model.parameters()))
    peak = final * cpu_weights.LOAD_PEAK_FACTOR
    monkeypatch.setattr(cpu_weights, "available_memory", lambda: math.ceil(peak) - 1)
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # what earlier tests left alive
    with pytest.raises(CheckpointError) as refusal:
        load_model(path, **options)
    assert mx.get_peak_memory() - held < final / 8  # refused before the weights were read
    assert str(refusal.value) == (
        f"{path}: its weights take {final / 2**30:.1f} GiB in the form the CPU computes them "
        f"and their load peaks near {peak / 2**30:.1f} GiB, more than the "
        f"{(math.ceil(peak) - 1) / 2**30:.1f} GiB of memory available now"
        + "; quantized at load (--cpu-quantize 8 or 4), they take less" * hint
    )
    monkeypatch.setattr(cpu_weights, "available_memory", lambda: math.ceil(peak))  # enough
    load_model(path, **options)
    monkeypatch.setattr(cpu_weights, "available_memory", lambda: None)  # unknown: not checked
    load_model(path, **options)


def test_the_refusal_counts_lazy_weights_in_gib(monkeypatch):
    huge = nn.Sequential(nn.Linear(32768, 65536, bias=False))  # 8 GiB of float32, never made
    monkeypatch.setattr(cpu_weights, "available_memory", lambda: int(9.5 * 2**30))
    with pytest.raises(
        CheckpointError,
        match=r"^its weights take 8\.0 GiB .* peaks near 10\.0 GiB, more than the 9\.5 GiB ",
    ):
        cpu_weights.check_fits_in_memory(huge, quantizable=False)
    monkeypatch.setattr(cpu_weights, "available_memory", lambda: 10 * 2**30)
    cpu_weights.check_fits_in_memory(huge, quantizable=False)


@needs_kernels
def test_a_long_read_says_how_much_of_the_weights_is_ready(make_checkpoint, monkeypatch):
    """A line each READY_PROGRESS_BYTES (2 GiB; here a quarter of the model), between the
    path's line and the weights' form."""
    path = make_checkpoint("llama", dtype="bfloat16", **EIGHT_LAYERS)
    total = sum(p.nbytes for _, p in tree_flatten(load_model(path).model.parameters()))
    monkeypatch.setattr(cpu_weights, "READY_PROGRESS_BYTES", total // 4)
    lines: list[str] = []
    load_model(path, on_progress=lines.append)
    start = lines.index("keeping the 16-bit weights of linear layers (float32 compute)") + 1
    ready = lines[start:-1]
    assert len(ready) == 4 and lines[-1].startswith("weights: ")  # 1/4, 2/4, 3/4, all
    figures = [line.removeprefix("weights ready: ").split(" of ") for line in ready]
    assert {of for _, of in figures} == {f"{total / 2**20:,.0f} MB"}
    done = [float(now.replace(",", "")) for now, _ in figures]
    assert done == sorted(done) and done[-1] == round(total / 2**20)
