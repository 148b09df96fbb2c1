"""Around the requests, against a real Hypercorn on a loopback port: connections, the cap on
requests in flight, and CORS.

An early answer (before the request body was read) must close the connection, or the
unread body is parsed as the next request and that request hangs; a client's own
`Connection: close` must be honoured; plain keep-alive must keep working. CORS is off
unless origins are named, and then only those origins get the headers.
"""

import contextlib
import functools
import gzip
import http.client
import json
import logging
import re
import socket
import time
from types import SimpleNamespace

from runtime.errors import CadenceError

import h2.config
import h2.connection
import h2.events
import h2.settings
import hypercorn.config
import hypercorn.trio
import openai
import pytest
import trio
import trio.testing
from structlog.testing import capture_logs

from actors import http_access, http_server
from actors.cors import CorsPolicy, parse_origins
from actors.http_access import LOOPBACK_HOSTS
from actors.http_app import ServerState, create_app
from actors.http_server import _InFlight, serving_on_loopback

LIMIT = 1000  # max body bytes of the test server


@contextlib.asynccontextmanager
async def loading_server(max_requests=None, **app_args):
    """A server whose model is still loading: every route answers without an engine.

    Its request bodies may stall for 60 s, not 5: the tests' held requests hold their
    place as long as a test needs it, however slow the box."""
    app_args.setdefault("body_grace_s", 60.0)
    app = create_app(ServerState(), max_body_bytes=LIMIT, **app_args)
    cors = app_args.get("cors")
    async with serving_on_loopback(
        app, graceful_timeout=0.1, max_requests=max_requests, cors=cors
    ) as url:
        yield int(url.rsplit(":", 1)[1])


def post_head(path, length, *extra):
    lines = [f"POST {path} HTTP/1.1", "Host: t", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock, timeout=5.0):
    """(status line, lower-cased headers) of the next final response; skips 1xx."""
    sock.settimeout(timeout)
    buffer = b""
    while True:
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before a response: {buffer!r}"
            buffer += chunk
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        status, *lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines)
        if not status.startswith("HTTP/1.1 1"):
            length = int(headers.get("content-length", 0))
            while len(buffer) < length:
                buffer += sock.recv(65536)
            return status, headers


def is_closed_by_server(sock, timeout=5.0):
    """True when the server closes the socket within `timeout` (reading what is left)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


@pytest.mark.parametrize(
    ("status", "head"),
    [
        ("413", post_head("/v1/completions", 5 * LIMIT)),
        ("404", post_head("/v1/nowhere", 500)),
        ("405", post_head("/health", 500)),
        ("401", post_head("/v1/completions", 500, "Authorization: Bearer wrong")),
    ],
    ids=["413", "404", "405", "401"],
)
async def test_an_answer_before_the_body_was_read_closes_the_connection(status, head):
    async with loading_server(api_keys=("sesame",) if status == "401" else ()) as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(head)  # the body stays unsent: the answer must not wait for it
                status_line, headers = read_response(sock)
                return status_line, headers, is_closed_by_server(sock)

        status_line, headers, is_closed = await in_thread(exchange)
    assert status_line.split()[1] == status
    assert headers.get("connection") == "close"
    assert is_closed


async def test_a_chunked_body_cut_off_at_the_limit_closes_the_connection():
    """The 413 comes after part of the body was read: the rest must not be parsed as
    the next request."""
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                head = post_head("/v1/completions", 0).replace(
                    b"Content-Length: 0", b"Transfer-Encoding: chunked"
                )
                sock.sendall(head + b"%x\r\n%s\r\n" % (LIMIT, b"x" * LIMIT) * 2)
                status, headers = read_response(sock)
                return status, headers, is_closed_by_server(sock)

        status, headers, is_closed = await in_thread(exchange)
    assert status.split()[1] == "413" and headers.get("connection") == "close" and is_closed


@pytest.mark.parametrize(("size", "is_too_big"), [(LIMIT, False), (LIMIT + 1, True)])
async def test_a_chunked_body_is_taken_up_to_the_limit_and_no_byte_past_it(size, is_too_big):
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                head = post_head("/v1/completions", 0).replace(
                    b"Content-Length: 0", b"Transfer-Encoding: chunked"
                )
                sock.sendall(head + b"%x\r\n%s\r\n0\r\n\r\n" % (size, b"x" * size))
                return read_response(sock)[0]

        status = await in_thread(exchange)
    assert (status.split()[1] == "413") is is_too_big, status


async def test_the_openai_clients_next_request_after_a_413_is_answered():
    async with loading_server() as port:

        def two_requests():
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=10
            )
            with pytest.raises(openai.APIStatusError) as too_big:
                client.completions.create(model="m", prompt="x" * (4 << 20))
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as loading:  # not a timeout
                client.models.list()
            return too_big.value.status_code, loading.value.status_code, time.monotonic() - started

        too_big, loading, seconds = await in_thread(two_requests)
    assert (too_big, loading) == (413, 503)  # 503: the model is loading
    assert seconds < 5


async def test_expect_100_continue_over_the_limit_gets_413_without_sending_the_body():
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(post_head("/v1/completions", 5 * LIMIT, "Expect: 100-continue"))
                status, _ = read_response(sock)
                return status, is_closed_by_server(sock)

        status, is_closed = await in_thread(exchange)
    assert status.startswith("HTTP/1.1 413") and is_closed


async def test_a_clients_connection_close_is_honoured_after_a_whole_post():
    body = b'{"model": "m", "prompt": "hi"}'
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(post_head("/v1/completions", len(body), "Connection: close") + body)
                status, _ = read_response(sock)
                return status, is_closed_by_server(sock)

        status, is_closed = await in_thread(exchange)
    assert status.startswith("HTTP/1.1 503") and is_closed


async def test_a_body_framed_by_both_chunks_and_a_length_closes_the_connection():
    """RFC 9112, 6.1: the server must close after answering such a request, or a proxy
    that framed it by its Content-Length has the rest of it read as a request of ours."""
    body = b'{"model": "m", "prompt": "hi"}'
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = post_head("/v1/completions", len(body), "Transfer-Encoding: chunked")
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(head + chunked + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                status, headers = read_response(sock)
                return status, headers.get("connection"), is_closed_by_server(sock)

        status, connection, is_closed = await in_thread(exchange)
    assert status.startswith("HTTP/1.1 503") and connection == "close" and is_closed


@pytest.mark.parametrize(
    ("path", "after"),
    [("/health", b""), ("/v1/completions", b""), ("/nope", b""), ("/health", b"\r\n")]
    + [("/health", b"\x81\x80\x00\x00\x00\x00")],
    ids=["health", "completions", "nope", "crlf-after", "frame-after"],
)
async def test_a_websocket_handshake_gets_an_openai_error_and_the_server_keeps_serving(
    path, after
):
    """No route speaks WebSocket. A handshake reached the app's error handler outside
    any request context: a 500 with no body and a traceback in the log, every time.
    With bytes after its head in the same packet (a frame, a CRLF), Hypercorn answered
    twice, h11 refused the second, and the error ended the whole server."""
    upgrade = [
        f"GET {path} HTTP/1.1",
        "Host: t",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
    ]
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(("\r\n".join(upgrade) + "\r\n\r\n").encode() + after)
                sock.settimeout(5)
                answer = b""
                while chunk := sock.recv(65536):  # the server closes after it
                    answer += chunk
                head, _, body = answer.partition(b"\r\n\r\n")
                return head.decode(), json.loads(body)

        def health():
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            return connection.getresponse().status

        head, body = await in_thread(exchange)
        health_status = await in_thread(health)
    assert head.startswith("HTTP/1.1 400") and "x-request-id: " in head
    assert body["error"]["code"] == "websocket_not_supported"
    assert health_status == 503  # still loading, and still answering


async def test_an_error_in_one_connections_handling_closes_that_connection_only(monkeypatch):
    """An exception Hypercorn's connection handling lets through (as h11's refusal of
    its second answer to a WebSocket handshake did) reached the listener's nursery
    and ended the whole server; it now closes its own connection."""
    handle = http_server._LenientH11.handle

    async def failing(self, event):
        if getattr(event, "data", b"").startswith(b"FAIL"):
            raise RuntimeError("a bug in the protocol's handling")
        await handle(self, event)

    monkeypatch.setattr(http_server._LenientH11, "handle", failing)

    def exchange(port):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"FAIL / HTTP/1.1\r\n\r\n")
            is_closed = is_closed_by_server(sock)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            return is_closed, read_response(sock)[0]

    with capture_logs() as logs:
        async with loading_server() as port:
            is_closed, status = await in_thread(exchange, port)
    assert is_closed and status.split()[1] == "503"
    assert [e["log_level"] for e in logs if e["event"] == "connection_failed"] == ["error"]  # with its traceback


async def test_a_connection_its_client_closes_is_forgotten_and_logs_no_failure(monkeypatch):
    """Closed by its client, after an answer or with none, a connection leaves the set a
    drain's end would close (else every connection a server ever had stayed in it), and
    its end is no `connection_failed`."""
    configs = []

    class Recorded(http_server._Config):
        def __init__(self, send_timeout):
            super().__init__(send_timeout)
            self.keep_alive_timeout = 0.2  # Hypercorn ends a connection's task then, closed or not
            configs.append(self)

    monkeypatch.setattr(http_server, "_Config", Recorded)

    def exchange(port):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            read_response(sock)  # kept alive, then closed while idle
        with socket.create_connection(("127.0.0.1", port)):
            pass  # closed before any request
        deadline = time.monotonic() + 5
        while configs[0].open_streams and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(configs[0].open_streams)

    with capture_logs() as logs:
        async with loading_server() as port:
            assert await in_thread(exchange, port) == 0
    assert [e for e in logs if e["event"] == "connection_failed"] == []


async def test_a_hypercorn_server_of_an_embedders_own_still_serves():
    """The connection class is replaced for the whole process: a Hypercorn served with a
    config of its own (no drain's set) in the same process still gets its connections."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = hypercorn.config.Config()
    config.bind, config.accesslog, config.errorlog = ["127.0.0.1:0"], None, None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(functools.partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait))
        head = await in_thread(answer_head, int(url.rsplit(":", 1)[1]), HEALTH)
        stop.set()
    assert head.startswith("HTTP/1.1 204")


