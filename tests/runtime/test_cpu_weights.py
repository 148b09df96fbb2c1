"""runtime/cpu_weights.py: stacking the layers that read one input (q, k, v; gate, up)."""

from runtime import cpu_weights
from runtime.checkpoint import load_model

import mlx.core as mx
import mlx.nn as nn
import pytest

from kernels.dense_matmul import KernelLinear
from kernels.quantized_linear import KernelQuantizedLinear
from tests.kernels.test_quantized_matmul import needs_kernels
from tests.kernels.test_quantized_models import PROMPT, SHAPE


def quantized_layer(n, k, bits=4, group=64, bias=False, seed=0):
    linear = nn.Linear(k, n, bias=bias)
    linear.weight = mx.random.normal((n, k), key=mx.random.key(seed))
    if bias:
        linear.bias = mx.random.normal((n,), key=mx.random.key(seed + 100))
    return KernelQuantizedLinear.adopt(nn.QuantizedLinear.from_linear(linear, group, bits))


def dense_layer(n, k, seed=0):
    linear = nn.Linear(k, n)
    linear.weight = mx.random.normal((n, k), key=mx.random.key(seed))
    return KernelLinear.adopt(linear)


@needs_kernels
@pytest.mark.parametrize("kind", ["quantized", "quantized with biases", "dense"])
@pytest.mark.parametrize("rows", [1, 3, 40])  # the row kernel, and the sgemm past 32 rows
def test_a_stacked_layer_computes_its_layers_side_by_side(kind, rows):
    if kind == "dense":
        layers = [dense_layer(n, 128, seed=i) for i, n in enumerate((64, 32, 32))]
    else:
        bias = kind.endswith("biases")
        layers = [quantized_layer(n, 128, bias=bias, seed=i) for i, n in enumerate((64, 32, 32))]
    stacked = cpu_weights.stack_rows(layers)
    assert type(stacked) is type(layers[0])
    x = mx.random.normal((rows, 128), key=mx.random.key(9))
    want = mx.concatenate([layer(x) for layer in layers], axis=-1)
    assert mx.allclose(stacked(x), want, rtol=1e-5, atol=1e-5).item()


@needs_kernels
def test_layers_that_differ_are_not_stacked():
    q4, q8 = quantized_layer(64, 128), quantized_layer(64, 128, bits=8)
    assert cpu_weights.stack_rows([q4, q8]) is None  # another layout
    assert cpu_weights.stack_rows([q4, quantized_layer(64, 128, bias=True)]) is None
    assert cpu_weights.stack_rows([dense_layer(64, 128), q4]) is None
    plain = nn.Linear(128, 64)  # not adopted by the kernels: left as it is
    assert cpu_weights.stack_rows([plain, plain]) is None


@needs_kernels
@pytest.mark.parametrize(
    ("family", "extra"),
    [("qwen2", dict(quantize=(64, 4))), ("gemma3_text", dict(head_dim=32, num_layers=2)), ("llama", {})],
)
def test_loading_stacks_every_layer_and_the_logits_stay_the_same(make_checkpoint, monkeypatch, family, extra):
    """qwen2 has q/k/v biases; gemma3 norms q and k per head after the split; llama is float32."""
    path = make_checkpoint(family, **SHAPE, **extra)
    stacked = load_model(path)
    for layer in stacked.model.model.layers:
        assert set(layer.self_attn.children()) >= {"qkv_proj"} and "q_proj" not in layer.self_attn
        assert "gate_up_proj" in layer.mlp and "up_proj" not in layer.mlp
    assert "q_proj" in load_model(path, keep_dtype=True).model.model.layers[0].self_attn
    monkeypatch.setattr(cpu_weights, "_stack_projections", lambda model: None)
    separate = load_model(path)
    assert "q_proj" in separate.model.model.layers[0].self_attn
    tokens = mx.array([PROMPT])
    want = separate.model(tokens)
    assert mx.allclose(stacked.model(tokens), want, rtol=1e-4, atol=1e-4 * mx.abs(want).max().item()).item()
