"""Shared fixtures. `runtime` is imported first so the fast BLAS loads before mlx."""

import runtime  # noqa: F401  (must precede every mlx import, mlx_lm's included)
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