def answer_head(port, request):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        return read_response(sock)[0]


async def test_keep_alive_still_serves_several_requests_on_one_connection():
    body = b'{"model": "m", "prompt": "hi"}'
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                statuses = []
                for _ in range(3):
                    sock.sendall(post_head("/v1/completions", len(body)) + body)
                    statuses.append(read_response(sock))
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                    statuses.append(read_response(sock))
                return statuses

        responses = await in_thread(exchange)
    assert [status.split()[1] for status, _ in responses] == ["503"] * 6
    assert all(headers.get("connection") != "close" for _, headers in responses)


def cors_exchange(port, method, path, headers):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        lines = [f"{method} {path} HTTP/1.1", "Host: t", *headers, "Content-Length: 0"]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        return read_response(sock)


PREFLIGHT = ("Access-Control-Request-Method: POST", "Access-Control-Request-Headers: authorization")


async def test_empty_lines_before_a_request_line_are_ignored():
    """RFC 9112 (2.2): a server SHOULD ignore at least one empty line before a
    request-line. h11 read one as a request without a request-line: a CRLF sent on an
    idle keep-alive connection got a 400 and the connection closed."""
    health = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"

    def exchange(port):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(health)
            status = read_response(sock)[0]  # the loading server's answer
            for before in (b"\r\n", b"\n\r\n"):
                sock.sendall(before)  # alone, on the idle connection
                time.sleep(0.2)
                sock.sendall(before + health)  # and with the next request
                assert read_response(sock)[0] == status, before
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"\r\n" + health)  # before a new connection's first request
            assert read_response(sock)[0] == status

    async with loading_server() as port:
        await in_thread(exchange, port)


async def test_a_request_head_whose_last_empty_line_arrives_alone_is_answered():
    """The CRLF that ends a head, sent on its own after the rest, is that head's end:
    only empty lines where a request-line is awaited (nothing of one buffered) are dropped."""

    def exchange(port):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
            time.sleep(0.2)
            sock.sendall(b"\r\n")
            return read_response(sock)[0]

    async with loading_server() as port:
        assert (await in_thread(exchange, port)).split()[1] == "503"  # (still loading)


async def test_empty_lines_sent_with_the_request_before_are_ignored():
    """A CRLF written with the end of a body (curl-style POSTs), or between pipelined
    requests, arrives with what it follows and sat in h11's buffer: the next request
    got a 400 and the connection closed."""
    health = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"

    def exchange(port):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            body = b'{"model": "m", "prompt": "hi"}'
            sock.sendall(post_head("/v1/completions", len(body)) + body + b"\r\n")
            first = read_response(sock)[0]  # the loading server's answer
            sock.sendall(health)
            after_body = read_response(sock)[0]
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(health + b"\r\n" + health + b"\r\n\n\r\n" + health)
            sock.settimeout(5)
            answers = b""
            while answers.count(b"HTTP/1.1 ") < 3 and (chunk := sock.recv(65536)):
                answers += chunk
        return first, after_body, re.findall(rb"HTTP/1\.1 (\d+)", answers)

    async with loading_server() as port:
        first, after_body, statuses = await in_thread(exchange, port)
    assert first.split()[1] == "503" and after_body.split()[1] == "503"
    assert statuses == [b"503"] * 3


