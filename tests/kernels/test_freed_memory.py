"""kernels/freed_memory.py: memory freed at load handed back to the system."""

import ctypes
import platform
import sys

import mlx.core as mx
import pytest

from kernels import freed_memory


def test_mlxs_cache_is_emptied():
    scratch = mx.zeros((1 << 20,))
    mx.eval(scratch)
    del scratch
    assert mx.get_cache_memory() > 0
    freed_memory.release_freed_memory()
    assert mx.get_cache_memory() == 0


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's call"
)
def test_glibcs_free_heap_pages_are_trimmed(monkeypatch):
    assert freed_memory._malloc_trim() is not None  # found in this C library
    calls = []
    monkeypatch.setattr(freed_memory, "_malloc_trim", lambda: calls.append)
    freed_memory.release_freed_memory()
    assert calls == [0]  # keep no slack at the heap's top either


def test_a_c_library_without_malloc_trim_is_left_alone(monkeypatch):
    class NoTrim:
        def __init__(self, name):
            pass

    monkeypatch.setattr(ctypes, "CDLL", NoTrim)
    freed_memory._malloc_trim.cache_clear()
    try:
        assert freed_memory._malloc_trim() is None
        freed_memory.release_freed_memory()  # mlx's cache still emptied, nothing raised
    finally:
        freed_memory._malloc_trim.cache_clear()
