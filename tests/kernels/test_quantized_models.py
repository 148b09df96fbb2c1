"""Quantized checkpoints served through the CPU kernels: greedy parity with mlx-lm for
every family, the fallback's tokens, and the load-time quantization of 16-bit weights."""

import importlib.util

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from kernels import cpu_extension as loader
from kernels.quantized_linear import KernelQuantizedEmbedding, KernelQuantizedLinear

IS_BUILT = importlib.util.find_spec("kernels._cpu_ext") is not None
PROMPT = [11, 305, 42, 977, 5, 1203, 64, 88, 300, 7, 1500, 19]
NEW_TOKENS = 24
FAMILIES = {
    "llama": dict(tie_word_embeddings=True),
    "mistral": dict(),
    "ministral3": dict(),  # queries scaled past its original context (16 here)
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32),
    "phi3": dict(),  # q/k/v and gate/up stored fused, split at load
    # Routed experts (their gathered matmuls are mlx's), a dense MLP in the middle layer.
    "qwen3_moe": dict(head_dim=32, num_layers=3, dense_layers=(1,)),
    "mixtral": dict(num_experts=6),
    "qwen2_moe": dict(),  # a shared expert beside the routed ones
    # Attention sinks, biased clamped experts, a window of 8 on every other layer.
    "gpt_oss": dict(num_layers=4, sliding_window=8),
    # Soft-capped scores and logits (mlx-lm runs no windows for it: the window is past the test's tokens).
    "gemma2": dict(head_dim=32, num_layers=4, num_kv_heads=1, sliding_window=4096),
    # Sliding-window layers (window 8) beside global ones, as tests/runtime/test_gemma3_paged.py.
    "gemma3_text": dict(head_dim=32, num_layers=4, num_kv_heads=1, sliding_window=8),
    # Every variant's part: keys as values on the full layers (1 and 3, heads of 64),
    # per-layer inputs, layers 2 and 3 reading 0's and 1's K/V, routed GeGLU experts.
    "gemma4_text": dict(
        head_dim=32, num_layers=4, sliding_window=8, sliding_window_pattern=2, tie_word_embeddings=True,
        gemma4={"attention_k_eq_v": True, "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 64,
                "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "enable_moe_block": True},
    ),
    "smollm3": dict(num_layers=4),  # its fourth layer without RoPE
    "granite": dict(),  # its multipliers, its layers off the one-op blocks
    "olmo2": dict(),  # norms after each block and over each whole q and k projection
    "olmo3": dict(num_layers=4, sliding_window=8),  # OLMo 2's layer, three in four sliding
    "glm4": dict(head_dim=32),  # half of each head rotated in interleaved pairs; gate_up stored fused
    # Mamba2 layers (their in_proj and out_proj on the kernels) beside attention, routed and shared MLPs.
    "granitemoehybrid": dict(num_layers=4),
    "granitemoe": dict(num_layers=3),  # Granite 3 MoE: the multipliers, routed experts alone
    "deepseek_v2": dict(num_layers=3),  # MLA, a float router beside routed and shared experts
    "deepseek_v3": dict(num_layers=3),  # mlx-lm's split kv_b_proj (embed_q, unembed_out), joined at load
    "glm4_moe_lite": dict(num_layers=3),  # deepseek_v3's layout, its latent norms at rms_norm_eps
    "nemotron_h": dict(num_layers=5, nemotron={"hybrid_override_pattern": "MEM*E"}),
    # Attention and Mamba2 side by side, their multipliers folded in. In mlx-lm's form: an
    # original's keys are scaled by key_multiplier, which mlx-lm leaves out (test_falcon_h1).
    "falcon_h1": dict(num_layers=3, hf_original=False),
    "glm4_moe": dict(num_layers=3),  # GQA with qk norm and half of each head rotated, V3's router
    "cohere": dict(),
    "cohere2": dict(num_layers=4, sliding_window=8),
    "exaone4": dict(num_layers=4, sliding_window=8),  # OLMo 2's layer, per-head q/k norms, NoPE full layer
    "ernie4_5": dict(tie_word_embeddings=True),  # llama's with interleaved RoPE
    "seed_oss": dict(),  # q/k/v biased, o not
    "apertus": dict(),  # an ungated xIELU MLP
    "olmoe": dict(),  # routed experts, whole-projection q/k norms
    "stablelm": dict(),  # biased LayerNorms, a quarter of each head rotated
    "phi": dict(),  # biased everywhere, an ungated GELU MLP, side by side
    "hunyuan_v1_dense": dict(),  # q/k norms after RoPE, its NTK alpha
    "internlm3": dict(),
}
SHAPE = dict(hidden_size=128, intermediate_size=256)


