"""The BLAS loader: an optimized BLAS is active on Linux, and matmuls stay correct."""

import os
import sys

import mlx.core as mx
import numpy as np
import pytest

from kernels.blas import _with_kernels, active_blas, ensure_fast_blas
from tests.kernels.fresh_python import last_line


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux's CPU wheel links the reference BLAS")
def test_an_optimized_blas_is_active_on_linux():
    assert ensure_fast_blas() == active_blas()
    assert "OpenBLAS" in active_blas() or "openblas" in active_blas()


def test_matmul_is_correct_under_the_loaded_blas():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(65, 130)).astype(np.float32)
    b = rng.normal(size=(130, 33)).astype(np.float32)
    got = np.array(mx.array(a) @ mx.array(b))
    np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)
    got_t = np.array(mx.array(a).T.T @ mx.array(b.T).T)  # transposed operands take other paths
    np.testing.assert_allclose(got_t, a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux's CPU wheel links the reference BLAS")
def test_the_reference_blas_stays_when_asked_or_when_mlx_came_first():
    load = "from kernels.blas import ensure_fast_blas, active_blas; print(ensure_fast_blas(), '|', active_blas())"
    assert last_line(load, {"CADENCE_BLAS": "Reference"}) == (
        "reference (CADENCE_BLAS=reference) | reference (CADENCE_BLAS=reference)"
    )
    late = last_line("import mlx.core; " + load, {"CADENCE_BLAS": ""})
    assert late.startswith("reference (mlx.core was imported before")


class _Library:
    """A loaded OpenBLAS's corename function, as ctypes hands it out."""

    def __init__(self, core: bytes | None):
        if core is not None:
            self.scipy_openblas_get_corename = lambda: core


@pytest.mark.parametrize(
    ("core", "pinned", "expected"),
    [
        (b"SkylakeX", "", "OpenBLAS, SkylakeX kernels"),
        (b"Haswell", "Haswell", "OpenBLAS, Haswell kernels (OPENBLAS_CORETYPE=Haswell)"),
        (b"", "Haswell", "OpenBLAS"),  # nothing to say
        (None, "", "OpenBLAS"),  # an OpenBLAS too old to have the function
    ],
)
def test_the_description_names_the_kernels_openblas_chose_and_the_pin(core, pinned, expected):
    assert _with_kernels("OpenBLAS", _Library(core), "scipy_openblas_get_corename", pinned) == expected


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux's CPU wheel links the reference BLAS")
def test_the_loaded_openblas_says_its_kernels_and_whether_the_environment_pinned_them():
    pinned = os.environ.get("OPENBLAS_CORETYPE", "").strip()
    assert " kernels" in active_blas()
    assert ("(OPENBLAS_CORETYPE=" in active_blas()) == bool(pinned)
    assert active_blas().endswith(f"(OPENBLAS_CORETYPE={pinned})" if pinned else " kernels")
