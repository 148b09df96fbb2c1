"""The per-row recurrent state (runtime/kv/recurrent.py) on its own: which state a
span reads, where the store keeps what a step computed, and what it hands the engine
to evaluate. Each token's inputs are a function of its row and position, so the same
row's same tokens give the same outputs from the same state."""

from runtime.kv.base import RowSpan
from runtime.kv.recurrent import RecurrentStore

import mlx.core as mx
import numpy as np
import pytest

C, K, H, D = 6, 4, 2, 4  # conv channels and kernel, heads, head size


def token_inputs(seq_id, position):
    rng = np.random.default_rng(1000 * seq_id + position)
    x, q, k, v = (rng.standard_normal(n).astype(np.float32) for n in (C, H * D, H * D, H * D))
    log_decay = -rng.uniform(0.1, 1.0, H).astype(np.float32)
    beta = rng.uniform(0.2, 0.9, H).astype(np.float32)
    return x, q / 4, k / 4, v, log_decay, beta


def forward(store, spans, *, layers=2, commit=True):
    """Every layer's conv and delta-rule outputs for each span's row: {seq_id: [N, ...]}."""
    step = store.step(spans)
    per_token = [token_inputs(s.seq_id, s.start + i) for s in spans for i in range(s.num_new)]
    x, q, k, v, log_decay, beta = (mx.array(np.stack(column)) for column in zip(*per_token, strict=True))
    weight = mx.array(np.linspace(-1, 1, C * K, dtype=np.float32).reshape(C, K))
    outs = []
    for layer in range(layers):
        conv = step.convolve(layer, x * (layer + 1), weight)
        heads = (q.reshape(-1, H, D), k.reshape(-1, H, D), v.reshape(-1, H, D))
        y = step.delta_rule(layer, *heads, log_decay, beta)
        outs.append(mx.concatenate([conv, y.reshape(-1, H * D)], axis=-1))
    if commit:
        store.commit(step)
    out = np.array(mx.concatenate(outs, axis=-1))
    ends = np.cumsum([0] + [s.num_new for s in spans])
    return {s.seq_id: out[ends[i] : ends[i + 1]] for i, s in enumerate(spans)}


def span(seq_id, start, num_new=1):
    return RowSpan(seq_id, start, num_new, (0,))


def test_a_span_starting_at_0_reads_zero_states_whatever_its_row_held():
    """A recompute from the start (a preempted row, a retry) must not continue from the
    state its row reached before."""
    store = RecurrentStore()
    first = forward(store, [span(0, 0, 3)])
    forward(store, [span(0, 3)])
    again = forward(store, [span(0, 0, 3)])
    assert np.array_equal(again[0], first[0])


def test_decoding_rows_in_another_order_than_their_last_step_read_their_own_states():
    """The last step's batch is read whole only where the rows come in its order."""

    def run(last_order):
        store = RecurrentStore()
        forward(store, [span(r, 0, 3) for r in range(3)])
        forward(store, [span(r, 3) for r in range(3)])  # held as one batch
        return forward(store, [span(r, 4) for r in last_order])

    in_order, reordered = run([0, 1, 2]), run([2, 0, 1])
    for r in range(3):
        assert np.allclose(reordered[r], in_order[r], atol=1e-6), r


@pytest.mark.parametrize(("num_rows", "stepping"), [(2, 0), (3, 0), (3, 2)])
def test_a_row_sitting_out_a_step_keeps_its_own_state_not_the_batch(num_rows, stepping):
    store = RecurrentStore()
    forward(store, [span(r, 0) for r in range(num_rows)])
    batch = store._rows[0].delta[0].batch
    forward(store, [span(stepping, 1)])  # the others sit out
    for r in set(range(num_rows)) - {stepping}:
        row = store._rows[r]
        assert all(h.batch.shape[0] == 1 for h in (*row.conv, *row.delta)), r
        assert mx.array_equal(row.delta[0].array, batch[r]).item()


def test_a_prompt_row_sitting_out_drops_the_conv_batch_it_shared():
    """A prompt chunk's delta state is its own, but its conv inputs are kept in the
    step's batch with every other row's."""
    store = RecurrentStore()
    forward(store, [span(0, 0, 3), span(1, 0)])
    conv = store._rows[0].conv[0]
    assert conv.batch.shape[0] == 2 and store._rows[0].delta[0].batch.shape[0] == 1
    forward(store, [span(1, 1)])  # row 0 awaits its budget
    row = store._rows[0]
    assert all(h.batch.shape[0] == 1 for h in (*row.conv, *row.delta))
    assert mx.array_equal(row.conv[0].array, conv.array).item()


def test_arrays_are_every_state_held_conv_and_delta_once_each():
    store = RecurrentStore()
    forward(store, [span(r, 0) for r in range(2)], layers=1)
    row = store._rows[0]
    held = store.arrays()
    assert len(held) == 2
    assert {id(a) for a in held} == {id(row.conv[0].batch), id(row.delta[0].batch)}


@pytest.mark.parametrize("which", ["convolve", "delta_rule"])
def test_a_layer_out_of_order_is_refused(which):
    step = RecurrentStore().step([span(0, 0)])
    q = mx.ones((1, H, D))
    with pytest.raises(ValueError, match="recurrent layer 1 (convolved|stepped) out of order"):
        if which == "convolve":
            step.convolve(1, mx.ones((1, C)), mx.ones((C, K)))
        else:
            step.delta_rule(1, q, q, q, mx.zeros((1, H)), mx.ones((1, H)))


def test_a_snapshot_is_taken_only_of_a_row_at_the_position_asked():
    """A row whose span did not run (failed, skipped) is not where it would end: no
    snapshot of it, nor of a row the store does not hold."""
    store = RecurrentStore()
    forward(store, [span(0, 0, 3)])
    assert store.snapshot(0, 4) is None and store.snapshot(1, 3) is None
    kept = store.snapshot(0, 3)
    assert kept is not None and kept.position == 3
