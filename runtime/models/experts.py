"""Routed experts (a sparse mixture of experts): the MLP of qwen3_moe, qwen2_moe, olmoe, mixtral and
gpt_oss, and beside the dense MLP in Gemma 4's 26B (runtime/models/gemma4.py).

A router scores each token against E experts; the token runs through its top k
SwiGLU MLPs only and sums their outputs, weighted by the router's probabilities:

    p = softmax(gate(x))                        [N, E]
    e = the k experts of largest p              [N, k]; w = p[e], divided by its sum
                                                where the family normalises
    y = sum_j  w_j * down[e_j](silu(gate[e_j](x)) * up[e_j](x))
      [ + sigmoid(shared_expert_gate(x)) * shared_expert(x) ]   qwen2_moe's, every token

gpt-oss adds a bias to the router and to each expert's projections, and clamps its
SwiGLU (`clamped_swiglu`).

Each projection's experts are stacked, [E, out, in] (mlx-lm's `switch_mlp` layout,
the one mlx-community's quantized checkpoints store), and run as one op over the
step's (token, expert) pairs, which reads each chosen expert's weights once for all
the tokens that chose it (kernels/expert_matmul.py).

The layer is row-local like a dense MLP: a token's output depends on its own input
alone, so a ragged step mixes requests as freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.config import ConfigFields, ModelConfig
from runtime.errors import CheckpointError
from runtime.models.layers import GatedMLP

import attrs
import mlx.core as mx
import mlx.nn as nn

from kernels.expert_matmul import dense_expert_matmul, quantized_expert_matmul
from kernels.swiglu import gelu_tanh, swiglu


@attrs.frozen
class Experts:
    """A family's routed-experts settings (in `ModelConfig.extra["experts"]`)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's
    # The k weights divided by their sum (mixtral always; qwen3_moe's norm_topk_prob).
    normalize: bool
    sparse_layers: tuple[bool, ...]  # per layer: routed experts, else the dense MLP
    shared_intermediate_size: int | None = None  # an expert every token runs (qwen2_moe)
    biases: bool = False  # the router and every expert projection carry a bias (gpt-oss)
    # gpt-oss's clamped SwiGLU (its `swiglu_limit`), else None for SiLU(gate) * up:
    # (clip(up, -l, l) + 1) * g * sigmoid(1.702 g), g = min(gate, l).
    swiglu_limit: float | None = None
    activation: str = "silu"  # the gate's: "silu" (SwiGLU) or "gelu_tanh" (Gemma 4's GeGLU)

    @classmethod
    def read(
        cls,
        fields: ConfigFields,
        *,
        num_experts: int,
        intermediate_size: int,
        normalize: bool,
        dense_layers: Sequence[int] = (),
        sparse_step: int = 1,
        shared_intermediate_size: int | None = None,
        biases: bool = False,
        swiglu_limit: float | None = None,
    ) -> Experts:
        """Checked settings; layer i is sparse unless listed dense or (i + 1) is not a
        multiple of `sparse_step` (transformers' qwen3_moe rule)."""
        top_k = fields.get("num_experts_per_tok", int)
        if top_k > num_experts:
            raise CheckpointError(
                f"{fields.source}: num_experts_per_tok ({top_k}) is more than the {num_experts} experts"
            )
        num_layers = fields.get("num_hidden_layers", int)
        sparse = tuple(
            i not in dense_layers and (i + 1) % sparse_step == 0 for i in range(num_layers)
        )
        return cls(
            num_experts,
            top_k,
            intermediate_size,
            normalize,
            sparse,
            shared_intermediate_size,
            biases,
            swiglu_limit,
        )


