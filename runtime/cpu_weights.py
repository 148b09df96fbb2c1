"""The CPU dtype policy: what form each layer's weights take after loading, and why.

Single-stream decode on a CPU is memory-bound, so its speed is the bytes of weights
streamed per token. With cadence's quantized kernels (kernels/cpu/):
  - a quantized checkpoint stays quantized (4 or 8 bits, ~1/7 and ~1/3.5 of fp32's bytes);
  - a 16-bit checkpoint keeps its linear and embedding weights in 16 bits, computed in
    float32 (the kernels widen them exactly as they read them, so the results are the
    float32 expansion's, from half its bytes); everything else becomes float32.
    `cpu_quantize` "float32" expands them too, "8" or "4" quantizes them at load (group
    64) so they decode through the quantized kernels.
Without them (no compiler at install, or CADENCE_CPU_KERNELS=off) the old policy holds:
everything is expanded to float32 when memory allows (bf16 and mlx's 4-bit matmuls run
20-40x slower than fp32 on the CPU), else kept as stored.
Everything that is not a quantized matmul (norms, a dense embedding) computes in float32.
With the extension loaded, a tied output head runs its few-row products (decode)
through its dense kernel (kernels/dense_matmul.py), which streams the weights once
instead of packing them for an sgemm.
Once adopted, the kernel layers that read one input are stacked into one (q, k and v
as `qkv_proj`; gate and up as `gate_up_proj`, see `stack_rows`), and then every
float32 or 16-bit one is packed into column panels for the panel kernel
(`PanelLinear`), which serves every step size. Last, each layer plans which of its
residual blocks run as one op on few-row steps (`plan_blocks`, kernels/fused_blocks.py).
Every form is decided while the weights are still lazy, so that its size is checked
against the memory available before any weight is read (`check_fits_in_memory`), and
then evaluated one layer at a time, each layer's stored form freed as its final one is
built.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

from runtime.errors import CheckpointError
from runtime.kv.budget import available_memory
from runtime.models.experts import ExpertLinear, QuantizedExpertLinear
from runtime.models.layers import CausalLM

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from kernels.cpu_extension import cpu_extension, kernel_status
from kernels.dense_matmul import KernelEmbedding, KernelLinear, PanelLinear
from kernels.freed_memory import release_freed_memory
from kernels.huge_pages import move_weights_to_huge_pages
from kernels.quantized_linear import KernelQuantizedEmbedding, KernelQuantizedLinear
from kernels.quantized_matmul import exponent_scales, is_kernel_layout

CPU_QUANTIZE_CHOICES = ("off", "float32", "8", "4")
DEFAULT_CPU_QUANTIZE = "off"  # see README "Quantized weights on the CPU" for why
HALF_DTYPES = (mx.float16, mx.bfloat16)
LOAD_TIME_GROUP_SIZE = 64


def prepare_for_cpu(
    model: CausalLM,
    *,
    keep_dtype: bool,
    cpu_quantize: str = DEFAULT_CPU_QUANTIZE,
    progress: Callable[[str], None] = lambda message: None,
) -> CausalLM:
    """Put `model`'s weights in the form the CPU computes fastest; on a GPU, do nothing.

    Reports, through `progress`, the kernel status and one line naming the path and
    dtype of each layer kind.
    """
    if cpu_quantize not in CPU_QUANTIZE_CHOICES:
        raise ValueError(f"cpu_quantize must be one of {CPU_QUANTIZE_CHOICES}, got {cpu_quantize!r}")
    if mx.default_device() != mx.cpu:
        return model
    progress(kernel_status())
    if keep_dtype:
        check_fits_in_memory(model, quantizable=False)
        progress(f"weights kept as stored: {describe_layers(model)}")
        return model
    quantizable = model.config.quantization is None and cpu_quantize not in ("8", "4")
    if cpu_extension() is not None:
        if model.config.quantization is None and cpu_quantize in ("8", "4"):
            progress(f"quantizing weights to {cpu_quantize} bits for the CPU")
            _quantize(model, int(cpu_quantize))
        if _has_kernel_layers(model):
            _adopt_kernel_layers(model)
            _float32_except_quantized(model)
            return _on_kernels(model, quantizable, progress)
        if cpu_quantize == "off" and _has_16_bit_matmuls(model):
            progress("keeping the 16-bit weights of linear layers (float32 compute)")
            _float32_except_16_bit_matmuls(model)
            return _on_kernels(model, quantizable, progress)
    if _fits_as_float32(model):
        progress("expanding weights to float32 for the CPU")
        model = to_float32(model)
    if cpu_extension() is not None:
        return _on_kernels(model, quantizable, progress)
    check_fits_in_memory(model, quantizable)
    progress(f"weights: {describe_layers(model)}")
    return model


def _on_kernels(model: CausalLM, quantizable: bool, progress: Callable[[str], None]) -> CausalLM:
    """The dense layers adopted by the kernels, then every weight evaluated in its final
    form, one layer at a time: stacked, packed and settled."""
    _adopt_dense_layers(model)
    _mxfp4_experts_on_kernels(model)
    check_fits_in_memory(model, quantizable)
    _stack_projections(model)
    _evaluate_layer_by_layer(model, progress)
    _settle(model, progress)
    progress(f"weights: {describe_layers(model)}")
    return model


# A load's peak resident memory over its final weights, measured (`cadence bench load`):
# 1.07x for an 8B bf16 checkpoint kept in 16 bits, 1.21x quantized to 4 bits at load
# (its float32 transients), 1.10-1.32x for a 1.3 GB one. The 8B load let through with
# ~15 GiB available for its 15.0 GiB of weights was killed by Linux 37 s in.
LOAD_PEAK_FACTOR = 1.25


def check_fits_in_memory(model: CausalLM, quantizable: bool) -> None:
    """Refuse, before a weight is read, weights whose load would peak past the memory
    available now (their sizes are known while they are still lazy).

    Past it, loading ran until Linux killed the process, with no word of why.
    """
    if (available := available_memory()) is None:
        return
    needed = sum(p.nbytes for p in _arrays(model))
    if needed * LOAD_PEAK_FACTOR > available:
        hint = "; quantized at load (--cpu-quantize 8 or 4), they take less" * quantizable
        raise CheckpointError(
            f"its weights take {needed / 2**30:.1f} GiB in the form the CPU computes them and "
            f"their load peaks near {needed * LOAD_PEAK_FACTOR / 2**30:.1f} GiB, more than the "
            f"{available / 2**30:.1f} GiB of memory available now{hint}"
        )


def _settle(model: CausalLM, progress: Callable[[str], None]) -> None:
    """The kernel layers' final form: packed into panels, moved onto 2 MB pages
    (kernels/huge_pages.py), then each layer's plan of its residual blocks, which holds
    the weights it found."""
    _pack_panels(model)
    if moved := move_weights_to_huge_pages(model):
        progress(f"weights on 2 MB pages where Linux grants them: {moved / 2**20:.0f} MB")
    _plan_blocks(model)


def _plan_blocks(model: CausalLM) -> None:
    """Let each layer that can decide which of its residual blocks run as one op
    (kernels/fused_blocks.py), now that its weights have their final form."""
    for module in model.modules():
        if hasattr(module, "plan_blocks"):
            module.plan_blocks()


# The layer groups that read one input: (the stacked layer's name, the layers' names).
STACKED_PROJECTIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def stack_rows(layers: list[nn.Module]) -> nn.Module | None:
    """One layer whose output is `layers`' outputs side by side (weight rows stacked), or None.

    One matmul instead of two or three reading the same input streams the same bytes in
    one call: one op, one split over the kernel threads, one packing of the input.
    Measured on the SmolLM2-135M-shaped 4-bit decode: see the README. All the layers
    must be cadence kernel layers of one kind and layout, with biases all or none.
    """
    first = layers[0]
    if type(first) is KernelQuantizedLinear:
        layout = (first.group_size, first.bits, first.mode)
        same = all(
            type(m) is KernelQuantizedLinear and (m.group_size, m.bits, m.mode) == layout
            for m in layers
        )
        names: tuple[str, ...] = ("weight", "scales", "biases") if "biases" in first else ("weight", "scales")
    else:
        same = all(type(m) is KernelLinear for m in layers)
        names = ("weight",)
    with_bias = {"bias" in m for m in layers}
    if not same or len(with_bias) != 1:
        return None
    stacked = type(first).__new__(type(first))
    nn.Module.__init__(stacked)
    if isinstance(first, KernelQuantizedLinear):
        stacked.group_size, stacked.bits, stacked.mode = first.group_size, first.bits, first.mode
    for name in names + (("bias",) if with_bias == {True} else ()):
        stacked[name] = mx.contiguous(mx.concatenate([m[name] for m in layers]))
    stacked.freeze()
    return stacked


def _stack_projections(model: CausalLM) -> None:
    for _, owner in model.named_modules():
        for stacked_name, names in STACKED_PROJECTIONS:
            if not all(name in owner for name in names):
                continue
            if (stacked := stack_rows([owner[name] for name in names])) is not None:
                for name in names:
                    del owner[name]
                owner[stacked_name] = stacked


# A progress line each time this much more of the weights is ready: an 8B bf16 load read
# its 16 GB for 44 s between two lines.
READY_PROGRESS_BYTES = 2 << 30


def _evaluate_layer_by_layer(model: CausalLM, progress: Callable[[str], None]) -> None:
    """Every weight read and given its final dtype, one layer at a time: each layer's
    stored form (and a stacked layer's parts) is freed as its final one is built."""
    layers = [_arrays(module) for _, module in _leaves(model)]
    total = sum(p.nbytes for arrays in layers for p in arrays)
    ready, next_line = 0, READY_PROGRESS_BYTES
    for arrays in layers:
        mx.eval(arrays)
        release_freed_memory()
        ready += sum(p.nbytes for p in arrays)
        if ready >= next_line:  # one line, however many multiples this layer crossed
            progress(f"weights ready: {ready / 2**20:,.0f} of {total / 2**20:,.0f} MB")
            next_line = (ready // READY_PROGRESS_BYTES + 1) * READY_PROGRESS_BYTES


def _pack_panels(model: CausalLM) -> None:
    """Every KernelLinear (float32 or 16-bit storage) -> PanelLinear, one at a time (each
    packed and evaluated before the next: loading never holds two copies of the model).

    Only the owners are listed up front: a list holding the layers themselves would keep
    every replaced weight alive to the end."""
    slots = [
        (owner, name)
        for _, owner in model.named_modules()
        for name, child in owner.children().items()
        if type(child) is KernelLinear
    ]
    for owner, name in slots:
        packed = PanelLinear.adopt(owner[name])
        mx.eval(packed.parameters())
        owner[name] = packed
        release_freed_memory()


def describe_layers(model: CausalLM) -> str:
    """e.g. "linear 4-bit g64 (cadence kernel) x14, embedding 4-bit g64 (cadence kernel) x1, ..."."""
    kinds: Counter[str] = Counter(_layer_kind(module) for _, module in _leaves(model))
    dtypes = set()
    for _, module in _leaves(model):
        if not _layer_kind(module):  # norms and the like: not the matmuls named above
            params: list[tuple[str, mx.array]] = tree_flatten(module.parameters())  # type: ignore[assignment]
            dtypes |= {p.dtype for _, p in params if p.dtype != mx.uint32}
    others = "/".join(sorted(str(d).removeprefix("mlx.core.") for d in dtypes))
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items()) if kind) + (
        f"; other weights {others}"
    )


