"""The sampler's masks and penalties against numpy, and seeded rows inside batches."""

import collections

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.sampling import (
    Logprobs,
    RowSampler,
    Sampled,
    apply_penalties,
    joined,
    logprob_rows,
    min_p_mask,
    sample,
    top_k_mask,
    top_p_mask,
)
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SamplingParams, SequenceParams

import attrs
import mlx.core as mx
import numpy as np
import pytest

rng = np.random.default_rng(0)
LOGITS = rng.normal(size=(4, 50)).astype(np.float32) * 3


def kept(masked) -> list[set[int]]:
    return [set(np.flatnonzero(np.isfinite(row))) for row in np.array(masked)]


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_top_k_matches_numpy():
    ks = [0, 1, 5, 49]
    ours = kept(top_k_mask(mx.array(LOGITS), mx.array(ks)))
    for row, k, got in zip(LOGITS, ks, ours, strict=True):
        want = set(range(50)) if k == 0 else set(np.argsort(-row)[:k])
        assert got == want


def test_top_p_matches_numpy():
    ps = [1.0, 0.9, 0.5, 0.01]
    ours = kept(top_p_mask(mx.array(LOGITS), mx.array(ps)))
    for row, p, got in zip(LOGITS, ps, ours, strict=True):
        probs = softmax(row)
        order = np.argsort(-probs)
        mass_before = np.cumsum(probs[order]) - probs[order]
        want = set(order[mass_before < p])  # the smallest top set reaching p
        assert got == want


def test_min_p_matches_numpy():
    ps = [0.0, 0.05, 0.3, 1.0]
    ours = kept(min_p_mask(mx.array(LOGITS), mx.array(ps)))
    for row, p, got in zip(LOGITS, ps, ours, strict=True):
        probs = softmax(row)
        assert got == set(np.flatnonzero(probs >= p * probs.max() - 1e-7))


def test_penalties_match_numpy():
    prompt = [1, 2, 3]
    generated = [3, 7, 7, 9]
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    row = RowSampler.create(params, prompt, 50)
    for token in generated:
        row.record(mx.array([token]))
    plain = RowSampler.create(SamplingParams(), prompt, 50)
    ours = np.array(apply_penalties(mx.array(LOGITS[:2]), [row, plain]))

    want = LOGITS[0].copy()
    counts = collections.Counter(generated)
    for t in set(prompt) | set(generated):
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, c in counts.items():
        want[t] -= 0.25 * c + 0.5
    np.testing.assert_allclose(ours[0], want, rtol=1e-6)
    np.testing.assert_allclose(ours[1], LOGITS[1], rtol=1e-6)


def test_a_tiny_temperature_is_greedy_and_a_tiny_penalty_stays_finite():
    # 1e-300 is 0 in float32: logits / T and logits / penalty were inf, logprobs NaN.
    logits = mx.array(LOGITS[:2])
    greedy = sample(logits, [RowSampler.create(SamplingParams(logprobs=3), [], 50)] * 2)
    for temperature in (1e-300, 1e-40, 1e-6):
        row = RowSampler.create(SamplingParams(temperature=temperature, logprobs=3), [], 50)
        tiny = sample(logits, [row, row])
        assert tiny.tokens.tolist() == greedy.tokens.tolist() == list(LOGITS[:2].argmax(-1))
        np.testing.assert_array_equal(np.array(tiny.logprobs.top), np.array(greedy.logprobs.top))
    second = int(np.argsort(LOGITS[0])[-2])  # a positive logit: divided by the penalty, it wins
    row = RowSampler.create(SamplingParams(repetition_penalty=1e-300, logprobs=3), [second], 50)
    penalised = sample(mx.array(LOGITS[:1]), [row])
    assert penalised.tokens.tolist() == [second]
    assert np.isfinite(np.array(penalised.logprobs.top)).all()
    assert np.isfinite(np.array(apply_penalties(mx.array(LOGITS[:1]), [row]))).all()


