"""The gated delta rule (Gated DeltaNet's recurrence), per row, as mlx-lm and
transformers compute it:

    S <- S * exp(log_decay_t)               the state [H, Dv, Dk] decays
    S <- S + beta_t (v_t - S k_t) k_t^T     and moves its read-out at k_t towards v_t
    y_t = S q_t

`delta_step` takes one token of a batch of rows (a decode step's). `span_delta_rule`
takes one row's span of T tokens: on the CPU in chunks of up to `CHUNK` tokens, each
chunk's T x T interactions as matmuls and one triangular inverse (the WY form of
Yang et al., "Gated Delta Networks", as transformers' torch_chunk_gated_delta_rule),
the state carried from chunk to chunk; elsewhere token by token, as mlx-lm's ops path.
A 160-token span of 16 heads of 128 x 128 took ~20-48 ms by chunks against ~112 ms a
token at a time (the shared 2-core box); both agree to ~1e-6.
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 64


# Compiled: its elementwise ops fuse into a few kernels, once per batch size.
@mx.compile
def delta_step(
    q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token of B rows: q, k [B, H, Dk], v [B, H, Dv], log_decay, beta [B, H], state
    [B, H, Dv, Dk] -> (y [B, H, Dv], the new state)."""
    state = state * mx.exp(log_decay.astype(mx.float32))[..., None, None]
    remembered = (state * k[..., None, :]).sum(axis=-1)  # [B, H, Dv]
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


def span_delta_rule(
    q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One row's T tokens: q, k [T, H, Dk], v [T, H, Dv], log_decay, beta [T, H], state
    [H, Dv, Dk] -> (y [T, H, Dv], the state after them)."""
    if mx.default_device() != mx.cpu:  # mlx's triangular inverse runs on the CPU only
        return _token_by_token(q, k, v, log_decay, beta, state)
    return _by_chunks(q, k, v, log_decay, beta, state)


def _token_by_token(
    q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    ys, batch = [], state[None]
    for t in range(q.shape[0]):
        y, batch = delta_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], log_decay[t : t + 1], beta[t : t + 1], batch)
        ys.append(y)
    return mx.concatenate(ys), batch[0]


def _by_chunks(
    q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    T = q.shape[0]
    C = min(CHUNK, T)
    pad = -T % C  # padded with tokens that write nothing (beta 0) and keep the state (decay 1)
    N = (T + pad) // C

    def chunked(x: mx.array) -> mx.array:  # [T, H, ...] -> [H, N, C, ...], float32
        x = mx.pad(x.astype(mx.float32), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        x = mx.moveaxis(x, 0, 1)
        return x.reshape(x.shape[0], N, C, *x.shape[2:])

    qc, kc, vc, bc = chunked(q), chunked(k), chunked(v), chunked(beta)
    decayed = mx.cumsum(chunked(log_decay), axis=-1)  # [H, N, C]: log decay since the chunk began
    on_or_below = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    below = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    between = decayed[..., :, None] - decayed[..., None, :]  # from token j to token i
    decay = mx.where(on_or_below, mx.exp(mx.where(on_or_below, between, 0.0)), 0.0)  # [H, N, C, C]
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    # Within a chunk each token's write depends on the earlier ones': solved at once,
    # (I + L)^-1 with L the strictly lower beta_i (k_i . k_j) decay_ij.
    interactions = mx.where(below, (k_beta @ kc.swapaxes(-1, -2)) * decay, 0.0)
    solve = mx.linalg.tri_inv(mx.eye(C) + interactions, upper=False, stream=mx.cpu)
    writes = solve @ v_beta  # [H, N, C, Dv]
    reads = solve @ (k_beta * mx.exp(decayed)[..., None])  # [H, N, C, Dk]
    S = state.astype(mx.float32).swapaxes(-1, -2)  # [H, Dk, Dv]
    ys = []
    for i in range(N):
        qi, ki, di = qc[:, i], kc[:, i], decayed[:, i]
        new = writes[:, i] - reads[:, i] @ S  # [H, C, Dv]
        within = (qi @ ki.swapaxes(-1, -2)) * decay[:, i]
        ys.append((qi * mx.exp(di)[..., None]) @ S + within @ new)
        last = di[:, -1]
        S = S * mx.exp(last)[:, None, None] + (ki * mx.exp(last[:, None] - di)[..., None]).swapaxes(-1, -2) @ new
    y = mx.moveaxis(mx.concatenate(ys, axis=1)[:, :T], 0, 1)  # [T, H, Dv]
    return y.astype(q.dtype), S.swapaxes(-1, -2)
