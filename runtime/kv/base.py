"""The one KV-cache interface the models see, whatever the storage behind it.

A step is a ragged batch: the new tokens of every row in it, concatenated into
one flat batch `[N]`. For every forward the engine asks the storage for a
`ForwardKV`: each token's position and where the rows' keys and values live.
The model calls `kv.attend(layer, q, k, v, scale)` in every layer (or, with its
q/k/v projections stacked, `kv.attend_stacked`, or the whole attention block,
`kv.residual_attention`) and never branches on storage or on prefill versus decode.
A linear-attention layer (a hybrid model's) calls `kv.convolve` and `kv.delta_rule`
(a Mamba2 layer `kv.ssm_scan`), which carry each row's recurrent state instead
(runtime/kv/recurrent.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from runtime.kv.recurrent import RecurrentStep

import attrs
import mlx.core as mx

from kernels.paged_attention_mx import attention

if TYPE_CHECKING:
    from kernels.fused_blocks import NormedLayers


@attrs.frozen
class RowSpan:
    """One row's part in a step: K/V for positions `[start, start + num_new)` is
    computed and stored in `blocks` (the row's block table, covering at least
    `start + num_new` positions); the row attends over positions `[0, start + num_new)`,
    or the last `window` of them in a sliding-window layer. A model with windowed layers
    has several layer groups, each with its own table (runtime/kv/layout.py): `blocks`
    is the first's, `group_tables` the others'."""

    seq_id: int
    start: int
    num_new: int
    blocks: tuple[int, ...]
    group_tables: tuple[tuple[int, ...], ...] = ()

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        return (self.blocks, *self.group_tables)

    @property
    def end(self) -> int:
        return self.start + self.num_new


class ForwardKV(Protocol):
    """The KV view for one forward over `N` new tokens."""

    @property
    def positions(self) -> mx.array:
        """Each new token's position in its row: `[N]` int32 (RoPE offsets)."""
        ...

    def attend(
        self,
        layer: int,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        softcap: float = 0.0,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Store `k`, `v` and attend each query over its row's history up to its own position.

        q: [N, n_heads, head_dim]; k, v: [N, n_kv_heads, head_dim]. Returns [N, n_heads, head_dim].
        `softcap` > 0: each score s (scaled) becomes softcap * tanh(s / softcap), Gemma 2's.
        `sinks` [n_heads]: each head's softmax sum takes e^(sink) too, with no value (gpt-oss's).
        """
        ...

    def attend_shared(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float = 0.0
    ) -> mx.array:
        """`attend` over K/V that `layer` stored earlier in this forward, storing nothing:
        a later layer reading an earlier one's cache (Gemma 4's KV-shared layers). `k`, `v`
        are what `layer` stored for this step's tokens."""
        ...

    def attend_stacked(
        self, layer: int, qkv: mx.array, rope: Rotary, num_heads: int, num_kv_heads: int, scale: float
    ) -> mx.array:
        """`attend` from a stacked projection: qkv [..., (H + 2 Hkv) * D] holds each token's
        H query, then Hkv key and Hkv value heads; q and k are rotated by `rope` at
        `positions` first. Returns [..., H * D]. `attend_stacked_by_parts` is the reference.
        """
        ...

    def residual_attention(
        self,
        layer: int,
        x: mx.array,
        block: NormedLayers,
        rope: Rotary,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
    ) -> mx.array | None:
        """x + o(`attend_stacked`(qkv(norm(x)))) as one op (kernels/fused_blocks.py), the
        block's norm and layers (qkv, then o) in `block`; None where the storage cannot,
        and the caller runs the parts."""
        ...

    def convolve(self, layer: int, x: mx.array, weight: mx.array) -> mx.array:
        """Recurrent `layer`'s causal depthwise convolution, x [N, C] by weight [C, K],
        over each row's inputs (its stored last K - 1 before its span); see
        runtime/kv/recurrent.py."""
        ...

    def delta_rule(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array
    ) -> mx.array:
        """Recurrent `layer`'s gated delta rule from each row's state: q, k [N, Hv, Dk],
        v [N, Hv, Dv], log_decay and beta [N, Hv] -> [N, Hv, Dv]; see runtime/kv/recurrent.py."""
        ...

    def ssm_scan(
        self, layer: int, x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array
    ) -> mx.array:
        """Recurrent `layer`'s Mamba2 scan from each row's state: x [N, H, Dh], dt and
        log_decay [N, H], B and C [N, G, Ds] -> [N, H, Dh]; see runtime/kv/recurrent.py."""
        ...


