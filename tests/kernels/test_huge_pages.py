"""kernels/huge_pages.py and kernels/cpu/huge_pages.cpp: the weights on 2 MB pages."""

import gc
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from runtime.checkpoint import load_model

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kernels import huge_pages
from kernels.cpu_extension import cpu_extension
from tests.kernels.test_quantized_matmul import needs_kernels

MB = 1 << 20
needs_linux = pytest.mark.skipif(sys.platform != "linux", reason="2 MB pages are Linux's")


def address(array: mx.array) -> int:
    return int(np.asarray(array).ctypes.data)


def thp_mode() -> str:
    """The bracketed word of the sysfs switch (always, madvise, never), "" if none."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_kernels
@needs_linux
@pytest.mark.parametrize("dtype", [mx.float32, mx.uint32, mx.bfloat16])
def test_a_copy_holds_the_same_values_from_a_2mb_boundary(dtype):
    source = (mx.random.normal((1024, 1536)) * 1000).astype(dtype)
    copy = cpu_extension().copy_to_huge_pages(source)
    assert copy.dtype == dtype and copy.shape == source.shape
    assert mx.array_equal(copy, source).item()
    if dtype != mx.bfloat16:  # numpy has no bfloat16 to read the address through
        assert address(copy) % (2 * MB) == 0 and address(copy) != address(source)
    assert mx.array_equal(copy * 2, source * 2).item()  # an ordinary array to mlx's ops


@needs_kernels
@needs_linux
def test_strided_and_offset_arrays_are_copied_as_their_values():
    whole = mx.random.normal((1536, 1024))
    for view in (whole.T, whole[7:1031], whole[:, 3:900]):
        copy = cpu_extension().copy_to_huge_pages(view)
        assert copy.shape == view.shape and mx.array_equal(copy, view).item()
        assert address(copy) % (2 * MB) == 0


@needs_kernels
def test_an_array_under_2mb_stays_where_it_is():
    small = mx.random.normal((256, 511))  # 2 MB less 1 KB
    mx.eval(small)
    assert address(cpu_extension().copy_to_huge_pages(small)) == address(small)


@needs_kernels
@needs_linux
@pytest.mark.skipif(
    thp_mode() not in ("always", "madvise"), reason="this system grants no 2 MB pages"
)
def test_linux_backs_the_copy_with_2mb_pages():
    ext = cpu_extension()
    copy = ext.copy_to_huge_pages(mx.random.normal((4096, 1024)))  # 16 MB
    assert ext.huge_page_bytes(copy) >= 16 * MB
    plain = mx.random.normal((4096, 1024))  # mlx's own buffer, no advice
    mx.eval(plain)
    if thp_mode() == "madvise":
        assert ext.huge_page_bytes(plain) < 16 * MB


@needs_kernels
@needs_linux
def test_the_mapping_goes_back_to_the_system_with_its_array():
    ext = cpu_extension()
    source = mx.random.normal((16 * MB,))  # 64 MB
    mx.eval(source)
    before = resident_bytes()
    for _ in range(40):  # 2.5 GB in all, were none of it unmapped
        copy = ext.copy_to_huge_pages(source)
        mx.eval(copy)
        del copy
    assert resident_bytes() - before < 512 * MB


@needs_kernels
@needs_linux
def test_loading_moves_the_large_weights_before_the_blocks_take_them(make_checkpoint, monkeypatch):
    """gate_up (4096 x 256) and down (256 x 2048) are 4 and 2 MB in float32; the residual
    blocks' plans (kernels/fused_blocks.py) must hold the moved arrays, not the old ones."""
    path = make_checkpoint(
        "llama", hidden_size=256, intermediate_size=2048, num_layers=1, num_heads=4
    )
    loaded = load_model(path)
    layer = loaded.model.model.layers[0]
    moved = [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    assert all(address(w) % (2 * MB) == 0 for w in moved)
    block = layer.mlp_block
    assert block is not None
    assert [address(block.first[0]), address(block.second[0])] == [address(w) for w in moved]
    tokens = mx.array([[11, 305, 42, 977, 5, 1203, 64, 88]])
    got = loaded.model(tokens)
    monkeypatch.setenv("CADENCE_HUGE_PAGES", "off")
    plain = load_model(path)
    assert address(plain.model.model.layers[0].mlp.gate_up_proj.weight) % (2 * MB) != 0
    assert mx.array_equal(got, plain.model(tokens)).item()


@needs_kernels
@needs_linux
def test_moving_the_weights_leaves_mlx_none_of_the_old_buffers():
    """Each old buffer is freed as its copy replaces it, and not kept in mlx's cache,
    which would hold a second model: nothing later has those sizes."""
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)))  # 4 MB weights
    mx.eval(model.parameters())
    gc.collect()  # earlier tests' arrays freed now, not into the cache mid-load
    mx.clear_cache()
    active = mx.get_active_memory()
    assert huge_pages.move_weights_to_huge_pages(model) == 4 * 4 * MB
    assert mx.get_cache_memory() == 0 and mx.get_active_memory() <= active - 4 * 4 * MB


@needs_kernels
@needs_linux
@pytest.mark.parametrize(
    ("value", "is_on"),
    [("off", False), ("0", False), ("no", False), ("OFF", False), ("", True), ("on", True)],
)
def test_cadence_huge_pages_turns_the_copy_off_in_any_case(monkeypatch, value, is_on):
    monkeypatch.setenv("CADENCE_HUGE_PAGES", value)
    assert huge_pages.huge_pages_wanted() is is_on


@needs_kernels
@needs_linux
@pytest.mark.parametrize("gpu", ["metal", "cuda"])
def test_a_gpu_build_keeps_mlxs_buffers(monkeypatch, gpu):
    """A GPU build's buffers are not plain memory: nothing is copied."""
    monkeypatch.setattr(mx, gpu, SimpleNamespace(is_available=lambda: True), raising=False)
    assert not huge_pages.huge_pages_wanted()


@needs_kernels
@needs_linux
def test_moving_counts_the_bytes_of_the_arrays_it_moved():
    model = nn.Linear(1024, 1024)  # a 4 MB weight and a 4 KB bias
    mx.eval(model.parameters())
    assert huge_pages.move_weights_to_huge_pages(model) == 4 * MB
    assert address(model.weight) % (2 * MB) == 0
