"""Per-row sampling over a batch of logits, in one fused `[B, vocab]` path.

Every row carries its own parameters; they become `[B]` vectors, so rows with
different temperatures, top-p, penalties or seeds share one set of array ops
(mlx-lm's server refuses to batch a seeded request). The order, as vLLM's V1 sampler
applies it (and mlx-lm: the bias before the penalties, so -100 bans a token whatever a
penalty below 1 makes of its logit):

    logit_bias -> penalties -> grammar mask -> (greedy rows: argmax) -> temperature
    -> min-p -> top-k -> top-p -> draw

The grammar mask (structured output, runtime/grammar.py) sets the tokens a row's
grammar forbids to -inf; a row without a grammar is untouched, bit for bit.

A seeded row draws its Gumbel noise from its own key, split once per step, so its
tokens depend only on its seed and its logits, never on its neighbours.

Logprobs (rows whose `SamplingParams.logprobs` is set) are of the distribution the
token was drawn from: log-softmax after every processor, temperature and masks
included, so a masked token has -inf. A greedy row's are of its penalized, biased
logits (temperature 1, no masks). They are computed for the whole batch in one op
when any row asks, and not at all when none does.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.sequence import SamplingParams

import attrs
import mlx.core as mx


@attrs.define
class RowSampler:
    """One row's sampling state; the token history lives on the device."""

    params: SamplingParams
    key: mx.array | None  # per-row PRNG key for seeded rows
    prompt_mask: mx.array | None  # [V] 1.0 where the prompt has the token (repetition penalty)
    output_counts: mx.array | None  # [V] occurrences among generated tokens
    dense_bias: mx.array | None = None  # [V] its logit_bias, built at its first step

    @classmethod
    def create(cls, params: SamplingParams, prompt: Sequence[int], vocab_size: int) -> RowSampler:
        prompt_mask = counts = None
        if params.has_penalties:
            counts = mx.zeros((vocab_size,), dtype=mx.float32)
            prompt_mask = mx.zeros((vocab_size,), dtype=mx.float32)
            prompt_mask[mx.array(sorted(set(prompt)), dtype=mx.int32)] = 1.0
        # A seed is an int64, as OpenAI's and vLLM's; the key takes its 64 bits unsigned.
        key = mx.random.key(params.seed % 2**64) if params.seed is not None else None
        return cls(params=params, key=key, prompt_mask=prompt_mask, output_counts=counts)

    def record(self, token: mx.array) -> None:
        """Count a sampled token (lazy, shape [1]) for the frequency/presence penalties."""
        if self.output_counts is not None:
            self.output_counts = self.output_counts.at[token].add(1.0)

    def next_key(self) -> mx.array:
        assert self.key is not None
        self.key, use = mx.random.split(self.key)
        return use


@attrs.frozen
class Logprobs:
    """A batch's logprobs (lazy). Rows that did not ask hold values nobody reads."""

    token: mx.array  # [B] float32: each sampled token's logprob
    top_ids: mx.array  # [B, K] int32, most likely first; K = the most any row asks
    top: mx.array  # [B, K] float32


@attrs.frozen
class Sampled:
    tokens: mx.array  # [B] int32
    logprobs: Logprobs | None = None  # None when no row asks


def sample(logits: mx.array, rows: Sequence[RowSampler], allowed: mx.array | None = None) -> Sampled:
    """logits [B, V] -> token ids [B] int32 and, if any row asks, their logprobs (lazy).

    `allowed` [B, V] bool: the tokens each row may draw (its grammar's mask); None: all."""
    logits = logits.astype(mx.float32)
    params = [r.params for r in rows]
    if any(p.logit_bias for p in params):
        logits = logits + _bias_matrix(rows, logits.shape[-1])
    if any(p.has_penalties for p in params):
        logits = apply_penalties(logits, rows)
    if allowed is not None:
        logits = mx.where(allowed, logits, -mx.inf)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all(p.is_greedy for p in params):
        return Sampled(greedy, _logprobs(logits, greedy, params))
    unscaled = logits
    temperature = mx.array([1.0 if p.is_greedy else p.temperature for p in params])
    logits = logits / temperature[:, None]
    if any(p.min_p > 0.0 for p in params):
        logits = min_p_mask(logits, mx.array([p.min_p for p in params]))
    if any(p.top_k > 0 for p in params):
        vocab = logits.shape[-1]  # a k past the vocabulary keeps all; and int32 can't hold 2**31
        logits = top_k_mask(logits, mx.array([min(p.top_k, vocab) for p in params], dtype=mx.int32))
    if any(p.top_p < 1.0 for p in params):
        logits = top_p_mask(logits, mx.array([p.top_p for p in params]))
    drawn = mx.argmax(logits + _gumbel(rows, logits.shape), axis=-1).astype(mx.int32)
    is_greedy = mx.array([p.is_greedy for p in params])
    tokens = mx.where(is_greedy, greedy, drawn)
    if not any(p.logprobs is not None for p in params):
        return Sampled(tokens)
    drawn_from = mx.where(is_greedy[:, None], unscaled, logits)
    return Sampled(tokens, _logprobs(drawn_from, tokens, params))


