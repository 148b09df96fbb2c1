"""examples/train_demo.py, run as its README line runs it: in a subprocess."""

import signal
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



def test_a_run_cut_short_leaves_the_checkpoint_as_it_was(tmp_path):
    """The tokenizer was written at the start: a Ctrl-C during training left the demo
    with a new tokenizer over the old weights (its text silently lost tokens)."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / "tokenizer.json").write_text("the old one")
    training = subprocess.Popen(
        [sys.executable, "examples/train_demo.py", "--steps", "100000", "--batch-size", "2",
         "--seq-len", "16", "--vocab-size", "300", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in training.stdout:  # trained past the first 50 steps: cut it short
            if line.startswith("step    50"):
                break
    finally:
        training.send_signal(signal.SIGINT)
        training.wait(60)
    assert [p.name for p in out.iterdir()] == ["tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "the old one"
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no staging left beside it


def test_a_run_writes_the_whole_checkpoint_at_its_end_and_nothing_before(tmp_path):
    """The tokenizer was written at the start: a Ctrl-C during training left the demo
    with a new tokenizer over the old weights. Now every file moves in at the end."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / "README.md").write_text("kept")
    result = subprocess.run(
        [sys.executable, "examples/train_demo.py", "--steps", "10", "--batch-size", "2",
         "--seq-len", "16", "--vocab-size", "300", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    written = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"}
    assert {p.name for p in out.iterdir()} == written | {"README.md"}
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no staging left beside it
