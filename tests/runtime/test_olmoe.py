"""OLMoE against mlx-lm: OLMo 2's whole-projection q/k norms in llama's pre-norm layer, every
MLP routed experts (unnormalised top-k, as the releases); greedy tokens through the paged
engine, float (experts stored one tensor each) and 4-bit (stacked), rows in mixed steps of
prompt chunks; its config."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.models.experts import RoutedExperts
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import pytest

from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy
from tests.runtime.test_cohere import assert_gguf_refused, assert_rows_in_mixed_steps_match_mlx_lm

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 35))


def olmoe(tmp_path: Path, quantize=None, **fields) -> Path:
    path = make_tiny_checkpoint(tmp_path, "olmoe", num_layers=2, seed=3, quantize=quantize, num_experts=4, num_experts_per_tok=2)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))
    return path


@pytest.mark.parametrize("normalize", [False, True], ids=["raw-topk", "norm-topk"])
def test_olmoe_logits_match_mlx_lm(tmp_path: Path, normalize: bool):
    path = olmoe(tmp_path, norm_topk_prob=normalize)
    ours = load_model(path)
    layers = ours.model.model.layers
    assert all(isinstance(layer.mlp, RoutedExperts) for layer in layers)
    assert layers[0].self_attn.q_norm.weight.shape == (64,)  # all heads at once
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=1e-4).item()


@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["float", "q4"])
def test_olmoe_greedy_parity_through_the_engine(tmp_path: Path, quantize):
    path = olmoe(tmp_path, quantize)
    loaded = load_model(path)
    assert not any(layer.attention_block for layer in loaded.model.model.layers)  # whole-projection norms
    tokens = greedy(loaded, PROMPT, 16)
    assert tokens == mlx_lm_greedy(path, PROMPT, 16)
    assert len(set(tokens)) >= 4


def test_olmoe_rows_in_mixed_steps_of_prompt_chunks_match_each_alone(tmp_path: Path):
    path = olmoe(tmp_path)
    assert_rows_in_mixed_steps_match_mlx_lm(path)


def config(**fields):
    raw = hf_config("olmoe", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    return config_from_dict({**raw, **fields})


def test_olmoe_without_norm_topk_prob_weighs_by_the_softmax_unnormalised():
    """transformers' OlmoeConfig default (False), as mlx-lm's."""
    raw = hf_config("olmoe", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    read = config_from_dict({name: value for name, value in raw.items() if name != "norm_topk_prob"})
    assert not read.extra["experts"].normalize and config(norm_topk_prob=True).extra["experts"].normalize


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"clip_qkv": 8.0}, "olmoe's clip_qkv is not supported, got 8.0"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok (5) is more than the 4 experts"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_olmoe_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_an_olmoe_gguf_stays_a_one_line_refusal(tmp_path: Path):
    assert_gguf_refused(tmp_path, "olmoe")