def _logprobs(
    logits: mx.array, tokens: mx.array, params: Sequence[SamplingParams]
) -> Logprobs | None:
    """log-softmax of `logits` [B, V] at `tokens` [B], and its top K per row, most likely first."""
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked:
        return None
    # Only the values read are normalized: one pass over [B, V] (logsumexp) plus the top-k.
    log_total = mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, 1]
    token = (mx.take_along_axis(logits, tokens[:, None], axis=-1) - log_total)[:, 0]
    k = min(max(asked), logits.shape[-1])
    if k == 0:
        empty = mx.zeros((len(params), 0))
        return Logprobs(token, empty.astype(mx.int32), empty)
    # Tokens tied with the K-th are taken lowest id first, and ties listed by id: cut by
    # argpartition, which of them made a row's list (every token a mask excluded sits at
    # -inf; half-precision logits tie often) and their order changed with K, the most
    # any row asks, so with a neighbour's top_logprobs. Now a row's top N is the first N
    # of any longer list.
    kth = mx.partition(logits, -k, axis=-1)[:, -k][:, None]  # [B, 1]: the K-th largest
    above, tied = logits > kth, logits == kth
    needed = k - mx.sum(above, axis=-1, keepdims=True)
    is_top = above | (tied & (mx.cumsum(tied, axis=-1) <= needed))  # K a row
    top_ids = mx.argpartition(mx.logical_not(is_top).astype(mx.int32), k - 1, axis=-1)[:, :k]
    top_ids = mx.sort(top_ids, axis=-1)  # [B, K], by id
    top = mx.take_along_axis(logits, top_ids, axis=-1) - log_total
    # Ranked by logprob, then by id (unique ranks: no sort's order among ties is relied on).
    mine, other = top[:, :, None], top[:, None, :]
    is_lower_id = mx.arange(k)[None, :] < mx.arange(k)[:, None]  # [K, K]: other's id < mine
    rank = mx.sum((other > mine) | ((other == mine) & is_lower_id), axis=-1)  # [B, K]
    order = mx.argsort(rank, axis=-1)
    top_ids = mx.take_along_axis(top_ids, order, axis=-1).astype(mx.int32)
    return Logprobs(token, top_ids, mx.take_along_axis(top, order, axis=-1))


