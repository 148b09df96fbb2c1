"""x @ W.T for a float32 or 16-bit weight on the CPU: the row kernel, and the panel kernel.

Linear layers are packed at load into column panels and run the panel kernel at every
step size (`PanelLinear`, below). The row kernel (`dense_matmul`) reads a weight as
nn.Linear stores it; it serves a tied output head, whose table must stay in rows for
the embedding lookups, and the layers between their adoption and their packing. The
measurements that put it there:

With few rows (decode), an sgemm is the wrong tool on the CPU: it copies (packs) the
whole weight before multiplying, so each weight crosses memory three times. cadence's
kernel (kernels/cpu/dense_kernels.cpp) reads each weight once, in place, for all rows.
Measured on the 2-core x86-64 box (AVX-512, 2 threads; GB/s of weights streamed):

| layer [K -> N] | rows | OpenBLAS sgemm | cadence kernel |
|---|---|---|---|
| 1024 -> 2816 | 1 | 19.6 | 37.6 |
| 1024 -> 2816 | 4 | 16.0 | 33.7 |
| 2816 -> 1024 | 4 | 17.9 | 42.4 |
| 1024 -> 32000 (a head) | 1 | 16.6 | 43.1 |
| 1024 -> 2816 | 16 | 8-14 | 9-17 (runs vary) |

From 8 rows on the kernel's FMAs bound it as much as memory, and a layer alone is a
toss-up. A whole step is not: OpenBLAS keeps its threads spinning for a while after
each sgemm, so the kernel's pool shares the second core with them unless every layer
of the step is on the kernel (a 16-row decode step of the 200M bench model: 107 ms
all on the sgemm, 138 ms with only the down projection and the head on the kernel).
With every layer on the kernel, whole decode steps of that model measured (best of
7, three alternating runs): 8 rows 105 -> 79 ms, 16 rows 122-131 -> 99-119 ms,
32 rows 166-178 -> 155-166 ms. So a step of up to 32 rows runs every layer on the
kernel, and a larger one (prefill) every layer on the sgemm. On a GPU, with another
dtype, or without the extension, this is plain `x @ w.T`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels.cpu_extension import cpu_extension

MOST_ROWS = 32


def uses_dense_kernel(rows: int) -> bool:
    """Whether `dense_matmul` runs cadence's kernel for `rows` rows of x here and now."""
    return 0 < rows <= MOST_ROWS and mx.default_device() == mx.cpu and cpu_extension() is not None


HALF_DTYPES = (mx.float16, mx.bfloat16)


def dense_matmul(x: mx.array, w: mx.array) -> mx.array:
    """x: [..., K]; w: [N, K] -> x @ w.T, [..., N].

    A 16-bit w beside a float32 x is 16-bit storage: computed in float32, w widened
    exactly (in the kernel as it is read; for the sgemm, the whole layer per call).
    """
    if x.dtype != mx.float32 or (w.dtype != mx.float32 and w.dtype not in HALF_DTYPES):
        return x @ w.T
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if not uses_dense_kernel(rows):
        return x @ (w if w.dtype == mx.float32 else w.astype(mx.float32)).T
    ext = cpu_extension()
    assert ext is not None
    return ext.dense_matmul(x, w)  # [..., K] as it is: no reshape in or out


class KernelLinear(nn.Linear):
    """nn.Linear whose matmul is `dense_matmul`; same parameters and names. Its weight
    is float32, or 16-bit storage (computed in float32); a bias is float32."""

    @classmethod
    def adopt(cls, layer: nn.Linear) -> KernelLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = mx.contiguous(layer.weight)
        if "bias" in layer:
            new.bias = layer.bias.astype(mx.float32)
        return new

    def __call__(self, x: mx.array) -> mx.array:
        y = dense_matmul(x, self.weight)
        return y + self.bias if "bias" in self else y


def pack_panels(w: mx.array) -> mx.array:
    """w [N, K] -> [ceil(N / 32), K, 32], same dtype: column n at panel n // 32, lane n % 32,
    the last panel's missing columns zero (the layout `ext.panel_matmul` reads).

    Packed by the extension (kernels/cpu/dense_ops.cpp): mlx's transposing copy of the
    same layout (pad, reshape, transpose, contiguous) ran ~0.3 GB/s, 4.9 s of a 1.3 GB
    bf16 model's 6.4 s of preparation at load; 1.4 s now."""
    ext = cpu_extension()
    assert ext is not None, "panels exist only where the extension loaded"
    return ext.pack_panels(w)


class PanelLinear(nn.Module):
    """A linear layer whose weight (float32, or 16-bit storage widened exactly as it is
    read) is packed once, at load, into column panels (`pack_panels`), computed by the
    extension's panel kernel in float32 at every step size.

    An sgemm copies (packs) the whole weight into such panels on every call: for a
    176-token prefill chunk of the bench model that was 12% of the step (perf). Packed
    once, one kernel serves decode and prefill. Measured on the 2-core box (ms; the
    bench model's layers; ext.dense_matmul is the row kernel it replaces):

    | rows | layer [K -> N] | panel kernel | row kernel | OpenBLAS |
    |---|---|---|---|---|
    | 1 | 1024 -> 5632 | 0.45 | 0.52 | 2.04 |
    | 4 | 1024 -> 5632 | 0.44 | 0.52 | 2.27 |
    | 16 | 1024 -> 5632 | 1.11 | 1.50 | 2.75 |
    | 32 | 1024 -> 5632 | 2.01 | 2.87 | 3.73 |
    | 176 | 1024 -> 5632 | 10.8 | | 11.6 |
    | 176 | 2816 -> 1024 | 5.43 | | 5.36 |
    | 176 | 1024 -> 1536 | 2.82 | | 3.02 |
    | 512 | 1024 -> 5632 | 29.9 | | 29.2 |
    """

    @classmethod
    def adopt(cls, layer: KernelLinear) -> PanelLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.out_features = layer.weight.shape[0]
        new.weight = pack_panels(layer.weight)
        if "bias" in layer:
            new.bias = layer.bias
        new.freeze()
        return new

    def __call__(self, x: mx.array) -> mx.array:
        ext = cpu_extension()
        assert ext is not None, "a PanelLinear exists only where the extension loaded"
        y = ext.panel_matmul(x.astype(mx.float32), self.weight, self.out_features)
        return y + self.bias if "bias" in self else y


class KernelEmbedding(nn.Embedding):
    """nn.Embedding whose `as_linear` (a tied output head) is `dense_matmul`; a 16-bit
    table's rows are looked up as float32."""

    @classmethod
    def adopt(cls, layer: nn.Embedding) -> KernelEmbedding:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = mx.contiguous(layer.weight)
        return new

    def __call__(self, x: mx.array) -> mx.array:
        rows = self.weight[x]
        return rows if rows.dtype == mx.float32 else rows.astype(mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return dense_matmul(x, self.weight)
