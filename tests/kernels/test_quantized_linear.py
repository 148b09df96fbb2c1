"""kernels/quantized_linear.py: mlx's quantized layers, adopted to compute through the kernels."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from kernels.quantized_linear import KernelQuantizedEmbedding, KernelQuantizedLinear
from kernels.quantized_matmul import reference_quantized_matmul

X = mx.random.normal((3, 64), key=mx.random.key(0))


def with_bfloat16_scales(layer):
    """As mlx-lm's converter writes a bfloat16 model's scales and biases."""
    layer.update({name: layer[name].astype(mx.bfloat16) for name in ("scales", "biases")})
    return layer


def reference(layer):
    scales, biases = layer.scales.astype(mx.float32), layer.biases.astype(mx.float32)
    return reference_quantized_matmul(X, layer.weight, scales, biases, 32, 4)


def test_adopted_layers_hold_float32_scales_and_biases_and_compute_the_same():
    linear = with_bfloat16_scales(nn.QuantizedLinear(64, 24, bias=True, group_size=32, bits=4))
    linear.bias = mx.random.normal((24,), key=mx.random.key(1))
    adopted = KernelQuantizedLinear.adopt(linear)
    assert adopted.scales.dtype == adopted.biases.dtype == mx.float32
    assert mx.allclose(adopted(X), reference(linear) + linear.bias, rtol=1e-4, atol=1e-4).item()
    embedding = with_bfloat16_scales(nn.QuantizedEmbedding(24, 64, group_size=32, bits=4))
    head = KernelQuantizedEmbedding.adopt(embedding)
    assert head.scales.dtype == head.biases.dtype == mx.float32
    assert mx.allclose(head.as_linear(X), reference(embedding), rtol=1e-4, atol=1e-4).item()


def test_an_mxfp4_layer_is_adopted_with_its_exponents_as_scales_and_an_affine_one_needs_biases():
    layer = nn.QuantizedLinear(64, 24, group_size=32, bits=4, mode="mxfp4")
    adopted = KernelQuantizedLinear.adopt(layer)
    assert "biases" not in adopted and adopted.scales.dtype == mx.float32 and adopted.mode == "mxfp4"
    dense = mx.dequantize(layer.weight, layer.scales, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    assert mx.allclose(adopted(X), X @ dense.T, rtol=1e-4, atol=1e-4).item()
    affine = nn.QuantizedLinear(64, 24, group_size=32, bits=4)
    affine.pop("biases")
    with pytest.raises(ValueError, match="without biases"):
        KernelQuantizedLinear.adopt(affine)
