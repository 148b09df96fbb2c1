"""mlx's QuantizedLinear and QuantizedEmbedding, computing through `quantized_matmul`.

Same parameters and names as mlx's (weights load and save unchanged); only the matmul
differs, so on the CPU it runs cadence's kernels. Scales and biases are held in float32,
converted once at load instead of on every call: at 4 bits and group 64 that is 5 bits
a weight instead of 4.5 (11% more bytes streamed per token).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels.quantized_matmul import exponent_scales, quantized_matmul


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose matmul is `kernels.quantized_matmul`."""

    @classmethod
    def adopt(cls, layer: nn.QuantizedLinear) -> KernelQuantizedLinear:
        """The same layer, its arrays shared (scales and biases as float32)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.group_size, new.bits, new.mode = layer.group_size, layer.bits, layer.mode
        new.weight = mx.contiguous(layer.weight)
        if layer.mode == "mxfp4":  # no biases: the exponents as the scales they stand for
            new.scales = exponent_scales(layer.scales)
        else:
            new.scales = _float32(layer.scales)
            new.biases = _float32(layer.get("biases"))
        if "bias" in layer:
            new.bias = layer.bias
        new.freeze()
        return new

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(
            x, self.weight, self.scales, self.get("biases"), self.group_size, self.bits, self.mode
        )
        return y + self.bias if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (a tied output head) is the kernel's matmul."""

    @classmethod
    def adopt(cls, layer: nn.QuantizedEmbedding) -> KernelQuantizedEmbedding:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.group_size, new.bits, new.mode = layer.group_size, layer.bits, layer.mode
        new.num_embeddings, new.dims = layer.num_embeddings, layer.dims
        new.weight = mx.contiguous(layer.weight)
        new.scales = _float32(layer.scales)
        new.biases = _float32(layer.get("biases"))
        new.freeze()
        return new

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(x, self.weight, self.scales, self["biases"], self.group_size, self.bits)


def _float32(a: mx.array | None) -> mx.array:
    if a is None:  # only affine layers are adopted, and they always have biases
        raise ValueError("an affine quantized layer without biases")
    return mx.contiguous(a.astype(mx.float32))