def test_logit_bias_and_greedy_rows_in_one_batch():
    logits = mx.array(LOGITS[:3])
    rows = [
        RowSampler.create(SamplingParams(logit_bias=((7, 100.0),)), [], 50),
        RowSampler.create(SamplingParams(), [], 50),
        RowSampler.create(SamplingParams(temperature=1.0, top_k=1), [], 50),
    ]
    tokens = sample(logits, rows).tokens.tolist()
    assert tokens == [7, int(LOGITS[1].argmax()), int(LOGITS[2].argmax())]


def test_logit_bias_is_added_before_the_penalties_as_vllm_and_mlx_lm_order_them():
    """Token 1 (logit 2, in the prompt) under repetition penalty 2 and bias +2: biased
    first it is (2 + 2) / 2 = 2 and loses to token 0's 2.5; penalised first, 3 won."""
    logits = mx.array([[2.5, 2.0, 0.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, logit_bias={1: 2.0}, logprobs=1)
    got = sample(logits, [RowSampler.create(params, [1], 4)])
    assert got.tokens.tolist() == [0]
    np.testing.assert_allclose(
        got.logprobs.token.item(), log_softmax(np.array([2.5, 2.0, 0.0, 0.0]))[0], rtol=1e-5
    )


def test_a_bias_of_minus_100_bans_a_token_under_a_repetition_penalty_below_1():
    """A penalty below 1 divides a seen token's negative logit too: added after it, the
    -100 of a ban came out as 2.09 / 0.01 - 100 = +109, and the banned token won."""
    logits = mx.array([[5.74, 2.09, 0.0, 0.0]])
    params = SamplingParams(repetition_penalty=0.01, logit_bias={1: -100.0})
    assert sample(logits, [RowSampler.create(params, [1], 4)]).tokens.tolist() == [0]


def test_a_rows_logit_bias_is_made_dense_once_and_holds_at_every_step():
    """Rebuilt from its pairs every step, a whole vocabulary's bias cost ~20 ms a row."""
    row = RowSampler.create(SamplingParams(temperature=1.0, logit_bias={7: 100.0, 3: -5.0}), [], 50)
    plain = RowSampler.create(SamplingParams(temperature=1.0), [], 50)
    first = sample(mx.array(LOGITS[:2]), [row, plain])
    dense = row.dense_bias
    second = sample(mx.array(LOGITS[2:4]), [row, plain])
    assert row.dense_bias is dense and plain.dense_bias is None
    assert first.tokens.tolist()[0] == second.tokens.tolist()[0] == 7
    expected = np.zeros(50, dtype=np.float32)
    expected[[7, 3]] = [100.0, -5.0]
    assert np.array_equal(np.array(dense), expected)


def test_draws_follow_the_distribution():
    logits = mx.array(np.log(np.array([[0.7, 0.2, 0.1, 1e-9]], dtype=np.float32)))
    row = RowSampler.create(SamplingParams(temperature=1.0, seed=3), [], 4)
    counts = collections.Counter(sample(logits, [row]).tokens.item() for _ in range(2000))
    assert counts[3] == 0
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[2] / 2000 - 0.1) < 0.03


def test_a_top_k_of_1_draws_the_most_likely_token_at_any_temperature():
    """top_k 1 keeps the top token alone: every draw is it, over near-uniform logits
    and at a high temperature, alone in a batch or beside rows that mask nothing."""
    logits = mx.array([[0.0] * 20 + [0.1] + [0.0] * 29] * 2)
    rows = [RowSampler.create(SamplingParams(temperature=2.0, top_k=1, seed=3), [], 50)]
    draws = {sample(logits[:1], rows).tokens.item() for _ in range(100)}
    assert draws == {20}
    rows.append(RowSampler.create(SamplingParams(temperature=2.0, seed=4), [], 50))
    draws = {sample(logits, rows).tokens.tolist()[0] for _ in range(100)}
    assert draws == {20}


def test_a_negative_seed_keys_on_its_64_bits_unsigned():
    """An int64 seed's two's complement: every value in range is a valid, distinct key."""
    for seed, unsigned in [(-1, 2**64 - 1), (-(2**63), 2**63), (2**63 - 1, 2**63 - 1)]:
        row = RowSampler.create(SamplingParams(temperature=1.0, seed=seed), [], 4)
        assert row.key is not None
        assert row.key.tolist() == mx.random.key(unsigned).tolist()


def test_unseeded_rows_beside_a_seeded_one_draw_independently():
    """Two unseeded rows over the same uniform logits, in a batch with a seeded row (n=2
    choices beside another client's seeded request): each draws its own token, so they
    agree about once in 50 steps, not at every step."""
    logits = mx.zeros((3, 50))
    rows = [RowSampler.create(SamplingParams(temperature=1.0, seed=5), [], 50)]
    rows += [RowSampler.create(SamplingParams(temperature=1.0), [], 50) for _ in range(2)]
    draws = [sample(logits, rows).tokens.tolist() for _ in range(40)]
    assert sum(a == b for _, a, b in draws) < 10


def test_sample_combines_temperature_top_k_top_p_and_min_p_as_numpy_does():
    """2,000 seeded draws: tokens outside the masked set never appear, and the
    frequencies match softmax(logits / T) over the kept set."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(1, 40)).astype(np.float32) * 2
    T, k, p, min_p = 1.0, 12, 0.8, 0.05
    # numpy: temperature, then min-p, top-k, top-p (vLLM's order), each on what the last kept.
    scaled = logits[0] / T
    probs = softmax(scaled)
    keep = probs >= min_p * probs.max()
    num_kept = [int(keep.sum())]
    keep &= scaled >= np.sort(scaled)[-k]
    num_kept.append(int(keep.sum()))
    order = np.argsort(-scaled)
    probs = softmax(np.where(keep, scaled, -np.inf))
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep &= np.isin(np.arange(40), order[mass_before < p])
    num_kept.append(int(keep.sum()))
    expected = softmax(np.where(keep, scaled, -np.inf))
    row = RowSampler.create(
        SamplingParams(temperature=T, top_k=k, top_p=p, min_p=min_p, seed=11), [], 40
    )
    draws = [sample(mx.array(logits), [row]).tokens.item() for _ in range(2000)]
    counts = np.bincount(draws, minlength=40) / 2000
    assert set(draws) <= set(np.flatnonzero(keep))
    assert 40 > num_kept[0] > num_kept[1] > num_kept[2] >= 2  # each mask really bites
    assert np.abs(counts - expected).max() < 0.04


def run_rows(engine, param_list, prompt, steps=12):
    """Each row's tokens when the rows run together (one batch, through the policy)."""
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context)
    requests = {
        str(i): SequenceParams(
            prompt_tokens=tuple(prompt), max_tokens=steps, sampling=params, ignore_eos=True
        )
        for i, params in enumerate(param_list)
    }
    got = run_offline(engine, policy, requests)
    return [list(got[str(i)].tokens) for i in range(len(param_list))]