def _layer_kind(module: nn.Module) -> str:
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        name = "linear" if isinstance(module, nn.QuantizedLinear) else "embedding"
        path = (
            "cadence kernel"
            if isinstance(module, (KernelQuantizedLinear, KernelQuantizedEmbedding))
            else "mlx quantized_matmul"
        )
        mode = getattr(module, "mode", "affine")
        layout = f"{module.bits}-bit g{module.group_size}" if mode == "affine" else mode
        return f"{name} {layout} ({path})"
    if isinstance(module, (ExpertLinear, QuantizedExpertLinear)):
        return f"experts {_experts_layout(module)}"
    if isinstance(module, PanelLinear):
        return f"linear {str(module.weight.dtype).removeprefix('mlx.core.')} (cadence panel kernel)"
    if isinstance(module, (nn.Linear, nn.Embedding)):
        name = "linear" if isinstance(module, nn.Linear) else "embedding"
        path = "cadence kernel, sgemm" if isinstance(module, (KernelLinear, KernelEmbedding)) else "matmul"
        return f"{name} {str(module.weight.dtype).removeprefix('mlx.core.')} ({path})"
    return ""


def _experts_layout(module: ExpertLinear | QuantizedExpertLinear) -> str:
    """e.g. "4-bit g64 (cadence kernel)": what kernels/expert_matmul.py will run them with."""
    if isinstance(module, ExpertLinear):
        dtype = module.weight.dtype
        path = "cadence kernel" if cpu_extension() is not None else "mlx gather_mm"
        return f"{str(dtype).removeprefix('mlx.core.')} ({path})"
    is_kernel = cpu_extension() is not None and is_kernel_layout(
        module.group_size, module.bits, module.mode
    )
    path = "cadence kernel" if is_kernel and module.scales.dtype == mx.float32 else "mlx gather_qmm"
    layout = f"{module.bits}-bit g{module.group_size}" if module.mode == "affine" else module.mode
    return f"{layout} ({path})"


