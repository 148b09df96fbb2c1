"""Run a script in a fresh interpreter: for settings read once, at import or load."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def last_line(script: str, env: dict[str, str], timeout: float = 120) -> str:
    """`script` run by `python -c` in the repository with `env` added; its last printed line."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]
