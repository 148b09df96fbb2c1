"""examples/make_qwen3_5_checkpoint.py, run as its docstring runs it: in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as load_reference

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_checkpoint_is_qwen3_5s_geometry_and_both_servers_run_it_alike(tmp_path):
    """The bench compares cadence with mlx_lm.server on it: both must load it as the
    same model (mlx-lm's layout, its flat qwen3_5 config), token for token."""
    out = tmp_path / "qwen3_5"
    result = subprocess.run(
        [sys.executable, "examples/make_qwen3_5_checkpoint.py", str(out), "--layers", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["linear_num_value_heads"], config["head_dim"]) == (1024, 16, 256)
    loaded = load_model(out)
    assert loaded.config.extra["linear_layers"] == (True, True, True, False)
    prompt = list(range(40, 72))
    engine = Engine(loaded, max_batch=1)
    policy = FcfsScheduler(1, BlockPool(engine.kv.num_blocks, engine.kv.block_size), engine.max_context)
    tokens = run_offline(engine, policy, {"a": SequenceParams(tuple(prompt), 8, ignore_eos=True)})["a"].tokens
    reference, _ = load_reference(out)
    steps = generate_step(mx.array(prompt), reference, max_tokens=8, sampler=lambda x: mx.argmax(x, axis=-1))
    assert list(tokens) == [int(t) for t, _ in steps]
