"""Paged attention: the vectorized path against the gather reference, from one pool state."""

import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

from kernels import paged_attention as pa


def reference_attention(q, k, v, scale, mask):
    """Plain attention with K/V heads repeated: q [B, H, T, D]; k, v [B, Hkv, L, D]."""
    repeat = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1, precise=True) @ v

BLOCK = 4


def make_step(starts, num_new, num_kv_heads, group, num_blocks=64, seed=0):
    """A pool with random history for each row, and a step of new tokens on top."""
    rng = np.random.default_rng(seed)
    tables, free = [], list(rng.permutation(num_blocks))  # scattered, not contiguous
    for s, n in zip(starts, num_new, strict=True):
        tables.append([int(free.pop()) for _ in range(-(-(s + n) // BLOCK))])
    width = max(len(t) for t in tables)
    table = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    step = pa.PagedStep(
        tables=mx.array(table),
        starts=tuple(starts),
        num_new=tuple(num_new),
        block_size=BLOCK,
        num_slots=num_blocks * BLOCK,
        num_kv_heads=num_kv_heads,
        num_queries_per_kv=group,
    )
    D, N = 16, sum(num_new)
    shape = (num_kv_heads * num_blocks * BLOCK, D)
    keys = mx.array(rng.standard_normal(shape).astype(np.float32))
    values = mx.array(rng.standard_normal(shape).astype(np.float32))
    q = mx.array(rng.standard_normal((N, num_kv_heads * group, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((N, num_kv_heads, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((N, num_kv_heads, D)).astype(np.float32))
    return step, tables, keys, values, q, k, v


def run(path, step, keys, values, q, k, v):
    pools = ([mx.array(keys)], [mx.array(values)])
    out = pa.paged_attention(pools, 0, q, k, v, 0.25, step, path)
    mx.eval(out, pools)
    return out, pools


SHAPES = {
    "decode, ragged": ([5, 17, 0, 30], [1, 1, 1, 1]),
    "mixed": ([9, 0, 22, 3], [1, 13, 1, 6]),
    "prefill chunks straddling blocks": ([3, 7], [9, 5]),
    "one row": ([40], [1]),
}


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_fast_matches_gather_from_the_same_pool_state(shape, group):
    starts, num_new = SHAPES[shape]
    step, _, keys, values, q, k, v = make_step(starts, num_new, 2, group)
    before = pa.dispatch_counts["fast"]
    fast, fast_pools = run("fast", step, keys, values, q, k, v)
    gather, gather_pools = run("gather", step, keys, values, q, k, v)
    assert mx.allclose(fast, gather, atol=1e-5, rtol=1e-5).item()
    assert mx.array_equal(fast_pools[0][0], gather_pools[0][0]).item()
    assert before == pa.dispatch_counts["fast"]  # run() forces paths; dispatch() counts


@pytest.mark.parametrize("group", [1, 4])
def test_gather_matches_plain_attention_over_each_rows_history(group):
    starts, num_new = [9, 0, 22], [1, 13, 3]
    step, tables, keys, values, q, k, v = make_step(starts, num_new, 2, group)
    out, _ = run("gather", step, keys, values, q, k, v)
    S, D = 64 * BLOCK, 16
    lo = 0
    for table, s, n in zip(tables, starts, num_new, strict=True):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(s)]
        hist_k = keys.reshape(2, S, D)[:, mx.array(slots, dtype=mx.int32)] if s else mx.zeros((2, 0, D))
        hist_v = values.reshape(2, S, D)[:, mx.array(slots, dtype=mx.int32)] if s else mx.zeros((2, 0, D))
        row_k = mx.concatenate([hist_k, k[lo : lo + n].transpose(1, 0, 2)], axis=1)[None]
        row_v = mx.concatenate([hist_v, v[lo : lo + n].transpose(1, 0, 2)], axis=1)[None]
        for t in range(n):  # query t sees positions [0, s + t]
            want = reference_attention(
                q[lo + t][None, :, None, :], row_k[:, :, : s + t + 1], row_v[:, :, : s + t + 1], 0.25, None
            )
            assert mx.allclose(out[lo + t], want[0, :, 0], atol=1e-5).item()
        lo += n


def test_every_new_token_is_written_once_at_its_slot_whichever_path_runs():
    starts, num_new = [5, 2], [1, 7]
    step, tables, keys, values, q, k, v = make_step(starts, num_new, 2, 2)
    S = 64 * BLOCK
    for path in ("fast", "gather"):
        _, (new_keys, _) = run(path, step, keys, values, q, k, v)
        written = np.array(new_keys[0].reshape(2, S, 16))
        expected = np.array(keys.reshape(2, S, 16))
        lo = 0
        for table, s, n in zip(tables, starts, num_new, strict=True):
            for t in range(n):
                p = s + t
                expected[:, table[p // BLOCK] * BLOCK + p % BLOCK] = np.array(k[lo + t])
            lo += n
        assert np.array_equal(written, expected), path


def test_a_declined_fast_path_builds_nothing_and_the_pool_is_written_once(monkeypatch):
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    monkeypatch.setenv("CADENCE_PAGED_FAST_MIN_KEYS", "100000")  # this step is below it
    step, tables, keys, values, q, k, v = make_step([5, 2], [1, 7], 2, 2)
    path = pa.dispatch(step)
    assert path == "gather"

    def never(*args):
        raise AssertionError("a declined step built the fast plan")

    monkeypatch.setattr(pa._FastPlan, "__init__", never)
    out, pools = run(path, step, keys, values, q, k, v)
    monkeypatch.undo()
    _, reference_pools = run("gather", step, keys, values, q, k, v)
    assert mx.array_equal(pools[0][0], reference_pools[0][0]).item()


def test_select_path_follows_the_floor_the_cap_and_the_environment(monkeypatch):
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    monkeypatch.delenv("CADENCE_PAGED_FAST_MIN_KEYS", raising=False)
    small = pa.StepShape(1, 1, 64, 0, 4, 4)
    big = pa.StepShape(16, 1, 2048, 0, 4, 4)
    huge_prefill = pa.StepShape(2, 4096, 8192, 2, 8, 8)
    assert pa.select_path(small).reason == "below_floor" and pa.select_path(small).path == "gather"
    assert pa.select_path(big).path == "fast"
    assert pa.select_path(huge_prefill).reason == "scores_over_cap"
    monkeypatch.setenv("CADENCE_PAGED_FAST_MIN_KEYS", "1")
    assert pa.select_path(small).path == "fast"
    monkeypatch.setenv("CADENCE_PAGED_FAST_MIN_KEYS", "lots")  # a typo keeps the measured floor
    assert pa.select_path(small).reason == "below_floor"
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "gather")
    assert pa.select_path(big) == pa.Decision("gather", "forced", "CADENCE_PAGED_ATTENTION=gather")
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "fast")
    assert pa.select_path(small).path == "fast"


def test_dispatch_counts_every_step_and_logs_each_outcome_once(monkeypatch):
    monkeypatch.setattr(pa, "_logged", set())
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "fast")
    step = make_step([3, 9], [1, 1], 2, 2)[0]
    before = pa.dispatch_counts["fast"]
    with capture_logs() as logs:
        assert [pa.dispatch(step) for _ in range(3)] == ["fast"] * 3
        monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "gather")
        pa.dispatch(step)
        pa.dispatch(step)
    assert pa.dispatch_counts["fast"] == before + 3
    events = [(e["path"], e["reason"], e["log_level"]) for e in logs if e["event"] == "paged_attention"]
    assert events == [("fast", "forced", "info"), ("gather", "forced", "info")]
