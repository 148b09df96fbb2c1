"""What a caller asks for and what it gets back, checked before any capacity is taken."""

from __future__ import annotations

import math
from typing import Any

from runtime.errors import CadenceError, RequestError
from runtime.grammar import GrammarSpec
from runtime.sequence import SamplingParams

import attrs

from actors.chat_messages import chat_messages

MAX_STOP_STRINGS = 16
MAX_PRIORITY = 2**31 - 1
MAX_STOP_BYTES = 4096  # per stop string, in UTF-8
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (chat) and logprobs (completions)
# A seed is an int64, as OpenAI's spec and vLLM take it (llama.cpp's -1, "random", is a
# seed like any other here); the sampler keys on its 64 bits unsigned.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
MAX_TOP_K = 2**31 - 1  # the engine's top-k array is int32
# The chat template switches a client may set, and their types: `enable_thinking`
# (Qwen3, GLM-4.5), `thinking` (DeepSeek-V3.1, Hermes 4, Granite 3.2/3.3),
# `reasoning_effort` (gpt-oss; OpenAI's request field of that name lands here) and
# `thinking_budget` (Seed-OSS: the tokens its thought may take, -1 no limit, 0 no
# thought). Any variable beyond these could steer a template in ways nobody reviewed,
# so the rest are refused.
CHAT_TEMPLATE_KWARGS: dict[str, type] = {
    "enable_thinking": bool,
    "thinking": bool,
    "reasoning_effort": str,
    "thinking_budget": int,
}
MAX_THINKING_BUDGET = 2**31 - 1
REASONING_EFFORTS = ("low", "medium", "high")  # the levels gpt-oss was trained on


class SiblingRefusedError(RequestError):
    """Refused because another request admitted with it (a choice, a batch's prompt) was."""