async def test_cors_is_off_unless_origins_are_named():
    async with loading_server(api_keys=("sesame",)) as port:
        origin = "Origin: https://evil.example"
        status, headers = await in_thread(
            cors_exchange, port, "OPTIONS", "/v1/chat/completions", (origin, *PREFLIGHT)
        )
        assert "access-control-allow-origin" not in headers
        assert status.split()[1] == "401"  # no preflight answer: the browser sends nothing
        _, headers = await in_thread(cors_exchange, port, "GET", "/health", (origin,))
        assert "access-control-allow-origin" not in headers


async def test_a_named_origin_gets_its_preflight_before_the_key_check_and_others_nothing():
    cors = CorsPolicy(parse_origins(["https://app.example:8443/"]))
    async with loading_server(api_keys=("sesame",), cors=cors) as port:
        good, evil = "Origin: https://app.example:8443", "Origin: https://evil.example"
        status, headers = await in_thread(
            cors_exchange, port, "OPTIONS", "/v1/chat/completions", (good, *PREFLIGHT)
        )
        assert status.split()[1] == "204"
        assert headers["access-control-allow-origin"] == "https://app.example:8443"
        assert "authorization" in headers["access-control-allow-headers"]
        assert "post" in headers["access-control-allow-methods"]
        # No cache may hand it to another origin, or to a preflight asking for other headers.
        assert headers["vary"].lower() == "origin, access-control-request-headers"
        # The allowed origin exactly: one that extends it is another site.
        for other in (evil, "Origin: https://app.example:84430", "Origin: https://app.example"):
            status, headers = await in_thread(
                cors_exchange, port, "OPTIONS", "/v1/chat/completions", (other, *PREFLIGHT)
            )
            assert status.split()[1] == "401" and "access-control-allow-origin" not in headers
        # An OPTIONS that asks for no method is no preflight: the key check answers it.
        status, headers = await in_thread(
            cors_exchange, port, "OPTIONS", "/v1/chat/completions", (good,)
        )
        assert status.split()[1] == "401"
        # Real requests: the allowed origin can read the answer (errors included).
        status, headers = await in_thread(
            cors_exchange, port, "GET", "/v1/models", (good, "Authorization: Bearer sesame")
        )
        assert headers["access-control-allow-origin"] == "https://app.example:8443"
        assert "x-request-id" in headers["access-control-expose-headers"]
        assert "retry-after" in headers["access-control-expose-headers"]  # a 503's wait
        assert "origin" in headers["vary"].lower()
        _, headers = await in_thread(cors_exchange, port, "GET", "/health", (evil,))
        assert "access-control-allow-origin" not in headers


async def test_only_an_options_request_is_a_preflight_whatever_headers_another_carries():
    """A GET or POST carrying a preflight's headers is an ordinary request: the key
    check answers it, not an empty 204."""
    cors = CorsPolicy(parse_origins(["https://app.example"]))
    async with loading_server(api_keys=("sesame",), cors=cors) as port:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            status, headers = await in_thread(
                cors_exchange, port, method, path, ("Origin: https://app.example", *PREFLIGHT)
            )
            assert status.split()[1] == "401", method
            assert headers["access-control-allow-origin"] == "https://app.example"


async def test_a_preflight_may_ask_for_the_openai_sdks_own_headers():
    """The OpenAI SDKs in a browser send `x-stainless-*` headers: a preflight that lists
    them must be allowed them, or the browser never sends the request."""
    cors = CorsPolicy(parse_origins(["https://app.example"]))
    asked = "authorization, content-type, x-stainless-os, X-Stainless-Retry-Count"
    async with loading_server(api_keys=("sesame",), cors=cors) as port:
        _, headers = await in_thread(
            cors_exchange, port, "OPTIONS", "/v1/chat/completions",
            ("Origin: https://app.example", "Access-Control-Request-Method: POST",
             f"Access-Control-Request-Headers: {asked}"),
        )
    allowed = {name.strip().lower() for name in headers["access-control-allow-headers"].split(",")}
    assert {name.strip().lower() for name in asked.split(",")} <= allowed


def test_a_malformed_header_list_in_a_preflight_gets_only_ours():
    policy = CorsPolicy(parse_origins(["https://app.example"]))
    asked = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    for bad in ("x-ok, bad header", "x-ok, a:b", "x-ok\r\nSet-Cookie: a=b"):
        headers = policy.preflight_headers({**asked, "Access-Control-Request-Headers": bad})
        assert headers is not None
        assert headers["Access-Control-Allow-Headers"] == "Authorization, Content-Type, X-Request-Id"


def test_an_ipv6_origin_is_allowed_and_a_port_past_65535_is_not():
    assert CorsPolicy(parse_origins(["http://[::1]:8000"])).allows("http://[::1]:8000")
    for bad in ("http://app.example:65536", "http://app.example:99999"):
        with pytest.raises(CadenceError, match="--allowed-origin"):
            parse_origins([bad])
    assert parse_origins(["http://app.example:65535"]) == {"http://app.example:65535"}


def test_an_origin_named_with_its_schemes_default_port_matches_the_browsers_origin():
    """A browser's Origin leaves out the scheme's default port (RFC 6454): an origin
    named with it matched no browser, so its preflights got the key check's 401."""
    policy = CorsPolicy(parse_origins(["https://app.example:443", "http://other.example:80/"]))
    assert policy.allows("https://app.example") and policy.allows("http://other.example")
    assert not policy.allows("http://app.example")  # another scheme is another origin
    assert parse_origins(["http://app.example:443"]) == {"http://app.example:443"}


@pytest.mark.parametrize("bad", ["app.example", "https://app.example/path", "ftp://x", ""])
def test_a_malformed_allowed_origin_is_refused(bad):
    # Only http and https: the message said "scheme://host", which ftp://x is.
    with pytest.raises(CadenceError, match=r"--allowed-origin .*expected http\(s\)://host\[:port\]"):
        parse_origins([bad])


def test_origins_match_in_any_case_and_a_star_allows_every_origin():
    named = CorsPolicy(parse_origins(["https://App.Example:8443"]))
    assert named.allows("https://app.example:8443") and named.allows("HTTPS://APP.EXAMPLE:8443")
    assert not named.allows("https://app.example")
    star = CorsPolicy(parse_origins(["*"]))
    headers = star.response_headers("https://any.example")
    assert headers["Access-Control-Allow-Origin"] == "https://any.example"


def test_a_preflight_asking_for_our_own_headers_gets_each_named_once():
    policy = CorsPolicy(parse_origins(["https://app.example"]))
    asked = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    headers = policy.preflight_headers(
        {**asked, "Access-Control-Request-Headers": "authorization, X-Request-Id, x-stainless-os"}
    )
    assert headers is not None
    allowed = headers["Access-Control-Allow-Headers"]
    assert allowed == "Authorization, Content-Type, X-Request-Id, x-stainless-os"


