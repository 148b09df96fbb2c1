"""The gated delta rule by chunks against token by token (mlx-lm's ops path)."""

from runtime.kv.delta_rule import _by_chunks, _token_by_token, delta_step

import mlx.core as mx
import pytest


def inputs(T, H=4, Dk=16, Dv=8, seed=0):
    mx.random.seed(seed)
    q = mx.fast.rms_norm(mx.random.normal((T, H, Dk)), None, 1e-6) / Dk
    k = mx.fast.rms_norm(mx.random.normal((T, H, Dk)), None, 1e-6) * Dk**-0.5
    v = mx.random.normal((T, H, Dv))
    log_decay = -mx.exp(mx.random.normal((H,))) * mx.logaddexp(mx.random.normal((T, H)), 0)
    beta = mx.sigmoid(mx.random.normal((T, H)))
    state = 0.1 * mx.random.normal((H, Dv, Dk))
    return q, k, v, log_decay, beta, state


@pytest.mark.parametrize("T", [1, 5, 64, 65, 160, 200])
def test_chunks_give_the_outputs_and_state_of_one_token_at_a_time(T):
    """Past 64 tokens the state is carried from chunk to chunk; 65 and 200 pad the last."""
    args = inputs(T)
    (y, state), (want_y, want_state) = _by_chunks(*args), _token_by_token(*args)
    assert y.shape == want_y.shape == (T, 4, 8) and state.shape == want_state.shape == (4, 8, 16)
    assert mx.allclose(y, want_y, atol=1e-5).item() and mx.allclose(state, want_state, atol=1e-5).item()


def test_a_span_split_in_two_continues_from_the_first_halfs_state():
    q, k, v, log_decay, beta, state = inputs(100, seed=3)
    whole, whole_state = _by_chunks(q, k, v, log_decay, beta, state)
    first, mid = _by_chunks(q[:30], k[:30], v[:30], log_decay[:30], beta[:30], state)
    second, end = _by_chunks(q[30:], k[30:], v[30:], log_decay[30:], beta[30:], mid)
    assert mx.allclose(mx.concatenate([first, second]), whole, atol=1e-5).item()
    assert mx.allclose(end, whole_state, atol=1e-5).item()


def test_a_bfloat16_models_decode_step_keeps_its_state_in_float32():
    """Only y takes the inputs' dtype: a bfloat16 state would round every step's write."""
    q, k, v, log_decay, beta, state = inputs(1)
    y, new = delta_step(*(x.astype(mx.bfloat16) for x in (q, k, v, log_decay, beta)), state[None])
    assert y.dtype == mx.bfloat16 and new.dtype == mx.float32