def apply_penalties(logits: mx.array, rows: Sequence[RowSampler]) -> mx.array:
    """Repetition penalty over prompt and output tokens; presence/frequency over output only."""
    vocab = logits.shape[-1]
    zeros = mx.zeros((vocab,), dtype=mx.float32)
    counts = mx.stack([r.output_counts if r.output_counts is not None else zeros for r in rows])
    prompt = mx.stack([r.prompt_mask if r.prompt_mask is not None else zeros for r in rows])
    # A penalty under 1e-6 already multiplies every seen token's logit past any other;
    # smaller ones became 0 in float32 (1e-300), and logits / 0 inf and NaN.
    rep = mx.maximum(mx.array([r.params.repetition_penalty for r in rows]), 1e-6)[:, None]
    presence = mx.array([r.params.presence_penalty for r in rows])[:, None]
    frequency = mx.array([r.params.frequency_penalty for r in rows])[:, None]
    seen = (counts + prompt) > 0
    logits = mx.where(seen, mx.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency * counts - presence * (counts > 0)


def top_k_mask(logits: mx.array, top_k: mx.array) -> mx.array:
    """Keep each row's `top_k` largest logits (0: keep all). logits [B, V], top_k [B]."""
    vocab = logits.shape[-1]
    ascending = mx.sort(logits, axis=-1)
    k = mx.where(top_k > 0, mx.minimum(top_k, vocab), vocab)
    threshold = mx.take_along_axis(ascending, (vocab - k)[:, None], axis=-1)  # [B, 1]
    return mx.where(logits < threshold, -mx.inf, logits)


def top_p_mask(logits: mx.array, top_p: mx.array) -> mx.array:
    """Keep the smallest set of tokens whose probability mass reaches `top_p`. top_p [B].

    Tokens tied with the last one kept are kept lowest id first, as many as the set
    needs: four tokens at 0.245 under top_p 0.3 keep two, not all four (vLLM, transformers
    and mlx-lm cut by sorted position too)."""
    vocab = logits.shape[-1]
    ascending = mx.sort(logits, axis=-1)
    # A token survives when the mass strictly above it is still short of top_p; the top
    # token always does. Summed from the top, that mass is exactly 0 for it: as
    # 1 - cumsum from the bottom it was float32's error in the vocabulary's total
    # (6e-8 to 2e-7 over 2,048 tokens), and a top_p below that kept no token, so all.
    mass_above = mx.cumsum(mx.softmax(ascending, axis=-1), axis=-1, reverse=True, inclusive=False)
    # ... as long as top_p is positive in float32: under 1.4e-45 it is 0, and kept
    # no token, so all. So the top token is kept by place.
    keep = (mass_above < top_p[:, None]) | (mx.arange(vocab) == vocab - 1)
    first_kept = mx.argmax(keep, axis=-1)[:, None]
    threshold = mx.take_along_axis(ascending, first_kept, axis=-1)
    # The set's last token may be tied: of the tokens at the threshold, keep the number
    # the set needs beyond those above it, by id.
    above = logits > threshold
    tied = logits == threshold
    ties_needed = (vocab - first_kept) - mx.sum(above, axis=-1, keepdims=True)
    is_kept = above | (tied & (mx.cumsum(tied, axis=-1) <= ties_needed))
    # A row at 1.0 keeps everything: in float32 the mass above its least likely tokens
    # (under ~6e-8 each) comes to 1.0, and it must not lose them because a neighbour set top_p.
    is_off = (top_p >= 1.0)[:, None]
    return mx.where(is_kept | is_off, logits, -mx.inf)


def min_p_mask(logits: mx.array, min_p: mx.array) -> mx.array:
    """Drop tokens whose probability is below `min_p` times the top token's. min_p [B]."""
    top = mx.max(logits, axis=-1, keepdims=True)
    # p / p_max = exp(logit - top); compare in log space. A row at 0 keeps everything
    # (its floor would be log(1e-30): logits 69 below the top, dropped for a neighbour's min_p).
    floor = top + mx.log(mx.maximum(min_p[:, None], 1e-30))
    return mx.where((logits < floor) & (min_p > 0.0)[:, None], -mx.inf, logits)


def _bias_matrix(rows: Sequence[RowSampler], vocab: int) -> mx.array:
    """[B, V]. A row's bias is made dense once and kept: rebuilt from its pairs every
    step, a whole vocabulary's (152k entries) cost ~20 ms a row a step."""
    zeros = mx.zeros((vocab,), dtype=mx.float32)
    for row in rows:
        if row.dense_bias is None and row.params.logit_bias:
            pairs = row.params.logit_bias
            ids = mx.array([t for t, _ in pairs], dtype=mx.int32)
            row.dense_bias = zeros.at[ids].add(mx.array([b for _, b in pairs], dtype=mx.float32))
    return mx.stack([zeros if row.dense_bias is None else row.dense_bias for row in rows])


def _gumbel(rows: Sequence[RowSampler], shape: tuple[int, ...]) -> mx.array:
    if all(r.key is None for r in rows):
        return mx.random.gumbel(shape=shape)
    # Unseeded rows share one draw; it is skipped when every row has its own key.
    shared = mx.random.gumbel(shape=shape) if any(r.key is None for r in rows) else None
    return mx.stack(
        [
            mx.random.gumbel(shape=shape[1:], key=r.next_key())
            if shared is None or r.key is not None
            else shared[i]
            for i, r in enumerate(rows)
        ]
    )


def joined(parts: list[tuple[Sampled, mx.array]]) -> tuple[Sampled, mx.array]:
    """The samples of a split step's forwards, as one step's: [S] and [S]."""
    samples = [sampled for sampled, _ in parts]
    tokens = mx.concatenate([s.tokens for s in samples])
    finite = mx.concatenate([is_finite for _, is_finite in parts])
    if all(s.logprobs is None for s in samples):
        return Sampled(tokens), finite
    # Parts ask for different K, or none: pad to the widest; padding is never read.
    k = max(s.logprobs.top.shape[1] for s in samples if s.logprobs is not None)
    padded = [_padded(s.logprobs, s.tokens.shape[0], k) for s in samples]
    merged = Logprobs(
        *(mx.concatenate([getattr(p, f) for p in padded]) for f in ("token", "top_ids", "top"))
    )
    return Sampled(tokens, merged), finite


def _padded(logprobs: Logprobs | None, num_rows: int, k: int) -> Logprobs:
    if logprobs is None:
        logprobs = Logprobs(
            mx.zeros((num_rows,)), mx.zeros((num_rows, 0), mx.int32), mx.zeros((num_rows, 0))
        )
    pad = k - logprobs.top.shape[1]
    return Logprobs(
        logprobs.token,
        mx.pad(logprobs.top_ids, [(0, 0), (0, pad)]),
        mx.pad(logprobs.top, [(0, 0), (0, pad)], constant_values=-mx.inf),
    )


def logprob_rows(
    logprobs: Logprobs | None, num_rows: int
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """A step's logprobs, per row: (the token's, its top K as (id, logprob) pairs)."""
    if logprobs is None:
        return [(0.0, ())] * num_rows
    token: list[float] = logprobs.token.tolist()  # type: ignore[assignment]
    ids: list[list[int]] = logprobs.top_ids.tolist()  # type: ignore[assignment]
    top: list[list[float]] = logprobs.top.tolist()  # type: ignore[assignment]
    return [(t, tuple(zip(i, v, strict=True))) for t, i, v in zip(token, ids, top, strict=True)]
