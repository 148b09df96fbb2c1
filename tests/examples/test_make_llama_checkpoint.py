"""examples/make_llama_checkpoint.py, run as its docstring runs it: in a subprocess."""

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
from runtime.synth import demo_tokenizer

import mlx.core as mx
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stored", [["--dtype", "bfloat16"], ["--bits", "4"]])
def test_every_token_it_generates_is_one_the_tokenizer_decodes(tmp_path, stored):
    """A bench times a token when its text arrives: with the 128K rows past the demo
    tokenizer's 2,048 random, nearly every token was one nothing decodes, and a 1-client
    run printed a TTFT of 0.00 s."""
    out = tmp_path / "llama"
    result = subprocess.run(
        [sys.executable, "examples/make_llama_checkpoint.py", str(out), "--layers", "1",
         "--hidden", "128", *stored],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (128_256, True)
    assert ("quantization" in config) == ("--bits" in stored)
    table = mx.load(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    spoken = demo_tokenizer().get_vocab_size()
    assert table.shape[0] == 128_256 and not mx.any(table[spoken:]).item()
    assert mx.any(table[:spoken]).item()
    engine = Engine(load_model(out), max_batch=2)
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(2, pool, engine.max_context)
    prompts = {str(i): SequenceParams(tuple(range(10 + i, 40)), 24, ignore_eos=True) for i in (0, 1)}
    tokens = [t for r in run_offline(engine, policy, prompts).values() for t in r.tokens]
    assert len(tokens) == 48 and max(tokens) < spoken
