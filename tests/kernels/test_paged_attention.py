"""Paged attention: the native and vectorized paths against the gather reference, from one pool state."""

import importlib.util

import attrs
import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

from kernels import paged_attention as pa
from kernels.cpu_extension import cpu_extension
from kernels.paged_attention_mx import attention
from tests.kernels.test_quantized_matmul import run_with_isa_cap

IS_BUILT = importlib.util.find_spec("kernels._cpu_ext") is not None
needs_native = pytest.mark.skipif(not IS_BUILT, reason="the C++ kernels were not built here")
# Every path, for tests that must hold on each; the native one needs the built extension.
ATTENTION_PATHS = ["gather", "fast", pytest.param("native", marks=needs_native)]


def reference_attention(q, k, v, scale, mask, softcap=0.0, sinks=None):
    """Plain attention with K/V heads repeated: q [B, H, T, D]; k, v [B, Hkv, L, D];
    scores soft-capped at softcap * tanh(s / softcap) where softcap > 0; sinks [H]: one
    more score per head, in the softmax, whose weight multiplies no value."""
    repeat = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    if softcap:
        scores = softcap * mx.tanh(scores / softcap)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    if sinks is None:
        return mx.softmax(scores, axis=-1, precise=True) @ v
    column = mx.broadcast_to(sinks[:, None, None], (*scores.shape[:-1], 1))
    probs = mx.softmax(mx.concatenate([scores, column], axis=-1), axis=-1, precise=True)
    return probs[..., :-1] @ v

BLOCK = 4


