"""examples/bench_choices.py, run as its README line runs it: in a subprocess."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_it_prints_its_three_figures_and_no_log_events():
    result = subprocess.run(
        [sys.executable, "examples/bench_choices.py", "--n", "2", "--prompt-tokens", "40",
         "--max-tokens", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "n=1 prefix cache on ", "n=2 prefix cache on ", "n=2 prefix cache off"
    ]
