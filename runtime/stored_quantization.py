"""Quantize a freshly built model the way an MLX-quantized checkpoint stored each layer.

config.json's `quantization` gives a default and names the layers that differ, but a
layer it does not name may differ too (an 8-bit lm_head or a 6-bit down_proj in a
4-bit checkpoint). As mlx-lm (`utils.infer_quant_config`), such a layer's packing is
read from its tensors: the group size from how many groups its scales hold, the bits
from how many uint32 words its packed rows take, and the mode from the scales' dtype
(affine keeps them in a float dtype, the microscaling modes in uint8, each at one
bits and group size).
"""

from __future__ import annotations

from runtime.config import Quantization
from runtime.errors import CheckpointError

import mlx.core as mx
import mlx.nn as nn

# (bits, group_size) -> the one microscaling mode stored so (scales in uint8).
MICROSCALING_MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}

Packing = dict[str, int | str | None]  # nn.quantize's per-layer {group_size, bits, mode}


def quantize_as_stored(
    model: nn.Module, quantization: Quantization, weights: dict[str, mx.array], source: str
) -> None:
    """Replace each layer stored packed (it has `.scales`) by its quantized form, in place."""
    last_quantized = [""]  # the layer mlx is quantizing, for its error
    # ... and how its packing was read from its tensors: over a wrong config.json size
    # that read gives a packing mlx refuses ("group size 16"), which alone hid the size.
    read_as = [""]

    def packing_of(path: str, module: nn.Module) -> bool | Packing:
        if f"{path}.scales" not in weights:
            return False  # stored unquantized (e.g. a layer the quantizer skipped)
        if f"{path}.weight" not in weights:
            return False  # named as the missing tensor it is by the shape check (was a KeyError)
        last_quantized[0], read_as[0] = path, ""
        if path in quantization.per_layer:
            group_size, bits, mode = quantization.per_layer[path]
            return {"group_size": group_size, "bits": bits, "mode": mode}
        packing = stored_packing(path, module, weights, source)
        read_as[0] = (
            f" (read from its tensors as {packing['bits']} bits in groups of {packing['group_size']}"
            f" over the {module.weight.shape[-1]} inputs the config gives it)"
        )
        return packing

    try:
        nn.quantize(
            model,
            group_size=quantization.group_size,
            bits=quantization.bits,
            mode=quantization.mode,
            class_predicate=packing_of,
        )
    except ValueError as error:  # bits or a group size mlx has no kernel for
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{source}: layer '{last_quantized[0]}': {reason}{read_as[0]}") from None


def stored_packing(path: str, module: nn.Module, weights: dict[str, mx.array], source: str) -> Packing:
    """The group size, bits and mode `path`'s packed weight and scales were stored with.

    `module` is still unquantized: its weight's last dimension is the layer's inputs
    (a Linear's [out, in], an Embedding's [vocab, hidden]).
    """
    num_inputs = module.weight.shape[-1]
    packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
    num_words = packed.shape[-1] if packed.ndim else 0
    num_groups = scales.shape[-1] if scales.ndim else 0
    fits = num_groups > 0 and num_inputs % num_groups == 0 and (num_words * 32) % num_inputs == 0
    group_size = num_inputs // num_groups if fits else 0
    bits = num_words * 32 // num_inputs
    if fits and scales.dtype != mx.uint8:
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    if fits and (mode := MICROSCALING_MODES.get((bits, group_size))) is not None:
        return {"group_size": group_size, "bits": bits, "mode": mode}
    raise CheckpointError(
        f"{source}: layer '{path}' is stored packed, but its weight {tuple(packed.shape)} "
        f"and {str(scales.dtype).removeprefix('mlx.core.')} scales {tuple(scales.shape)} fit no quantization of its "
        f"{num_inputs} inputs, and config.json's quantization does not name it"
    )
