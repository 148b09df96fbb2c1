"""Mamba2's selective state-space scan (the SSD recurrence), per row, as mlx-lm's `ssm`
and transformers' Bamba mixer compute it:

    S <- exp(log_decay_t) S + dt_t x_t B_t^T     the state [H, Dh, Ds] decays, then takes
                                                 the token's input x_t [H, Dh] at B_t [H, Ds]
    y_t = S C_t                                  [H, Dh]

(log_decay = dt A, A = -exp(A_log) < 0; the D skip, x_t D, is the model's.) `ssm_step`
takes one token of a batch of rows (a decode step's). `span_ssm_scan` takes one row's
span of T tokens in chunks of up to `CHUNK`: within a chunk y is a masked T x T matmul
(C_i . B_j, decayed from j to i, times dt_j x_j), the state carried from chunk to
chunk, as mlx-lm's `ssm_attn` does; on any device (no triangular solve, unlike the
delta rule's chunks).
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 64


# Compiled: its elementwise ops fuse into a few kernels, once per batch size.
@mx.compile
def ssm_step(
    x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token of R rows: x [R, H, Dh], dt and log_decay [R, H], B and C [R, H, Ds],
    state [R, H, Dh, Ds] -> (y [R, H, Dh], the new state)."""
    written = (dt[..., None] * x.astype(mx.float32))[..., None] * B.astype(mx.float32)[..., None, :]
    state = state * mx.exp(log_decay)[..., None, None] + written
    y = (state * C.astype(mx.float32)[..., None, :]).sum(axis=-1)
    return y.astype(x.dtype), state


def span_ssm_scan(
    x: mx.array, dt: mx.array, B: mx.array, C: mx.array, log_decay: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One row's T tokens: x [T, H, Dh], dt and log_decay [T, H], B and C [T, H, Ds],
    state [H, Dh, Ds] -> (y [T, H, Dh], the state after them)."""
    T = x.shape[0]
    size = min(CHUNK, T)
    pad = -T % size  # padded with tokens that write nothing (dt 0) and keep the state (decay 1)
    N = (T + pad) // size

    def chunked(a: mx.array) -> mx.array:  # [T, H, ...] -> [H, N, size, ...], float32
        a = mx.pad(a.astype(mx.float32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        a = mx.moveaxis(a, 0, 1)
        return a.reshape(a.shape[0], N, size, *a.shape[2:])

    inputs = chunked(dt[..., None] * x.astype(mx.float32))  # [H, N, c, Dh]: dt_j x_j
    Bc, Cc = chunked(B), chunked(C)  # [H, N, c, Ds]
    decayed = mx.cumsum(chunked(log_decay), axis=-1)  # [H, N, c]: log decay since the chunk began
    on_or_below = mx.tril(mx.ones((size, size), dtype=mx.bool_))
    between = decayed[..., :, None] - decayed[..., None, :]  # from token j to token i
    decay = mx.where(on_or_below, mx.exp(mx.where(on_or_below, between, 0.0)), 0.0)  # [H, N, c, c]
    within = ((Cc @ Bc.swapaxes(-1, -2)) * decay) @ inputs  # [H, N, c, Dh]
    S = state.astype(mx.float32)  # [H, Dh, Ds]
    ys = []
    for i in range(N):
        di = decayed[:, i]
        ys.append(within[:, i] + mx.exp(di)[..., None] * (Cc[:, i] @ S.swapaxes(-1, -2)))
        last = di[:, -1]
        carried = (inputs[:, i] * mx.exp(last[:, None] - di)[..., None]).swapaxes(-1, -2) @ Bc[:, i]
        S = S * mx.exp(last)[:, None, None] + carried
    y = mx.moveaxis(mx.concatenate(ys, axis=1)[:, :T], 0, 1)  # [T, H, Dh]
    return y.astype(x.dtype), S