def test_every_api_key_is_accepted_under_a_bearer_scheme_in_any_case():
    keys = (b"first", b"second")

    def sent(authorization):
        return http_access.is_authorized(SimpleNamespace(headers={"Authorization": authorization}), keys)

    assert sent("Bearer first") and sent("Bearer second") and sent("bearer second ")
    assert not sent("Bearer third") and not sent("Basic second") and not sent("second")


def test_loopback_is_known_however_it_is_spelled_and_nothing_else_is():
    # "::1" unbracketed is what `--host ::1` gives: read as a name with a port, the server
    # on it lost its Host check (and warned it was open without a key).
    for host in ("::1", "[::1]", "::ffff:127.0.0.1", "127.0.0.2", "LOCALHOST", "localhost."):
        assert http_access.is_loopback(host), host
    for host in ("0.0.0.0", "::", "::ffff:10.0.0.1", "10.0.0.1", "app.example", "localhost.example"):
        assert not http_access.is_loopback(host), host
    assert http_access.hostname("::1") == "::1"
    assert http_access.hostname("[::1]:8000") == "::1"
    assert http_access.hostname("LocalHost.:80") == "localhost"


def test_a_client_request_id_is_echoed_only_when_well_formed_and_short():
    longest = "a" * 64
    echoed, internal = http_access.request_ids(longest)
    assert echoed == longest and internal.startswith(f"{longest}-")
    for bad in ("a" * 65, "", "has space", "new\nline", "é"):
        echoed, internal = http_access.request_ids(bad)
        assert echoed == internal and len(echoed) == 32  # a fresh uuid4().hex


@pytest.mark.parametrize("coding", ["gzip", "br, gzip"])
async def test_a_compressed_body_is_a_415_naming_its_content_encoding(coding):
    body = gzip.compress(b'{"model": "m", "prompt": "hi"}')
    async with loading_server() as port:

        def exchange():
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            headers = {"Content-Type": "application/json", "Content-Encoding": coding}
            connection.request("POST", "/v1/completions", body, headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read())

        status, answer = await in_thread(exchange)
    assert status == 415 and coding in answer["error"]["message"]


@pytest.mark.parametrize("coding", ["identity", "Identity", " IDENTITY "])
async def test_an_identity_content_encoding_in_any_case_is_read_as_is(coding):
    """Content codings are case-insensitive (RFC 9110, 8.4.1): 'Identity' was a 415."""
    async with loading_server() as port:

        def exchange():
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            headers = {"Content-Type": "application/json", "Content-Encoding": coding}
            connection.request("POST", "/v1/completions", b'{"model": "m", "prompt": "hi"}', headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read())

        status, answer = await in_thread(exchange)
    assert status == 503 and answer["error"]["code"] == "unavailable"  # past the body's checks: loading


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
async def test_a_body_that_is_not_json_is_a_415_naming_its_content_type(content_type):
    """A text/plain or form POST is a "simple" cross-site request: it is refused, and the
    message says what was sent ("none" when the client sent no Content-Type)."""
    async with loading_server() as port:

        def exchange():
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            headers = {} if content_type is None else {"Content-Type": content_type}
            connection.request("POST", "/v1/completions", b"{}", headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read())

        status, answer = await in_thread(exchange)
    assert status == 415 and answer["error"]["type"] == "invalid_request_error"
    sent = content_type or "none"
    assert answer["error"]["message"] == f"Content-Type must be application/json, got {sent}"


async def test_the_default_body_limit_is_4_mib():
    """A server made without max_body_bytes (the soak harness's) reads a 4 MiB body and
    refuses one byte more, naming the limit."""
    limit, path = 4 << 20, "/v1/completions"
    async with serving_on_loopback(create_app(ServerState()), graceful_timeout=0.1) as url:
        port = int(url.rsplit(":", 1)[1])
        at_the_limit = b"{}" + b" " * (limit - 2)
        close = "Connection: close"
        whole = await in_thread(answer, port, post_head(path, limit, close) + at_the_limit)
        over = await in_thread(answer, port, post_head(path, limit + 1, close))
    assert whole[0] == 400 and whole[2]["error"]["param"] == "prompt"  # read and parsed
    assert over[0] == 413
    assert over[2]["error"]["message"] == f"the request body is larger than {limit} bytes"


async def test_an_unknown_path_is_a_404_naming_it_cut_to_200_characters():
    path = "/v1/" + "x" * 300
    async with loading_server() as port:
        status, _, body, _ = await in_thread(
            answer, port, f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode()
        )
    assert status == 404 and body["error"]["code"] == "unknown_url"
    assert body["error"]["message"] == f"Invalid URL ({f'GET {path}'[:200]})"