@pytest.mark.parametrize("neighbours", [0, 3])
def test_seeded_row_is_reproducible_inside_any_batch(make_checkpoint, neighbours):
    engine = Engine(load_model(make_checkpoint("llama")), max_batch=4)
    prompt = [5, 9, 200, 31, 77]
    seeded = SamplingParams(temperature=1.2, top_p=0.95, seed=1234)
    alone = run_rows(engine, [seeded], prompt)[0]
    others = [
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=99, frequency_penalty=0.5),
    ][:neighbours]
    in_batch = run_rows(engine, [*others, seeded], prompt)[-1]
    assert in_batch == alone
    different_seed = run_rows(
        engine, [SamplingParams(temperature=1.2, top_p=0.95, seed=4321)], prompt
    )[0]
    assert different_seed != alone


def test_the_engine_penalises_what_a_row_generated_step_by_step(make_checkpoint):
    """Greedy under penalties, through the engine, against a reference that recomputes
    each step's logits whole and applies the penalties to the counts so far: the
    engine's rows must count each token they sample (a mutant that skipped it ran on)."""
    model = load_model(make_checkpoint("llama"))
    engine = Engine(model, max_batch=4)
    prompt = [7, 7, 7, 7]  # greedy repeats a token within 4 steps here
    params = SamplingParams(repetition_penalty=1.2, presence_penalty=1.5, frequency_penalty=1.0)
    [got] = run_rows(engine, [params], prompt, steps=12)
    tokens, generated = list(prompt), collections.Counter()
    for _ in range(12):
        logits = np.array(model.model(mx.array([tokens]))[0, -1].astype(mx.float32))
        for t in set(prompt) | set(generated):
            logits[t] = logits[t] / 1.2 if logits[t] > 0 else logits[t] * 1.2
        for t, count in generated.items():
            logits[t] -= 1.0 * count + 1.5
        tokens.append(int(np.argmax(logits)))
        generated[tokens[-1]] += 1
    assert got == tokens[len(prompt) :]
    assert got != run_rows(engine, [SamplingParams()], prompt, steps=12)[0]  # they bite