def feed_forward(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: routed experts where the family's config makes it sparse,
    else the dense SwiGLU of `intermediate_size`."""
    experts: Experts | None = config.extra.get("experts")
    if experts is None or not experts.sparse_layers[layer]:
        return GatedMLP(config.hidden_size, config.intermediate_size)
    return RoutedExperts(config.hidden_size, experts)


def with_expert_bias(module: nn.Module, y: mx.array, experts: mx.array) -> mx.array:
    """y [R, k, out] plus each pair's expert's bias, where the layer has biases [E, out]."""
    return y + module["bias"][experts] if "bias" in module else y


class ExpertLinear(nn.Module):
    """E stacked linear layers, weight [E, out, in] (and bias [E, out] where the family
    has them); each (row, expert) pair multiplies its row by its expert's weight
    (kernels/expert_matmul.py)."""

    def __init__(self, num_inputs: int, num_outputs: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((num_experts, num_outputs, num_inputs))
        if bias:
            self.bias = mx.zeros((num_experts, num_outputs))

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        """x [R, in], experts [R, k] -> [R, k, out]."""
        return with_expert_bias(self, dense_expert_matmul(x, experts, self["weight"]), experts)

    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine"
    ) -> nn.Module:
        """Called by `nn.quantize` (a layer stored packed, or `--cpu-quantize`)."""
        quantized = QuantizedExpertLinear(self["weight"], group_size, bits, mode)
        if "bias" in self:
            quantized.bias = self["bias"]
        return quantized


class QuantizedExpertLinear(nn.Module):
    """ExpertLinear with packed weights, [E, out, in * bits / 32] uint32, plus scales
    (and biases, for affine) per group along the inputs."""

    def __init__(self, weight: mx.array, group_size: int | None, bits: int | None, mode: str):
        super().__init__()
        num_inputs = weight.shape[-1]
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        # As packed (None asks for the mode's defaults): bits from the words a row
        # takes, the group size from the groups it holds.
        self.bits: int = self.weight.shape[-1] * 32 // num_inputs
        self.group_size: int = num_inputs // self.scales.shape[-1]
        self.mode = mode

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        y = quantized_expert_matmul(
            x,
            experts,
            self["weight"],
            self["scales"],
            self.get("biases"),
            self.group_size,
            self.bits,
            self.mode,
        )
        return with_expert_bias(self, y, experts)


def clamped_swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """gpt-oss's gated activation: the gate clipped from above at `limit`, the linear
    part clipped both ways and shifted by 1, and a sigmoid of 1.702 x for SiLU's."""
    gate = mx.minimum(gate, limit)
    return (mx.clip(up, -limit, limit) + 1.0) * (gate * mx.sigmoid(1.702 * gate))


class ExpertMLPs(nn.Module):
    """E SwiGLU MLPs, their projections stacked (`switch_mlp` in the checkpoints)."""

    def __init__(self, hidden: int, experts: Experts):
        super().__init__()
        intermediate, num_experts, bias = experts.intermediate_size, experts.num_experts, experts.biases
        self.gate_proj = ExpertLinear(hidden, intermediate, num_experts, bias)
        self.up_proj = ExpertLinear(hidden, intermediate, num_experts, bias)
        self.down_proj = ExpertLinear(intermediate, hidden, num_experts, bias)
        self.swiglu_limit = experts.swiglu_limit
        self.activation = experts.activation

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        """x [N, hidden], experts [N, k] -> each pair's output [N, k, hidden]."""
        num_tokens, k = experts.shape
        gate, up = self.gate_proj(x, experts), self.up_proj(x, experts)  # [N, k, I]
        if self.swiglu_limit is not None:
            hidden = clamped_swiglu(gate, up, self.swiglu_limit)
        elif self.activation == "gelu_tanh":
            hidden = gelu_tanh(gate, up)
        else:
            hidden = swiglu(gate, up)
        pairs = experts.reshape(num_tokens * k, 1)  # each pair's hidden row, its one expert
        return self.down_proj(hidden.reshape(num_tokens * k, -1), pairs).reshape(num_tokens, k, -1)


class RoutedExperts(nn.Module):
    """The sparse MLP: `gate` routes each token to `top_k` of `switch_mlp`'s experts,
    beside a `shared_expert` every token runs, gated per token, where the family has one."""

    def __init__(self, hidden: int, experts: Experts):
        super().__init__()
        self.gate = nn.Linear(hidden, experts.num_experts, bias=experts.biases)
        self.switch_mlp = ExpertMLPs(hidden, experts)
        self.top_k = experts.top_k
        self.normalize = experts.normalize
        if experts.shared_intermediate_size is not None:
            self.shared_expert = GatedMLP(hidden, experts.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        """x [B, T, hidden] -> [B, T, hidden]."""
        tokens = x.reshape(-1, x.shape[-1])
        probabilities = mx.softmax(self.gate(tokens).astype(mx.float32), axis=-1)
        chosen = mx.argpartition(probabilities, kth=-self.top_k, axis=-1)[:, -self.top_k :]
        weights = mx.take_along_axis(probabilities, chosen, axis=-1)
        if self.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        outputs = self.switch_mlp(tokens, chosen)  # [N, k, hidden]
        y = (outputs * weights[..., None].astype(outputs.dtype)).sum(axis=-2)
        if "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return y.reshape(x.shape)

    def block_operands(self, norm: Any, post_norm: Any = None) -> None:
        """No one-op residual block (kernels/fused_blocks.py) for routed experts."""
        return None

    def as_block(self, h: mx.array, block: None) -> None:
        return None


def stack_experts(
    weights: dict[str, mx.array],
    experts: Experts,
    *,
    layer_prefix: str,
    names: dict[str, str],
) -> None:
    """Per-expert tensors, as Hugging Face stores them, into the stacked layout, in place.

    `layer_prefix` is a sparse layer's MLP path with `{layer}` in it (e.g.
    "model.layers.{layer}.mlp"); `names` maps a checkpoint's projection names to
    ours ({"w1": "gate_proj", ...}). Expert e of projection n is
    `{prefix}.experts.{e}.{n}.{suffix}`; layers already stacked are left as they are.
    """
    for layer, is_sparse in enumerate(experts.sparse_layers):
        prefix = layer_prefix.format(layer=layer)
        if not is_sparse or f"{prefix}.experts.0.{next(iter(names))}.weight" not in weights:
            continue
        for stored, ours in names.items():
            for suffix in ("weight", "scales", "biases"):
                parts = [
                    f"{prefix}.experts.{e}.{stored}.{suffix}" for e in range(experts.num_experts)
                ]
                if parts[0] not in weights:
                    continue
                missing = next((name for name in parts if name not in weights), None)
                if missing is not None:
                    raise CheckpointError(
                        f"missing tensor {missing!r} (config.json names {experts.num_experts} experts)"
                    )
                shapes = {weights[name].shape for name in parts}
                if len(shapes) != 1:
                    raise CheckpointError(
                        f"tensors '{prefix}.experts.*.{stored}.{suffix}' differ in shape: {sorted(shapes)}"
                    )
                weights[f"{prefix}.switch_mlp.{ours}.{suffix}"] = mx.stack(
                    [weights.pop(name) for name in parts]
                )
