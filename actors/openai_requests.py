"""The OpenAI wire format coming in: request bodies to `GenerateRequest`s. No I/O here.

Every bad request becomes an `ApiError` whose body is exactly OpenAI's
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.errors import RequestError
from runtime.grammar import shapes_content_only
from runtime.sequence import SamplingParams

import attrs

from actors.choices import DEFAULT_MAX_N
from actors.openai_fields import IGNORED_FIELDS, ApiError, check_bookkeeping, json_field
from actors.openai_tools import (
    STRUCTURED_FIELDS,
    TOOL_FIELDS,
    ToolRequest,
    structured_output,
    tool_request,
)
from actors.requests import (
    MAX_TOP_LOGPROBS,
    REASONING_EFFORTS,
    GenerateRequest,
    as_float,
    check_request,
    stop_strings,
)


@attrs.frozen
class ApiRequest:
    kind: str  # "chat" or "completion"
    model: str
    request: GenerateRequest
    is_stream: bool
    include_usage: bool
    parallel_tool_calls: bool = True  # False: a reply's calls after the first are dropped
    n: int = 1  # choices: requests of their own that share the prompt (actors/choices.py)
    # A completion's further prompts (OpenAI's batch): n choices each, after the first's.
    more_prompts: tuple[str | tuple[int, ...], ...] = ()
    is_batch: bool = False  # the prompt was a list of prompts: a refusal names `prompt[i]`

    @property
    def requests(self) -> list[GenerateRequest]:
        """One request per prompt, the first prompt's being `request`."""
        return [self.request] + [attrs.evolve(self.request, prompt=p) for p in self.more_prompts]

    @property
    def parses_tools(self) -> bool:
        """The reply may hold tool calls, in the model's format."""
        return bool(self.request.tools) and self.request.tool_choice != "none"


# How a UTF-16 surrogate is spelled in JSON (paired ones too; the check after tells them apart).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(
            400, f"the request body is not valid UTF-8 ({error.reason} at byte {error.start})"
        ) from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as error:
        raise ApiError(
            400,
            # json's own wording ("Unterminated string starting at: line 1 column 11"):
            # its messages may end in "at", so appending " at line" read "at at line".
            f"the request body is not valid JSON: {error.msg}: line {error.lineno} column {error.colno}",
        ) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError:  # the one json raises besides: an integer past Python's 4,300 digits
        raise ApiError(400, "the request body has an integer of more than 4,300 digits") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:  # "\ud800" escapes decode to lone surrogates, which no response can encode
        if _SURROGATE_ESCAPE.search(text):  # a pass over the whole body saved where none is
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, "the request body contains an unpaired UTF-16 surrogate escape"
        ) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    return body


def _reject_constant(name: str) -> None:
    raise ApiError(400, f"the request body contains {name}, which is not valid JSON")


COMPLETION_DEFAULT_MAX_TOKENS = 16


def parse_chat(body: dict[str, Any], *, max_n: int = DEFAULT_MAX_N) -> ApiRequest:
    for name, why in UNSUPPORTED_CHAT_FIELDS.items():
        if body.get(name) is not None:  # null is absent, as SDKs serialize an unset field
            raise ApiError(400, f"'{name}' is not supported: {why}", param=name)
    if json_field(body, "modalities", list) not in (None, ["text"]):
        raise ApiError(
            400, "'modalities' must be [\"text\"]: this server writes text only", param="modalities"
        )
    messages = json_field(body, "messages", list, required=True)
    # check_request holds the allowlists of keys (messages', the template's) and their types.
    template_kwargs = json_field(body, "chat_template_kwargs", dict) or {}
    if (effort := body.get("reasoning_effort")) is not None:  # the template's variable
        if effort not in REASONING_EFFORTS:  # checked here to name the field the client sent
            levels = ", ".join(REASONING_EFFORTS)
            raise ApiError(400, f"'reasoning_effort' must be one of {levels}", param="reasoning_effort")
        template_kwargs = {"reasoning_effort": effort, **template_kwargs}
    return _parse_common(
        body,
        "chat",
        messages=tuple(messages),
        chat_template_kwargs=tuple(template_kwargs.items()),
        max_n=max_n,
    )


