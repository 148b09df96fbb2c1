"""The bench's check that OPENBLAS_CORETYPE slows the peer: the child's timing and the note."""

import json
import subprocess

import pytest

from actors import bench_blas
from actors.bench_blas import Unpinned, measure_unpinned, pin_note
from actors.bench_model import Floor

FLOOR = Floor(num_params=182_000_000, gemm_flops=262e9, gemm_shape=(256, 1024, 2816))


def test_no_note_without_an_unpinned_timing_or_below_a_tenth_faster():
    assert pin_note(FLOOR, None) is None
    assert pin_note(FLOOR, Unpinned("Haswell", 262e9 * 1.09, "x, SkylakeX kernels")) is None


def test_the_note_names_the_pin_both_rates_and_the_command_that_unsets_it():
    note = pin_note(FLOOR, Unpinned("Haswell", 452.4e9, "scipy-openblas32, SkylakeX kernels"))
    assert note is not None
    assert "OPENBLAS_CORETYPE=Haswell" in note
    assert "(BLAS scipy-openblas32, SkylakeX kernels)" in note
    assert "[256, 1024] @ [1024, 2816]" in note
    assert "452.4 against 262.0 GFLOP/s" in note
    assert "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE cadence bench serve" in note


def test_nothing_is_timed_where_nothing_pins_openblas(monkeypatch, tmp_path):
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child was started"))
    assert measure_unpinned(tmp_path) is None


def test_the_child_runs_without_either_variable_and_its_last_line_is_read(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "512")
    seen = {}

    def run(command, env, **kwargs):
        seen.update(command=command, env=env)
        line = json.dumps({"gemm_flops": 4.5e11, "blas": "OpenBLAS, SkylakeX kernels"})
        return subprocess.CompletedProcess(command, 0, stdout=f"a warning\n{line}\n", stderr="")

    monkeypatch.setattr(bench_blas.subprocess, "run", run)
    assert measure_unpinned(tmp_path) == Unpinned("Haswell", 4.5e11, "OpenBLAS, SkylakeX kernels")
    assert "OPENBLAS_CORETYPE" not in seen["env"] and "OPENBLAS_L2_SIZE" not in seen["env"]
    assert seen["command"][-1] == str(tmp_path.resolve())


@pytest.mark.parametrize(
    "stdout", ["", "not json\n", '{"blas": "x"}\n', '{"gemm_flops": "fast", "blas": 1}\n']
)
def test_a_child_that_prints_no_timing_is_no_timing(monkeypatch, tmp_path, stdout):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setattr(
        bench_blas.subprocess,
        "run",
        lambda c, **k: subprocess.CompletedProcess(c, 1, stdout=stdout),
    )
    assert measure_unpinned(tmp_path) is None


@pytest.mark.parametrize("error", [subprocess.TimeoutExpired("python", 300), OSError("no python")])
def test_a_child_that_hangs_or_cannot_start_is_no_timing(monkeypatch, tmp_path, error):
    # Faked: the environment's pin is left alone in tests, as the machine's notes ask.
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")

    def run(*args, **kwargs):
        raise error

    monkeypatch.setattr(bench_blas.subprocess, "run", run)
    assert measure_unpinned(tmp_path) is None