class OverloadedError(CadenceError):
    """The waiting queue is full; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class ServiceClosedError(CadenceError):
    """The service is draining or stopped and takes no new requests."""


class GenerationError(CadenceError):
    """A request failed after it started streaming (an engine fault in its row)."""


@attrs.frozen
class GenerateRequest:
    """Exactly one of `prompt` (text or token ids) and `messages` (chat) is set."""

    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int | None = None  # None: `default_max_tokens`, else whatever the context leaves
    max_tokens_field: str = "max_tokens"  # the name the client gave it, for errors
    # Without max_tokens, at most this many, as far as the context leaves room (OpenAI's
    # completions default to 16); None: no default.
    default_max_tokens: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # (name, value) pairs the chat template sees as variables; see CHAT_TEMPLATE_KWARGS
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    priority: int = 0  # lower runs first (vLLM's meaning); FCFS among equals
    grammar: GrammarSpec | None = None  # structured output: the text must match it
    # OpenAI tool definitions, shown to the chat template; `tool_choice` is "auto", "none",
    # "required" (some call, forced) or "function" (the call of `tool_name`, forced).
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"
    tool_name: str | None = None


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class LogprobEntry:
    """One generated token's logprob and its top alternatives, most likely first.

    `token` is the token id decoded alone; a piece of a multi-byte character, which
    has no text of its own, is spelled as OpenAI does ("bytes:\\xf0\\x9f"), and its
    real bytes are in `token_bytes` (`top_bytes` for the alternatives, in order; empty
    or None: each text's UTF-8). -inf marks a token the sampler's masks excluded.
    """

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()
    token_bytes: bytes | None = None
    top_bytes: tuple[bytes, ...] = ()


@attrs.frozen
class Delta:
    """A piece of generated text; the last one carries `finish_reason` and `usage`.

    `finish_reason` is OpenAI's ("stop" or "length"); `cause` says more (eos,
    stop_sequence, repetition_loop, ...). `logprobs` has one entry per token generated
    since the last delta when the request asks for logprobs, in order.
    """

    text: str
    finish_reason: str | None = None
    cause: str | None = None
    usage: Usage | None = None
    logprobs: tuple[LogprobEntry, ...] = ()
    # OpenAI `tool_calls` delta items parsed out of the text (actors/openai_tools.py):
    # a call's first carries id, type and name, the next ones argument text.
    tool_calls: tuple[dict[str, Any], ...] = ()
    # Reasoning parsed out of the text (gpt-oss's analysis channel), apart from the answer.
    reasoning: str = ""


def check_request(request: GenerateRequest) -> GenerateRequest:
    """The request in the form the actors take (its messages as actors/chat_messages.py
    rebuilds them), or RequestError naming the first bad field. HTTP and the embedding
    API both pass through here, so both follow one rule."""
    if (request.prompt is None) == (request.messages is None):
        raise RequestError("give exactly one of 'prompt' and 'messages'", param="prompt")
    # Types first: the embedding API passes whatever a caller gives (5, b"abc", a dict:
    # a TypeError, or a traceback from the tokenizer in admission).
    if request.prompt is not None and not isinstance(request.prompt, str | tuple):
        raise RequestError("'prompt' must be text or a list of token ids", param="prompt")
    if not isinstance(request.ignore_eos, bool):
        raise RequestError("'ignore_eos' must be a boolean", param="ignore_eos")
    if request.grammar is not None and not isinstance(request.grammar, GrammarSpec):
        raise RequestError("'grammar' must be a runtime.grammar.GrammarSpec", param="grammar")
    # A schema as a dict, not its JSON text, failed in admission as "could not prepare the
    # prompt: unhashable type: 'dict'", logged as the server's fault (json_object's is unread).
    if (grammar := request.grammar) is not None and not (
        isinstance(grammar.source, str) or (grammar.kind == "json_object" and grammar.source is None)
    ):
        raise RequestError(
            f"'grammar' source must be text (a JSON schema or a list of choices as JSON), "
            f"got {type(grammar.source).__name__}",
            param="grammar",
        )
    if request.prompt is not None and len(request.prompt) == 0:
        raise RequestError("'prompt' must not be empty", param="prompt")
    if isinstance(request.prompt, tuple) and not all(_is_int(t) and t >= 0 for t in request.prompt):
        raise RequestError("token ids in 'prompt' must be non-negative integers", param="prompt")
    if request.messages is not None:
        request = attrs.evolve(request, messages=chat_messages(request.messages))
    check_chat_template_kwargs(request)
    if request.max_tokens is not None and (
        not _is_int(request.max_tokens) or request.max_tokens < 1
    ):
        raise RequestError(
            f"'max_tokens' must be a positive integer, got {request.max_tokens!r}",
            param="max_tokens",
        )
    if not _is_int(request.priority) or abs(request.priority) > MAX_PRIORITY:
        raise RequestError(
            f"'priority' must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]", param="priority"
        )
    if len(request.stop) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if not all(isinstance(s, str) and s for s in request.stop):
        raise RequestError("stop strings must be non-empty strings", param="stop")
    if any(len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES for s in request.stop):
        raise RequestError(f"stop strings are limited to {MAX_STOP_BYTES} bytes each", param="stop")
    return attrs.evolve(request, sampling=check_sampling(request.sampling))


def check_chat_template_kwargs(request: GenerateRequest) -> None:
    if request.chat_template_kwargs and request.messages is None:
        raise RequestError(
            "'chat_template_kwargs' applies to chat messages only", param="chat_template_kwargs"
        )
    for name, value in request.chat_template_kwargs:
        param = f"chat_template_kwargs.{str(name)[:64]}"
        wanted = CHAT_TEMPLATE_KWARGS.get(name)
        if wanted is None:
            allowed = ", ".join(CHAT_TEMPLATE_KWARGS)
            raise RequestError(f"'{param}' is not supported (only {allowed})", param=param)
        if type(value) is not wanted:
            raise RequestError(f"'{param}' must be a {wanted.__name__}", param=param)
        if name == "reasoning_effort" and value not in REASONING_EFFORTS:
            raise RequestError(f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}", param=param)
        if name == "thinking_budget" and isinstance(value, int) and not -1 <= value <= MAX_THINKING_BUDGET:
            raise RequestError(
                f"'{param}' must be -1 (no limit) or a number of tokens in [0, {MAX_THINKING_BUDGET}]",
                param=param,
            )


# (field, lowest, highest, lowest is allowed)
_RANGES: tuple[tuple[str, float, float, bool], ...] = (
    ("temperature", 0.0, 2.0, True),
    ("top_p", 0.0, 1.0, False),
    ("min_p", 0.0, 1.0, True),
    ("repetition_penalty", 0.0, 10.0, False),
    ("presence_penalty", -2.0, 2.0, True),
    ("frequency_penalty", -2.0, 2.0, True),
)


def check_sampling(sampling: SamplingParams) -> SamplingParams:
    """`sampling` with top_k's spellings of "off" as 0, or RequestError naming the first
    bad field."""
    for name, low, high, low_ok in _RANGES:
        value = getattr(sampling, name)
        if not _is_number(value) or not math.isfinite(as_float(value)):
            raise RequestError(f"'{name}' must be a finite number, got {_shown(value)}", param=name)
        if value > high or value < low or (value == low and not low_ok):
            bracket = "[" if low_ok else "("
            raise RequestError(
                f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value!r}", param=name
            )
    if not _is_int(sampling.top_k) or sampling.top_k < -1:
        raise RequestError(
            f"'top_k' must be an integer >= -1 (-1 or 0: off), got {_shown(sampling.top_k)}",
            param="top_k",
        )
    # -1: OpenAI-compatible servers commonly send it for "off". A k past any vocabulary
    # keeps every token, as off does, and would overflow the engine's int32 top-k array.
    if sampling.top_k == -1 or sampling.top_k > MAX_TOP_K:
        sampling = attrs.evolve(sampling, top_k=0)
    if sampling.seed is not None and (
        not _is_int(sampling.seed) or not MIN_SEED <= sampling.seed <= MAX_SEED
    ):
        raise RequestError(
            f"'seed' must be an integer in [-2**63, 2**63), got {sampling.seed!r}", param="seed"
        )
    if sampling.logprobs is not None and (
        not _is_int(sampling.logprobs) or not 0 <= sampling.logprobs <= MAX_TOP_LOGPROBS
    ):
        raise RequestError(
            f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {sampling.logprobs!r}",
            param="logprobs",
        )
    for token, bias in sampling.logit_bias:
        if not _is_int(token) or token < 0:
            raise RequestError(f"logit_bias key {token!r} is not a token id", param="logit_bias")
        if not _is_number(bias) or not -100.0 <= bias <= 100.0:
            raise RequestError(
                f"logit_bias values must be numbers in [-100, 100], got {_shown(bias)}",
                param="logit_bias",
            )
    seen: set[int] = set()
    for token, _ in sampling.logit_bias:  # "5" and "05" in one JSON object: which bias?
        if token in seen:
            raise RequestError(f"logit_bias names token {token} twice", param="logit_bias")
        seen.add(token)
    return sampling


def stop_strings(stop: object) -> tuple[str, ...]:
    """A request's `stop` as a tuple (check_request checks the strings): None or "" is
    none, as HTTP's null and empty string, and one string is a list of one."""
    if stop is None or stop == "":
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list | tuple):
        raise RequestError("'stop' must be a string or a list of strings", param="stop")
    return tuple(stop)


def as_float(value: int | float) -> float:
    """An integer too large for a float becomes infinite, which the range checks refuse."""
    try:
        return float(value)
    except OverflowError:  # JSON integers are unbounded, and so are Python's: 10**400
        return math.inf if value > 0 else -math.inf


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(value: object) -> str:
    """A value in an error message, cut short: a caller's value may be a megabyte."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