async def test_a_method_a_route_does_not_take_is_a_405_naming_the_ones_it_does():
    """RFC 9110: a 405 carries Allow; the message says what was asked and what to use
    (it was werkzeug's sentence, and its code null)."""
    async with loading_server() as port:
        status, headers, body, _ = await in_thread(
            answer, port, b"DELETE /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        )
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    assert {m.strip() for m in headers["allow"].split(",")} == {"post", "options"}
    assert body["error"]["code"] == "method_not_allowed"
    message = body["error"]["message"]
    assert message.startswith("Invalid method for URL (DELETE /v1/completions); it takes ")
    assert {m.strip() for m in message.split("takes ")[1].split(",")} == {"POST", "OPTIONS"}


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("get", "/health", 405),
        ("Get", "/v1/models", 405),
        ("post", "/v1/completions", 405),
        ("options", "/v1/completions", 405),
        ("get", "/nowhere", 404),
    ],
)
async def test_a_method_is_case_sensitive_and_one_spelt_otherwise_is_refused_as_unknown(
    method, path, status
):
    """RFC 9110: "get" is not GET. werkzeug upper-cases the method, so it was served
    (a 200 or the loading 503), where any other unknown method is a 405."""
    async with loading_server() as port:
        head = f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        got, headers, body, _ = await in_thread(answer, port, head.encode())
        still = await in_thread(answer, port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    assert got == status and body["error"]["type"] == "invalid_request_error"
    assert f"({method} {path})" in body["error"]["message"]  # as sent
    if status == 405:
        assert body["error"]["code"] == "method_not_allowed" and method.lower() in headers["allow"]
    assert still[0] == 503  # the server still answers GET (loading)


async def test_an_early_answer_to_a_request_with_an_empty_body_keeps_the_connection():
    """Content-Length: 0 leaves nothing unread on the wire: no reason to close."""
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(post_head("/v1/nowhere", 0))
                first = read_response(sock)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                return first, read_response(sock)

        (status, headers), (next_status, _) = await in_thread(exchange)
    assert status.split()[1] == "404" and headers.get("connection") != "close"
    assert next_status.split()[1] == "503"  # answered on the same connection


async def test_an_http2_client_is_refused_and_the_server_keeps_serving():
    """Hypercorn speaks cleartext HTTP/2 to a client that opens with its preface, and its
    HTTP/2 code raised out of the whole server when a body came after an early answer."""
    async with loading_server() as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
                client.initiate_connection()
                head = [(":method", "POST"), (":path", "/v1/nowhere"), (":scheme", "http")]
                client.send_headers(1, [*head, (":authority", "t"), ("content-length", "500")])
                sock.sendall(client.data_to_send())
                events: list[h2.events.Event] = []
                while not any(isinstance(e, H2_ENDS) for e in events):
                    if not (data := sock.recv(65536)):
                        break
                    events += client.receive_data(data)
                if client.state_machine.state is not h2.connection.ConnectionState.CLOSED:
                    client.send_data(1, b"x" * 500, end_stream=True)  # after the 404
                    sock.sendall(client.data_to_send())
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                return events, read_response(sock)

        events, (status, _) = await in_thread(exchange)
    assert not any(isinstance(e, h2.events.ResponseReceived) for e in events)
    assert any(isinstance(e, h2.events.ConnectionTerminated) for e in events)
    assert status.split()[1] == "503"  # still serving (the model is loading)


H2_ENDS = (h2.events.StreamEnded, h2.events.StreamReset, h2.events.ConnectionTerminated)


# An upgrade after a request on the same connection: "get" there was the method as sent
# (a 405), and the upgrading GET must not be taken for it.
# (An upgrading "get" is refused as any method spelt otherwise is: over HTTP/2.)
@pytest.mark.parametrize(
    ("earlier", "method", "status"),
    [(b"", "GET", b"503"), (b"get /health HTTP/1.1\r\nHost: t\r\n\r\n", "GET", b"503"), (b"", "get", b"405")],
)
async def test_an_h2c_upgrade_is_answered_and_allows_no_further_streams(earlier, method, status):
    """The upgrading request (bodiless, so nothing can follow its answer) gets its answer
    over HTTP/2; the settings then allow the client no stream of its own, whose body
    could arrive after an early answer."""
    async with loading_server() as port:

        def upgrade():
            client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            settings = client.initiate_upgrade_connection().decode()
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                if earlier:
                    sock.sendall(earlier)
                    head = b""
                    while b"\r\n\r\n" not in head:
                        head += sock.recv(65536)
                    head, _, body = head.partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 405"), head
                    length = int(re.search(rb"(?i)content-length: *([0-9]+)", head)[1])
                    while len(body) < length:
                        body += sock.recv(65536)
                sock.sendall(
                    f"{method} /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n".encode()
                    + f"Upgrade: h2c\r\nHTTP2-Settings: {settings}\r\n\r\n".encode()
                )
                received = b""
                while b"\r\n\r\n" not in received:
                    received += sock.recv(65536)
                switching, _, rest = received.partition(b"\r\n\r\n")
                events = client.receive_data(rest) if rest else []
                while not any(isinstance(e, H2_ENDS) for e in events):
                    if not (data := sock.recv(65536)):
                        break
                    events += client.receive_data(data)
                    sock.sendall(client.data_to_send())
            return switching.decode(), events

        switching, events = await in_thread(upgrade)
    assert switching.startswith("HTTP/1.1 101")
    answers = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert [dict(a.headers)[b":status"] for a in answers] == [status]  # 503: loading
    server_settings = next(e for e in events if isinstance(e, h2.events.RemoteSettingsChanged))
    max_streams = h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS
    assert server_settings.changed_settings[max_streams].new_value == 0


async def test_a_connection_that_sends_only_the_http2_preface_is_closed_at_once():
    """It is answered with settings and a GOAWAY, then closed: held open, a few thousand
    of them used up the server's file descriptors and every new client hung."""
    async with loading_server() as port:

        def preface_only():
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
                client.initiate_connection()
                received, started = b"", time.monotonic()
                while data := sock.recv(65536):  # until the server closes
                    received += data
                return client.receive_data(received), time.monotonic() - started

        events, waited = await in_thread(preface_only)
        events2, _ = await in_thread(preface_only)  # and the server goes on serving
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events)
    assert any(isinstance(e, h2.events.ConnectionTerminated) for e in events + events2)
    assert waited < 2.0  # not the 5 s keep-alive timeout, and not never


async def test_idle_waits_for_every_request_in_flight():
    """A drain waits until the last response is sent, not the first."""
    releases = [trio.Event(), trio.Event()]

    async def app(scope, receive, send):
        await releases[scope["n"]].wait()

    tracker = _InFlight(app)
    async with trio.open_nursery() as nursery:
        for n in (0, 1):
            nursery.start_soon(tracker, {"type": "http", "headers": [], "n": n}, None, None)
        await trio.testing.wait_all_tasks_blocked()
        releases[0].set()
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.05) as waited:
            await tracker.wait_idle()
        assert waited.cancelled_caught and tracker.num_requests == 1
        releases[1].set()
        with trio.fail_after(1):
            await tracker.wait_idle()


async def test_hypercorn_gives_in_flight_requests_the_whole_grace_not_its_default(monkeypatch):
    """Hypercorn cancels what is in flight graceful_timeout after shutdown (3 s unless
    told): a longer drain must reach it, or streams are cut 3 s into every drain."""
    configs = []

    async def serve(app, config, *, shutdown_trigger, task_status):
        configs.append(config)
        task_status.started([])

    monkeypatch.setattr(http_server, "serve", serve)
    await http_server.serve_http(
        None, "127.0.0.1", 0, shutdown_trigger=trio.sleep_forever, graceful_timeout=35.0
    )
    assert [config.graceful_timeout for config in configs] == [35.0]


async def test_a_drain_ends_when_its_last_response_is_sent_not_when_the_grace_runs_out():
    """Hypercorn keeps a keep-alive connection open when its response was in flight at
    shutdown: the drain must end with that response, neither cut it nor wait out the grace."""
    release, stop, stopped = trio.Event(), trio.Event(), trio.Event()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"o", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"k"})

    async def serve(task_status):
        run = http_server.serve_http
        await run(
            app,
            "127.0.0.1",
            0,
            shutdown_trigger=stop.wait,
            graceful_timeout=60,
            task_status=task_status,
        )
        stopped.set()

    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(serve)
        port = int(url.rsplit(":", 1)[1])
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            await client.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            received = b""
            while not received.endswith(b"\r\n\r\no"):
                received += await client.receive_some()
            stop.set()  # shutdown begins with the response in flight
            await trio.testing.wait_all_tasks_blocked()
            release.set()
            with trio.fail_after(10):  # the grace is 60 s
                while not received.endswith(b"ok"):
                    received += await client.receive_some()
                await stopped.wait()
    assert received.startswith(b"HTTP/1.1 200")


