"""Gemma 4 against mlx-lm: each variant's layer (31B's keys-as-values full layers, E2B/E4B's
per-layer inputs and KV sharing, 26B's routed experts), through the paged engine on every
attention path, stored 4-bit, and its config read as transformers reads it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.engine import Engine
from runtime.errors import CheckpointError
from runtime.kv.blocks import BlockPool
from runtime.models.layers import RoPE
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams
from runtime.synth import hf_config, make_tiny_checkpoint

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.rope_utils import ProportionalRoPE
from safetensors.numpy import load_file, save_file

from kernels import paged_attention
from tests.kernels.test_paged_attention import ATTENTION_PATHS
from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy

TOKENS = mx.array([list(range(5, 45))])
PROMPT = list(range(5, 35))  # past the window of 8
# Layers 2 and 5 full (heads of 32), the rest sliding over 8 positions (heads of 16).
SHAPE = dict(num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=3, seed=3)
VARIANTS = {
    "31B": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "E4B": {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True},
    "26B-A4B": {"enable_moe_block": True, "attention_k_eq_v": True, "num_global_key_value_heads": 1},
}


def gemma4(tmp_path: Path, variant: str, family: str = "gemma4_text", **kwargs) -> Path:
    # mlx-lm's multimodal gemma4 has no untied head (nor has any release).
    tied = kwargs.pop("tie_word_embeddings", family == "gemma4")
    shape = {**SHAPE, **kwargs}
    return make_tiny_checkpoint(tmp_path / variant, family, **shape, gemma4=VARIANTS[variant], tie_word_embeddings=tied)


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gemma4_logits_match_mlx_lm(tmp_path: Path, variant, family):
    path = gemma4(tmp_path, variant, family)
    ours = load_model(path)
    want = mlx_lm.load(str(path))[0](TOKENS)
    assert mx.allclose(ours.model(TOKENS), want, atol=5e-4).item()
    assert float(mx.abs(want).max()) < 30.0  # the final cap


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gemma4_greedy_parity_through_the_paged_engine(tmp_path: Path, monkeypatch, variant, path):
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    checkpoint = gemma4(tmp_path, variant)
    before = paged_attention.dispatch_counts[path]
    assert greedy(load_model(checkpoint), PROMPT, 24) == mlx_lm_greedy(checkpoint, PROMPT, 24)
    assert paged_attention.dispatch_counts[path] > before  # no silent fallback


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_shared_kv_layers_read_the_right_rows_in_mixed_steps(tmp_path: Path, monkeypatch, path):
    """Two requests of different lengths, their prompts in 8-token chunks beside the other's
    decoding: a shared layer reads its source's K/V for its own row and positions only."""
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    checkpoint = gemma4(tmp_path, "E4B")
    # The short one first: its last chunk samples while the long one's goes on after it.
    prompts = {"a": list(range(100, 113)), "b": PROMPT}
    engine = Engine(load_model(checkpoint), max_batch=2)
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size, is_caching=True, layout=engine.kv.layout)
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context, prefill_chunk=8)
    params = {
        name: SequenceParams(prompt_tokens=tuple(p), max_tokens=12, ignore_eos=True) for name, p in prompts.items()
    }
    results = run_offline(engine, policy, params)
    for name, prompt in prompts.items():
        assert list(results[name].tokens) == mlx_lm_greedy(checkpoint, prompt, 12), name


def test_kv_pools_hold_only_the_storing_layers_at_their_own_widths(tmp_path: Path):
    engine = Engine(load_model(gemma4(tmp_path, "E4B")), max_batch=2)
    kv = engine.kv
    assert engine.config.kv_layers == 4 and len(kv.keys) == 4  # layers 4 and 5 read 1 and 2
    assert kv.layout.group_layers == ((2,), (0, 1, 3))
    assert kv.group_shapes == ((2, 32), (2, 16))
    assert [k.shape[-1] for k in kv.keys] == [16, 16, 32, 16]
    engine = Engine(load_model(gemma4(tmp_path, "31B")), max_batch=2)
    k_eq_v = engine.kv
    assert k_eq_v.group_shapes == ((1, 32), (2, 16))  # the full layers' one KV head
    full_blocks, sliding_blocks = k_eq_v.layout.group_num_blocks
    assert k_eq_v.keys[2].shape == (1 * full_blocks * k_eq_v.block_size, 32)
    assert k_eq_v.keys[0].shape == (2 * sliding_blocks * k_eq_v.block_size, 16)
    # A group-0 block: layers 2 and 5, K and V, one head of 32, float32.
    assert engine.bytes_per_block == 2 * 2 * 1 * 32 * k_eq_v.block_size * 4
    assert engine.window_bytes == sliding_blocks * 4 * 2 * 2 * 16 * k_eq_v.block_size * 4  # layers 0, 1, 3, 4


