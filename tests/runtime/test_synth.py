"""Tiny random checkpoints (runtime.synth) and the shipped demo load in mlx-lm and parse."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.config import load_config
from runtime.synth import DEMO_DIR, make_tiny_checkpoint

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

PROMPT = "The for statement is used to iterate over the elements of a sequence"


def logits_of(model: nn.Module, tokenizer, text: str = PROMPT) -> mx.array:
    return model(mx.array([tokenizer.encode(text)]))[0].astype(mx.float32)  # [T, vocab]


def greedy(model: nn.Module, tokenizer, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(PROMPT)
    for _ in range(num_tokens):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[-num_tokens:]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("is_tied", [False, True], ids=["untied", "tied"])
def test_family_loads_in_mlx_lm_and_config_round_trips(tmp_path: Path, family: str, is_tied: bool):
    make_tiny_checkpoint(tmp_path, family, tie_word_embeddings=is_tied, seed=3)
    model, tokenizer = mlx_lm.load(str(tmp_path))
    logits = logits_of(model, tokenizer)
    assert mx.all(mx.isfinite(logits)).item()
    assert logits.std().item() > 1.0  # a real spread, not near-ties everywhere

    config = load_config(tmp_path)
    assert (config.model_type, config.tie_word_embeddings) == (family, is_tied)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 2, 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == logits.shape[-1] == len(tokenizer.get_vocab())
    assert config.qkv_bias == (family == "qwen2")
    assert config.qk_norm == (family == "qwen3")
    assert set(config.eos_token_ids) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


@pytest.mark.parametrize("is_tied", [False, True], ids=["untied", "tied"])
def test_greedy_continuation_is_not_one_repeated_token(tmp_path: Path, is_tied: bool):
    make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=is_tied)
    model, tokenizer = mlx_lm.load(str(tmp_path))
    assert len(set(greedy(model, tokenizer, 32))) >= 8


@pytest.mark.parametrize(
    ("family", "group_size", "bits"), [("llama", 64, 4), ("qwen3", 32, 8)], ids=["q4", "q8"]
)
def test_quantized_checkpoint_uses_mlx_community_layout(
    tmp_path: Path, family: str, group_size: int, bits: int
):
    make_tiny_checkpoint(tmp_path, family, quantize=(group_size, bits), tie_word_embeddings=True)
    weights, metadata = mx.load(str(tmp_path / "model.safetensors"), return_metadata=True)
    assert metadata["format"] == "mlx"
    for prefix in (
        "model.embed_tokens",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ):
        assert weights[f"{prefix}.weight"].dtype == mx.uint32
        assert f"{prefix}.scales" in weights and f"{prefix}.biases" in weights
    assert weights["model.norm.weight"].dtype == mx.float32

    config = load_config(tmp_path)
    assert (config.quantization.group_size, config.quantization.bits) == (group_size, bits)
    model, tokenizer = mlx_lm.load(str(tmp_path))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert mx.all(mx.isfinite(logits_of(model, tokenizer))).item()


def test_sharded_checkpoint_matches_single_file(tmp_path: Path):
    single = make_tiny_checkpoint(tmp_path / "single", "qwen2", seed=5)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "qwen2", seed=5, shards=3)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    stored = {name: f for f in files for name in mx.load(str(sharded / f))}
    assert index["weight_map"] == stored
    assert stored.keys() == mx.load(str(single / "model.safetensors")).keys()

    expected = logits_of(*mlx_lm.load(str(single)))
    assert mx.array_equal(logits_of(*mlx_lm.load(str(sharded))), expected).item()


def test_same_seed_same_bytes(tmp_path: Path):
    def weights_bytes(name: str, seed: int) -> bytes:
        out = make_tiny_checkpoint(tmp_path / name, "qwen3", seed=seed, dtype="bfloat16")
        return (out / "model.safetensors").read_bytes()

    assert weights_bytes("a", seed=1) == weights_bytes("b", seed=1)
    assert weights_bytes("a", seed=1) != weights_bytes("c", seed=2)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["head_dim"] == 16


def test_demo_checkpoint_loads_and_knows_its_text():
    config = load_config(DEMO_DIR)
    assert config.model_type == "llama"
    model, tokenizer = mlx_lm.load(str(DEMO_DIR))
    assert config.vocab_size == len(tokenizer.get_vocab())
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

    # Trained on Python's help text: a sentence from it is far likelier than chance.
    ids = mx.array([tokenizer.encode(PROMPT + " (such as a string, tuple or list)")])
    loss = nn.losses.cross_entropy(model(ids[:, :-1]), ids[:, 1:], reduction="mean").item()
    assert loss < 0.5 * mx.log(mx.array(config.vocab_size)).item()
