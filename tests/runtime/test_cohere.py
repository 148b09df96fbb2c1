"""Cohere (Command-R, with and without its per-head q/k LayerNorms) and Cohere 2 (Command
R7B: three sliding layers in four, the fourth without RoPE) against mlx-lm: logits past
the window, greedy tokens through the paged engine, float and 4-bit, off the CPU's one-op
blocks, rows in mixed steps of prompt chunks; the configs as transformers reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.engine import Engine
from runtime.errors import CheckpointError
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from kernels import paged_attention
from tests.kernels.test_paged_attention import ATTENTION_PATHS
from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_gguf import minimal_gguf, one_line_error

TOKENS = mx.array([list(range(5, 45))])  # 40 positions: several times an 8-key window
PROMPT = list(range(5, 35))
VARIANTS = {"command-r": ("cohere", {}), "command-r-plus": ("cohere", {"use_qk_norm": True}), "r7b": ("cohere2", {})}


def cohere(tmp_path: Path, variant: str, quantize=None, **fields) -> Path:
    family, own = VARIANTS[variant]
    path = make_tiny_checkpoint(tmp_path, family, num_layers=4, seed=3, quantize=quantize)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **own, **fields}))
    if own.get("use_qk_norm"):  # Command-R+'s per-head norms, a weight per head: [heads, head_dim]
        rng = np.random.default_rng(4)
        norms = {
            f"model.layers.{layer}.self_attn.{name}.weight": 1.0 + 0.3 * rng.standard_normal((heads, 16))
            for layer in range(4)
            for name, heads in (("q_norm", 4), ("k_norm", 2))
        }
        rewrite_weights(path, quantize, norms)
    return path


def rewrite_weights(path: Path, quantize, new: dict[str, np.ndarray], keep=lambda name: True) -> None:
    """The checkpoint's weights with `new` added (as float32) and those `keep` refuses dropped."""
    weights = {name: w for name, w in mx.load(str(path / "model.safetensors")).items() if keep(name)}
    weights.update({name: mx.array(values.astype(np.float32)) for name, values in new.items()})
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx" if quantize else "pt"})


@pytest.mark.parametrize("variant", VARIANTS)
def test_cohere_logits_match_mlx_lm_past_the_window_and_its_logit_scale_matters(tmp_path: Path, variant):
    path = cohere(tmp_path, variant)
    ours = load_model(path)
    layers = ours.model.model.layers
    is_r7b = variant == "r7b"
    assert ours.config.layer_windows == ((8, 8, 8, None) if is_r7b else ())
    assert [layer.self_attn.rope.base is None for layer in layers] == [False, False, False, is_r7b]  # NoPE
    assert ("q_norm" in layers[0].self_attn) == (variant == "command-r-plus")
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()
    unscaled = load_model(cohere(tmp_path / "unscaled", variant, logit_scale=1.0)).model(TOKENS)
    assert not mx.allclose(unscaled, want, atol=1e-2).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cohere_greedy_parity_through_the_engine_off_the_one_op_blocks(tmp_path: Path, variant, quantize):
    path = cohere(tmp_path, variant, quantize=quantize)
    loaded = load_model(path)
    layers = loaded.model.model.layers
    assert all("qkv_proj" in layer.self_attn for layer in layers)  # the CPU's stacked form
    assert not any(hasattr(layer, "attention_block") for layer in layers)
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def mixed_step_tokens(checkpoint: Path, prompts: dict[str, list[int]], n: int = 12) -> dict[str, list[int]]:
    """Each prompt's greedy tokens with the prompts fed in 8-token chunks beside the other
    rows' decoding (the short one's last chunk samples while the long one's go on)."""
    engine = Engine(load_model(checkpoint), max_batch=len(prompts))
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size, is_caching=True, layout=engine.kv.layout)
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context, prefill_chunk=8)
    params = {name: SequenceParams(prompt_tokens=tuple(p), max_tokens=n, ignore_eos=True) for name, p in prompts.items()}
    return {name: list(result.tokens) for name, result in run_offline(engine, policy, params).items()}


def assert_rows_in_mixed_steps_match_mlx_lm(checkpoint: Path, long_prompt: list[int] = PROMPT, monkeypatch=None, path=None) -> None:
    """A short and a long prompt, fed in chunks beside each other's decoding, each get
    mlx-lm's greedy tokens for it alone; on the attention `path` where one is given."""
    if path is not None:
        monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    before = paged_attention.dispatch_counts[path] if path is not None else 0
    prompts = {"short": list(range(100, 113)), "long": long_prompt}
    got = mixed_step_tokens(checkpoint, prompts)
    for name, prompt in prompts.items():
        assert got[name] == mlx_lm_greedy(checkpoint, prompt, 12), name
    assert path is None or paged_attention.dispatch_counts[path] > before  # no silent fallback


def assert_gguf_refused(tmp_path: Path, arch: str) -> None:
    """A GGUF of `arch` is refused in one line naming it."""
    path = minimal_gguf(tmp_path / f"{arch}.gguf", arch, {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    assert f"unsupported GGUF architecture '{arch}'" in one_line_error(path)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("variant", ["command-r-plus", "r7b"])
def test_cohere_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path, monkeypatch, variant, path):
    assert_rows_in_mixed_steps_match_mlx_lm(cohere(tmp_path, variant), monkeypatch=monkeypatch, path=path)


def config(family="cohere2", *left_out: str, **fields):
    raw = hf_config(family, vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=8,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({name: value for name, value in {**raw, **fields}.items() if name not in left_out})


def test_cohere_configs_read_as_transformers_reads_them():
    assert config("cohere2", "sliding_window", "sliding_window_pattern").layer_windows == (4096, 4096, 4096, None) * 2
    assert config(layer_types=["sliding_attention", "full_attention"] * 4).layer_windows == (8, None) * 4
    plain = config("cohere", "logit_scale", "layer_norm_eps", "tie_word_embeddings")
    assert (plain.extra["logit_scale"], plain.extra["layer_norm_eps"], plain.tie_word_embeddings) == (0.0625, 1e-5, True)
    assert plain.layer_windows == () and not plain.extra["nope_full_layers"]
    assert (config("cohere", attention_bias=True).qkv_bias, config("cohere", attention_bias=True).o_bias) == (True, True)
    unbiased = config("cohere", "attention_bias")  # transformers' default: no biases
    assert (unbiased.qkv_bias, unbiased.o_bias) == (False, False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_scale": 0}, "logit_scale must be a positive number, got 0"),
        ({"logit_scale": "0.25"}, "logit_scale must be a positive number, got '0.25'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "cohere2 with RoPE scaling is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"layer_types": ["full_attention"]}, "layer_types needs 8 entries"),
        ({"use_qk_norm": "yes"}, "field 'use_qk_norm' should be bool"),
    ],
)
def test_cohere_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


@pytest.mark.parametrize("arch", ["command-r", "cohere2"])
def test_a_cohere_gguf_stays_a_one_line_refusal(tmp_path: Path, arch: str):
    assert_gguf_refused(tmp_path, arch)
