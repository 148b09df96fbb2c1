"""The HTTP server around the app: Hypercorn in our nursery, and the ASGI wrappers that
make its connection handling right (an early answer closes; a drain waits for requests
in flight; past a cap on requests in flight, a new one gets an immediate 503). The
routes are actors/http_app.py's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import h11
import hypercorn.protocol
import hypercorn.trio.run
import structlog
import trio
from hypercorn.config import Config, Sockets
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.events import Body, Data
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer

from actors.cors import CorsPolicy
from actors.http_access import is_bindable_host, request_ids
from actors.openai_fields import ApiError
from actors.openai_responses import wire_json

log = structlog.get_logger("cadence.http")

# A response write that makes no progress for this long drops the connection, as
# nginx's send_timeout (60 s) does: a client that stops reading a stream would
# otherwise hold its connection, its answer's text and a task forever, and keep the
# server from stopping (Hypercorn's writes are shielded from cancellation).
SEND_TIMEOUT_S = 60.0


async def serve_http(
    app: Any,  # the ASGI app: create_app's
    host: str,
    port: int,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    graceful_timeout: float = 30.0,
    send_timeout: float = SEND_TIMEOUT_S,
    max_requests: int | None = None,
    cors: CorsPolicy | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run Hypercorn until `shutdown_trigger` returns; reports the bound URLs on start.

    `max_requests`: the most HTTP requests in flight (their body being read, generating,
    or their answer being sent); past it a new one gets an immediate 503. None: no cap.
    `cors`: the app's, for that 503, which the app never sees (a browser hides an answer
    without its CORS headers from the page, `Retry-After` and all).

    On shutdown it stops accepting, gives in-flight requests `graceful_timeout`
    seconds, then closes the connections still open, cancels what is left (which
    aborts their rows) and returns. Once the last response is sent it returns without
    waiting out the timeout for connections still open: Hypercorn (0.17, 0.18) closes
    a keep-alive connection itself when shutdown began during its response, and this
    is the backstop should one not.
    """
    stopping = trio.Event()
    tracked = _InFlight(_CloseAfterEarlyResponse(app, stopping), max_requests, cors)
    config = _Config(send_timeout)
    # Bracketed always, which Hypercorn strips: bare, a host named "unix" read as
    # "unix:PATH", a UNIX socket named after the port in the working directory.
    config.bind = [f"[{host}]:{port}"]
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    config.errorlog = logging.getLogger("cadence.hypercorn")  # silent unless the app configures it
    # HTTP/1.1 only: Hypercorn also speaks cleartext HTTP/2 to a client that opens with
    # its preface, and its HTTP/2 code raised out of the whole server (KeyError) when a
    # request's body arrived after its answer (a 404, 401 or 413 sent early). A peer
    # allowed no streams can send no request; it gets GOAWAY and a closed connection.
    # (An `Upgrade: h2c` request, bodiless by Hypercorn's rule, is still answered: it
    # arrives whole, so nothing can follow its answer.)
    config.h2_max_concurrent_streams = 0

    async def trigger() -> None:
        await shutdown_trigger()
        stopping.set()

    async with trio.open_nursery() as nursery:

        async def cut_off_after_drain() -> None:
            await stopping.wait()
            with trio.move_on_after(graceful_timeout) as grace:
                await tracked.wait_idle()
            if grace.cancelled_caught:
                config.close_open_connections()
            nursery.cancel_scope.cancel()

        nursery.start_soon(cut_off_after_drain)
        await serve(tracked, config, shutdown_trigger=trigger, task_status=task_status)
        nursery.cancel_scope.cancel()


class _RefusedH2(H2Protocol):
    """Hypercorn's HTTP/2, which a connection opening with HTTP/2's preface gets: here it
    answers the preface with its settings and a GOAWAY and closes at once. Hypercorn's
    own kept such a connection open for good (its idle timer restarts only when a
    stream ends, and a peer allowed no streams opens none): a client sending just the
    24-byte preface, thousands of times, used up the server's file descriptors and every
    new client hung. An `Upgrade: h2c` request (`initiate` with its headers) is still
    answered, as Hypercorn does, and its connection idles out once the stream ends."""

    refused = False

    async def initiate(
        self, headers: list[tuple[bytes, bytes]] | None = None, settings: bytes | None = None
    ) -> None:
        if headers is not None:
            return await super().initiate(headers, settings)
        self.refused = True
        self.connection.initiate_connection()
        self.connection.close_connection()  # GOAWAY: no stream will be served
        await self._flush()
        await self.send(Closed())

    async def handle(self, event: Event) -> None:
        if not self.refused:  # the preface's bytes, handed on after `initiate`
            await super().handle(event)