def parse_completion(body: dict[str, Any], *, max_n: int = DEFAULT_MAX_N) -> ApiRequest:
    prompt = json_field(body, "prompt", (str, list), required=True)
    prompts = _prompts(prompt)
    is_batch = _is_batch(prompt)
    if body.get("chat_template_kwargs") is not None:
        raise ApiError(
            400, "'chat_template_kwargs' applies to chat only", param="chat_template_kwargs"
        )
    if json_field(body, "echo", bool):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if json_field(body, "suffix", str):
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    try:
        api = _parse_common(body, "completion", max_n=max_n, prompt=prompts[0])
    except ApiError as error:
        # The first prompt is checked here, the others in admission (which names them):
        # a batch's first, even alone ([""]), is prompt[0] too.
        if is_batch and error.param == "prompt":
            raise naming_the_prompt(error, "prompt[0]") from None
        raise
    return attrs.evolve(api, more_prompts=tuple(prompts[1:]), is_batch=is_batch)


def _prompts(prompt: str | list[Any]) -> list[str | tuple[int, ...]]:
    """A completion's prompts: text, token ids, or a batch (a list) of either, as OpenAI's."""
    if isinstance(prompt, str):
        return [prompt]
    if _is_batch(prompt):
        return [
            p if isinstance(p, str) else _token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)
        ]
    return [_token_ids(prompt, "prompt")]


def _is_batch(prompt: str | list[Any]) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str | list) for p in prompt)


def _token_ids(prompt: list[Any], param: str) -> tuple[int, ...]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ApiError(
            400,
            # a batch's prompt is one of the two; the whole may be a list of them
            f"'{param}' must be a string or a list of token ids"
            + (", or a list of either" if param == "prompt" else ""),
            param=param,
        )
    return tuple(prompt)


def naming_the_prompt(error: ApiError, field: str) -> ApiError:
    """`error` about a batch's prompt, named as that one, `field` (`prompt[i]`)."""
    return attrs.evolve(error, message=f"{field}: {error.message}", param=field)


def _parse_common(body: dict[str, Any], kind: str, *, max_n: int, **prompt: Any) -> ApiRequest:
    # A field we don't know may be one the client expects an effect from: refuse it.
    known = _CHAT_FIELDS if kind == "chat" else _COMPLETION_FIELDS
    if unknown := sorted(name for name in body if name not in known):
        name = unknown[0][:64]
        raise ApiError(400, f"unknown field '{name}'", param=name, code="unknown_field")
    check_bookkeeping(body)
    model = json_field(body, "model", str, required=True)
    n = json_field(body, "n", int, default=1)
    if not 1 <= n <= max_n:
        raise ApiError(400, f"'n' must be an integer in [1, {max_n}], got {n}", param="n")
    # best_of (deprecated by OpenAI, dropped by vLLM) would rank candidates by logprob.
    best_of = json_field(body, "best_of", int)
    if best_of not in (None, 1):
        raise ApiError(400, "only best_of=1 is supported; use 'n'", param="best_of")
    if best_of is not None and n > best_of:  # OpenAI's rule: best_of >= n
        raise ApiError(400, f"'best_of' must be at least 'n' ({n}); leave it out", param="best_of")
    tools = _tools(body, kind)
    try:
        grammar = structured_output(body)
    except RequestError as error:
        raise ApiError.from_error(error) from None
    # A forced call has no content for OpenAI's response_format to shape: accepted, as
    # OpenAI accepts it. vLLM's guided fields constrain the whole reply, which a forced
    # call already does otherwise.
    is_whole_reply = grammar is not None and not shapes_content_only(grammar)
    if is_whole_reply and tools.choice in ("required", "function"):
        raise ApiError(
            400,
            "a forced tool_choice cannot be combined with a guided grammar",
            param="tool_choice",
        )
    is_stream = bool(json_field(body, "stream", bool))
    if body.get("stream_options") is not None and not is_stream:
        raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
    stream_options = json_field(body, "stream_options", dict) or {}
    # As for top-level fields: vLLM's continuous_usage_stats, say, was dropped silently.
    if unknown := sorted(name for name in stream_options if name not in _STREAM_OPTIONS):
        name = f"stream_options.{unknown[0][:64]}"
        raise ApiError(400, f"unknown field '{name}'", param=name, code="unknown_field")
    if not isinstance(stream_options.get("include_obfuscation"), bool | None):
        raise ApiError(
            400,
            "'stream_options.include_obfuscation' must be a boolean",
            param="stream_options.include_obfuscation",
        )
    include_usage = stream_options.get("include_usage")
    include_usage = False if include_usage is None else include_usage  # null: absent, as elsewhere
    if not isinstance(include_usage, bool):
        raise ApiError(
            400,
            "'stream_options.include_usage' must be a boolean",
            param="stream_options.include_usage",
        )
    stop = stop_strings(json_field(body, "stop", (str, list)))
    # OpenAI's newer name wins, but both are checked: a bad one is refused, not ignored.
    limits = {name: json_field(body, name, int) for name in ("max_completion_tokens", "max_tokens")}
    for name, limit in limits.items():
        if limit is not None and limit < 1:
            raise ApiError(400, f"'{name}' must be a positive integer, got {limit}", param=name)
    max_tokens_field, max_tokens = next(
        ((name, limit) for name, limit in limits.items() if limit is not None),
        ("max_tokens", None),
    )
    sampling = attrs.evolve(_sampling(body), logprobs=_logprobs(body, kind))
    request = GenerateRequest(
        **prompt,
        max_tokens=max_tokens,
        max_tokens_field=max_tokens_field,
        # OpenAI's legacy completions default to 16 tokens, as vLLM's; chat to no limit.
        default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else None,
        sampling=sampling,
        stop=stop,
        ignore_eos=bool(json_field(body, "ignore_eos", bool)),
        priority=json_field(body, "priority", int, default=0),
        grammar=grammar,
        tools=tools.tools,
        tool_choice=tools.choice,
        tool_name=tools.name,
    )
    try:
        request = check_request(request)
    except RequestError as error:
        raise ApiError.from_error(error) from None
    return ApiRequest(
        kind,
        model,
        request,
        is_stream,
        include_usage,
        parallel_tool_calls=tools.is_parallel,
        n=n,
    )