def make_step(
    starts, num_new, num_kv_heads, group, num_blocks=64, seed=0, head_dim=16, block_size=BLOCK
):
    """A pool with random history for each row, and a step of new tokens on top."""
    rng = np.random.default_rng(seed)
    tables, free = [], list(rng.permutation(num_blocks))  # scattered, not contiguous
    for s, n in zip(starts, num_new, strict=True):
        tables.append([int(free.pop()) for _ in range(-(-(s + n) // block_size))])
    width = max(len(t) for t in tables)
    table = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    step = pa.PagedStep(
        tables=mx.array(table),
        starts=tuple(starts),
        num_new=tuple(num_new),
        block_size=block_size,
        num_slots=num_blocks * block_size,
        num_kv_heads=num_kv_heads,
        num_queries_per_kv=group,
    )
    D, N = head_dim, sum(num_new)
    shape = (num_kv_heads * num_blocks * block_size, D)
    keys = mx.array(rng.standard_normal(shape).astype(np.float32))
    values = mx.array(rng.standard_normal(shape).astype(np.float32))
    q = mx.array(rng.standard_normal((N, num_kv_heads * group, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((N, num_kv_heads, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((N, num_kv_heads, D)).astype(np.float32))
    return step, tables, keys, values, q, k, v


def run(path, step, keys, values, q, k, v, softcap=0.0, sinks=None):
    pools = ([mx.array(keys)], [mx.array(values)])
    out = pa.paged_attention(pools, 0, q, k, v, 0.25, step, path, softcap=softcap, sinks=sinks)
    mx.eval(out, pools)
    return out, pools


def without_fresh_tails(pool, step):
    """The pool with the slots the mlx paths zero (see PagedStep.write_rows_and_tails) zeroed."""
    rows, num_tails = step.write_rows_and_tails
    pool = np.array(pool)
    tails = np.array(rows).reshape(step.num_kv_heads, -1)[:, -num_tails:] if num_tails else []
    pool[np.ravel(tails).astype(np.int64)] = 0
    return pool


SHAPES = {
    "decode, ragged": ([5, 17, 0, 30], [1, 1, 1, 1]),
    "mixed": ([9, 0, 22, 3], [1, 13, 1, 6]),
    "prefill chunks straddling blocks": ([3, 7], [9, 5]),
    "one row": ([40], [1]),
    # Native tiles of 8 to 32 query heads: whole ones, and partial ones.
    "long chunks, partial tiles": ([0, 2], [34, 19]),
}


@pytest.mark.parametrize("path", ["fast", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_each_path_matches_gather_from_the_same_pool_state(shape, group, path):
    starts, num_new = SHAPES[shape]
    step, _, keys, values, q, k, v = make_step(starts, num_new, 2, group)
    before = pa.dispatch_counts[path]
    out, pools = run(path, step, keys, values, q, k, v)
    gather, gather_pools = run("gather", step, keys, values, q, k, v)
    assert mx.allclose(out, gather, atol=1e-5, rtol=1e-5).item()
    # The native kernel reads no masked slot: it leaves fresh tails as they were.
    assert np.array_equal(*(without_fresh_tails(p[0][0], step) for p in (pools, gather_pools)))
    assert before == pa.dispatch_counts[path]  # run() forces paths; dispatch() counts


@pytest.mark.parametrize("path", ["fast", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("head_dim", [16, 20])
@pytest.mark.parametrize("shape", SHAPES)
def test_soft_capped_scores_match_gather_on_each_path(shape, head_dim, path):
    """Gemma 2's capped scores: decode tokens, prefill tiles (a head dim of whole
    vectors and one ending in scalars), scores well past the cap of 1.5."""
    starts, num_new = SHAPES[shape]
    step, _, keys, values, q, k, v = make_step(starts, num_new, 2, 4, head_dim=head_dim)
    q = q * 4
    out, _ = run(path, step, keys, values, q, k, v, softcap=1.5)
    gather, _ = run("gather", step, keys, values, q, k, v, softcap=1.5)
    assert mx.allclose(out, gather, atol=1e-5, rtol=1e-5).item()
    plain, _ = run("gather", step, keys, values, q, k, v)
    assert not mx.allclose(plain, gather, atol=1e-2).item()


def some_sinks(num_heads, seed=3):
    """Sinks that matter beside scores of ~N(0, 1): from well below them to well above."""
    return mx.array(np.random.default_rng(seed).uniform(-2.0, 3.0, num_heads).astype(np.float32))


@pytest.mark.parametrize("path", ["fast", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("group", [2, 5])
@pytest.mark.parametrize("head_dim", [16, 20])
@pytest.mark.parametrize("shape", SHAPES)
def test_sinks_match_gather_on_each_path(shape, head_dim, group, path):
    """gpt-oss's sinks: decode tokens (5 heads a KV head: four at a time, then one),
    prefill tiles (2 heads a KV head: 8 lanes hold 4 tokens; 5 would leave too few lanes
    for a tile), a head dim ending in scalars; each head its own sink."""
    starts, num_new = SHAPES[shape]
    step, _, keys, values, q, k, v = make_step(starts, num_new, 2, group, head_dim=head_dim)
    sinks = some_sinks(2 * group)
    out, _ = run(path, step, keys, values, q, k, v, sinks=sinks)
    gather, _ = run("gather", step, keys, values, q, k, v, sinks=sinks)
    assert mx.allclose(out, gather, atol=1e-5, rtol=1e-5).item()
    plain, _ = run("gather", step, keys, values, q, k, v)
    assert not mx.allclose(plain, gather, atol=1e-2).item()
    # Each head reads its own sink: the heads' order matters.
    swapped, _ = run(path, step, keys, values, q, k, v, sinks=sinks[::-1])
    assert not mx.allclose(swapped, gather, atol=1e-3).item()



@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_16_bit_sinks_attend_as_their_float32_values(path):
    """A 16-bit checkpoint's sinks beside a float32 pool (the native op reads float32)."""
    step, _, keys, values, q, k, v = make_step([5, 2], [1, 7], 2, 2)
    sinks = some_sinks(4).astype(mx.bfloat16)
    want, _ = run("gather", step, keys, values, q, k, v, sinks=sinks.astype(mx.float32))
    got, _ = run(path, step, keys, values, q, k, v, sinks=sinks)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()

@needs_native
def test_the_native_op_refuses_sinks_that_are_not_one_per_query_head():
    ext = cpu_extension()
    step, _, keys, values, q, k, v = make_step([5], [1], 2, 4)
    index = (step.tables, step.row_of_token, step.positions, 2, BLOCK, 0, 0.25)
    with pytest.raises(ValueError, match="sinks must be"):
        ext.paged_attention_write(q, k, v, keys, values, *index, sinks=mx.zeros((4,)))


@needs_native
@pytest.mark.parametrize("block_size", [BLOCK, 16, 32])
@pytest.mark.parametrize("head_dim", [20, 40, 64])
@pytest.mark.parametrize("group", [2, 3, 5, 8])
def test_a_decode_token_matches_gather_whatever_its_heads_and_head_dim(group, head_dim, block_size):
    """A decode token's query heads go four at a time and the rest together; a head dim
    that is not whole vectors ends in scalars; keys go 16 at a time at most (blocks of 16
    are whole chunks, of 32 two); histories of many blocks (prefetched as they are read)."""
    step, _, keys, values, q, k, v = make_step(
        [5, 47, 0, 63, 16], [1] * 5, 2, group, num_blocks=96, head_dim=head_dim, block_size=block_size
    )
    native, _ = run("native", step, keys, values, q, k, v)
    gather, _ = run("gather", step, keys, values, q, k, v)
    assert mx.allclose(native, gather, atol=1e-5, rtol=1e-5).item()


@needs_native
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_a_half_precision_pool_runs_the_fast_path_on_any_device(dtype):
    """mlx's CPU gather_mm takes float32 only: on the CPU, the decode rows of a 16-bit
    pool (--keep-dtype, or no extension) failed every step from 512 rows x keys."""
    step, _, keys, values, q, k, v = make_step([600, 300, 5], [1, 1, 9], 2, 4, num_blocks=256)
    step = pa.PagedStep(**{**attrs.asdict(step, recurse=False), "is_float32": False})
    half = [x.astype(dtype) for x in (keys, values, q, k, v)]
    out, _ = run("fast", step, *half)
    reference, _ = run("gather", step, *half)
    assert out.dtype == dtype
    assert mx.allclose(out.astype(mx.float32), reference.astype(mx.float32), atol=2e-2).item()


ON_CPU = mx.default_device() == mx.cpu


@pytest.mark.skipif(not ON_CPU, reason="the native kernel is the CPU's")
def test_the_native_path_runs_the_cpu_kernel():
    step, _, keys, values, q, k, v = make_step([5, 17, 2], [1, 1, 9], 2, 4)
    ext = cpu_extension()
    assert ext is not None, "built but not loaded: see kernels.cpu_extension.kernel_status()"
    before = ext.num_attention_calls()
    run("native", step, keys, values, q, k, v)
    assert ext.num_attention_calls() == before + 1


@needs_native
def test_a_table_pointing_outside_the_pool_gives_nan_not_a_wild_read():
    step, tables, keys, values, q, k, v = make_step([5, 17], [1, 1], 2, 4)
    ext = cpu_extension()
    args = (q, k, v, keys, values)
    index = (step.row_of_token, step.positions, 2, BLOCK, 0, 0.25)
    sound, _, _ = ext.paged_attention_write(*args, step.tables, *index)
    assert mx.isfinite(sound).all().item()
    for bad_block in (64, -1, 1 << 30):  # the pool has 64 blocks
        bad = np.array(step.tables)
        bad[1, 2] = bad_block
        out, written_keys, _ = ext.paged_attention_write(*args, mx.array(bad), *index)
        assert mx.isnan(out).all().item(), bad_block
        assert mx.array_equal(written_keys, keys).item()  # and nothing written
    past_the_table = mx.array([0, 1000], dtype=mx.int32)
    out, _, _ = ext.paged_attention_write(*args, step.tables, step.row_of_token, past_the_table, 2, BLOCK, 0, 0.25)
    assert mx.isnan(out).all().item()


@pytest.mark.parametrize("mask", [None, "causal", "window"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_soft_capped_attention_matches_capped_plain_attention(group, mask):
    """The contiguous cache's op (kernels/paged_attention_mx.py): 3 queries, the last 3
    of 7 positions; "causal" lets query t see positions up to 4 + t."""
    q = mx.random.normal((1, 4, 3, 16), key=mx.random.key(0)) * 4
    k, v = (mx.random.normal((1, 4 // group, 7, 16), key=mx.random.key(i)) for i in (1, 2))
    causal = mx.arange(7)[None, :] <= mx.arange(3)[:, None] + 4
    want_mask = {None: None, "causal": causal, "window": causal & (mx.arange(7)[None, :] >= mx.arange(3)[:, None] + 2)}[mask]
    got = attention(q, k, v, 0.25, want_mask if mask == "window" else mask, 1.5)
    assert mx.allclose(got, reference_attention(q, k, v, 0.25, want_mask, 1.5), atol=1e-5).item()
    assert not mx.allclose(got, reference_attention(q, k, v, 0.25, want_mask), atol=1e-2).item()
    sinks = some_sinks(4)  # and with sinks beside the caps, or alone
    got = attention(q, k, v, 0.25, want_mask if mask == "window" else mask, 1.5, sinks)
    assert mx.allclose(got, reference_attention(q, k, v, 0.25, want_mask, 1.5, sinks), atol=1e-5).item()
    got = attention(q, k, v, 0.25, want_mask if mask == "window" else mask, 0.0, sinks)
    assert mx.allclose(got, reference_attention(q, k, v, 0.25, want_mask, 0.0, sinks), atol=1e-5).item()
    assert not mx.allclose(got, reference_attention(q, k, v, 0.25, want_mask), atol=1e-2).item()


@pytest.mark.parametrize(
    ("softcap", "with_sinks"), [(0.0, False), (1.5, False), (0.0, True)], ids=["plain", "soft-capped", "sinks"]
)
@pytest.mark.parametrize("group", [1, 4])
def test_gather_matches_plain_attention_over_each_rows_history(group, softcap, with_sinks):
    starts, num_new = [9, 0, 22], [1, 13, 3]
    step, tables, keys, values, q, k, v = make_step(starts, num_new, 2, group)
    sinks = some_sinks(2 * group) if with_sinks else None
    out, _ = run("gather", step, keys, values, q, k, v, softcap, sinks)
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
                q[lo + t][None, :, None, :], row_k[:, :, : s + t + 1], row_v[:, :, : s + t + 1], 0.25, None,
                softcap, sinks,
            )
            assert mx.allclose(out[lo + t], want[0, :, 0], atol=1e-5).item()
        lo += n


@pytest.mark.parametrize(
    ("starts", "num_new"),
    [([5, 2], [1, 7]), ([8, 4, 6], [2, 1, 2])],
    ids=["opened-mid-step", "opened-at-the-steps-first-token"],
)
def test_every_new_token_is_written_once_at_its_slot_whichever_path_runs(starts, num_new):
    """...and the mlx paths zero the rest of a block a row opens (see fresh tails)."""
    step, tables, keys, values, q, k, v = make_step(starts, num_new, 2, 2)
    S = 64 * BLOCK
    for path in ("fast", "gather") + (("native",) if IS_BUILT else ()):
        _, (new_keys, _) = run(path, step, keys, values, q, k, v)
        written = np.array(new_keys[0].reshape(2, S, 16))
        expected = np.array(keys.reshape(2, S, 16))
        lo = 0
        for table, s, n in zip(tables, starts, num_new, strict=True):
            for t in range(n):
                p = s + t
                expected[:, table[p // BLOCK] * BLOCK + p % BLOCK] = np.array(k[lo + t])
            lo += n
        for table, s, n in zip(tables, starts, num_new, strict=True):
            last = (s + n - 1) // BLOCK  # the row's last block: opened here where it starts at s or later
            if path != "native" and last * BLOCK >= s:  # the rest of it is zeroed
                expected[:, table[last] * BLOCK + (s + n) - last * BLOCK : table[last] * BLOCK + BLOCK] = 0
        assert np.array_equal(written, expected), path


def without_native(monkeypatch):
    monkeypatch.setattr(pa, "cpu_extension", lambda: None)


def test_a_declined_fast_path_builds_nothing_and_the_pool_is_written_once(monkeypatch):
    without_native(monkeypatch)
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    monkeypatch.setenv("CADENCE_PAGED_FAST_MIN_KEYS", "100000")  # this step is below it
    step, tables, keys, values, q, k, v = make_step([5, 2], [1, 7], 2, 2)
    path = pa.dispatch(step)
    assert path == "gather"

    def never(*args):
        raise AssertionError("a declined step built the fast plan")

    monkeypatch.setattr(pa.FastPlan, "__init__", never)
    out, pools = run(path, step, keys, values, q, k, v)
    monkeypatch.undo()
    _, reference_pools = run("gather", step, keys, values, q, k, v)
    assert mx.array_equal(pools[0][0], reference_pools[0][0]).item()


def test_without_native_select_path_follows_the_floor_the_cap_and_the_environment(monkeypatch):
    without_native(monkeypatch)
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    monkeypatch.delenv("CADENCE_PAGED_FAST_MIN_KEYS", raising=False)
    small = pa.StepShape(1, 1, 64, 0, 4, 4)
    big = pa.StepShape(16, 1, 2048, 0, 4, 4)
    huge_prefill = pa.StepShape(2, 4096, 8192, 2, 8, 8)
    assert pa.select_path(small).reason == "below_floor" and pa.select_path(small).path == "gather"
    assert pa.select_path(big).path == "fast"
    assert pa.select_path(huge_prefill).reason == "scores_over_cap"
    at_the_floor = pa.StepShape(1, 1, pa.FAST_MIN_KEYS, 0, 4, 4)  # 1 row x the floor's keys
    assert pa.select_path(at_the_floor).reason == "at_or_above_floor"
    below = attrs.evolve(at_the_floor, max_visible=pa.FAST_MIN_KEYS - 1)
    assert pa.select_path(below).path == "gather"
    monkeypatch.setenv("CADENCE_PAGED_FAST_MIN_KEYS", "1")
    assert pa.select_path(small).path == "fast"
    monkeypatch.setenv("CADENCE_PAGED_FAST_MIN_KEYS", "lots")  # a typo keeps the measured floor
    assert pa.select_path(small).reason == "below_floor"
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "gather")
    assert pa.select_path(big) == pa.Decision("gather", "forced", "CADENCE_PAGED_ATTENTION=gather")
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "fast")
    assert pa.select_path(small).path == "fast"
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "native")  # cannot run here: the rules decide
    assert pa.select_path(small).reason == "below_floor"


@needs_native
def test_the_native_kernel_runs_every_float32_cpu_step_unless_forced_away(monkeypatch):
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    shapes = [pa.StepShape(1, 1, 64, 0, 4, 4), pa.StepShape(2, 4096, 8192, 2, 8, 8)]
    for shape in shapes:
        assert pa.select_path(shape).path == "native"
        assert pa.select_path(pa.StepShape(*attrs_tuple(shape)[:6], is_float32=False)).path != "native"
    too_many_heads = pa.StepShape(16, 1, 2048, 0, 1, pa.MAX_NATIVE_QUERIES_PER_KV + 1)
    assert pa.native_kernel_reason(too_many_heads) is not None
    assert pa.select_path(too_many_heads).path == "fast"
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "gather")
    assert pa.select_path(shapes[0]).path == "gather"


def attrs_tuple(shape):
    return (shape.num_rows, shape.max_new, shape.max_visible, shape.num_multi_rows,
            shape.num_kv_heads, shape.num_queries_per_kv)


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


EVERY_SHAPE_SCRIPT = """
import mlx.core as mx
from kernels.cpu_extension import cpu_extension
from tests.kernels.test_paged_attention import SHAPES, make_step, run
for shape in SHAPES.values():
    for group, head_dim, block in ((1, 16, 4), (4, 16, 4), (7, 16, 4), (5, 20, 16), (2, 40, 16)):
        step, _, keys, values, q, k, v = make_step(*shape, 2, group, head_dim=head_dim, block_size=block)
        native, _ = run("native", step, keys, values, q, k, v)
        gather, _ = run("gather", step, keys, values, q, k, v)
        assert mx.allclose(native, gather, atol=1e-5, rtol=1e-5).item(), (shape, group, head_dim)
        sinks = mx.linspace(-2.0, 3.0, 2 * group)
        native, _ = run("native", step, keys, values, q, k, v, sinks=sinks)
        gather, _ = run("gather", step, keys, values, q, k, v, sinks=sinks)
        assert mx.allclose(native, gather, atol=1e-5, rtol=1e-5).item(), ("sinks", shape, group)
print(cpu_extension().attention_isa())
"""


@needs_native
@pytest.mark.parametrize("cap", ["baseline", "avx2"])
def test_every_instruction_set_of_the_native_kernel_matches_gather(cap):
    """Tiles hold 32 query heads with AVX-512 and 8 otherwise: both tilings, and the
    token-by-token path, against the reference, with and without sinks."""
    assert run_with_isa_cap(EVERY_SHAPE_SCRIPT, cap) == cap


@needs_native
def test_the_native_write_takes_the_pools_buffers_unless_someone_still_holds_them():
    """The K/V write donates the old pools (no copy a step) yet never changes an array
    someone still holds: a held pool is copied, and keeps its old contents."""
    ext = cpu_extension()
    step, _, keys, values, q, k, v = make_step([5, 17], [1, 3], 2, 4)
    index = (step.tables, step.row_of_token, step.positions, 2, BLOCK, 0, 0.25)
    held_keys, held_values = mx.array(keys), mx.array(values)
    mx.eval(held_keys, held_values)
    snapshot = np.array(held_keys)
    copies = ext.num_pool_copies()
    out, new_keys, new_values = ext.paged_attention_write(q, k, v, held_keys, held_values, *index)
    mx.eval(out, new_keys, new_values)
    assert ext.num_pool_copies() == copies + 2
    assert np.array_equal(np.array(held_keys), snapshot)  # the held pool is untouched
    assert not mx.array_equal(new_keys, held_keys).item()  # the new one has the step's rows
    _, pools = run("gather", step, keys, values, q, k, v)
    assert mx.array_equal(new_keys, pools[0][0]).item() and mx.array_equal(new_values, pools[1][0]).item()
    # Held by nothing but the call: donated, not copied.
    lone = [mx.array(keys), mx.array(values)]
    mx.eval(lone)
    copies = ext.num_pool_copies()
    out, lone[0], lone[1] = ext.paged_attention_write(q, k, v, lone[0], lone[1], *index)
    mx.eval(out, lone)
    assert ext.num_pool_copies() == copies
    assert mx.array_equal(lone[0], pools[0][0]).item()


@needs_native
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("group", "rotated_dims", "rope_scale", "window"),
    [(1, 16, 1.0, 0), (4, 16, 0.25, 0), (4, 8, 1.0, 0), (2, 16, 1.0, 6)],
)
def test_the_rotary_op_equals_rope_then_the_write_op_exactly(shape, group, rotated_dims, rope_scale, window):
    """paged_attention_rotary reads a stacked qkv [N, (H + 2 Hkv) * D]: its outputs and
    pools must be those of RoPE on the q and k slices, then paged_attention_write."""
    ext = cpu_extension()
    starts, num_new = SHAPES[shape]
    step, _, keys, values, q, k, v = make_step(starts, num_new, 2, group)
    N, H, D = q.shape
    qkv = mx.concatenate([q, k, v], axis=1).reshape(1, N, -1)  # as the stacked projection gives it
    inv_freqs = mx.exp(mx.arange(0, -(rotated_dims // 2), -1, dtype=mx.float32) * 0.7)
    index = (step.tables, step.row_of_token, step.positions)
    rotate = lambda x: ext.rope(x, step.positions, inv_freqs, rope_scale)  # noqa: E731
    want = ext.paged_attention_write(
        rotate(q), rotate(k), v, mx.array(keys), mx.array(values), *index, 2, BLOCK, window, 0.25
    )
    mx.eval(want)
    rope_calls = ext.num_rope_calls()
    got = ext.paged_attention_rotary(
        qkv, mx.array(keys), mx.array(values), *index, inv_freqs, H, 2, BLOCK, window, 0.25, rope_scale
    )
    mx.eval(got)
    assert got[0].shape == (1, N, H * D)
    assert mx.array_equal(got[0].reshape(N, H, D), want[0]).item()
    assert mx.array_equal(got[1], want[1]).item() and mx.array_equal(got[2], want[2]).item()
    assert ext.num_rope_calls() == rope_calls  # the rotation ran inside the one op


@needs_native
def test_the_rotary_op_refuses_a_qkv_of_the_wrong_width():
    ext = cpu_extension()
    step, _, keys, values, q, k, v = make_step([5], [1], 2, 4)
    narrow = mx.concatenate([q, k], axis=1).reshape(1, 1, -1)  # no value heads
    with pytest.raises(ValueError, match="qkv must be"):
        ext.paged_attention_rotary(
            narrow, keys, values, step.tables, step.row_of_token, step.positions,
            mx.ones((8,)), 8, 2, BLOCK, 0, 0.25, 1.0,
        )


@needs_native
@pytest.mark.parametrize("in_place", [False, True])
def test_pools_in_place_writes_into_a_pool_something_else_holds(in_place):
    """A pool something else still holds is copied before the write, unless the caller
    owns it (`pools_in_place`, as PagedKV does): then the write goes into its buffer."""
    ext = cpu_extension()
    step, _, keys, values, q, k, v = make_step([5, 17], [1, 1], 2, 4)
    held_keys, held_values = mx.array(keys), mx.array(values)
    mx.eval(held_keys, held_values)
    copies = ext.num_pool_copies()
    out, new_keys, _ = ext.paged_attention_write(
        q, k, v, held_keys, held_values, step.tables, step.row_of_token, step.positions,
        2, BLOCK, 0, 0.25, in_place,
    )
    mx.eval(out, new_keys)
    assert not mx.array_equal(new_keys, keys).item()
    assert ext.num_pool_copies() == copies + (0 if in_place else 2)
    assert mx.array_equal(held_keys, new_keys if in_place else keys).item()


def test_a_steps_shape_counts_its_rows_tokens_and_visible_keys():
    step = make_step([5, 0, 30], [1, 13, 1], 2, 4)[0]
    assert step.shape == pa.StepShape(
        num_rows=3, max_new=13, max_visible=31, num_multi_rows=1, num_kv_heads=2, num_queries_per_kv=4
    )
    prefill = make_step([0], [600], 1, 1, num_blocks=160)[0]  # the chunk's own keys are visible
    assert prefill.shape.max_visible == 600 and prefill.shape.num_multi_rows == 1


def test_only_rows_bringing_several_tokens_count_towards_the_score_cap(monkeypatch):
    without_native(monkeypatch)
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    monkeypatch.delenv("CADENCE_PAGED_FAST_MIN_KEYS", raising=False)
    # One chunk of 4096 queries over 4096 keys, 8 KV heads: 4 * 8 * 4096 * 4096 bytes, the cap.
    at_the_cap = pa.StepShape(1, 4096, 4096, 1, 8, 1)
    assert pa.FAST_MAX_SCORE_BYTES == 4 * 8 * 4096 * 4096
    assert pa.select_path(at_the_cap).path == "fast"
    with_decoding_rows = attrs.evolve(at_the_cap, num_rows=64)  # 63 one-token rows beside it
    assert pa.select_path(with_decoding_rows).path == "fast"
    two_chunks = attrs.evolve(with_decoding_rows, num_multi_rows=2)
    assert pa.select_path(two_chunks).reason == "scores_over_cap"


def test_each_decision_logs_the_numbers_it_was_made_on(monkeypatch):
    """The first step of each outcome is logged with this detail: an operator reads the
    step's size against the floor, or the scores that went over the cap."""
    without_native(monkeypatch)
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    monkeypatch.delenv("CADENCE_PAGED_FAST_MIN_KEYS", raising=False)
    assert pa.select_path(pa.StepShape(2, 1, 100, 0, 4, 4)).detail == "200 rows x keys < floor 512"
    assert pa.select_path(pa.StepShape(4, 1, 128, 0, 4, 4)).detail == "512 rows x keys >= floor 512"
    two_chunks = pa.StepShape(2, 4096, 4096, 2, 8, 1)  # 2 * 4 * 8 * 4096 * 4096 bytes: 1 GiB
    assert pa.select_path(two_chunks).detail == "1024 MiB of scores per layer"


def test_the_native_kernel_declines_a_step_off_the_cpu(monkeypatch):
    monkeypatch.setattr(pa.mx, "default_device", lambda: mx.Device(mx.gpu))
    shape = pa.StepShape(1, 1, 64, 0, 4, 4)
    assert pa.native_kernel_reason(shape).startswith("default device is")
    assert pa.select_path(shape).path != "native"


@needs_native
def test_the_native_kernel_takes_up_to_its_limit_of_query_heads_per_kv_head(monkeypatch):
    monkeypatch.delenv("CADENCE_PAGED_ATTENTION", raising=False)
    group = pa.MAX_NATIVE_QUERIES_PER_KV
    step, _, keys, values, q, k, v = make_step([5, 17], [1, 3], 1, group)
    assert pa.native_kernel_reason(step.shape) is None and pa.dispatch(step) == "native"
    native, _ = run("native", step, keys, values, q, k, v)
    gather, _ = run("gather", step, keys, values, q, k, v)
    assert mx.allclose(native, gather, atol=1e-5, rtol=1e-5).item()
    monkeypatch.setenv("CADENCE_PAGED_ATTENTION", "native")
    assert pa.select_path(step.shape).reason == "forced"


def test_the_fast_path_runs_the_vectorized_plan(monkeypatch):
    step, _, keys, values, q, k, v = make_step([5, 2], [1, 7], 2, 2)

    def never(*args):
        raise AssertionError("the fast path built the per-row plan")

    monkeypatch.setattr(pa.GatherPlan, "__init__", never)
    out, _ = run("fast", step, keys, values, q, k, v)
    monkeypatch.undo()
    gather, _ = run("gather", step, keys, values, q, k, v)
    assert mx.allclose(out, gather, atol=1e-5, rtol=1e-5).item()


def test_key_positions_past_the_table_read_its_last_entry():
    step, tables, *_ = make_step([5, 1], [1, 1], 2, 1)  # tables of 2 and 1 blocks: width 2
    rows = step.key_rows([0], np.array([[0, 7, 8, 13]]))  # positions 8 and 13: past both columns
    first, last = tables[0][0] * BLOCK, tables[0][1] * BLOCK
    expected = [first + 0, last + 3, last + 0, last + 1]
    assert rows.tolist() == expected + [step.num_slots + slot for slot in expected]  # KV head 0, 1


@needs_native
def test_paged_attention_writes_in_place_into_a_held_pool_when_it_owns_the_pools():
    ext = cpu_extension()
    step, _, keys, values, q, k, v = make_step([5, 17], [1, 1], 2, 4)
    held = ([mx.array(keys)], [mx.array(values)])
    mx.eval(held)
    before = held[0][0]
    copies = ext.num_pool_copies()
    out = pa.paged_attention(held, 0, q, k, v, 0.25, step, "native", pools_in_place=True)
    mx.eval(out, held)
    assert ext.num_pool_copies() == copies
    assert mx.array_equal(before, held[0][0]).item() and not mx.array_equal(before, keys).item()


@pytest.mark.skipif(not ON_CPU, reason="the split over streams runs on the CPU only")
@pytest.mark.parametrize(
    ("softcap", "with_sinks"), [(0.0, False), (1.5, False), (0.0, True)], ids=["plain", "soft-capped", "sinks"]
)
def test_a_chunk_large_enough_to_split_its_kv_heads_over_two_streams_matches_gather(softcap, with_sinks):
    """2 KV heads x 2 queries each x 512 queries x 512 keys: 2^20 scores, the split's floor;
    each half's scores capped where Gemma 2's are, each half's heads their own sinks."""
    step, _, keys, values, q, k, v = make_step([0], [512], 2, 2, num_blocks=160)
    plan = step.fast
    assert [type(g).__name__ for g in plan.groups] == ["_CopyGroup"] and plan.groups[0].is_split
    q = q * 4
    sinks = mx.array([9.0, 0.0, -3.0, 6.0]) if with_sinks else None  # large: the early keys' weights
    out, _ = run("fast", step, keys, values, q, k, v, softcap, sinks)
    gather, _ = run("gather", step, keys, values, q, k, v, softcap, sinks)
    assert mx.allclose(out, gather, atol=1e-5, rtol=1e-5).item()


def test_a_two_token_chunk_is_causal_on_every_path():
    step, _, keys, values, q, k, v = make_step([6, 0], [2, 2], 2, 2)
    out, _ = run("gather", step, keys, values, q, k, v)
    fast, _ = run("fast", step, keys, values, q, k, v)
    assert mx.allclose(out, fast, atol=1e-5, rtol=1e-5).item()
    # Row 1's first token sees only itself: its output is its own value, whatever q is.
    assert mx.allclose(out[2], mx.repeat(v[2], 2, axis=0), atol=1e-6).item()


def test_a_groups_padding_queries_repeat_each_rows_last_token():
    """Pads stay inside the step's tokens (never an index past them), and are dropped."""
    step = make_step([9, 0, 22, 3], [1, 13, 1, 6], 2, 2)[0]  # tokens 0 | 1-13 | 14 | 15-20
    singles, multis = step.fast.groups
    assert singles.query_tokens.tolist() == [[0], [14]]
    assert multis.query_tokens.tolist() == [list(range(1, 14)), list(range(15, 21)) + [20] * 7]
    assert multis.is_real.sum() == 19 and multis.query_pos[1].tolist() == list(range(3, 9)) + [8] * 7
