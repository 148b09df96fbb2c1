"""examples/train_demo.py, run as its README line runs it: in a subprocess."""

import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def train_command(out, *args):
    """The example's command line, tiny: 2 x 16-token batches, a 300-token vocabulary."""
    return [sys.executable, "examples/train_demo.py", *args, "--batch-size", "2",
            "--seq-len", "16", "--vocab-size", "300", "--out", str(out)]  # fmt: skip


def train(out, *args):
    """Run it to its end; its output once it succeeded."""
    result = subprocess.run(
        train_command(out, *args), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_a_training_step_runs_through_mlx_own_ops_not_the_inference_kernels(tmp_path):
    # --measure trains without writing runtime/demo/; the kernels' primitives have no vjp.
    assert "step     1  loss" in train(tmp_path, "--measure", "1")
    assert list(tmp_path.iterdir()) == []  # --measure writes nothing


def test_a_run_cut_short_leaves_the_checkpoint_as_it_was(tmp_path):
    """The tokenizer was written at the start: a Ctrl-C during training left the demo
    with a new tokenizer over the old weights (its text silently lost tokens)."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / "tokenizer.json").write_text("the old one")
    training = subprocess.Popen(
        train_command(out, "--steps", "100000"),
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
    train(out, "--steps", "10")
    written = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"}
    assert {p.name for p in out.iterdir()} == written | {"README.md"}
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no staging left beside it
