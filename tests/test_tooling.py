"""The project's own checks, run by the test command: lint, types, and layering rules."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "actors", "kernels")


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean():
    result = run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    result = run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def imports_in(package: str, pattern: str) -> list[str]:
    regex = re.compile(pattern, re.MULTILINE)
    return [str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py") if regex.search(p.read_text())]


@pytest.mark.parametrize("package", ["runtime", "kernels"])
def test_sans_io_core_never_imports_trio(package):
    assert imports_in(package, r"^\s*(import trio|from trio)") == []


@pytest.mark.parametrize("package", PACKAGES)
def test_mlx_lm_is_a_test_oracle_only(package):
    assert imports_in(package, r"^\s*(import mlx_lm|from mlx_lm)") == []


def test_cadences_modules_are_found_from_any_directory_beside_other_kernels_packages(tmp_path):
    """Its import packages have plain names, and transformers 5 (mlx-lm's) installs Hugging
    Face's own `kernels` package: run from outside the checkout, every module cadence
    imports must still be cadence's own, as the editable install finds them by full name."""
    probe = (
        "import sys, actors.cli, runtime.engine, kernels.blas, kernels.paged_attention, "
        "kernels.cpu_extension; "
        "print('\\n'.join(m.__file__ for m in (actors.cli, runtime.engine, kernels.blas, "
        "kernels.paged_attention, kernels.cpu_extension)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    files = [Path(line) for line in done.stdout.split()]
    assert len(files) == 5 and all(path.is_relative_to(ROOT) for path in files), files