hypercorn.protocol.H2Protocol = _RefusedH2  # type: ignore[misc]  # the one ProtocolWrapper builds


# Hypercorn upper-cases the method (as ASGI asks), so "get" reached the app as GET, where
# methods are case-sensitive (RFC 9110): the method as sent, which `_InFlight` gives the
# app (http_app refuses one that is not a route's as spelt).
_METHOD_AS_SENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "method_as_sent", default=None
)


class _LenientConnection(h11.Connection):
    """h11's connection, dropping the empty lines its buffer starts with when a new
    request is due: ones that came with the end of the request before (a CRLF written
    with a POST's body, or between pipelined requests)."""

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        data = self.trailing_data[0]
        buffer = getattr(self, "_receive_buffer", None)  # h11 has no public way; 0.14-0.16
        if (num_blank := len(data) - len(data.lstrip(b"\r\n"))) and buffer is not None:
            buffer.maybe_extract_at_most(num_blank)  # (a later h11 without it: a 400, as before)


class _LenientH11(H11Protocol):
    """Hypercorn's HTTP/1.1, ignoring empty lines where a request-line is awaited, as
    RFC 9112 (2.2) asks and nginx does: h11 took a CRLF sent on an idle keep-alive
    connection, or after a request (some clients end a POST body with one), for a
    request with no request-line, and the connection got a 400 and closed. Those that
    arrive alone are dropped here; those that came with what they follow are in h11's
    buffer, and dropped there (`_LenientConnection`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = _LenientConnection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )

    async def handle(self, event: Event) -> None:
        if isinstance(event, RawData) and event.data and self._awaits_request_line():
            data = event.data.lstrip(b"\r\n")
            if not data:
                return  # nothing but empty lines: not the end of the stream (b"")
            event = RawData(data=data)
        await super().handle(event)

    async def _check_protocol(self, event: h11.Request) -> None:
        # Set in this task, so the app's task (spawned here, or by the HTTP/2 an h2c upgrade
        # hands on to) inherits it. Hypercorn checks every request before it makes its stream;
        # an upgrade makes none, and so had kept an earlier request's method, or none.
        _METHOD_AS_SENT.set(event.method.decode("ascii"))  # h11 admits token bytes only
        await super()._check_protocol(event)

    def _awaits_request_line(self) -> bool:
        connection = self.connection  # a WebSocket's is no h11.Connection
        return (
            isinstance(connection, h11.Connection)
            and connection.their_state in (h11.IDLE, h11.DONE)
            and not connection.trailing_data[0]
        )


hypercorn.protocol.H11Protocol = _LenientH11  # type: ignore[misc]  # the one ProtocolWrapper builds


class _RefusedWSStream(WSStream):
    """Hypercorn's WebSocket stream, whose handshake the app always refuses (no route
    speaks WebSocket: `_InFlight`). Bytes sent before the answer to the handshake (a
    frame, a CRLF, in the handshake's packet) are dropped: Hypercorn answered them with
    a 400 of its own, the app's answer then failed, and where the app had answered
    first, h11 refused Hypercorn's second answer and the error ended the whole server."""

    async def handle(self, event: StreamEvent) -> None:
        if isinstance(event, (Body, Data)) and not self.handshake.accepted:
            return
        await super().handle(event)


hypercorn.protocol.h11.WSStream = _RefusedWSStream  # type: ignore[misc]  # the ones the protocols build
hypercorn.protocol.h2.WSStream = _RefusedWSStream  # type: ignore[misc]


class _TrackedTCPServer(TCPServer):
    """Hypercorn's connection, known to its `_Config` while it is open, so that the
    end of a drain can close it (`_Config.close_open_connections`). An error its
    handling lets through ends this connection alone (Hypercorn closed it already):
    Hypercorn passes it to the listener's nursery, which ended the whole server."""

    async def run(self) -> None:
        open_streams = getattr(self.config, "open_streams", None)
        if open_streams is None:  # a config of Hypercorn's own
            return await super().run()
        open_streams.add(self.stream)
        try:
            await super().run()
        except Exception:
            log.exception("connection_failed")
        finally:
            open_streams.discard(self.stream)


hypercorn.trio.run.TCPServer = _TrackedTCPServer  # type: ignore[misc]  # the one worker_serve starts


class _Config(Config):
    """Hypercorn's config, its listening sockets set to drop a connection whose sent
    data goes unacknowledged for `send_timeout` (TCP_USER_TIMEOUT, which accepted
    connections inherit, and which covers a receive window that stays shut), and that
    knows its open connections, to close them when a drain's grace runs out."""

    def __init__(self, send_timeout: float):
        super().__init__()
        self.send_timeout = send_timeout
        self.open_streams: set[Any] = set()

    def close_open_connections(self) -> None:
        """Close every connection still open. Hypercorn shields its writes from
        cancellation: a client that stopped reading held its write, and so the end of
        the shutdown, until `send_timeout` dropped it (60 s after its last ACK). Closed,
        the write fails at once (trio wakes it with ClosedResourceError); what it had
        sent is left to the kernel to deliver, as after any close."""
        for stream in list(self.open_streams):
            sock = getattr(stream, "socket", None)  # a TLS stream has none: we serve none
            if sock is not None:
                sock.close()

    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; not macOS
            for listener in sockets.insecure_sockets:
                milliseconds = max(1, round(self.send_timeout * 1000))
                listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
        return sockets


@contextlib.asynccontextmanager
async def serving_on_loopback(
    app: Any,
    *,
    graceful_timeout: float = 30.0,
    send_timeout: float = SEND_TIMEOUT_S,
    max_requests: int | None = None,
    cors: CorsPolicy | None = None,
) -> AsyncIterator[str]:
    """`app` served on 127.0.0.1 at a free port while the block runs; yields its URL.

    For the soak, the benchmarks and the tests: a real server in the caller's event loop.
    """
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        run = functools.partial(
            serve_http,
            app,
            "127.0.0.1",
            0,
            shutdown_trigger=stop.wait,
            graceful_timeout=graceful_timeout,
            send_timeout=send_timeout,
            max_requests=max_requests,
            cors=cors,
        )
        (url,) = await nursery.start(run)
        try:
            yield url
        finally:
            stop.set()


class _CloseAfterEarlyResponse:
    """ASGI wrapper: a response sent before its request body was read closes the connection.

    An early answer (413, 401, a 404 or 405 on a POST) leaves the rest of the body on
    the wire, where it would be read as the next request; so the response says
    `Connection: close` and Hypercorn closes after it. The final send is shielded
    because Quart cancels the handler as soon as the disconnect that follows it
    arrives: unshielded, that cancellation lands inside Hypercorn's close, the socket
    stays open, and the client's next request on it waits forever. The same race made
    a client's own `Connection: close` leave the socket open. Once `stopping` is set
    (shutdown began), and for a request framed by both Transfer-Encoding and
    Content-Length, the response says `Connection: close` too.
    """

    def __init__(self, app: Any, stopping: trio.Event):
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        is_body_read = not _has_body(scope["headers"])
        # Framed by chunks and a length at once: h11 reads the chunks, but a proxy in
        # front may have gone by the length and sent what follows as another request,
        # so the connection closes after the answer (RFC 9112, 6.1: a MUST).
        is_ambiguous = _is_framed_twice(scope["headers"])

        async def tracked_receive() -> Any:
            nonlocal is_body_read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                is_body_read = True
            return message

        async def guarded_send(message: Any) -> None:
            # Once shutdown began the server closes the connection after this answer:
            # it says so (RFC 9112, 9.6), or a pooled client sends its next request
            # down a closed connection and gets a connection error, not the 503.
            is_last = not is_body_read or is_ambiguous or self.stopping.is_set()
            if message["type"] == "http.response.start" and is_last:
                headers = [*message.get("headers", ()), (b"connection", b"close")]
                message = {**message, "headers": headers}
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
                return
            await send(message)

        await self.app(scope, tracked_receive, guarded_send)


def _header(scope: Any, name: bytes) -> str | None:
    """A request header's first value (`name` in lower case), or None."""
    value = next((v for k, v in scope["headers"] if k.lower() == name), None)
    return None if value is None else value.decode("latin-1")


def _has_body(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _is_framed_twice(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    names = {name.lower() for name, _ in headers}
    return b"transfer-encoding" in names and b"content-length" in names


class _InFlight:
    """ASGI wrapper counting HTTP requests until their response is fully sent, and
    refusing one that would take the count past `max_requests`.

    The refusal is sent before the app sees the request, so no body is read: without
    the cap, every client uploading a body at once made the server hold all of them
    (200 clients' 4 MB bodies took 800 MB). Probes of /health and /metrics are let
    through at the cap, so a load balancer still sees the server alive and busy, and
    so are CORS preflights, so a browser page gets to see the 503.
    """

    def __init__(self, app: Any, max_requests: int | None = None, cors: CorsPolicy | None = None):
        self.app = app
        self.max_requests = max_requests
        self.cors = cors or CorsPolicy()
        self.num_requests = 0
        self._idle = trio.Event()
        self._idle.set()
        self._is_refusing = False  # refusing since the count last fell below the cap

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            # No route speaks it: Quart sent a handshake to the HTTP error handlers,
            # which need a request context, so it got a bodiless 500 and a traceback.
            message = "this server has no WebSocket endpoints; send HTTP requests"
            error = ApiError(400, message, code="websocket_not_supported")
            return await self._answer(scope, send, error, "websocket.http.response")
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._is_full() and not _is_probe(scope):
            return await self._refuse(scope, send)
        host = _header(scope, b"host")
        if not is_bindable_host(scope.get("scheme", "http"), host, scope.get("server")):
            error = ApiError(400, f"the Host header {host!r} is no valid host name", code="invalid_host")
            return await self._answer(scope, send, error, "http.response")
        if (method := _METHOD_AS_SENT.get()) is not None and method.upper() == scope["method"]:
            scope = {**scope, "method": method}
        if self.num_requests == 0:
            self._idle = trio.Event()
        self.num_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_requests -= 1
            if self.num_requests == 0:
                self._idle.set()
            self._is_refusing = self._is_refusing and self._is_full()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def _is_full(self) -> bool:
        return self.max_requests is not None and self.num_requests >= self.max_requests

    async def _refuse(self, scope: Any, send: Any) -> None:
        if not self._is_refusing:  # once as the cap is reached, not once per refusal
            self._is_refusing = True
            log.warning("http_requests_at_limit", max_requests=self.max_requests)
        error = ApiError(
            503,
            f"the server has {self.max_requests} HTTP requests in flight, its limit; retry shortly",
            code="overloaded",
            headers=(("retry-after", "1"),),
        )
        await self._answer(scope, send, error, "http.response")

    async def _answer(self, scope: Any, send: Any, error: ApiError, kind: str) -> None:
        """`error` as an answer sent before the app, `kind` the ASGI messages' prefix."""
        # Refused before the app: its x-request-id and its log line are made here, as
        # the app makes them for every answer of its own.
        echoed, request_id = request_ids(_header(scope, b"x-request-id"))
        # The fields every other refusal's line has (http_app._refused).
        log.info(
            "rejected",
            request_id=request_id,
            status=error.status,
            code=error.code,
            param=None,
            error=error.message,
        )
        body = wire_json(error.body())
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((k.encode(), v.encode("latin-1")) for k, v in error.headers),
            (b"x-request-id", echoed.encode()),
            (b"connection", b"close"),  # the body was not read: it must not be parsed next
        ]
        allowed = self.cors.response_headers(_header(scope, b"origin"))
        headers += [(k.lower().encode(), v.encode("latin-1")) for k, v in allowed.items()]
        await send({"type": f"{kind}.start", "status": error.status, "headers": headers})
        await send({"type": f"{kind}.body", "body": body})


# Cheap and bodiless: a load balancer's and Prometheus' view of a busy server.
_PROBE_PATHS = frozenset({"/health", "/metrics"})


def _is_probe(scope: Any) -> bool:
    """Let through at the cap: probes, and CORS preflights (bodiless OPTIONS), which a
    browser sends before its request: refused, the page saw no answer at all."""
    if _has_body(scope["headers"]):
        return False
    return scope["method"] == "OPTIONS" or (
        scope["method"] in ("GET", "HEAD") and scope["path"] in _PROBE_PATHS
    )