def test_a_top_k_past_int32_keeps_every_token_instead_of_failing():
    def draw(**params):
        row = RowSampler.create(SamplingParams(temperature=1.0, seed=3, **params), [1], 50)
        return sample(mx.array(LOGITS[:1]), [row]).tokens.item()

    assert draw(top_k=2**40) == draw()


def log_softmax(x):
    m = x[np.isfinite(x)].max()
    return x - m - np.log(np.exp(x - m).sum())


def test_logprobs_are_of_the_distribution_each_row_draws_from():
    """A mixed batch: each asking row's token logprob and top N equal numpy's log-softmax
    of its logits after the same processors; the other rows' tokens do not change."""
    rows_params = [
        SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=3),
        SamplingParams(logit_bias=((7, 5.0),), logprobs=4),  # greedy: biased, unscaled
        SamplingParams(temperature=1.0, seed=5, logprobs=0),
        SamplingParams(temperature=0.9, seed=9),
        SamplingParams(),
    ]
    logits = np.concatenate([LOGITS, LOGITS[:1]])  # [5, 50]
    bias = np.zeros(50, dtype=np.float32)
    bias[7] = 5.0
    scaled0 = LOGITS[0] / 0.7
    processed = {
        0: np.where(scaled0 >= np.sort(scaled0)[-5], scaled0, -np.inf),
        1: LOGITS[1] + bias,
        2: LOGITS[2],
    }

    def run(params):
        return sample(mx.array(logits), [RowSampler.create(p, [], 50) for p in params])

    got = run(rows_params)
    tokens = got.tokens.tolist()
    assert got.logprobs is not None
    token_logprob = np.array(got.logprobs.token)
    top_ids, top = np.array(got.logprobs.top_ids), np.array(got.logprobs.top)
    for i, want in processed.items():
        want_logprobs = log_softmax(want)
        n = rows_params[i].logprobs
        np.testing.assert_allclose(token_logprob[i], want_logprobs[tokens[i]], rtol=1e-5)
        assert list(top_ids[i, :n]) == list(np.argsort(-want_logprobs)[:n])
        np.testing.assert_allclose(top[i, :n], np.sort(want_logprobs)[::-1][:n], rtol=1e-5)
    assert np.isneginf(log_softmax(processed[0])).sum() == 45  # top-k really bites
    assert top_ids.shape == (5, 4)
    without = run([attrs.evolve(p, logprobs=None) for p in rows_params])
    assert without.logprobs is None
    assert without.tokens.tolist() == tokens


def test_logprobs_of_an_all_greedy_batch_cost_nothing_unless_asked():
    rows = [RowSampler.create(SamplingParams(), [], 50) for _ in range(2)]
    assert sample(mx.array(LOGITS[:2]), rows).logprobs is None
    rows[1] = RowSampler.create(SamplingParams(logprobs=2), [], 50)
    got = sample(mx.array(LOGITS[:2]), rows)
    assert got.logprobs is not None
    np.testing.assert_allclose(
        np.array(got.logprobs.top)[1], np.sort(log_softmax(LOGITS[1]))[::-1][:2], rtol=1e-5
    )