def _arrays(module: nn.Module) -> list[mx.array]:
    params: list[tuple[str, mx.array]] = tree_flatten(module.parameters())  # type: ignore[assignment]
    return [p for _, p in params]


def _leaves(model: CausalLM) -> list[tuple[str, nn.Module]]:
    return tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)  # type: ignore[return-value]


def _quantize(model: CausalLM, bits: int) -> None:
    def is_quantizable(_path: str, module: nn.Module) -> bool:
        return (
            isinstance(module, (nn.Linear, nn.Embedding, ExpertLinear))
            and module.weight.shape[-1] % LOAD_TIME_GROUP_SIZE == 0
        )

    nn.quantize(model, group_size=LOAD_TIME_GROUP_SIZE, bits=bits, class_predicate=is_quantizable)


def _is_kernel_module(module: nn.Module) -> bool:
    """A quantized layer the kernels run: a linear layer of a kernel layout, or an
    affine embedding (an mxfp4 one keeps mlx's lookup, which reads its exponents)."""
    mode = getattr(module, "mode", "affine")
    if isinstance(module, nn.QuantizedEmbedding) and mode != "affine":
        return False
    return isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and is_kernel_layout(
        module.group_size, module.bits, mode
    )


def _has_kernel_layers(model: CausalLM) -> bool:
    return any(_is_kernel_module(module) for _, module in _leaves(model))


