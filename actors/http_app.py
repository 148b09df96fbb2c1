"""The OpenAI-compatible HTTP front: a Quart-Trio app (actors/http_server.py serves it).

Quart's defaults are wrong for an API (HTML error pages, 500 on bad UTF-8, a
16 MB body limit, `RESPONSE_TIMEOUT` cutting long streams), so the body is read
and parsed here and every error leaves as OpenAI's JSON error object.

A request's choices (OpenAI's `n`, one Generation each; actors/choices.py) are read
together in a nursery of their own. A stream's body opens it when Quart starts
sending and closes it when Quart stops: when the client disconnects, Quart cancels
the send, and leaving the nursery aborts every choice (the rows leave the batch
within one step).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from functools import partial
from importlib import resources
from types import TracebackType
from typing import Any

from runtime.errors import CadenceError
from runtime.tools import REASONING_STYLES

import attrs
import structlog
import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, g, request
from quart.wrappers.response import ResponseBody
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from actors.choices import (
    DEFAULT_MAX_N,
    ChoiceEvent,
    choice_requests,
    combined_usage,
    interleaved,
    start_together,
)
from actors.cors import CorsPolicy
from actors.generation import Generation
from actors.http_access import hostname, is_authorized, request_ids
from actors.http_body import BODY_GRACE_S, BODY_MIN_RATE, request_api
from actors.llm import LLM
from actors.openai_requests import (
    ApiError,
    ApiRequest,
    naming_the_prompt,
    parse_chat,
    parse_completion,
)
from actors.openai_responses import SSE_DONE, ChunkWriter, sse, wire_json
from actors.openai_tools import ToolCallDeltas, with_tool_calls
from actors.openapi import OPENAPI
from actors.requests import LogprobEntry, OverloadedError, ServiceClosedError, Usage

log = structlog.get_logger("cadence.http")


@attrs.define
class ServerState:
    """What the app serves: no LLM while loading; `is_draining` once shutdown began."""

    llm: LLM | None = None
    is_draining: bool = False

    @property
    def phase(self) -> str:
        if self.is_draining:
            return "draining"
        return "loading" if self.llm is None else "ready"


def create_app(
    state: ServerState,
    *,
    max_body_bytes: int = 4 << 20,
    api_keys: Sequence[str] = (),
    cors: CorsPolicy | None = None,
    max_n: int = DEFAULT_MAX_N,
    allowed_hosts: frozenset[str] | None = None,
    body_grace_s: float = BODY_GRACE_S,
    body_min_rate: int = BODY_MIN_RATE,
) -> QuartTrio:
    """`api_keys`: when given, every route but /, /health and /openapi.json needs a Bearer key.

    `cors`: the origins whose browser pages may call the API; none by default.
    `max_n`: the most choices (`n`) one request may ask for.
    `body_grace_s`, `body_min_rate`: a request body must arrive at `body_min_rate`
    bytes a second on average once `body_grace_s` have passed (actors/http_body.py).
    `allowed_hosts`: the names a request's `Host` may give (lower case, no port); None:
    any. A server on loopback answers only its own names: otherwise any web page could
    read it through DNS rebinding (a name of the page's that resolves to 127.0.0.1).
    """
    app = QuartTrio("cadence", static_folder=None)  # no /static route: the one page is at /
    # "/v1//chat/completions" (a base URL ending in "/v1/") is a 404 in OpenAI's shape:
    # merged, it was a 308 redirect with an HTML body, which routing raises past the
    # error handlers.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["BODY_GRACE_S"] = body_grace_s
    app.config["BODY_MIN_RATE"] = body_min_rate
    app.config["PARSE_THREADS"] = trio.CapacityLimiter(1)
    cors = cors or CorsPolicy()
    keys = tuple(key.encode() for key in api_keys)

    @app.before_request
    async def name_the_request() -> Response | None:
        g.client_request_id, g.request_id = request_ids(request.headers.get("x-request-id"))
        # No Host at all (HTTP/1.0: HAProxy's health check) passes: browsers always send one.
        host = request.headers.get("Host", "")
        if allowed_hosts is not None and host.strip() and hostname(host) not in allowed_hosts:
            raise ApiError(
                403,
                f"this server does not answer for host {host[:100]!r} "
                "(serve with --allowed-host to name it)",
                code="host_not_allowed",
            )
        # werkzeug upper-cases the method, so "get" was served as GET; methods are
        # case-sensitive (RFC 9110): one not spelt as a route's is refused as FOO is.
        if _method_as_sent() != request.method:
            adapter = app.create_url_adapter(request)
            methods = adapter.allowed_methods() if adapter is not None else []
            raise MethodNotAllowed(valid_methods=methods) if methods else NotFound()
        if request.method == "OPTIONS" and (allowed := cors.preflight_headers(request.headers)):
            return Response("", 204, headers=allowed)  # before the key check: no credentials here
        if keys and request.path not in _OPEN_PATHS and not is_authorized(request, keys):
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return None

    @app.after_request
    async def echo_the_request_id(response: Response) -> Response:
        response.headers["x-request-id"] = g.get("client_request_id") or uuid.uuid4().hex
        allowed = cors.response_headers(request.headers.get("Origin"))
        if vary := allowed.pop("Vary", None):  # added to a preflight's, not over it
            response.vary.add(vary)
        response.headers.update(allowed)
        return response

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return _refused(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        # A 405 must name the allowed methods (RFC 9110); werkzeug's error holds them.
        allow = tuple((k, v) for k, v in error.get_headers() if k.lower() == "allow")
        where = f"{_method_as_sent()} {request.path}"[:200]
        if error.code == 404:  # OpenAI's words and code for a path it does not serve
            return _refused(ApiError(404, f"Invalid URL ({where})", code="unknown_url"))
        if error.code == 405:
            allowed = ", ".join(v for _, v in allow)
            message = f"Invalid method for URL ({where}); it takes {allowed}"
            return _refused(ApiError(405, message, code="method_not_allowed", headers=allow))
        message = error.description or error.name
        return _refused(ApiError(error.code or 500, message, headers=allow))

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Response:
        log.exception("unhandled error")
        return _error_response(ApiError(500, "internal server error"))

    @app.get("/")
    async def playground() -> Response:
        return Response(_PLAYGROUND, 200, mimetype="text/html", headers=_PAGE_HEADERS)

    @app.get("/health")
    async def health() -> Response:
        status = 200 if state.phase == "ready" else 503
        return _json({"status": state.phase}, status)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return _json(OPENAPI)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = generate_latest(_loaded(state).metrics.registry)
        return Response(body, 200, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @app.get("/v1/cadence/stats")
    async def stats() -> Response:
        return _json(server_stats(_loaded(state)))

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [_model_card(_ready(state))]})

    @app.get("/v1/models/<path:model>")  # a Hub id has a slash
    async def model(model: str) -> Response:
        return _json(_model_card(_served(state, model)))

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _complete(state, await request_api(partial(parse_chat, max_n=max_n)))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _complete(state, await request_api(partial(parse_completion, max_n=max_n)))

    return app


def _loaded(state: ServerState) -> LLM:
    """The LLM once loaded, draining or not: the drain is worth watching."""
    if state.llm is None:
        raise ApiError.from_error(ServiceClosedError("the server is loading"))
    return state.llm


def _ready(state: ServerState) -> LLM:
    if state.llm is None or state.is_draining:
        raise ApiError.from_error(ServiceClosedError(f"the server is {state.phase}"))
    return state.llm


def _served(state: ServerState, model: str) -> LLM:
    """The LLM, if `model` names it; else OpenAI's 404 for an unknown model."""
    llm = _ready(state)
    if model != llm.name:
        raise ApiError(
            404,
            f"the model '{model[:256]}' does not exist; this server has '{llm.name}'",
            param="model",
            code="model_not_found",
        )
    return llm


def _model_card(llm: LLM) -> dict[str, Any]:
    return {"id": llm.name, "object": "model", "created": llm.loaded_at, "owned_by": "cadence"}


async def _complete(state: ServerState, api: ApiRequest) -> Response:
    llm = _served(state, api.model)
    # Counted before any request is built: a request per prompt and choice, built on
    # the event loop for a million one-token prompts (4 MB), stalled every stream 19 s.
    num_prompts = 1 + len(api.more_prompts)
    if api.more_prompts and num_prompts * api.n > llm.max_waiting:  # would never fit
        raise ApiError(
            400,
            f"{num_prompts} prompts of n={api.n} choices are {num_prompts * api.n} requests, "
            f"more than this server queues ({llm.max_waiting})",
            param="prompt",
        )
    # Choice i*n + j is prompt i's choice j, as OpenAI numbers a batch of prompts.
    choices = [choice for request in api.requests for choice in choice_requests(request, api.n)]
    suffixes = [f"-{i}" for i in range(len(choices))] if len(choices) > 1 else [""]
    generations = [
        Generation(llm, choice, request_id=g.request_id + suffix, cancel_cause="disconnected")
        for suffix, choice in zip(suffixes, choices, strict=True)
    ]
    try:
        await start_together(llm, generations)
    except CadenceError as error:
        # Admission logs what it refuses; a full queue or a draining service refuses
        # before it, and the handler logs those.
        g.is_end_logged = not isinstance(error, OverloadedError | ServiceClosedError)
        raise _naming_the_prompt(ApiError.from_error(error), error, generations, api) from None
    g.is_end_logged = True  # admitted: the pipeline logs how it ends, failures included
    prefix = "chatcmpl-" if api.kind == "chat" else "cmpl-"
    writer = ChunkWriter(
        api.kind,
        prefix + g.request_id,
        llm.name,
        api.include_usage,
        has_logprobs=api.request.sampling.logprobs is not None,
    )
    tools = None
    tags = llm.think_tags if api.kind == "chat" else None
    if tags is not None and not tags.thinks_with(dict(api.request.chat_template_kwargs)):
        tags = None  # Granite's, where the request leaves its thinking off
    think_tags = tags.spellings if tags is not None else None
    if api.parses_tools or think_tags or (api.kind == "chat" and llm.tool_style in REASONING_STYLES):
        # A harmony, Gemma 4 or thinking (<think>, [THINK]) reply is parsed for its
        # reasoning whether tools were offered or not.
        tools = ToolCallDeltas(
            llm.tool_style,
            api.parallel_tool_calls,
            api.is_stream,
            api.parses_tools,
            think_tags,
            api.request.tools,
            tags.answer if tags is not None else (),
        )
    if api.is_stream:
        response = Response(
            _ChoicesStream(generations, writer, tools, api.n), mimetype="text/event-stream"
        )
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None  # RESPONSE_TIMEOUT (60 s) would cut a long stream silently
        return response
    return await _collect(generations, writer, tools, api.n)


def _naming_the_prompt(
    refusal: ApiError, error: CadenceError, generations: list[Generation], api: ApiRequest
) -> ApiError:
    """A batch of prompts' refusal names the prompt it is about, `prompt[i]`: "the
    prompt is longer than the context" did not say which of 20."""
    if not api.is_batch or refusal.param != "prompt":
        return refusal
    refused = [i for i, generation in enumerate(generations) if generation.refusal is error]
    if not refused:
        return refusal
    return naming_the_prompt(refusal, f"prompt[{refused[0] // api.n}]")  # choice i*n + j is prompt i's


class _ChoicesStream(ResponseBody):
    """An SSE body over the choices' deltas: Quart enters it, iterates it and exits it
    in the task that sends the response, so the choices' nursery lives exactly as
    long as the sending (an async generator must not hold a nursery across a yield)."""

    def __init__(
        self,
        generations: Sequence[Generation],
        writer: ChunkWriter,
        tools: ToolCallDeltas | None,
        n: int,
    ):
        self._generations = generations
        self._writer = writer
        self._tools = tools
        self._n = n
        self._exits = contextlib.AsyncExitStack()
        self._events: AsyncGenerator[bytes, None] | None = None

    async def __aenter__(self) -> _ChoicesStream:
        events = await self._exits.enter_async_context(interleaved(self._generations))
        num_choices = len(self._generations)
        self._events = _sse_events(events, self._writer, num_choices, self._n, self._tools)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._events is not None:
            await self._events.aclose()
        await self._exits.__aexit__(exc_type, exc_value, tb)

    def __aiter__(self) -> AsyncIterator[bytes]:
        assert self._events is not None, "iterated before it was entered"
        return self._events


async def _sse_events(
    events: trio.MemoryReceiveChannel[ChoiceEvent],
    writer: ChunkWriter,
    num_choices: int,
    n: int,
    tools: ToolCallDeltas | None,
) -> AsyncGenerator[bytes, None]:
    usages: dict[int, Usage] = {}
    try:
        if (first := writer.start(num_choices)) is not None:
            yield first
        async for index, event in events:
            if isinstance(event, CadenceError):
                raise event
            if tools is not None:
                event = tools.convert(index, event)
            # A chunk carries its tokens' logprob entries: they leave with the first of
            # the reasoning, the text and the calls that the tokens made, or alone (as
            # empty content) where the parser holds back what they made.
            logprobs = event.logprobs
            if event.reasoning:
                yield writer.reasoning(event.reasoning, index, logprobs)
                logprobs = ()
            if event.text or (logprobs and not event.tool_calls):
                yield writer.text(event.text, logprobs, index)
                logprobs = ()
            if event.tool_calls:
                yield writer.tool_calls(event.tool_calls, index, logprobs)
            if event.finish_reason is not None:
                yield writer.finish(event.finish_reason, index)
                assert event.usage is not None
                usages[index] = event.usage
        if writer.include_usage and usages:  # once, after every choice finished
            yield writer.usage(combined_usage([usages[i] for i in sorted(usages)], n))
        yield SSE_DONE
    except CadenceError as error:  # mid-stream: an error event, then the stream ends
        yield sse(ApiError.from_error(error).body())
        yield SSE_DONE


async def _collect(
    generations: Sequence[Generation], writer: ChunkWriter, tools: ToolCallDeltas | None, n: int
) -> Response:
    texts: list[list[str]] = [[] for _ in generations]
    reasonings: list[list[str]] = [[] for _ in generations]
    logprobs: list[list[LogprobEntry]] = [[] for _ in generations]
    calls: list[list[dict[str, Any]]] = [[] for _ in generations]
    finished: dict[int, tuple[str, Usage]] = {}
    failure: CadenceError | None = None
    async with interleaved(generations) as events:
        async for index, event in events:
            if isinstance(event, CadenceError):
                failure = event  # leaving the block aborts the other choices
                break
            if tools is not None:
                event = tools.convert(index, event)
                calls[index] += event.tool_calls
            texts[index].append(event.text)
            reasonings[index].append(event.reasoning)
            logprobs[index] += event.logprobs
            if event.finish_reason is not None:
                assert event.usage is not None
                finished[index] = (event.finish_reason, event.usage)
    if failure is not None:  # raised out here: inside, the nursery would wrap it in a group
        raise ApiError.from_error(failure)
    choices = [
        with_tool_calls(
            writer.choice("".join(texts[i]), finished[i][0], logprobs[i], i, "".join(reasonings[i])),
            calls[i],
        )
        for i in range(len(generations))
    ]
    usage = combined_usage([finished[i][1] for i in range(len(generations))], n)
    return _json(writer.whole(choices, usage))


def server_stats(llm: LLM) -> dict[str, Any]:
    """The playground's live view: /metrics' own samples, as JSON (it polls every second)."""
    registry, labels = llm.metrics.registry, {"model_name": llm.name}

    def sample(name: str) -> float:
        return registry.get_sample_value(f"cadence:{name}", labels) or 0.0

    return {
        "num_running": int(sample("num_requests_running")),
        "num_waiting": int(sample("num_requests_waiting")),
        "kv_cache_usage": sample("kv_cache_usage_perc"),  # 0 to 1
        "generation_tokens_total": int(sample("generation_tokens_total")),
    }


# The page is static, so it is read once; the policy lets it run its own inline script and
# call this server only, and no other site may frame it.
_PLAYGROUND = (resources.files("actors") / "static" / "playground.html").read_bytes()
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
}

# Open without a key: / is the playground page, whose own calls carry the key;
# /health for load balancers; /openapi.json describes the API, not
# its data, and a client needs it to learn how to authenticate. /metrics is not open
# (vLLM's is): it reveals load and traffic, and Prometheus can send a bearer token.
_OPEN_PATHS = frozenset({"/", "/health", "/openapi.json"})


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(wire_json(body), status, mimetype="application/json")


def _method_as_sent() -> str:
    """The request's method as the client spelt it: werkzeug's `request.method` is upper-cased."""
    return str(request.scope.get("method", request.method))


def _refused(error: ApiError) -> Response:
    """The error's response, logged (once) under the request's id: a client that quotes
    its x-request-id for a 400, a 404 or a 503 finds why in the log."""
    if not g.get("is_end_logged"):
        log.info(
            "rejected",
            request_id=g.get("request_id"),
            status=error.status,
            code=error.code,
            param=error.param,
            error=error.message,
        )
    return _error_response(error)


def _error_response(error: ApiError) -> Response:
    response = _json(error.body(), error.status)
    for name, value in error.headers:
        response.headers[name] = value
    return response