def test_top_k_past_the_vocabulary_keeps_every_token():
    assert kept(top_k_mask(mx.array(LOGITS[:2]), mx.array([50, 60]))) == [set(range(50))] * 2


def test_top_p_reached_exactly_keeps_no_more_tokens():
    # probabilities 0.5, 0.25, 0.25: the top token alone reaches 0.5
    logits = mx.array(np.log(np.array([[0.5, 0.25, 0.25]], dtype=np.float32)))
    assert kept(top_p_mask(logits, mx.array([0.5]))) == [{0}]
    assert kept(top_p_mask(logits, mx.array([0.51]))) == [{0, 1}]  # 0.75, tie cut by id


def test_top_p_keeps_only_as_many_tied_tokens_as_its_set_needs():
    """Four tokens at 0.245: top_p 0.3 needs two of them, 0.6 three. Keeping every token
    tied with the last one (a logit threshold) kept all four, where vLLM keeps two."""
    probs = np.array([[0.01, 0.245, 0.245, 0.01, 0.245, 0.245]], dtype=np.float32)
    logits = mx.array(np.log(probs))
    assert kept(top_p_mask(logits, mx.array([0.3]))) == [{1, 2}]
    assert kept(top_p_mask(logits, mx.array([0.6]))) == [{1, 2, 4}]
    assert kept(top_p_mask(logits, mx.array([0.97]))) == [{1, 2, 4, 5}]
    assert kept(top_p_mask(logits, mx.array([0.985]))) == [{0, 1, 2, 4, 5}]


def test_a_tiny_top_p_keeps_the_top_token_alone_over_a_large_vocabulary():
    """The mass above the top token is 0, whatever float32 makes of the whole vocabulary's
    sum (1 - its cumsum came out 6e-8 or 2e-7 over 2,048 tokens, not below 1e-9): the top
    token must survive, or no token does and the mask kept every one."""
    logits = mx.array(np.random.default_rng(1).normal(size=(32, 2048)).astype(np.float32) * 3)
    ours = kept(top_p_mask(logits, mx.array([1e-9] * 32)))
    assert ours == [{int(i)} for i in np.argmax(np.array(logits), axis=-1)]


def test_a_top_p_that_float32_rounds_to_zero_keeps_the_top_token_alone():
    """The API takes top_p in (0, 1]: 1e-46 is positive, and 0.0 in float32, where no mass
    is below it. It kept no token, so all: sampling from the whole vocabulary."""
    logits = mx.array(np.random.default_rng(2).normal(size=(4, 64)).astype(np.float32))
    ours = kept(top_p_mask(logits, mx.array([1e-46, 5e-324, 0.0, 1e-45], dtype=mx.float32)))
    assert ours == [{int(i)} for i in np.argmax(np.array(logits), axis=-1)]


def test_a_row_without_top_p_or_min_p_keeps_even_its_least_likely_tokens():
    """Far below the top (prob 1e-11 and 1e-37), but not masked: their logprobs are finite."""
    logits = np.array([[5.0, 0.0, -20.0, -80.0]], dtype=np.float32)
    row = RowSampler.create(SamplingParams(temperature=1.0, seed=1, logprobs=4), [], 4)
    got = sample(mx.array(logits), [row])
    np.testing.assert_allclose(
        np.array(got.logprobs.top)[0], np.sort(log_softmax(logits[0]))[::-1], rtol=1e-5
    )