def _adopt_kernel_layers(model: CausalLM) -> None:
    def adopt(module: nn.Module) -> nn.Module:
        if not _is_kernel_module(module):
            return module
        if isinstance(module, nn.QuantizedLinear):
            return KernelQuantizedLinear.adopt(module)
        return KernelQuantizedEmbedding.adopt(module)  # type: ignore[arg-type]

    model.update_modules(tree_unflatten([(path, adopt(m)) for path, m in _leaves(model)]))


def _mxfp4_experts_on_kernels(model: CausalLM) -> None:
    """mxfp4 experts' exponents as the float32 scales the expert kernel multiplies by
    (kernels/quantized_matmul.py: exponent_scales), as their linear layers' adoption does."""
    for _, module in _leaves(model):
        if isinstance(module, QuantizedExpertLinear) and module.mode == "mxfp4" and module.scales.dtype == mx.uint8:
            module.scales = exponent_scales(module.scales)


def _is_16_bit_matmul(module: nn.Module) -> bool:
    """A layer the kernels read in 16 bits as stored (routed experts' too)."""
    matmuls = (nn.Linear, nn.Embedding, ExpertLinear)
    return type(module) in matmuls and module.weight.dtype in HALF_DTYPES


def _has_16_bit_matmuls(model: CausalLM) -> bool:
    return any(_is_16_bit_matmul(module) for _, module in _leaves(model))


def _float32_except_16_bit_matmuls(model: CausalLM) -> None:
    # set_dtype is lazy: the float32 copies of the kept weights are dropped unevaluated.
    kept = {path: module.weight for path, module in _leaves(model) if _is_16_bit_matmul(module)}
    model.set_dtype(mx.float32)
    for path, module in _leaves(model):
        if path in kept:
            module.weight = kept[path]


def _adopt_dense_layers(model: CausalLM) -> None:
    """float32 or 16-bit nn.Linear / nn.Embedding -> their dense-kernel twins (same arrays)."""

    def adopt(module: nn.Module) -> nn.Module:
        if type(module) not in (nn.Linear, nn.Embedding):
            return module
        if module.weight.dtype != mx.float32 and module.weight.dtype not in HALF_DTYPES:
            return module
        if type(module) is nn.Linear:
            return KernelLinear.adopt(module)
        return KernelEmbedding.adopt(module)  # type: ignore[arg-type]

    model.update_modules(tree_unflatten([(path, adopt(m)) for path, m in _leaves(model)]))


def _float32_except_quantized(model: CausalLM) -> None:
    # Module.set_dtype casts floating parameters only, so packed uint32 weights are safe;
    # the kernel layers' scales and biases are already float32.
    model.set_dtype(mx.float32)


def _fits_as_float32(model: CausalLM) -> bool:
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    bits = model.config.quantization.bits if model.config.quantization is not None else 32
    float32_bytes = sum(p.size * 4 * (32 // bits if p.dtype == mx.uint32 else 1) for _, p in params)
    return float32_bytes < 0.6 * _physical_memory()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def to_float32(model: CausalLM) -> CausalLM:
    """Dequantize quantized layers and cast every weight to float32, in place."""

    def expand(module: nn.Module) -> nn.Module:
        if isinstance(module, nn.QuantizedLinear):
            weight = _dequantized(module)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            linear.weight = weight.astype(mx.float32)
            if "bias" in module:
                linear.bias = module.bias.astype(mx.float32)
            return linear
        if isinstance(module, nn.QuantizedEmbedding):
            weight = _dequantized(module)
            embedding = nn.Embedding(weight.shape[0], weight.shape[1])
            embedding.weight = weight.astype(mx.float32)
            return embedding
        return module

    model.update_modules(tree_unflatten([(path, expand(m)) for path, m in _leaves(model)]))
    model.set_dtype(mx.float32)
    return model


def _dequantized(module: nn.QuantizedLinear | nn.QuantizedEmbedding) -> mx.array:
    """The layer's weight unpacked, in any of mlx's quantization modes (the microscaling
    ones store no biases)."""
    return mx.dequantize(
        module.weight,
        module.scales,
        module.get("biases"),
        module.group_size,
        module.bits,
        mode=getattr(module, "mode", "affine"),
    )
