"""The values that cross the Engine's boundary: parameters in, outcomes out; and
`check_sequence`, whether a request's parameters can run at all (admission and `open`)."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from runtime.errors import RequestError
from runtime.kv.base import RowSpan

import attrs

if TYPE_CHECKING:
    from runtime.grammar import CompiledGrammar, ThoughtFirst


def _bias_pairs(
    bias: Mapping[int, float] | Iterable[tuple[int, float]],
) -> tuple[tuple[int, float], ...]:
    """{token: bias} or (token, bias) pairs -> pairs sorted by token, so equal biases
    compare equal. Nothing is coerced (int() made a key of 1.5 token 1): admission's
    `check_sampling` names a key or value that is not one."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = tuple((token, value) for token, value in items)
    except (TypeError, ValueError):  # not pairs: "cannot unpack non-iterable int object"
        raise TypeError(
            "logit_bias must map token ids to biases, or be (token id, bias) pairs"
        ) from None
    with contextlib.suppress(TypeError):  # keys that do not order are the check's to name
        pairs = tuple(sorted(pairs))
    return pairs


# Temperatures this small sample the top token anyway; dividing by them does not: in
# float32 1e-40 is 0 or a subnormal, and logits / T were inf and their logprobs NaN.
# (vLLM's epsilon for the same rule.)
GREEDY_BELOW = 1e-5


@attrs.frozen
class SamplingParams:
    """Per-row sampling. A temperature under GREEDY_BELOW is greedy; every field batches
    with any other."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1.0: off; divides positive logits of seen tokens
    presence_penalty: float = 0.0  # subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token
    # (token id, bias added to its logit); a {token: bias} mapping is accepted too
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias_pairs)
    seed: int | None = None  # a seeded row draws from its own generator, whatever its batch
    # Report each sampled token's logprob and this many top alternatives (0..20); None: off.
    logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@attrs.frozen
class SequenceParams:
    prompt_tokens: tuple[int, ...]
    max_tokens: int | None  # None: until EOS, a stop, or the context is full
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()  # added to the model's EOS ids
    ignore_eos: bool = False
    # Finish with REPETITION_LOOP when the last `repetition_window` tokens are one
    # short pattern (period <= 1/4 of the window) repeated; None: never.
    repetition_window: int | None = None
    request_id: str = ""
    priority: int = 0  # lower runs first (vLLM's meaning); equal ones first come, first served
    # Structured output: every token must keep the output inside this grammar, and the
    # row ends when the grammar is complete. None: free text.
    grammar: CompiledGrammar | None = None
    # A thinking model's chat reply (`<think>`, `[THINK]`): the grammar shapes what follows its thought, which
    # is the model's own (runtime/grammar.py). None: the grammar shapes every token.
    thought_first: ThoughtFirst | None = None


@attrs.frozen
class SeqHandle:
    seq_id: int


@attrs.frozen
class StepBatch:
    """One engine step: one ragged forward over `spans`, in this order.

    `epoch` is the block pool's move counter when the step was planned: block-table
    arrays cached by the storage are reused only while it is unchanged.
    """

    spans: tuple[RowSpan, ...] = ()
    epoch: int = 0
    saves: tuple[tuple[int, int], ...] = ()  # (seq_id, snapshot id): keep its state after its span


class FinishCause(enum.Enum):
    """Why a row stopped, in the order `finish_step` checks them."""

    ERROR = "error"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    LENGTH = "length"
    CONTEXT_EXHAUSTED = "context_exhausted"
    REPETITION_LOOP = "repetition_loop"

    @property
    def openai_reason(self) -> str:
        """The OpenAI `finish_reason` this cause is reported as."""
        if self in (FinishCause.LENGTH, FinishCause.CONTEXT_EXHAUSTED):
            return "length"
        if self is FinishCause.ERROR:
            return "error"
        return "stop"


@attrs.frozen
class TokenLogprob:
    """A sampled token's log-probability and the most likely alternatives, by token id.

    Of the distribution the token was drawn from (see `runtime/sampling.py`); a token
    the processors masked has -inf.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@attrs.frozen
class StepOutcome:
    """One row's result of one step. `token` is None only when the row failed."""

    seq_id: int
    token: int | None
    finish: FinishCause | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None  # when the row's sampling asks for logprobs
    # The request field whose value failed the row (a grammar past llguidance's limits
    # mid-reply): the client's fault, not the server's.
    error_param: str | None = None
    # A constrained row inside the thought before its grammar (runtime/grammar.py): it
    # may be fed its queued sample, so the policy may plan it a speculative step.
    is_thinking: bool = False


def check_sequence(
    params: SequenceParams,
    *,
    max_context: int,
    vocab_size: int,
    prompt_field: str = "prompt",
    max_tokens_field: str = "max_tokens",
    kv_tokens: int | None = None,
) -> None:
    """Raise RequestError unless `params` can run; pure, so admission calls it off-thread too.

    `prompt_field` and `max_tokens_field` name the request fields the prompt and the
    limit came from ("prompt" or "messages"; "max_tokens" or "max_completion_tokens");
    `kv_tokens`, when it is what bounds `max_context`, is named in the error.
    """
    prompt = params.prompt_tokens
    if not prompt:
        raise RequestError(f"'{prompt_field}' encodes to no tokens", param=prompt_field)
    if params.max_tokens is not None and params.max_tokens < 1:
        raise RequestError(f"'{max_tokens_field}' must be at least 1", param=max_tokens_field)
    if len(prompt) + (params.max_tokens or 1) > max_context:
        asked = params.max_tokens or "at least 1"
        limit = f"this model's maximum context length is {max_context} tokens"
        if kv_tokens is not None and kv_tokens <= max_context:
            limit = f"the KV budget holds {kv_tokens} tokens in all (--kv-budget)"
        raise RequestError(
            f"{limit}; the prompt has {len(prompt)} tokens and {max_tokens_field} asks for "
            f"{asked} more",
            # The prompt's fault when it leaves no room for even one token.
            param=max_tokens_field
            if params.max_tokens and len(prompt) < max_context
            else prompt_field,
            code="context_length_exceeded",
        )
    if any(not 0 <= t < vocab_size for t in prompt):
        raise RequestError(
            f"token ids in '{prompt_field}' must be in 0..{vocab_size - 1}", param=prompt_field
        )
    if any(not 0 <= t < vocab_size for t, _ in params.sampling.logit_bias):
        raise RequestError(
            f"logit_bias keys must be token ids in 0..{vocab_size - 1}", param="logit_bias"
        )
