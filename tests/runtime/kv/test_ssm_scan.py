"""Mamba2's scan by chunks against one token at a time, and against mlx-lm's `ssm_attn`."""

from runtime.kv.ssm_scan import span_ssm_scan, ssm_step

import mlx.core as mx
import pytest
from mlx_lm.models.ssm import ssm_attn


def inputs(T, H=4, Dh=8, Ds=16, G=2, seed=0):
    mx.random.seed(seed)
    x = mx.random.normal((T, H, Dh))
    dt = mx.logaddexp(mx.random.normal((T, H)), 0)  # softplus: positive
    B, C = mx.random.normal((T, G, Ds)), mx.random.normal((T, G, Ds))  # each group 2 heads
    log_decay = dt * -mx.exp(mx.random.normal((H,)))
    state = 0.1 * mx.random.normal((H, Dh, Ds))
    return x, dt, B, C, log_decay, state


def one_at_a_time(x, dt, B, C, log_decay, state):
    ys, batch = [], state[None]
    for t in range(x.shape[0]):
        y, batch = ssm_step(x[t : t + 1], dt[t : t + 1], B[t : t + 1], C[t : t + 1], log_decay[t : t + 1], batch)
        ys.append(y)
    return mx.concatenate(ys), batch[0]


@pytest.mark.parametrize("T", [1, 5, 64, 65, 160])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_chunks_give_the_outputs_and_state_of_one_token_at_a_time(T, groups):
    """Past 64 tokens the state is carried from chunk to chunk; 65 and 160 pad the last."""
    args = inputs(T, G=groups)
    (y, state), (want_y, want_state) = span_ssm_scan(*args), one_at_a_time(*args)
    assert y.shape == want_y.shape == (T, 4, 8) and state.shape == want_state.shape == (4, 8, 16)
    assert mx.allclose(y, want_y, atol=1e-4).item() and mx.allclose(state, want_state, atol=1e-4).item()


def test_a_span_split_in_two_continues_from_the_first_halfs_state():
    x, dt, B, C, log_decay, state = inputs(100, seed=3)
    whole, whole_state = span_ssm_scan(x, dt, B, C, log_decay, state)
    first, mid = span_ssm_scan(x[:30], dt[:30], B[:30], C[:30], log_decay[:30], state)
    second, end = span_ssm_scan(x[30:], dt[30:], B[30:], C[30:], log_decay[30:], mid)
    assert mx.allclose(mx.concatenate([first, second]), whole, atol=1e-4).item()
    assert mx.allclose(end, whole_state, atol=1e-4).item()


def test_it_matches_mlx_lms_scan_from_a_state():
    """mlx-lm's takes raw dt (it applies softplus(dt + dt_bias)) and A_log; its D is 0 here.
    Two groups of two heads each: head h reads group h // 2, as mlx-lm's repeat lays them."""
    T, H = 70, 4
    x, raw_dt, B, C, _, state = inputs(T, seed=5)
    A_log, dt_bias = mx.random.normal((H,)), mx.zeros((H,))
    dt = mx.clip(mx.logaddexp(raw_dt, 0), 0.001, 100.0)
    y, new = span_ssm_scan(x, dt, B, C, dt * -mx.exp(A_log), state)
    want_y, want = ssm_attn(x[None], A_log, B[None], C[None], mx.zeros((H,)), raw_dt[None], dt_bias, state[None])
    assert mx.allclose(y, want_y[0], atol=1e-4).item() and mx.allclose(new, want[0], atol=1e-4).item()


def test_a_bfloat16_models_decode_step_keeps_its_state_in_float32():
    """Only y takes the inputs' dtype: a bfloat16 state would round every step's write."""
    x, dt, B, C, log_decay, state = inputs(1)
    y, new = ssm_step(x.astype(mx.bfloat16), dt, B.astype(mx.bfloat16), C.astype(mx.bfloat16), log_decay, state[None])
    assert y.dtype == mx.bfloat16 and new.dtype == mx.float32