def greedy(loaded, prompt=PROMPT, n=NEW_TOKENS):
    engine = Engine(loaded, max_batch=2)
    pool = BlockPool(
        engine.kv.num_blocks, engine.kv.block_size, is_caching=True, layout=engine.kv.layout
    )
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context, 256, 512, 0)
    params = SequenceParams(prompt_tokens=tuple(prompt), max_tokens=n, ignore_eos=True)
    return list(run_offline(engine, policy, {"a": params})["a"].tokens)


def mlx_lm_greedy(path, prompt=PROMPT, n=NEW_TOKENS):
    model, _ = mlx_lm.load(str(path))
    return [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def kernel_layers(model):
    leaves = [m for _, m in nn.utils.tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)]
    return [m for m in leaves if isinstance(m, (KernelQuantizedLinear, KernelQuantizedEmbedding))]


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setitem(loader._state, "module", None)
    monkeypatch.setitem(loader._state, "status", "CPU kernels off for the test")


@pytest.mark.skipif(not IS_BUILT, reason="the C++ kernels were not built here")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_with_mlx_lm_through_the_kernels(make_checkpoint, family, bits):
    path = make_checkpoint(family, quantize=(64, bits), **SHAPE, **FAMILIES[family])
    loaded = load_model(path)
    assert kernel_layers(loaded.model), "quantized layers should run on cadence's kernels"
    ext = loader.cpu_extension()
    before = ext.num_kernel_calls()
    ours = greedy(loaded)
    assert ext.num_kernel_calls() > before
    assert ours == mlx_lm_greedy(path)
    assert len(set(ours)) > 4, "the test model should not be degenerate"


@pytest.mark.skipif(not IS_BUILT, reason="the C++ kernels were not built here")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_mlx_lm_through_the_kernels(make_checkpoint, family, bits):
    path = make_checkpoint(family, quantize=(64, bits), **SHAPE, **FAMILIES[family])
    loaded = load_model(path)
    assert kernel_layers(loaded.model)
    peer, _ = mlx_lm.load(str(path))
    tokens = mx.array([PROMPT])
    ours, theirs = loaded.model(tokens), peer(tokens)
    assert mx.allclose(ours, theirs, atol=2e-3 * mx.abs(theirs).max().item()).item()


@pytest.mark.skipif(not IS_BUILT, reason="the C++ kernels were not built here")
def test_mixed_steps_prefix_reuse_and_lookahead_keep_parity_on_quantized_weights(make_checkpoint):
    """Batched decode beside chunked prefill (row counts on both sides of the sgemm switch),
    a shared prefix served from the cache, and two steps of lookahead."""
    path = make_checkpoint("qwen2", quantize=(64, 4), **SHAPE, tie_word_embeddings=True)
    engine = Engine(load_model(path), max_batch=4, block_size=4)
    long_prompt = (PROMPT * 5)[:50]
    requests = {
        "a": SequenceParams(prompt_tokens=tuple(PROMPT[:3]), max_tokens=16, ignore_eos=True),
        "b": SequenceParams(prompt_tokens=tuple(PROMPT[3:9]), max_tokens=16, ignore_eos=True),
        "long": SequenceParams(prompt_tokens=tuple(long_prompt), max_tokens=12, ignore_eos=True),
        "shared": SequenceParams(
            prompt_tokens=tuple(long_prompt[:40] + [77, 78]), max_tokens=12, ignore_eos=True
        ),
    }
    pool = BlockPool(
        engine.kv.num_blocks, engine.kv.block_size, is_caching=True, layout=engine.kv.layout
    )
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context, 40, 44, 0)
    step_sizes = []
    got = run_offline(
        engine, policy, requests, lookahead=2,
        on_step=lambda plan: step_sizes.append(sum(s.num_new for s in plan.spans)),
    )
    assert max(step_sizes) >= 32 > min(step_sizes)  # both kernel paths ran
    assert got["shared"].num_cached_tokens > 0  # its prefix came from the cache
    for request_id, request in requests.items():
        want = mlx_lm_greedy(path, list(request.prompt_tokens), request.max_tokens)
        assert list(got[request_id].tokens) == want, request_id


def test_the_fallback_expands_to_float32_and_gives_the_same_tokens(make_checkpoint, kernels_off):
    path = make_checkpoint("llama", quantize=(64, 4), **SHAPE, tie_word_embeddings=True)
    loaded = load_model(path)
    assert not kernel_layers(loaded.model)
    assert loaded.model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    assert greedy(loaded) == mlx_lm_greedy(path)


def test_the_start_up_log_names_each_layer_kind_and_the_kernel_status(make_checkpoint):
    path = make_checkpoint("llama", quantize=(64, 4), **SHAPE, tie_word_embeddings=True)
    lines = []
    load_model(path, on_progress=lines.append)
    assert loader.kernel_status() in lines
    weights = next(line for line in lines if line.startswith("weights:"))
    path_name = "cadence kernel" if IS_BUILT else "float32 (matmul)"
    assert "linear" in weights and "embedding" in weights and path_name in weights