Rotary = Callable[[mx.array, mx.array], mx.array]  # (x [N, H, D], positions [N]) -> rotated x


def split_heads(qkv: mx.array, num_heads: int, num_kv_heads: int) -> tuple[mx.array, mx.array, mx.array]:
    """A stacked projection's [..., (H + 2 Hkv) * D] -> q [N, H, D], k and v [N, Hkv, D]."""
    H, Hkv = num_heads, num_kv_heads
    heads = qkv.reshape(-1, H + 2 * Hkv, qkv.shape[-1] // (H + 2 * Hkv))
    return heads[:, :H], heads[:, H : H + Hkv], heads[:, H + Hkv :]


def attend_stacked_by_parts(
    kv: ForwardKV, layer: int, qkv: mx.array, rope: Rotary, num_heads: int, num_kv_heads: int, scale: float
) -> mx.array:
    """`ForwardKV.attend_stacked` as separate ops: split, rotate q and k, `kv.attend`."""
    q, k, v = split_heads(qkv, num_heads, num_kv_heads)
    out = kv.attend(layer, rope(q, kv.positions), rope(k, kv.positions), v, scale)
    return out.reshape(*qkv.shape[:-1], -1)


class CausalNoCache:
    """`ForwardKV` for a plain causal forward over `[B, T]` tokens with no cache (training,
    scoring). `windows[layer]`: that layer's sliding window, or None (see ModelConfig)."""

    def __init__(self, batch: int, length: int, windows: tuple[int | None, ...] = ()):
        self.batch, self.length, self.windows = batch, length, windows
        self.positions = mx.tile(mx.arange(length, dtype=mx.int32), batch)  # [B * T]
        # Linear-attention layers' states: every row from position 0, kept by no one.
        self.recurrent = RecurrentStep([(b, 0, length) for b in range(batch)], [None] * batch)

    def attend(
        self,
        layer: int,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        softcap: float = 0.0,
        sinks: mx.array | None = None,
    ) -> mx.array:
        B, T = self.batch, self.length

        def heads_first(x: mx.array) -> mx.array:  # [B*T, H, D] -> [B, H, T, D]
            return x.reshape(B, T, *x.shape[1:]).transpose(0, 2, 1, 3)

        window = self.windows[layer] if self.windows else None
        mask: mx.array | str | None = "causal" if T > 1 else None
        if window is not None and window < T:
            query, key = mx.arange(T)[:, None], mx.arange(T)[None, :]
            mask = (key <= query) & (key > query - window)  # [T, T]
        out = attention(heads_first(q), heads_first(k), heads_first(v), scale, mask, softcap, sinks)
        return out.transpose(0, 2, 1, 3).reshape(B * T, *q.shape[1:])

    def attend_shared(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float = 0.0
    ) -> mx.array:
        return self.attend(layer, q, k, v, scale, softcap)  # nothing stored: the same

    def attend_stacked(
        self, layer: int, qkv: mx.array, rope: Rotary, num_heads: int, num_kv_heads: int, scale: float
    ) -> mx.array:
        return attend_stacked_by_parts(self, layer, qkv, rope, num_heads, num_kv_heads, scale)

    def residual_attention(self, *args: object) -> None:
        return None  # no cache to write in place: by parts

    def convolve(self, layer: int, x: mx.array, weight: mx.array) -> mx.array:
        return self.recurrent.convolve(layer, x, weight)

    def delta_rule(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array
    ) -> mx.array:
        return self.recurrent.delta_rule(layer, q, k, v, log_decay, beta)

    def ssm_scan(
        self, layer: int, x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array
    ) -> mx.array:
        return self.recurrent.ssm_scan(layer, x, dt, B, C, log_decay)
