"""examples/check_gguf_vocab.py, run as its docstring runs it: in a subprocess."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [[], ["{empty}"]], ids=["no-directory", "no-vocabularies"])
def test_a_missing_or_wrong_directory_is_an_error_not_a_silent_pass(tmp_path, args):
    result = subprocess.run(
        [sys.executable, "examples/check_gguf_vocab.py", *[a.format(empty=tmp_path) for a in args]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("check_gguf_vocab.py: error: ")
