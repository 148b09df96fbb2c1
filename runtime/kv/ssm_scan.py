"""Mamba2's selective state-space scan (the SSD recurrence), per row, as mlx-lm's `ssm`
and transformers' Bamba mixer compute it:

    S <- exp(log_decay_t) S + dt_t x_t B_t^T     the state [H, Dh, Ds] decays, then takes
                                                 the token's input x_t [H, Dh] at B_t
    y_t = S C_t                                  [H, Dh]

B_t and C_t are [G, Ds]: each of G groups serves H / G adjacent heads.

(log_decay = dt A, A = -exp(A_log) < 0; the D skip, x_t D, is the model's.) `ssm_step`
takes one token of a batch of rows (a decode step's). `span_ssm_scan` takes one row's
span of T tokens in chunks of up to `CHUNK`: within a chunk y is a masked T x T matmul
(C_i . B_j, decayed from j to i, times dt_j x_j), the state carried from chunk to
chunk, as mlx-lm's `ssm_attn` does; on any device (no triangular solve, unlike the
delta rule's chunks). C . B and the state's matmuls are a group's, its heads side by
side (granite-4.0-h-tiny: one group of 48 heads of 64 x 128). A 160-token span of those
took ~100-145 ms on the shared 2-core box, as a token at a time did (~100-150 ms) and
against ~130-200 ms with C . B per head: the same flops, which are matmuls here, what
a faster BLAS or a GPU speeds up.
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 64


# Compiled: its elementwise ops fuse into a few kernels, once per batch size.
@mx.compile
def ssm_step(
    x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token of R rows: x [R, H, Dh], dt and log_decay [R, H], B and C [R, G, Ds],
    state [R, H, Dh, Ds] -> (y [R, H, Dh], the new state)."""
    heads_per_group = x.shape[1] // B.shape[1]
    B, C = (mx.repeat(a.astype(mx.float32), heads_per_group, axis=1) for a in (B, C))  # [R, H, Ds]
    written = (dt[..., None] * x.astype(mx.float32))[..., None] * B[..., None, :]
    state = state * mx.exp(log_decay)[..., None, None] + written
    y = (state * C[..., None, :]).sum(axis=-1)
    return y.astype(x.dtype), state


def span_ssm_scan(
    x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One row's T tokens: x [T, H, Dh], dt and log_decay [T, H], B and C [T, G, Ds],
    state [H, Dh, Ds] -> (y [T, H, Dh], the state after them)."""
    (T, H, Dh), (G, Ds) = x.shape, B.shape[1:]
    r = H // G  # heads per group
    size = min(CHUNK, T)
    pad = -T % size  # padded with tokens that write nothing (dt 0) and keep the state (decay 1)
    N = (T + pad) // size

    def chunked(a: mx.array) -> mx.array:  # [T, ...] -> [N, size, ...], float32
        a = mx.pad(a.astype(mx.float32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(N, size, *a.shape[1:])

    inputs = chunked(dt[..., None] * x.astype(mx.float32)).reshape(N, size, G, r, Dh).transpose(2, 3, 0, 1, 4)
    Bc, Cc = (chunked(a).transpose(2, 0, 1, 3) for a in (B, C))  # [G, N, c, Ds]
    # [G, r, N, c]: log decay since the chunk began
    decayed = mx.cumsum(chunked(log_decay).reshape(N, size, G, r).transpose(2, 3, 0, 1), axis=-1)
    on_or_below = mx.tril(mx.ones((size, size), dtype=mx.bool_))
    between = decayed[..., :, None] - decayed[..., None, :]  # from token j to token i
    decay = mx.where(on_or_below, mx.exp(mx.where(on_or_below, between, 0.0)), 0.0)  # [G, r, N, c, c]
    within = ((Cc @ Bc.swapaxes(-1, -2))[:, None] * decay) @ inputs  # [G, r, N, c, Dh]
    S = state.astype(mx.float32).reshape(G, r * Dh, Ds)  # a group's heads side by side
    ys = []
    for i in range(N):
        di = decayed[:, :, i]  # [G, r, c]
        read = (Cc[:, i] @ S.swapaxes(-1, -2)).reshape(G, size, r, Dh).transpose(0, 2, 1, 3)
        ys.append(within[:, :, i] + mx.exp(di)[..., None] * read)  # [G, r, c, Dh]
        last = di[..., -1]  # [G, r]
        kept = inputs[:, :, i] * mx.exp(last[..., None] - di)[..., None]  # [G, r, c, Dh]
        carried = kept.transpose(0, 1, 3, 2).reshape(G, r * Dh, size) @ Bc[:, i]  # [G, r Dh, Ds]
        S = (S.reshape(G, r, Dh, Ds) * mx.exp(last)[..., None, None]).reshape(G, r * Dh, Ds) + carried
    y = mx.concatenate(ys, axis=2)[:, :, :T]  # [G, r, T, Dh]
    return y.transpose(2, 0, 1, 3).reshape(T, H, Dh).astype(x.dtype), S.reshape(H, Dh, Ds)
