"""Shared fixtures. `runtime` is imported first so the fast BLAS loads before mlx."""

import os

# mlx's CUDA backend multiplies float32 in TF32 unless told not to (an H200 ran an fp32
# 8192^3 matmul at 363 TFLOP/s): the float32 parity and batch-invariance checks here
# assume float32 products. Read by mlx at its first matmul; nothing changes on a CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import runtime  # noqa: F401, E402  (must precede every mlx import, mlx_lm's included)
from runtime.synth import make_tiny_checkpoint

import pytest


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """`make_checkpoint(family, **shape)` -> a cached tiny random-weight checkpoint dir."""
    made = {}

    def make(family: str = "llama", **shape):
        key = (family, repr(sorted(shape.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family, **shape)
        return made[key]

    return make