@pytest.mark.parametrize(
    "neighbour",
    [{"top_p": 0.9}, {"min_p": 0.01}, {"top_p": 0.9, "min_p": 0.01}],
    ids=["top_p", "min_p", "both"],
)
def test_a_rows_masks_are_its_own_whatever_its_neighbour_asks(neighbour):
    """top_p 1.0 and min_p 0 are no masks at all: beside a neighbour that sets them, a
    row kept its top tokens only (the float32 mass above its tail rounds to 1.0, and the
    min_p floor's epsilon sits 69 below the top), so its logprobs depended on the batch."""
    logits = np.array([[5.0, 0.0, -20.0, -80.0]] * 2, dtype=np.float32)
    plain = SamplingParams(temperature=1.0, seed=1, logprobs=4)
    alone = sample(mx.array(logits[:1]), [RowSampler.create(plain, [], 4)])
    beside = sample(
        mx.array(logits),
        [
            RowSampler.create(plain, [], 4),
            RowSampler.create(SamplingParams(temperature=1.0, seed=2, **neighbour), [], 4),
        ],
    )
    assert np.isfinite(np.array(beside.logprobs.top)[0]).all()
    np.testing.assert_array_equal(np.array(beside.logprobs.top)[0], np.array(alone.logprobs.top)[0])


def test_a_greedy_rows_logprobs_ignore_its_masks():
    """Greedy rows draw the argmax: their logprobs are of the logits before top-k/top-p."""
    rows = [
        RowSampler.create(SamplingParams(top_k=2, top_p=0.5, logprobs=5), [], 50),
        RowSampler.create(SamplingParams(temperature=1.0, seed=3), [], 50),
    ]
    got = sample(mx.array(LOGITS[:2]), rows)
    assert got.tokens.tolist()[0] == int(LOGITS[0].argmax())
    np.testing.assert_allclose(
        np.array(got.logprobs.top)[0], np.sort(log_softmax(LOGITS[0]))[::-1][:5], rtol=1e-5
    )


def test_logprobs_asking_for_no_alternatives_or_more_than_the_vocabulary():
    logits = mx.array(LOGITS[:1, :4])
    zero = sample(logits, [RowSampler.create(SamplingParams(logprobs=0), [], 4)]).logprobs
    assert zero.top_ids.shape == (1, 0) and zero.top.shape == (1, 0)
    np.testing.assert_allclose(zero.token.item(), log_softmax(LOGITS[0, :4]).max(), rtol=1e-5)
    many = sample(logits, [RowSampler.create(SamplingParams(logprobs=10), [], 4)]).logprobs
    assert sorted(np.array(many.top_ids)[0].tolist()) == [0, 1, 2, 3]


def test_min_p_comes_before_top_k_and_top_p_as_in_vllm():
    """Probabilities .5 .3 .1 .1, min_p 0.3 and top_p 0.6: min-p keeps .5 and .3 (.625
    and .375 after it), and top-p then needs the first alone. top-p first kept both, and
    min-p after it kept both too: token 1 came a third of the time."""
    logits = mx.array(np.log(np.array([[0.5, 0.3, 0.1, 0.1]], dtype=np.float32)))
    row = RowSampler.create(SamplingParams(temperature=1.0, top_p=0.6, min_p=0.3, seed=5), [], 4)
    assert {sample(logits, [row]).tokens.item() for _ in range(200)} == {0}


def test_a_split_steps_parts_join_with_each_rows_alternatives_whatever_k_each_part_asked():
    """A step split around a failing row joins its parts' samples: one part asking for
    5 alternatives, one for 2 and one for none must give every row its own, padded to 5."""

    def part(tokens, k):
        n = len(tokens)
        logprobs = None
        if k is not None:
            top = mx.array(-np.arange(n * k, dtype=np.float32).reshape(n, k))
            logprobs = Logprobs(mx.array([-0.5] * n), mx.arange(n * k).reshape(n, k), top)
        return Sampled(mx.array(tokens), logprobs), mx.array([True] * n)

    parts = [part([3, 4], 5), part([5], 2), part([6], None)]
    sampled, finite = joined(parts)
    assert sampled.tokens.tolist() == [3, 4, 5, 6] and finite.tolist() == [True] * 4
    top_ids, top = np.array(sampled.logprobs.top_ids), np.array(sampled.logprobs.top)
    assert top_ids.shape == (4, 5)
    assert top_ids[:2].tolist() == np.arange(10).reshape(2, 5).tolist()
    assert top_ids[2, :2].tolist() == [0, 1] and top[2, :2].tolist() == [0.0, -1.0]
    plain, finite = joined([part([3, 4], None), part([5], None)])  # nobody asked: none
    assert plain.tokens.tolist() == [3, 4, 5] and plain.logprobs is None
    assert finite.tolist() == [True] * 3