async def test_an_answer_sent_once_shutdown_began_says_the_connection_closes():
    """Hypercorn closes a keep-alive connection whose answer was sent during shutdown:
    without `Connection: close` a pooled client sent its next request down the closed
    connection and got a connection error instead of the 503."""
    release, stop = trio.Event(), trio.Event()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        await release.wait()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    async def serve(task_status):
        await http_server.serve_http(
            app, "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status
        )

    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(serve)
        port = int(url.rsplit(":", 1)[1])
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            await client.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")  # keep-alive
            await trio.testing.wait_all_tasks_blocked()
            stop.set()  # shutdown begins with the answer not yet started
            await trio.testing.wait_all_tasks_blocked()
            release.set()
            received = b""
            with trio.fail_after(10):
                while not received.endswith(b"ok"):
                    received += await client.receive_some()
    head = received.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 200") and b"\r\nconnection: close" in head


def endless_stream(writing: trio.Event):
    """An app whose responses stream forever, like a long generation's; `writing` is set
    at each write."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async with trio.open_nursery() as nursery:

            async def until_disconnected():  # as the server's app stops: Hypercorn drops sends then
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_disconnected)
            while True:
                writing.set()
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})

    return app


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux's TCP_USER_TIMEOUT")
async def test_a_client_that_stops_reading_is_dropped_and_cannot_hold_the_server_open():
    """A stream whose client never reads fills the socket buffers and then its write
    blocks, shielded from cancellation: without a send timeout the connection, its task
    and the server's shutdown all waited for as long as the client stayed. The grace
    outlasts the test, so the drain's end (which closes what is left) cannot end it."""
    stop, stopped, writing = trio.Event(), trio.Event(), trio.Event()

    app = endless_stream(writing)

    async def serve(task_status):
        await http_server.serve_http(
            app,
            "127.0.0.1",
            0,
            shutdown_trigger=stop.wait,
            graceful_timeout=60.0,
            send_timeout=1.0,
            task_status=task_status,
        )
        stopped.set()

    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(serve)
        client.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        client.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")  # and never reads
        await writing.wait()
        await trio.sleep(0.5)  # the buffers fill and the write blocks
        started = trio.current_time()
        stop.set()
        with trio.move_on_after(10):  # then the client leaves, which unblocks the write
            await stopped.wait()
        client.close()
        await stopped.wait()
    assert trio.current_time() - started < 5  # the send timeout and the grace, not the client


async def test_a_client_that_stops_reading_is_dropped_when_the_drain_ends_not_at_the_send_timeout():
    """Hypercorn's writes are shielded from cancellation: a stream's client that stopped
    reading held the shutdown until the send timeout (60 s) dropped it, long after the
    grace. The end of the grace now drops every connection still open."""
    stop, stopped, writing = trio.Event(), trio.Event(), trio.Event()

    app = endless_stream(writing)

    async def serve(task_status):
        await http_server.serve_http(
            app, "127.0.0.1", 0, shutdown_trigger=stop.wait, graceful_timeout=0.5,
            task_status=task_status,
        )  # the default send timeout: 60 s
        stopped.set()

    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(serve)
        client.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        client.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")  # and never reads
        await writing.wait()
        await trio.sleep(0.5)  # the buffers fill and the write blocks
        started = trio.current_time()
        stop.set()
        with trio.move_on_after(10):
            await stopped.wait()
        took = trio.current_time() - started
        client.close()  # lets a server that still waits stop, so the test ends
    assert took < 5  # the grace (0.5 s), while the client stays


