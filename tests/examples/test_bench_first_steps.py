"""examples/bench_first_steps.py, run as its docstring runs it: in a subprocess."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_it_times_each_loads_first_and_second_run_after_the_warm_up(make_checkpoint):
    result = subprocess.run(
        [sys.executable, "examples/bench_first_steps.py", str(make_checkpoint("llama")),
         "--rows", "1", "3", "--warm-up"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"warm-up: \d+\.\d\d s, \d+ steps", lines[1])
    runs = [re.fullmatch(r"(\d+) rows, (\w+) run: \d+\.\d\d s, (\d+) steps, .*", line) for line in lines[2:]]
    assert [(m[1], m[2]) for m in runs] == [("1", "first"), ("1", "second"), ("3", "first"), ("3", "second")]
    assert all(int(m[3]) >= 16 for m in runs)  # 16 tokens each, one a step at least