def _tools(body: dict[str, Any], kind: str) -> ToolRequest:
    if kind != "chat":
        for name in (*TOOL_FIELDS, "functions", "function_call"):
            if body.get(name) is not None:
                raise ApiError(400, f"'{name}' applies to chat only", param=name)
        return ToolRequest()
    try:
        return tool_request(body)
    except RequestError as error:
        raise ApiError.from_error(error) from None


def _logprobs(body: dict[str, Any], kind: str) -> int | None:
    """How many top alternatives to report per token; None: no logprobs.

    Chat: `logprobs: true`, and `top_logprobs` only with it (as OpenAI); completions:
    `logprobs: N`."""
    if kind == "completion":
        num_top = json_field(body, "logprobs", int)
        name = "logprobs"
    else:
        is_on = bool(json_field(body, "logprobs", bool))
        num_top = json_field(body, "top_logprobs", int)
        if num_top is not None and not is_on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        name = "top_logprobs"
        num_top = (num_top or 0) if is_on else None
    if num_top is not None and not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400,
            f"'{name}' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {num_top}",
            param=name,
        )
    return num_top


def _sampling(body: dict[str, Any]) -> SamplingParams:
    defaults = SamplingParams()
    values: dict[str, Any] = {}
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        value = json_field(body, name, (int, float))
        values[name] = getattr(defaults, name) if value is None else as_float(value)
    values["top_k"] = json_field(body, "top_k", int, default=0)  # check_request reads -1 as off
    values["seed"] = json_field(body, "seed", int)
    bias = json_field(body, "logit_bias", dict) or {}
    pairs = []
    for key, value in bias.items():
        # ASCII digits only: str.isdigit() also accepts "²" and "١", which int() misreads or refuses.
        if (
            _TOKEN_ID.fullmatch(key) is None
            or not isinstance(value, int | float)
            or isinstance(value, bool)
        ):
            raise ApiError(400, "'logit_bias' maps token ids to numbers", param="logit_bias")
        # An id past ten digits is out of range whatever it is (check_request says so).
        digits = key.lstrip("0") or "0"
        pairs.append((int(digits) if len(digits) <= 10 else 10**10, as_float(value)))
    return SamplingParams(**values, logit_bias=pairs)


_TOKEN_ID = re.compile(r"[0-9]+")
# OpenAI's stream options; include_obfuscation only pads chunks against length side
# channels, so it is accepted without effect.
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
_COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "logit_bias",
        "stop",
        "stream",
        "stream_options",
        "ignore_eos",
        "priority",
        "logprobs",
        "n",
        *STRUCTURED_FIELDS,
        *IGNORED_FIELDS,
        # Chat only: refused by completions, each with its own message.
        "chat_template_kwargs",
        *TOOL_FIELDS,
        # Refused unless off, each with its own message:
        "best_of",
        "functions",
        "function_call",
    }
)
# OpenAI chat fields for features this server lacks: refused with what is missing, where
# an unknown field would only say "unknown".
UNSUPPORTED_CHAT_FIELDS = {
    "audio": "this server writes text only",
    "prediction": "predicted outputs are not implemented",
    "verbosity": "bound a reply's length with 'max_tokens'",
    "web_search_options": "this server does not search the web",
}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "top_logprobs", "modalities", "reasoning_effort", *UNSUPPORTED_CHAT_FIELDS
}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix"}