async def answer_lifespan(receive, send):
    """An ASGI app's side of Hypercorn's lifespan protocol: started, then stopped."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


def held_request(port):
    """A connection whose POST is in flight: its body half sent, so the app waits for the rest."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(post_head("/v1/chat/completions", 500) + b"{" * 250)
    return sock


def answer(port, head):
    """(status, lower-cased headers, JSON body, closed by the server) of one request."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        sock.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head_bytes, _, body = data.partition(b"\r\n\r\n")
        status, *lines = head_bytes.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines)
        while len(body) < int(headers["content-length"]):
            body += sock.recv(65536)
        return int(status.split()[1]), headers, json.loads(body), is_closed_by_server(sock)


MODELS = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"


def answers_with_code(port, code):
    """Whether a new request's error code becomes `code`, polling 5 s for the server to
    catch up with connections opened or closed just before."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if answer(port, MODELS)[2]["error"]["code"] == code:
            return True
        time.sleep(0.02)
    return False


def is_refused_at_the_cap(port):
    return answers_with_code(port, "overloaded")


def is_served(port):
    """Whether a new request reaches the app (the loading model's 503)."""
    return answers_with_code(port, "unavailable")


async def test_past_the_cap_a_request_gets_an_immediate_503_and_probes_are_still_answered():
    async with loading_server(max_requests=2) as port:

        def exchange():
            first = held_request(port)
            assert is_served(port)  # one in flight: below the cap
            second = held_request(port)
            assert is_refused_at_the_cap(port)
            # The answer does not wait for the body, and the connection closes after it.
            refused = answer(port, post_head("/v1/chat/completions", 500, "x-request-id: capped-7"))
            health = answer(port, HEALTH)
            first.close()
            second.close()
            return refused, health

        with capture_logs() as logs:
            (status, headers, body, is_closed), health = await in_thread(exchange)
    assert status == 503 and is_closed
    assert headers["retry-after"] == "1" and headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    assert body["error"]["type"] == "server_error" and "2 HTTP requests" in body["error"]["message"]
    assert health[0] == 503 and health[2] == {"status": "loading"}  # the app's answer
    # Said once as the cap is reached, not once for each of the requests it refused.
    assert [entry["event"] for entry in logs].count("http_requests_at_limit") == 1
    # Every answer carries an x-request-id, and the client's id finds the refusal.
    assert headers["x-request-id"] == "capped-7"
    capped = [
        e for e in logs if e["event"] == "rejected" and e["request_id"].startswith("capped-7-")
    ]
    # The fields of every other refusal's line, so a JSON consumer finds them all.
    assert {(e["status"], e["code"], e["param"]) for e in capped} == {(503, "overloaded", None)}
    assert all("2 HTTP requests in flight" in e["error"] for e in capped)


async def test_at_the_cap_a_browser_page_gets_its_preflight_and_a_503_it_can_read():
    """The 503 is made before the app, which adds the CORS headers: without them a
    browser shows the page a network error, not the 503 and its Retry-After. And the
    page's preflight, refused, left its request unsent."""
    page = "http://page.example"
    async with loading_server(max_requests=1, cors=CorsPolicy(parse_origins([page]))) as port:

        def exchange():
            held = held_request(port)
            assert is_refused_at_the_cap(port)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(
                    b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                    b"Origin: http://page.example\r\nAccess-Control-Request-Method: POST\r\n"
                    b"Connection: close\r\n\r\n"
                )
                preflight = read_response(sock)
            refused = answer(port, post_head("/v1/chat/completions", 500, f"Origin: {page}"))
            stranger = answer(
                port, post_head("/v1/chat/completions", 500, "Origin: http://x.example")
            )
            held.close()
            return preflight, refused, stranger

        (status, preflight), refused, stranger = await in_thread(exchange)
    assert status.split()[1] == "204" and preflight["access-control-allow-origin"] == page
    assert refused[0] == 503 and refused[1]["access-control-allow-origin"] == page
    assert "retry-after" in refused[1]["access-control-expose-headers"].lower()
    assert stranger[0] == 503 and "access-control-allow-origin" not in stranger[1]


async def test_a_host_the_server_does_not_answer_for_gets_a_403_before_anything_else():
    async with loading_server(allowed_hosts=LOOPBACK_HOSTS, api_keys=("k",)) as port:

        def ask(host):
            head = f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            return answer(port, head.encode())

        rebound = await in_thread(ask, f"attacker.example:{port}")
        own = [
            await in_thread(ask, host)
            for host in (f"localhost:{port}", "[::1]", "127.0.0.1", f"LocalHost.:{port}")
        ]
        # HTTP/1.0 without a Host (HAProxy's health check) passes: browsers always send one.
        bare = await in_thread(answer, port, b"GET /health HTTP/1.0\r\n\r\n")
    assert rebound[0] == 403 and rebound[2]["error"]["code"] == "host_not_allowed"
    assert [status for status, *_ in own] == [401] * 4  # past the host check, to the key's
    assert bare[0] == 503 and bare[2] == {"status": "loading"}


@pytest.mark.parametrize("allowed_hosts", [LOOPBACK_HOSTS, None], ids=["loopback", "any-host"])
async def test_a_host_header_that_is_no_host_name_gets_a_400_in_openais_shape(allowed_hosts):
    """Quart binds its URL map to the request's host before any handler, and werkzeug
    refused these names (an empty label, one over 63 characters): a bodiless 500 and a
    traceback, whatever the route."""
    async with loading_server(allowed_hosts=allowed_hosts) as port:

        def ask(host, path="/v1/models"):
            head = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            return answer(port, head.encode())

        # An unclosed or stray bracket read as the address in it: "[::1" was loopback.
        brackets = ("[::1", "::1]", "[::1]x", "[::1]]", "[localhost]", "[]:80")
        bad = [
            await in_thread(ask, host)
            for host in ("localhost..", ".localhost", "a" * 64, "x..y:80", *brackets)
        ]
        options = await in_thread(
            answer, port, b"OPTIONS /v1/models HTTP/1.1\r\nHost: localhost..\r\nConnection: close\r\n\r\n"
        )
        fine = await in_thread(ask, "localhost", "/health")
        bracketed = await in_thread(ask, f"[::1]:{port}", "/health")
    assert bracketed[0] == 503  # a sound IPv6 literal with its port passes
    for status, headers, body, is_closed in [*bad, options]:
        assert status == 400 and headers["x-request-id"] and is_closed
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["code"] == "invalid_host"
    assert "'localhost..'" in bad[0][2]["error"]["message"]
    assert fine[0] == 503 and fine[2] == {"status": "loading"}


async def test_requests_in_flight_return_to_none_when_their_clients_hang_up_mid_body():
    """Hung-up requests free their places: afterwards exactly the cap's worth are taken
    again before a new one is refused (a place still counted would refuse one sooner)."""
    async with loading_server(max_requests=2) as port:

        def exchange():
            for _ in range(3):
                held = [held_request(port), held_request(port)]
                assert is_refused_at_the_cap(port)
                for sock in held:
                    sock.close()  # mid-body
                assert is_served(port)
            first = held_request(port)
            time.sleep(0.2)  # counted by now, were it to be
            assert is_served(port)  # one place left, not none
            first.close()

        await in_thread(exchange)


async def test_the_openai_client_sending_a_big_body_at_the_cap_gets_the_503_not_a_reset():
    """The server answers and closes before the body is sent: the client's write fails
    and it must still read the 503 (its Retry-After), not report a broken connection."""
    async with loading_server(max_requests=1) as port:

        def request_at_the_cap():
            held = held_request(port)
            assert is_refused_at_the_cap(port)
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=10
            )
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="m", prompt="x" * (4 << 20))
            held.close()
            return refused.value

        refused = await in_thread(request_at_the_cap)
    assert refused.status_code == 503 and refused.response.headers["retry-after"] == "1"
    assert refused.code == "overloaded"


async def test_a_body_that_trickles_in_gets_a_408_and_frees_its_place():
    """A client sending its body a byte every few seconds held one of the
    --max-http-requests places for Quart's 60 s, so a few hundred of them shut every
    other client out. Past the grace a body must keep arriving at the minimum rate."""
    async with loading_server(max_requests=1, body_grace_s=0.5, body_min_rate=500) as port:

        def exchange():
            with socket.create_connection(("127.0.0.1", port)) as sock:
                started = time.monotonic()
                sock.sendall(post_head("/v1/chat/completions", 500) + b"{")
                for _ in range(5):  # 10 bytes a second: under the rate
                    time.sleep(0.1)
                    sock.sendall(b" ")
                status, headers = read_response(sock)
                seconds = time.monotonic() - started
                return status, headers, seconds, is_closed_by_server(sock), is_served(port)

        status, headers, seconds, is_closed, is_served_after = await in_thread(exchange)
    assert status.split()[1] == "408" and 0.5 <= seconds < 3
    assert headers.get("connection") == "close" and is_closed  # the body's rest is unread
    assert is_served_after  # its place is free again


async def test_a_body_arriving_at_the_rate_is_read_past_the_grace():
    """The grace grows with what arrived: a body sent over 1 s in steady parts, at
    800 bytes a second, is read whole with a 0.5 s grace and a 500 bytes/s rate."""
    async with loading_server(body_grace_s=0.5, body_min_rate=500) as port:

        def exchange():
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            body = body.encode().ljust(LIMIT)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(post_head("/v1/chat/completions", LIMIT))
                for start in range(0, LIMIT, 200):
                    time.sleep(0.25)
                    sock.sendall(body[start : start + 200])
                return read_response(sock)

        status, _ = await in_thread(exchange)
    assert status.split()[1] == "503"  # read whole and parsed: the model is loading