@pytest.mark.parametrize("masked", [False, True], ids=["tied", "masked"])
def test_a_rows_alternatives_among_ties_are_its_own_whatever_its_neighbour_asks(masked):
    """The top K was cut by argpartition with K the most any row asked: which of tied
    tokens (every token a mask excluded, at -inf; equal half-precision logits) made a
    row's list, and their order, changed with its neighbour's top_logprobs. Ties now go
    lowest id first, so a row's top N is the first N of any longer list."""
    logits = np.full((2, 50), 1.0, dtype=np.float32)
    logits[:, 7] = 3.0
    logits[:, 30] = 2.0
    mine = (
        SamplingParams(temperature=1.0, seed=1, top_k=2, logprobs=4)
        if masked
        else SamplingParams(logprobs=4)
    )
    alone = sample(mx.array(logits[:1]), [RowSampler.create(mine, [], 50)])
    beside = sample(
        mx.array(logits),
        [RowSampler.create(mine, [], 50), RowSampler.create(SamplingParams(logprobs=20), [], 50)],
    )
    want = [7, 30, 0, 1]
    assert np.array(alone.logprobs.top_ids)[0].tolist() == want
    assert np.array(beside.logprobs.top_ids)[0, :4].tolist() == want
    np.testing.assert_array_equal(np.array(beside.logprobs.top)[0, :4], np.array(alone.logprobs.top)[0])


def test_a_rows_grammar_mask_bounds_what_it_draws_greedy_or_not():
    allowed = np.zeros((2, 50), dtype=bool)
    allowed[:, [3, 7]] = True
    rows = [
        RowSampler.create(SamplingParams(), [], 50),
        RowSampler.create(SamplingParams(temperature=5.0, seed=1), [], 50),
    ]
    best = 3 if LOGITS[0, 3] > LOGITS[0, 7] else 7
    for _ in range(8):
        greedy, drawn = sample(mx.array(LOGITS[:2]), rows, mx.array(allowed)).tokens.tolist()
        assert greedy == best and drawn in (3, 7)


def test_half_precision_logits_are_sampled_in_float32():
    """A model's bfloat16 logits: the logprobs come back float32, of those logits."""
    logits = mx.array(LOGITS[:1]).astype(mx.bfloat16)
    got = sample(logits, [RowSampler.create(SamplingParams(logprobs=2), [], 50)]).logprobs
    assert got.token.dtype == got.top.dtype == mx.float32
    exact = log_softmax(np.array(logits.astype(mx.float32))[0])
    np.testing.assert_allclose(np.array(got.top)[0], np.sort(exact)[::-1][:2], rtol=1e-6)


def test_logprobs_asking_for_one_alternative_get_the_most_likely_token():
    got = sample(mx.array(LOGITS[:1]), [RowSampler.create(SamplingParams(logprobs=1), [], 50)]).logprobs
    assert np.array(got.top_ids).tolist() == [[int(LOGITS[0].argmax())]]
    np.testing.assert_allclose(np.array(got.top)[0], [log_softmax(LOGITS[0]).max()], rtol=1e-5)


def test_a_steps_logprobs_come_out_per_row_as_id_and_logprob_pairs():
    logprobs = Logprobs(mx.array([-0.5, -1.0]), mx.array([[4, 2], [1, 3]]), mx.array([[-0.5, -2.0], [-0.25, -1.0]]))
    assert logprob_rows(logprobs, 2) == [(-0.5, ((4, -0.5), (2, -2.0))), (-1.0, ((1, -0.25), (3, -1.0)))]
    assert logprob_rows(None, 2) == [(0.0, ())] * 2  # nobody asked
