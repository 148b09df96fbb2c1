"""Routed experts (runtime/models/experts.py) and the families built on them (gpt-oss's
own in tests/runtime/test_gpt_oss.py). Greedy and logit parity with mlx-lm through the engine and
the quantized kernels is in tests/runtime/test_engine.py and
tests/kernels/test_quantized_models.py (their family tables)."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.config import config_from_dict
from runtime.errors import CheckpointError
from runtime.models import build_model
from runtime.models.experts import Experts, QuantizedExpertLinear, RoutedExperts, stack_experts
from runtime.models.layers import GatedMLP
from runtime.synth import hf_config, make_tiny_checkpoint, save_weights

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest

from kernels import cpu_extension as loader
from kernels.expert_matmul import SORT_FROM_PAIRS
from kernels.quantized_matmul import exponent_scales
from tests.kernels.test_quantized_models import greedy

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 16, 8, 5
IS_BUILT = loader.cpu_extension() is not None


@pytest.fixture(params=["cadence-kernel", "mlx-gather"])
def expert_path(request, monkeypatch):
    """Each test twice: through cadence's expert kernel (counted) and through mlx's gathers."""
    if request.param == "mlx-gather":
        monkeypatch.setitem(loader._state, "module", None)
        yield request.param
        return
    if not IS_BUILT:
        pytest.skip("the C++ kernels were not built here")
    before = loader.cpu_extension().num_expert_calls()
    yield request.param
    assert loader.cpu_extension().num_expert_calls() > before, "the kernel did not run"


def routed_experts(
    top_k: int,
    normalize: bool,
    seed: int = 0,
    shared: int | None = None,
    biases: bool = False,
    swiglu_limit: float | None = None,
) -> RoutedExperts:
    experts = Experts(NUM_EXPERTS, top_k, INTERMEDIATE, normalize, (True,), shared, biases, swiglu_limit)
    layer = RoutedExperts(HIDDEN, experts)
    rng = np.random.default_rng(seed)
    layer.update(
        nn.utils.tree_map(
            lambda p: mx.array(
                rng.standard_normal(p.shape).astype(np.float32) / p.shape[-1] ** 0.5
            ),
            layer.parameters(),
        )
    )
    return layer


def reference(layer: RoutedExperts, x: np.ndarray, weights=None) -> np.ndarray:
    """Token by token, in NumPy: softmax over the experts, the top k, each expert's
    SwiGLU MLP weighted by its probability (divided by the k's sum if normalising)."""
    mlp = layer.switch_mlp
    weights = weights or {
        name: np.array(getattr(mlp, name).weight) for name in ("gate_proj", "up_proj", "down_proj")
    }
    router = np.array(layer.gate.weight)
    # gpt-oss's: biases on the router and on each expert's projections, a clamped SwiGLU.
    limit = mlp.swiglu_limit
    no_bias = {name: np.zeros((NUM_EXPERTS, 1)) for name in ("gate_proj", "up_proj", "down_proj")}
    bias = {name: np.array(getattr(mlp, name).bias) for name in no_bias} if "bias" in mlp.gate_proj else no_bias
    out = np.zeros_like(x)
    for n, token in enumerate(x):
        logits = router @ token + (np.array(layer.gate.bias) if "bias" in layer.gate else 0.0)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        chosen = np.argsort(-p)[: layer.top_k]
        w = p[chosen] / (p[chosen].sum() if layer.normalize else 1.0)
        for e, weight in zip(chosen, w, strict=True):
            gate = weights["gate_proj"][e] @ token + bias["gate_proj"][e]
            up = weights["up_proj"][e] @ token + bias["up_proj"][e]
            if limit is None:
                hidden = gate / (1 + np.exp(-gate)) * up
            else:
                gate = np.minimum(gate, limit)
                hidden = (np.clip(up, -limit, limit) + 1) * gate / (1 + np.exp(-1.702 * gate))
            out[n] += weight * (weights["down_proj"][e] @ hidden + bias["down_proj"][e])
        if "shared_expert" in layer:  # qwen2_moe's: every token, gated by a sigmoid
            mlp, gate_weight = layer.shared_expert, np.array(layer.shared_expert_gate.weight)
            gate, up = np.array(mlp.gate_proj.weight) @ token, np.array(mlp.up_proj.weight) @ token
            shared = np.array(mlp.down_proj.weight) @ (gate / (1 + np.exp(-gate)) * up)
            out[n] += shared / (1 + np.exp(-(gate_weight @ token)))
    return out


@pytest.mark.parametrize(
    ("normalize", "shared", "gpt_oss"),
    [(True, None, False), (False, None, False), (False, 12, False), (True, None, True)],
    ids=["normalised", "raw-probabilities", "shared-expert", "gpt-oss"],
)
@pytest.mark.parametrize("num_tokens", [3, 40], ids=["unsorted", "sorted-by-expert"])
def test_routed_experts_match_a_token_by_token_reference(
    num_tokens, normalize, shared, gpt_oss, expert_path
):
    """gpt-oss's clamp at 0.3 binds on some of these activations, not on all."""
    layer = routed_experts(
        top_k=2, normalize=normalize, shared=shared, biases=gpt_oss, swiglu_limit=0.3 if gpt_oss else None
    )
    assert (num_tokens * 2 >= SORT_FROM_PAIRS) == (num_tokens == 40)  # mlx's sorted path too
    x = np.random.default_rng(1).standard_normal((num_tokens, HIDDEN)).astype(np.float32)
    got = np.array(layer(mx.array(x)[None]))[0]
    np.testing.assert_allclose(got, reference(layer, x), rtol=1e-4, atol=1e-5)


def test_a_token_routes_alike_alone_and_among_many(expert_path):
    """The sorted path (a prompt chunk) gives each token what it gets alone (a decode step)."""
    layer = routed_experts(top_k=3, normalize=True)
    x = mx.array(np.random.default_rng(2).standard_normal((1, 50, HIDDEN)).astype(np.float32))
    together = layer(x)
    for n in (0, 17, 49):
        assert mx.array_equal(layer(x[:, n : n + 1])[0, 0], together[0, n]).item(), n


@pytest.mark.parametrize(
    ("mode", "bits", "expert_path"),
    [
        ("affine", 4, "cadence-kernel"),
        ("affine", 8, "cadence-kernel"),
        ("affine", 4, "mlx-gather"),
        ("mxfp4", 4, "mlx-gather"),
        ("mxfp4", 4, "cadence-kernel"),  # its exponents as the float32 scales the CPU load makes
    ],
    indirect=["expert_path"],
)
def test_quantized_experts_multiply_by_their_dequantized_weights(mode, bits, expert_path):
    group_size = 32
    # mxfp4's groups are 32 wide: give every projection 32 inputs.
    layer = RoutedExperts(32, Experts(NUM_EXPERTS, 2, 32, True, (True,)))
    rng = np.random.default_rng(3)
    layer.update(
        nn.utils.tree_map(
            lambda p: mx.array(rng.standard_normal(p.shape).astype(np.float32) * 0.2),
            layer.parameters(),
        )
    )
    nn.quantize(
        layer,
        group_size=group_size,
        bits=bits,
        mode=mode,
        class_predicate=lambda path, m: path.startswith("switch_mlp"),
    )
    assert isinstance(layer.switch_mlp.gate_proj, QuantizedExpertLinear)
    assert ("biases" in layer.switch_mlp.gate_proj) == (mode == "affine")
    weights = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        q = getattr(layer.switch_mlp, name)
        weights[name] = np.array(
            mx.dequantize(
                q.weight, q.scales, q.get("biases"), group_size=group_size, bits=bits, mode=mode
            ).astype(mx.float32)
        )
    if mode == "mxfp4" and expert_path == "cadence-kernel":
        for name in ("gate_proj", "up_proj", "down_proj"):
            projection = getattr(layer.switch_mlp, name)
            projection.scales = exponent_scales(projection.scales)
    x = rng.standard_normal((40, 32)).astype(np.float32)
    for rows in (x[:3], x):  # the row kernel, and the panel tiles (8+ pairs an expert)
        got = np.array(layer(mx.array(rows)[None]))[0]
        np.testing.assert_allclose(got, reference(layer, rows, weights), rtol=1e-3, atol=1e-4)


def moe_raw(family: str) -> dict:
    """A four-layer config.json of `family`, four experts of 128, two a token."""
    return hf_config(
        family,
        vocab_size=300,
        eos_token_id=[1],
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )


def moe_config(family: str, **fields):
    return config_from_dict({**moe_raw(family), **fields})



def test_packed_experts_read_their_group_size_and_bits_from_the_packing():
    """None asks for the mode's defaults (mx.quantize's): affine's 64 and 4, mxfp4's 32 and 4,
    mxfp8's 32 and 8."""
    weight = mx.random.normal((2, 8, 64), key=mx.random.key(0))
    defaults = {"affine": (64, 4), "mxfp4": (32, 4), "mxfp8": (32, 8)}
    cases = [((None, None, mode), want) for mode, want in defaults.items()] + [((32, 8, "affine"), (32, 8))]
    for args, want in cases:
        layer = QuantizedExpertLinear(weight, *args)
        assert (layer.group_size, layer.bits) == want, args

def test_qwen3_moe_runs_the_dense_mlp_where_mlp_only_layers_or_the_sparse_step_say():
    config = moe_config(
        "qwen3_moe", mlp_only_layers=[2], decoder_sparse_step=2, moe_intermediate_size=32
    )
    layers = build_model(config).model.layers
    kinds = [type(layer.mlp) for layer in layers]
    # Layer i is sparse when (i + 1) is a multiple of 2 and it is not listed dense.
    assert kinds == [GatedMLP, RoutedExperts, GatedMLP, RoutedExperts]
    assert layers[0].mlp.gate_proj.weight.shape == (128, 64)  # intermediate_size
    assert layers[1].mlp.switch_mlp.gate_proj.weight.shape == (4, 32, 64)  # moe_intermediate_size
    assert layers[1].mlp.top_k == 2 and layers[1].mlp.normalize


def test_qwen3_moe_normalises_only_when_norm_topk_prob_says_so_and_mixtral_always():
    assert not moe_config("qwen3_moe", norm_topk_prob=False).extra["experts"].normalize
    assert moe_config("qwen3_moe", norm_topk_prob=True).extra["experts"].normalize
    raw = moe_raw("qwen3_moe")
    del raw["norm_topk_prob"]  # transformers' default: false
    assert not config_from_dict(raw).extra["experts"].normalize
    assert moe_config("mixtral").extra["experts"].normalize


def test_a_token_may_route_to_every_expert(expert_path):
    """top_k equal to the number of experts is a valid (if dense) routing, not an error."""
    assert moe_config("qwen3_moe", num_experts_per_tok=4).extra["experts"].top_k == 4
    layer = routed_experts(top_k=NUM_EXPERTS, normalize=True)
    x = np.random.default_rng(4).standard_normal((3, HIDDEN)).astype(np.float32)
    got = np.array(layer(mx.array(x)[None]))[0]
    np.testing.assert_allclose(got, reference(layer, x), rtol=1e-4, atol=1e-5)


def test_the_sparse_step_counts_layers_from_one():
    """transformers' rule: layer i is sparse when (i + 1) is a multiple of the step."""
    experts = moe_config("qwen3_moe", decoder_sparse_step=3).extra["experts"]
    assert experts.sparse_layers == (False, False, True, False)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_every_layer_routes_experts_where_the_config_names_no_dense_ones(family):
    """A config.json without decoder_sparse_step or mlp_only_layers (transformers'
    defaults: 1 and [])."""
    raw = moe_raw(family)
    del raw["decoder_sparse_step"], raw["mlp_only_layers"]
    assert config_from_dict(raw).extra["experts"].sparse_layers == (True,) * 4


def test_mlp_only_layers_may_list_the_first_and_the_last_layer():
    experts = moe_config("qwen3_moe", mlp_only_layers=[0, 3]).extra["experts"]
    assert experts.sparse_layers == (False, True, True, False)


@pytest.mark.parametrize(
    ("family", "fields", "message"),
    [
        (
            "qwen3_moe",
            {"num_experts_per_tok": 5},
            "num_experts_per_tok (5) is more than the 4 experts",
        ),
        (
            "mixtral",
            {"num_experts_per_tok": 9},
            "num_experts_per_tok (9) is more than the 4 experts",
        ),
        ("qwen3_moe", {"num_experts": None}, "missing required field 'num_experts'"),
        ("mixtral", {"num_local_experts": 0}, "field 'num_local_experts' must be positive, got 0"),
        (
            "qwen3_moe",
            {"moe_intermediate_size": "8"},
            "field 'moe_intermediate_size' should be int",
        ),
        (
            "qwen3_moe",
            {"mlp_only_layers": [4]},
            "mlp_only_layers must list layer numbers in 0..3, got [4]",
        ),
        (
            "qwen3_moe",
            {"mlp_only_layers": [True]},
            "mlp_only_layers must list layer numbers in 0..3",
        ),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "field 'decoder_sparse_step' must be positive"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            "qwen2_moe",
            {"shared_expert_intermediate_size": None},
            "missing required field 'shared_expert_intermediate_size'",
        ),
        (
            "qwen2_moe",
            {"mlp_only_layers": [-1]},
            "mlp_only_layers must list layer numbers in 0..3, got [-1]",
        ),
    ],
    ids=[
        "top-k",
        "mixtral-top-k",
        "no-experts",
        "zero-experts",
        "size-type",
        "dense-range",
        "dense-bool",
        "step",
        "activation",
        "no-shared",
        "qwen2-dense-range",
    ],
)
def test_expert_settings_it_cannot_run_are_one_line_errors(family, fields, message):
    raw = {**moe_raw(family), **fields}
    raw = {k: v for k, v in raw.items() if v is not None or k not in fields}  # None: left out
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_dict(raw)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_missing_or_misshapen_expert_is_named(tmp_path: Path, family):
    path = make_tiny_checkpoint(tmp_path / "source", family)
    weights = mx.load(str(path / "model.safetensors"))
    block = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    down = "down_proj" if family == "qwen3_moe" else "w2"
    missing = f"model.layers.1.{block}.experts.3.{down}.weight"
    del weights[missing]
    save_weights(path, weights)
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"missing tensor '{missing}' (config.json names 4 experts)"),
    ):
        load_model(path)
    weights[missing] = weights[f"model.layers.1.{block}.experts.2.{down}.weight"][:, :-1]
    save_weights(path, weights)
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"tensors 'model.layers.1.{block}.experts.*.{down}.weight' differ in shape"
        ),
    ):
        load_model(path)