def test_gemma4_stored_4_bit_keeps_greedy_parity(tmp_path: Path):
    """Quantized layers on the CPU kernels: q/k/v stacked where there is a v_proj, the
    routed GeGLU experts on the expert kernel."""
    checkpoint = gemma4(tmp_path, "26B-A4B", hidden_size=64, quantize=(32, 4))
    ours = load_model(checkpoint)
    if mx.default_device() == mx.cpu:  # the stacking is the CPU kernels' (a GPU keeps mlx's)
        attention = ours.model.model.layers[0].self_attn
        assert "qkv_proj" in attention and "v_proj" not in ours.model.model.layers[2].self_attn
    assert greedy(ours, PROMPT, 24) == mlx_lm_greedy(checkpoint, PROMPT, 24)


def test_hugging_face_stacked_experts_load_as_mlx_community_stores_them(tmp_path: Path):
    """transformers' `experts.gate_up_proj` [E, 2I, hidden] (gate first) and `experts.down_proj`."""
    path = gemma4(tmp_path, "26B-A4B")
    want = load_model(path).model(TOKENS)
    weights = load_file(path / "model.safetensors")
    for layer in range(SHAPE["num_layers"]):
        prefix = f"model.layers.{layer}.experts"
        gate, up, down = (weights.pop(f"{prefix}.switch_glu.{p}_proj.weight") for p in ("gate", "up", "down"))
        weights[f"{prefix}.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        weights[f"{prefix}.down_proj"] = down
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert mx.array_equal(load_model(path).model(TOKENS), want).item()
    # One that does not halve is named, not an mlx split error.
    for odd in (weights["model.layers.0.experts.gate_up_proj"][:, 1:], weights["model.layers.0.experts.gate_up_proj"][0, 0]):
        save_file({**weights, "model.layers.0.experts.gate_up_proj": np.ascontiguousarray(odd)}, path / "model.safetensors")
        with pytest.raises(CheckpointError, match=r"gate_up_proj' of shape .* does not split into gate and up halves"):
            load_model(path)


def test_each_departure_from_gemma_3_matters(tmp_path: Path):
    """The logits move when any one of them is undone in the config."""
    path = gemma4(tmp_path, "E4B")
    want = load_model(path).model(TOKENS)
    raw = json.loads((path / "config.json").read_text())
    full_rope = {"rope_type": "default", "rope_theta": 1e6}
    for name, change in {
        "softcap": {"final_logit_softcapping": 1.0},
        "proportional": {"rope_parameters": {**raw["rope_parameters"], "full_attention": full_rope}},
        "window": {"sliding_window": 64},
    }.items():
        (path / "config.json").write_text(json.dumps({**raw, **change}))
        assert not mx.allclose(load_model(path).model(TOKENS), want, atol=1e-2).item(), name


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_proportional_rope_rotates_as_mlx_lms_its_factor_too(factor):
    """The full layers' rope_parameters may stretch every rotated period by `factor`."""
    scaling = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": factor}
    x = mx.random.normal((5, 2, 32), key=mx.random.key(0))
    positions = mx.array([0, 1, 7, 40, 300], dtype=mx.int32)
    got = RoPE(32, 10_000.0, scaling)(x, positions)
    theirs = ProportionalRoPE(32, rotated_dims=8, base=10_000.0, factor=factor)
    want = mx.concatenate([theirs(x[None, i : i + 1].transpose(0, 2, 1, 3), offset=int(p))
                           for i, p in enumerate(positions.tolist())], axis=2)[0].transpose(1, 0, 2)
    assert mx.allclose(got, want, atol=1e-5).item()


def config(**fields):
    raw = hf_config("gemma4_text", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=6,
                    num_heads=4, num_kv_heads=2, intermediate_size=128, sliding_window_pattern=3)
    return config_from_dict({**raw, **fields})


def test_gemma4_defaults_follow_transformers():
    raw = hf_config("gemma4_text", vocab_size=300, eos_token_id=[1], hidden_size=64, num_layers=7,
                    num_heads=4, num_kv_heads=2, intermediate_size=128)
    for name in ("head_dim", "global_head_dim", "sliding_window", "sliding_window_pattern", "layer_types",
                 "rope_parameters", "final_logit_softcapping", "num_kv_shared_layers", "hidden_size_per_layer_input",
                 "vocab_size_per_layer_input", "attention_k_eq_v", "num_global_key_value_heads"):
        raw.pop(name)
    got = config_from_dict(raw)
    settings = got.extra["gemma4"]
    # Five sliding to one full, the last forced full; full heads of 512 at a quarter rotated.
    assert got.layer_windows == (512, 512, 512, 512, 512, None, None)
    assert settings.layer_shapes == ((2, 256),) * 5 + ((2, 512),) * 2
    assert settings.ropes[5] == {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "factor": 1.0}
    assert settings.ropes[0]["rope_theta"] == 10_000.0
    assert settings.per_layer_size == 256 and settings.per_layer_vocab == 262_144
    assert settings.final_softcap is None and got.kv_layers == 7 and settings.experts is None


def test_shared_layers_read_the_last_storing_layer_of_their_kind():
    got = config(num_kv_shared_layers=3, layer_types=["sliding_attention", "full_attention"] * 3)
    assert got.kv_layers == 3
    assert got.extra["gemma4"].kv_sources == (None, None, None, 1, 2, 1)
    assert got.layer_kv_shapes == ((2, 16), (2, 32), (2, 16))



def test_a_null_global_head_dim_gives_the_full_layers_the_sliding_ones_width():
    """mlx-lm's reading of null (left out, it is transformers' 512)."""
    assert config(head_dim=16, global_head_dim=None).extra["gemma4"].layer_shapes[2] == (2, 16)
    assert config(head_dim=16, global_head_dim=64).extra["gemma4"].layer_shapes[2] == (2, 64)

@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_bidirectional_attention": "all"}, "gemma4 with bidirectional attention is not supported"),
        ({"hidden_activation": "silu"}, "gemma4 hidden_activation 'silu' is not supported"),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers (6) must be in 0..5"),
        ({"num_kv_shared_layers": 4}, "KV-shared layer 2 is full, and no earlier full layer stores K/V"),
        ({"attention_k_eq_v": True, "num_global_key_value_heads": 3},
         "num_attention_heads (4) is not a multiple of num_global_key_value_heads (3)"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
         "rope_parameters.full_attention: unsupported rope_type 'yarn'"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "proportional"}}},
         "rope_parameters.sliding_attention: unsupported rope_type 'proportional'"),
        ({"enable_moe_block": True, "num_experts": 2, "top_k_experts": 3, "moe_intermediate_size": 8},
         "top_k_experts (3) must be in 1..num_experts (2)"),
        ({"attention_bias": True}, "gemma4 with attention_bias is not supported"),
        ({"rope_parameters": {"full_attention": "proportional"}}, "rope_parameters.full_attention should be an object"),
        # A share above 1 would rotate more pairs than a head has.
        ({"rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.5}}},
         "rope_parameters.full_attention: rope_theta, partial_rotary_factor and factor must be positive"),
    ],
)
def test_gemma4_settings_it_cannot_run_are_one_line_errors(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config(**fields)


def test_multimodal_layout_skips_the_vision_and_audio_towers(tmp_path: Path):
    path = gemma4(tmp_path, "E4B", "gemma4")
    weights = load_file(path / "model.safetensors")
    weights["audio_tower.conv.weight"] = weights["vision_tower.vision_model.post_layernorm.weight"]
    weights["embed_audio.embedding_projection.weight"] = weights["vision_tower.vision_model.post_layernorm.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert mx.allclose(load_model(path).model(TOKENS), mlx_lm.load(str(path))[0](TOKENS), atol=5e-4).item()


def test_shared_layers_kv_projections_in_a_checkpoint_are_dropped(tmp_path: Path):
    """transformers ignores them (`_keys_to_ignore_on_load_unexpected`), and so does mlx-lm."""
    path = gemma4(tmp_path, "E4B")
    want = load_model(path).model(TOKENS)
    weights = load_file(path / "model.safetensors")
    for layer in (4, 5):
        for name in ("k_proj", "v_proj"):
            weights[f"model.layers.{layer}.self_attn.{name}.weight"] = np.ones((32, 64), np.float32)
        weights[f"model.layers.{layer}.self_attn.k_norm.weight"] = np.ones((16,), np.float32)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones((8,), np.float32)
    weights["model.layers.0.self_attn.rotary_emb.cos_cached"] = np.ones((4, 16), np.float32)  # a table some exports keep
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert mx.array_equal(load_model(path).model(TOKENS), want).item()


def test_the_last_layer_run_for_the_sampling_tokens_alone_is_the_full_forward_there(tmp_path: Path):
    """The engine keeps only each row's sampling token past the last attention: their
    per-layer inputs must be theirs."""
    model = load_model(gemma4(tmp_path, "E4B")).model
    keep = mx.array([3, 17], mx.int32)
    assert mx.allclose(model.hidden(TOKENS, None, keep), model.hidden(TOKENS)[:, keep], atol=1e-5).item()


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_full_layers_wider_than_the_kernels_prefill_tile_keep_greedy_parity(tmp_path: Path, monkeypatch, path):
    """The releases' full layers have heads of 512: past the CPU kernel's 256-wide prefill
    tiles, which take such heads token by token (here 288, and 144 on sliding layers)."""
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", path)
    checkpoint = gemma4(tmp_path, "31B", head_dim=144)
    assert load_model(checkpoint).config.extra["gemma4"].layer_shapes[2] == (1, 288)
    assert greedy(load_model(checkpoint), PROMPT, 12) == mlx_lm_greedy(checkpoint, PROMPT, 12)
