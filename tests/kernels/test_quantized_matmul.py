"""kernels/quantized_matmul.py and the C++ kernels under it, against the pure-mx reference."""

import importlib.util

import mlx.core as mx
import pytest

from kernels import cpu_extension as loader
from kernels.quantized_matmul import (
    exponent_scales,
    is_kernel_layout,
    quantized_matmul,
    reference_quantized_matmul,
    uses_cpu_kernel,
)
from tests.kernels.fresh_python import last_line

IS_BUILT = importlib.util.find_spec("kernels._cpu_ext") is not None
needs_kernels = pytest.mark.skipif(not IS_BUILT, reason="the C++ kernels were not built here")


def quantized(n, k, group_size, bits, seed=0):
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    return mx.quantize(w, group_size=group_size, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matches_the_reference_for_every_layout_and_row_count(bits, group_size):
    # K an odd number of groups (group 32 at 4 bits leaves half a 64-value block over), N odd.
    n, k = 37, 3 * group_size
    w, scales, biases = quantized(n, k, group_size, bits)
    for m in (1, 3, 16, 200):
        x = mx.random.normal((m, k), key=mx.random.key(m))
        ours = quantized_matmul(x, w, scales, biases, group_size, bits)
        reference = reference_quantized_matmul(x, w, scales, biases, group_size, bits)
        assert ours.shape == (m, n) and ours.dtype == mx.float32
        assert mx.allclose(ours, reference, rtol=1e-4, atol=1e-4).item(), (bits, group_size, m)


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_past_the_row_kernel_go_through_panel_tiles_in_passes_of_2048(bits):
    """From 8 rows each 32-column panel is dequantized 2,048 k at a time: K = 2,432 takes
    two passes (the second adds to the first), N = 37 leaves a panel 5 columns wide."""
    n, k = 37, 2432
    w, scales, biases = quantized(n, k, 128, bits, seed=3)
    for m in (8, 13, 40):
        x = mx.random.normal((m, k), key=mx.random.key(m))
        ours = quantized_matmul(x, w, scales, biases, 128, bits)
        reference = reference_quantized_matmul(x, w, scales, biases, 128, bits)
        assert mx.allclose(ours, reference, rtol=1e-4, atol=1e-3).item(), (bits, m)


def mxfp4(n, k, seed=0):
    """(packed weight, uint8 exponents, the float32 weight they decode to) of random values
    over many scales, so that the exponents vary (row r is scaled by 4^(r % 5 - 2))."""
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * (4.0 ** (mx.arange(n) % 5 - 2))[:, None]
    packed, exponents = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    dense = mx.dequantize(packed, exponents, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    return packed, exponents, dense


@needs_kernels
def test_mxfp4_runs_on_the_kernels_and_matches_its_dequantized_weight():
    """Its E2M1 codes looked up, its exponents as float32 scales: the row kernel (1-7
    rows) and the panel tiles (8+); K an odd number of 64-value blocks, N odd."""
    assert is_kernel_layout(32, 4, "mxfp4") and not is_kernel_layout(64, 4, "mxfp4")
    packed, exponents, dense = mxfp4(37, 3 * 32 + 2048, seed=5)
    scales = exponent_scales(exponents)
    assert mx.array_equal(scales, mx.power(2.0, exponents.astype(mx.float32) - 127)).item()
    calls = loader.cpu_extension().num_kernel_calls()
    for m in (1, 3, 4, 5, 8, 13, 40):
        x = mx.random.normal((m, packed.shape[1] * 8), key=mx.random.key(m))
        ours = quantized_matmul(x, packed, scales, None, 32, 4, "mxfp4")
        want = x @ dense.T
        assert mx.allclose(ours, want, rtol=1e-4, atol=1e-3).item(), m
    assert loader.cpu_extension().num_kernel_calls() == calls + 7


def test_every_exponent_becomes_its_exact_scale():
    exponents = mx.arange(256).astype(mx.uint8)
    scales = exponent_scales(exponents)
    assert scales[0].item() == 2.0**-127 and scales[1].item() == 2.0**-126 and scales[254].item() == 2.0**127
    assert mx.array_equal(scales[1:255], mx.power(2.0, mx.arange(1, 255).astype(mx.float32) - 127)).item()


def test_keeps_leading_dimensions_and_the_input_dtype():
    w, scales, biases = quantized(24, 128, 64, 4)
    x = mx.random.normal((2, 5, 128)).astype(mx.bfloat16)
    ours = quantized_matmul(x, w, scales, biases, 64, 4)
    reference = reference_quantized_matmul(x, w, scales, biases, 64, 4)
    assert ours.shape == (2, 5, 24) and ours.dtype == mx.bfloat16
    # bfloat16 has 8 bits of mantissa: one rounding step of a value near 30 is 0.125.
    assert mx.allclose(ours.astype(mx.float32), reference.astype(mx.float32), rtol=1e-2, atol=0.1).item()


def test_a_strided_input_gives_the_contiguous_result():
    w, scales, biases = quantized(16, 64, 32, 8)
    x = mx.random.normal((64, 5)).T  # [5, 64], column-major in memory
    ours = quantized_matmul(x, w, scales, biases, 32, 8)
    assert mx.allclose(ours, reference_quantized_matmul(x, w, scales, biases, 32, 8), atol=1e-4).item()


@needs_kernels
def test_the_kernel_really_runs_on_the_cpu_when_built():
    """A silent fallback to mlx's ops must fail here, for decode and prefill shapes alike."""
    ext = loader.cpu_extension()
    assert ext is not None, loader.kernel_status()
    assert uses_cpu_kernel(64, 4)
    w, scales, biases = quantized(8, 128, 64, 4)
    for m in (1, 8, 200):  # the row kernel, then the panels (decode, prefill)
        before = ext.num_kernel_calls()
        mx.eval(quantized_matmul(mx.ones((m, 128)), w, scales, biases, 64, 4))
        assert ext.num_kernel_calls() == before + 1



@pytest.mark.parametrize("bits", [3, 6])  # mlx-lm's mixed recipes: not the kernels' layouts
def test_layouts_the_kernels_lack_go_through_mlx(bits):
    assert not uses_cpu_kernel(64, bits)
    w, scales, biases = quantized(9, 128, 64, bits)
    x = mx.random.normal((3, 128))
    ours = quantized_matmul(x, w, scales, biases, 64, bits)
    want = reference_quantized_matmul(x, w, scales, biases, 64, bits)
    assert mx.allclose(ours, want, atol=1e-4).item()


@needs_kernels
def test_off_the_cpu_the_kernel_is_not_used(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not uses_cpu_kernel(64, 4)


@needs_kernels
def test_empty_operands_give_empty_or_zero_results_instead_of_crashing():
    """No rows of x (M = 0) or no columns of w (K = 0) once divided by zero in the kernels."""
    ext = loader.cpu_extension()
    assert ext is not None, loader.kernel_status()
    w, scales, biases = quantized(8, 64, 32, 4)
    before = ext.num_kernel_calls()
    ours = quantized_matmul(mx.ones((0, 64)), w, scales, biases, 32, 4)
    mx.eval(ours)
    assert ours.shape == (0, 8) and ext.num_kernel_calls() == before + 1
    no_columns = mx.zeros((8, 0), dtype=mx.uint32), mx.zeros((8, 0)), mx.zeros((8, 0))
    assert mx.array_equal(ext.matmul(mx.ones((2, 0)), *no_columns, 32, 4), mx.zeros((2, 8))).item()

EVERY_LAYOUT_SCRIPT = """
import runtime
import mlx.core as mx
from kernels.cpu_extension import cpu_extension
from kernels.quantized_matmul import reference_quantized_matmul
ext = cpu_extension()
for bits in (4, 8):
    for group_size in (32, 64, 128):
        k = 3 * group_size
        w, scales, biases = mx.quantize(mx.random.normal((37, k)), group_size=group_size, bits=bits)
        for m in (1, 3, 16):
            x = mx.random.normal((m, k))
            ours = ext.matmul(x, w, scales, biases, group_size, bits)
            want = reference_quantized_matmul(x, w, scales, biases, group_size, bits)
            assert mx.allclose(ours, want, rtol=1e-4, atol=1e-4).item(), (bits, group_size, m)
from kernels.quantized_matmul import exponent_scales
w, e = mx.quantize(mx.random.normal((37, 160)), group_size=32, bits=4, mode="mxfp4")
dense = mx.dequantize(w, e, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
for m in (1, 3, 16):  # every code of mxfp4, through the row kernel and the panels
    x = mx.random.normal((m, 160))
    ours = ext.matmul(x, w, exponent_scales(e), None, 32, 4)
    assert mx.allclose(ours, x @ dense.T, rtol=1e-4, atol=1e-4).item(), ("mxfp4", m)
print(ext.isa())
"""


def run_with_isa_cap(script, cap):
    """Run `script` in a fresh interpreter with CADENCE_CPU_ISA=cap; its last printed line."""
    return last_line(script, {"CADENCE_CPU_ISA": cap}, timeout=600)


@needs_kernels
@pytest.mark.parametrize("cap", ["baseline", "avx2"])
def test_every_instruction_set_matches_the_reference(cap):
    """The widest kernels run by default; CADENCE_CPU_ISA caps them to test the others."""
    isa = run_with_isa_cap(EVERY_LAYOUT_SCRIPT, cap)
    assert "avx512" not in isa
    if cap == "baseline":
        assert isa.split(" ")[0] in ("baseline", "neon")
        assert "avx2" not in isa


@needs_kernels
def test_thread_counts_agree():
    ext = loader.cpu_extension()
    w, scales, biases = quantized(4099, 256, 64, 4)  # enough rows to be split over threads
    x = mx.random.normal((3, 256))
    threads = ext.num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            ext.set_num_threads(n)
            assert ext.num_threads() == n
            results.append(quantized_matmul(x, w, scales, biases, 64, 4))
    finally:
        ext.set_num_threads(threads)
    assert all(mx.array_equal(results[0], r).item() for r in results[1:])


def test_two_cpu_streams_at_once_each_get_their_own_result():
    """The thread pool serves one call at a time; another stream's call runs alone."""
    w, scales, biases = quantized(8192, 512, 64, 4)  # big enough to be split over threads
    x = mx.random.normal((2, 512))
    side = mx.new_stream(mx.cpu)
    outs = []
    for _ in range(10):
        outs.append(quantized_matmul(x, w, scales, biases, 64, 4))
        with mx.stream(side):
            outs.append(quantized_matmul(x + 1, w, scales, biases, 64, 4))
    mx.eval(outs)
    want = [reference_quantized_matmul(x + i, w, scales, biases, 64, 4) for i in (0, 1)]
    assert all(mx.allclose(o, want[i % 2], atol=1e-3).item() for i, o in enumerate(outs))


@needs_kernels
def test_bad_operands_raise_one_line_errors():
    ext = loader.cpu_extension()
    w, scales, biases = quantized(8, 64, 32, 4)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        ext.matmul(mx.ones((1, 64)), w, scales, biases, 32, 3)
    with pytest.raises(ValueError, match="x must be"):
        ext.matmul(mx.ones((1, 32)), w, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="scales and biases"):
        ext.matmul(mx.ones((1, 64)), w, scales, biases, 64, 4)


def test_the_environment_switch_forces_the_fallback(monkeypatch):
    monkeypatch.setenv("CADENCE_CPU_KERNELS", "off")
    module, status = loader._load()
    assert module is None and "CADENCE_CPU_KERNELS" in status


def test_the_fallback_computes_the_same_through_mlx(monkeypatch):
    monkeypatch.setitem(loader._state, "module", None)
    monkeypatch.setitem(loader._state, "status", "off for the test")
    assert not uses_cpu_kernel(64, 4)
    w, scales, biases = quantized(9, 128, 64, 4)
    x = mx.random.normal((3, 128))
    assert mx.allclose(
        quantized_matmul(x, w, scales, biases, 64, 4),
        reference_quantized_matmul(x, w, scales, biases, 64, 4),
        atol=1e-4,
    ).item()


def test_the_loader_refuses_an_extension_built_for_another_mlx(monkeypatch):
    class BuiltForAnotherMlx:
        built_for_mlx = "0.1.0"

    monkeypatch.setattr(loader.importlib, "import_module", lambda name: BuiltForAnotherMlx)
    module, status = loader._load()
    assert module is None
    assert status.startswith("CPU kernels refused: built against mlx 0.1.0")


def test_an_extension_built_for_another_mlx_is_refused():
    assert loader.refusal_reason("0.32.4", "0.32.4") is None
    assert loader.refusal_reason("0.32.4", "0.32.4.dev20260101+abc") is None
    reason = loader.refusal_reason("0.32.4", "0.33.0")
    assert reason is not None and "0.33.0" in reason and "reinstall" in reason