def test_stacking_names_a_missing_expert_whichever_it_is():
    """Expert 0 present, expert 1 missing: named, not left unstacked."""
    experts = Experts(4, 2, 8, True, (True,))
    weights = {
        f"model.layers.0.mlp.experts.{e}.{name}.weight": mx.zeros((8, 16))
        for e in (0, 2, 3)
        for name in ("gate_proj", "up_proj", "down_proj")
    }
    with pytest.raises(
        CheckpointError,
        match=re.escape("missing tensor 'model.layers.0.mlp.experts.1.gate_proj.weight'"),
    ):
        stack_experts(
            weights,
            experts,
            layer_prefix="model.layers.{layer}.mlp",
            names={name: name for name in ("gate_proj", "up_proj", "down_proj")},
        )


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_float_experts_stored_stacked_load_as_those_stored_per_expert(tmp_path: Path, family):
    """mlx-lm's float conversions (and mlx-community's bf16 ones) store the experts
    stacked in `switch_mlp`, Mixtral's under `block_sparse_moe`."""
    per_expert = make_tiny_checkpoint(tmp_path / "hf", family)
    model, _ = mlx_lm.load(str(per_expert))
    stacked = tmp_path / "stacked"
    mlx_lm.convert(str(per_expert), str(stacked))  # no quantization: the layout alone
    names = set(mx.load(str(stacked / "model.safetensors")))
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    assert f"model.layers.0.{block}.switch_mlp.gate_proj.weight" in names
    prompt = list(range(3, 30))
    assert greedy(load_model(stacked), prompt, 12) == greedy(load_model(per_expert), prompt, 12)