@pytest.mark.skipif(not IS_BUILT, reason="the C++ kernels were not built here")
@pytest.mark.parametrize("bits", [8, 4])
def test_a_16_bit_checkpoint_can_be_quantized_at_load(make_checkpoint, bits):
    path = make_checkpoint("qwen2", dtype="bfloat16", **SHAPE)
    full = load_model(path)
    quantized = load_model(path, cpu_quantize=str(bits))
    layers = kernel_layers(quantized.model)
    assert layers and all(layer.bits == bits for layer in layers)
    assert not kernel_layers(full.model)  # the default keeps float32
    tokens = mx.array([PROMPT])
    error = mx.abs(quantized.model(tokens) - full.model(tokens)).max().item()
    scale = mx.abs(full.model(tokens)).max().item()
    assert error < (0.05 if bits == 8 else 0.5) * scale


def test_an_unknown_cpu_quantize_value_is_refused(make_checkpoint):
    with pytest.raises(ValueError, match="cpu_quantize"):
        load_model(make_checkpoint("llama"), cpu_quantize="2")


# mlx's microscaling modes (mlx-lm's `--q-mode`), each at its group size and bits: one
# scale per group and no biases, so not the kernels' layout.
MICROSCALING = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


@pytest.mark.parametrize("keep_dtype", [False, True], ids=["float32", "kept"])
@pytest.mark.parametrize("mode", MICROSCALING)
def test_microscaling_checkpoints_keep_greedy_parity_with_mlx_lm(make_checkpoint, mode, keep_dtype):
    """Expanded to float32 (the CPU default), or, for mxfp4, run packed by cadence's
    kernels, or kept packed for mlx, as a model too large for float32 is, the tokens are
    mlx-lm's."""
    path = make_checkpoint(
        "llama", quantize=MICROSCALING[mode], quantize_mode=mode, **SHAPE, tie_word_embeddings=True
    )
    loaded = load_model(path, keep_dtype=keep_dtype)
    leaves = nn.utils.tree_flatten(loaded.model.leaf_modules(), is_leaf=nn.Module.is_module)
    packed = [m for _, m in leaves if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    on_kernels = [m for m in packed if isinstance(m, KernelQuantizedLinear)]
    if keep_dtype:  # 2 layers x 7 projections, and the embedding (the tied head)
        assert len(packed) == 15 and all(m.mode == mode for m in packed) and not on_kernels
    elif mode == "mxfp4" and IS_BUILT:  # the layers stacked (qkv, gate_up), the embedding mlx's
        assert len(on_kernels) == 2 * 4 and all(m.mode == "mxfp4" for m in on_kernels)
        assert len(packed) == len(on_kernels) + 1
    else:
        assert not packed
    calls = loader.cpu_extension().num_kernel_calls() if IS_BUILT else 0
    ours = greedy(loaded)
    if on_kernels:
        assert loader.cpu_extension().num_kernel_calls() > calls
    assert ours == mlx_lm_greedy(path)
    assert len(set(ours)) > 4, "the test model should not be degenerate"


# Not Gemma 4 in mxfp4: mlx's lookup of an mxfp4 embedding gives bfloat16, so its
# per-layer inputs run in bfloat16 in mlx-lm and here alike, and mlx's CPU mxfp4 matmul
# rounds them further (measured on the per-layer projection against a float64 product:
# mlx 0.0055, cadence's kernel 0.0019 at outputs of ~0.75), which every layer's gate
# carries on: the two part after a few tokens for reasons of mlx's precision, not the format.
RECIPES = [
    (family, recipe)
    for family in FAMILIES
    for recipe in ("mxfp4", "mixed_3_6")
    if (family, recipe) not in (("gemma4_text", "mxfp4"), ("phi", "mixed_3_6"))  # mlx-lm's mixed recipe needs a down_proj
]


@pytest.mark.parametrize(("family", "recipe"), RECIPES)
def test_what_mlx_lm_convert_writes_gives_its_greedy_tokens(make_checkpoint, tmp_path, family, recipe):
    """mlx-lm's own converter, as mlx-community checkpoints are made: a microscaling mode,
    and a mixed recipe (per-layer bits with a null group size). mlx-lm computes in float32
    here, as cadence does on the CPU, so that the tokens compare the formats alone."""
    source = make_checkpoint(family, **SHAPE, **FAMILIES[family])
    path = tmp_path / recipe
    options = {"q_mode": recipe} if recipe == "mxfp4" else {"quant_predicate": recipe}
    mlx_lm.convert(str(source), str(path), quantize=True, **options)
    ours = greedy(load_model(path))
    model, _ = mlx_lm.load(str(path))
    model.set_dtype(mx.float32)
    assert ours == [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=NEW_TOKENS)]
    assert len(set(ours)) > 4, "the test model should not be degenerate"
