"""examples/train_demo.py, run as its README line runs it: in a subprocess."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_training_step_runs_through_mlx_own_ops_not_the_inference_kernels(tmp_path):
    # --measure trains without writing runtime/demo/; the kernels' primitives have no vjp.
    result = subprocess.run(
        [sys.executable, "examples/train_demo.py", "--measure", "1", "--batch-size", "2",
         "--seq-len", "16", "--vocab-size", "300", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step     1  loss" in result.stdout
    assert list(tmp_path.iterdir()) == []  # --measure writes nothing