async def test_a_host_named_unix_is_a_host_not_a_unix_socket(tmp_path, monkeypatch):
    """Hypercorn reads a bind of "unix:PATH" as a UNIX socket: `--host unix --port 8000`
    left a socket file named 8000 in the working directory, then failed on it."""
    monkeypatch.chdir(tmp_path)
    app = create_app(ServerState(), max_body_bytes=LIMIT)
    with pytest.raises(BaseException) as raised:  # no machine "unix" here: it does not resolve
        await http_server.serve_http(app, "unix", 8000, shutdown_trigger=trio.sleep_forever)
    error = raised.value
    while isinstance(error, BaseExceptionGroup):  # the server's nursery groups it
        (error,) = error.exceptions
    assert isinstance(error, socket.gaierror), error
    assert list(tmp_path.iterdir()) == []


async def test_the_server_listens_on_the_host_and_port_it_is_given():
    """--host and --port: the server is reached there (and an IPv6 host gets brackets)."""
    hosts = ["127.0.0.1"]
    if socket.has_ipv6:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            hosts.append("::1")
    for host in hosts:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as free:
            free.bind((host, 0))
            port = free.getsockname()[1]
        app = create_app(ServerState(), max_body_bytes=LIMIT)
        async with trio.open_nursery() as nursery:
            run = functools.partial(
                http_server.serve_http, app, host, port, shutdown_trigger=trio.sleep_forever
            )
            (url,) = await nursery.start(run)
            bracketed = f"[{host}]" if ":" in host else host
            assert url == f"http://{bracketed}:{port}"
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(HEALTH)
                status, _ = await in_thread(read_response, sock)
            assert status.split()[1] == "503"  # the app's: the model is loading
            nursery.cancel_scope.cancel()


async def test_two_servers_on_loopback_at_once_each_get_a_free_port():
    app = create_app(ServerState(), max_body_bytes=LIMIT)
    async with serving_on_loopback(app) as first, serving_on_loopback(app) as second:
        assert first != second
        for url in (first, second):
            assert (await in_thread(answer, int(url.rsplit(":", 1)[1]), HEALTH))[0] == 503


async def test_hypercorns_log_lines_go_to_the_apps_logging_and_none_is_a_warning(caplog):
    """Hypercorn's own logger prints to stderr; ours stays silent unless the app configures
    it. A start, a few answers (an early one among them) and a stop log no warning: the
    lifespan must reach the app, and every answer be sent once."""
    with caplog.at_level(logging.INFO):
        async with loading_server() as port:
            await in_thread(answer, port, HEALTH)
            await in_thread(answer, port, post_head("/v1/nowhere", 500) + b"x" * 500)
            await in_thread(answer, port, MODELS)
    hypercorn = [r for r in caplog.records if "hypercorn" in r.name]
    assert {r.name for r in hypercorn} == {"cadence.hypercorn"}
    assert any("Running on http://127.0.0.1:" in r.getMessage() for r in hypercorn)
    assert [r.getMessage() for r in hypercorn if r.levelno >= logging.WARNING] == []


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux's TCP_USER_TIMEOUT")
async def test_a_client_that_pauses_reading_for_less_than_the_send_timeout_gets_it_all():
    """The send timeout drops a client that stopped reading, not one that paused."""
    size = 1 << 20

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        headers = [(b"content-length", str(size).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(size // 65536):
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def exchange(port):
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            client.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            time.sleep(1.0)  # the buffers fill; the server's write waits on a shut window
            client.settimeout(10)
            received = b""
            while chunk := client.recv(1 << 20):
                received += chunk
                if received.endswith(b"x" * 16) and len(received) >= size:
                    break
            return received

    async with serving_on_loopback(app, send_timeout=5.0) as url:
        received = await in_thread(exchange, int(url.rsplit(":", 1)[1]))
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(body) == size


async def test_a_drain_waits_for_a_request_that_began_while_it_waited():
    """Idle at once with nothing in flight; and a request that arrives (on a kept-alive
    connection) once the drain began waiting is waited for too, not the first alone."""
    releases = [trio.Event(), trio.Event()]

    async def app(scope, receive, send):
        await releases[scope["n"]].wait()

    tracker = _InFlight(app)
    with trio.fail_after(1):
        await tracker.wait_idle()
    is_idle = trio.Event()

    async def drain():
        await tracker.wait_idle()
        is_idle.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tracker, {"type": "http", "headers": [], "n": 0}, None, None)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(drain)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(tracker, {"type": "http", "headers": [], "n": 1}, None, None)
        await trio.testing.wait_all_tasks_blocked()
        releases[0].set()
        await trio.testing.wait_all_tasks_blocked()
        assert not is_idle.is_set() and tracker.num_requests == 1
        releases[1].set()
        with trio.fail_after(1):
            await is_idle.wait()


async def test_the_cap_is_logged_each_time_it_is_reached_anew():
    """Once per episode at the cap, not once per refusal, and not once for ever."""
    async with loading_server(max_requests=1) as port:

        def two_episodes():
            for _ in range(2):
                held = held_request(port)
                assert is_refused_at_the_cap(port) and is_refused_at_the_cap(port)
                held.close()
                assert is_served(port)

        with capture_logs() as logs:
            await in_thread(two_episodes)
    assert [entry["event"] for entry in logs].count("http_requests_at_limit") == 2


async def test_at_the_cap_a_probe_or_preflight_with_a_body_is_refused_too():
    """Probes and preflights pass the cap because they are bodiless: one with a body
    is a request like any other, or a client could hold places past the cap with them."""
    async with loading_server(max_requests=1) as port:

        def exchange():
            held = held_request(port)
            assert is_refused_at_the_cap(port)
            health = answer(port, b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: 500\r\n\r\n")
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(
                    b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                    b"Origin: http://page.example\r\nAccess-Control-Request-Method: POST\r\n"
                    b"Content-Length: 500\r\n\r\n"
                )
                preflight = read_response(sock)
            held.close()
            return health, preflight

        (status, _, body, is_closed), (preflight, headers) = await in_thread(exchange)
    assert status == 503 and body["error"]["code"] == "overloaded" and is_closed
    assert preflight.split()[1] == "503" and headers["retry-after"] == "1"


def test_only_bodiless_gets_of_the_probe_paths_and_preflights_count_as_probes():
    def probe(method, path, *headers):
        return http_server._is_probe({"method": method, "path": path, "headers": list(headers)})

    assert probe("GET", "/health") and probe("HEAD", "/metrics") and probe("OPTIONS", "/v1/models")
    assert not probe("POST", "/health") and not probe("DELETE", "/metrics")
    assert not probe("GET", "/v1/models") and not probe("GET", "/health", (b"content-length", b"5"))
    assert probe("GET", "/health", (b"content-length", b"0"))
