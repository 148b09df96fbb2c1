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
