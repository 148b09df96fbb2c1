"""The batch ladder: pad a step's token count up when a bigger matmul is cheaper.

A BLAS's time for `[N, K] @ [K, M]` is not monotonic in N: its kernels work on
blocks of rows, and its threading changes with the shape. On this 2-core box with
OpenBLAS, one layer of the 200M benchmark model's projections measured 5.2 ms at
N = 14 and 4.3 ms at N = 16, 6.8 ms at N = 30 and 5.5 ms at N = 32. So a step of
14 tokens may run faster as 16: two pad tokens ride through every matmul, norm and
MLP, and are cut out around attention, where they would cost (and store) K/V.

The ladder is measured on the machine, for the model's own weight shapes (one
layer's linear layers, times the layer count), at start-up: a table of N -> ms.
A step of n tokens is padded to the n' >= n with the lowest time, when that is
below `1 - MIN_GAIN` of n's own. The table is the model's dense work only;
attention, which is not padded, is left out of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from runtime.kv.base import attend_stacked_by_parts

import attrs
import mlx.core as mx
import mlx.nn as nn

from kernels.dense_matmul import PanelLinear

MIN_GAIN = 0.05  # below a 5% saving, timing noise decides: never pad for it
REPEATS = 5  # the fastest of 5 timings: noise only ever adds time


@attrs.frozen
class BatchLadder:
    """`ms[n - 1]`: the measured dense cost of a step of n tokens, n = 1..len(ms)."""

    ms: tuple[float, ...]
    rungs: tuple[int, ...] = attrs.field(init=False)  # rungs[n - 1]: the padded size of n

    def __attrs_post_init__(self) -> None:
        rungs = []
        for n in range(1, len(self.ms) + 1):
            best = min(range(n, len(self.ms) + 1), key=lambda m: (self.ms[m - 1], m))
            gains = self.ms[best - 1] < (1 - MIN_GAIN) * self.ms[n - 1]
            rungs.append(best if gains else n)
        object.__setattr__(self, "rungs", tuple(rungs))

    def padded(self, n: int) -> int:
        """The token count to run a step of `n` tokens at (n itself above the table)."""
        return self.rungs[n - 1] if 0 < n <= len(self.rungs) else n

    def describe(self) -> dict[str, Any]:
        """For the start-up log: which sizes are padded to which, and the ms saved."""
        pads = {n: m for n, m in enumerate(self.rungs, start=1) if m != n}
        return {
            "sizes": len(self.ms),
            "pads": {
                f"{n}->{m}": round(self.ms[n - 1] - self.ms[m - 1], 2) for n, m in pads.items()
            },
        }


def measure_ladder(model: nn.Module, num_layers: int, max_tokens: int) -> BatchLadder:
    """Time one layer's linear layers at 1..max_tokens tokens; scale by the layer count.

    The sizes are timed round-robin, fastest of `REPEATS` rounds each, so a burst of
    load from another process slows one round of every size rather than a run of
    neighbouring sizes (which would invent rungs)."""
    linears = _layer_linears(model)
    sizes = range(1, max_tokens + 1)
    inputs = {n: [mx.zeros((n, _in_features(m)), dtype=_dtype(m)) for m in linears] for n in sizes}
    mx.eval(inputs)
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(REPEATS):
        for n in sizes:
            start = time.perf_counter()
            mx.eval([m(x) for m, x in zip(linears, inputs[n], strict=True)])
            best[n] = min(best[n], time.perf_counter() - start)
    return BatchLadder(tuple(num_layers * best[n] * 1e3 for n in sizes))


def _layer_linears(model: nn.Module) -> list[Callable[[mx.array], mx.array]]:
    """The first decoder layer's linear layers, as callables on [N, in_features]."""
    layer = model.model.layers[0]
    kinds = nn.Linear | nn.QuantizedLinear | PanelLinear
    return [m for _, m in layer.named_modules() if isinstance(m, kinds)]


def _in_features(linear: Any) -> int:
    if isinstance(linear, nn.QuantizedLinear):
        return linear.weight.shape[1] * 32 // linear.bits
    return linear.weight.shape[1]  # [N, K], or a PanelLinear's [N / 32, K, 32]


def _dtype(linear: Any) -> mx.Dtype:
    return linear.scales.dtype if isinstance(linear, nn.QuantizedLinear) else linear.weight.dtype


class PaddedForward:
    """A `ForwardKV` for a token batch padded past its `num_real` tokens.

    Pad tokens run through the dense layers only: around attention (and a linear-attention
    layer's recurrence) they are cut off (so they store no K/V or state and read none)
    and come back as zeros. Their positions are 0, so RoPE stays in range."""

    def __init__(self, inner: Any, num_real: int, num_padded: int):
        self._inner = inner
        self._num_real = num_real
        self._pad = num_padded - num_real
        self.positions = mx.concatenate(
            [inner.positions, mx.zeros((self._pad,), dtype=inner.positions.dtype)]
        )

    def attend(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any
    ) -> mx.array:
        n = self._num_real
        out = self._inner.attend(layer, q[:n], k[:n], v[:n], *args, **kwargs)
        return mx.concatenate([out, mx.zeros((self._pad, *out.shape[1:]), dtype=out.dtype)])

    def attend_shared(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any
    ) -> mx.array:
        n = self._num_real
        out = self._inner.attend_shared(layer, q[:n], k[:n], v[:n], *args, **kwargs)
        return mx.concatenate([out, mx.zeros((self._pad, *out.shape[1:]), dtype=out.dtype)])

    def attend_stacked(self, layer: int, qkv: mx.array, *args: Any) -> mx.array:
        return attend_stacked_by_parts(self, layer, qkv, *args)  # pads cut in `attend`

    def convolve(self, layer: int, x: mx.array, weight: mx.array) -> mx.array:
        return self._padded(self._inner.convolve(layer, x[: self._num_real], weight))

    def delta_rule(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array
    ) -> mx.array:
        """Like attention, the recurrence never sees a pad: no row's state takes one."""
        n = self._num_real
        return self._padded(self._inner.delta_rule(layer, q[:n], k[:n], v[:n], log_decay[:n], beta[:n]))

    def ssm_scan(
        self, layer: int, x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array
    ) -> mx.array:
        n = self._num_real
        return self._padded(self._inner.ssm_scan(layer, x[:n], dt[:n], B[:n], C[:n], log_decay[:n]))

    def _padded(self, out: mx.array) -> mx.array:
        return mx.concatenate([out, mx.zeros((self._pad, *out.shape[1:]), dtype=out.dtype)])

    def residual_attention(self, *args: Any) -> None:
        return None  # by parts, so the pads are cut around attention

    def __getattr__(self, name: str) -> Any:  # the storage's other attributes (e.g. path)
        return getattr(self._inner, name)


def pad_step(ladder: BatchLadder | None, tokens: mx.array, view: Any) -> tuple[mx.array, Any]:
    """tokens [N] and its view, padded to the ladder's size for N (unchanged if none)."""
    n = tokens.shape[0]
    target = n if ladder is None else ladder.padded(n)
    if target == n:
        return tokens, view
    padding = mx.zeros((target - n,), dtype=tokens.dtype)
    return mx.concatenate([tokens, padding]), PaddedForward(view, n, target)
