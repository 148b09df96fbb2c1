"""A request's JSON body, read as it arrives: bounded in size, in pace, and in type.

The app's routes call `request_api`; `create_app` puts the limits in
the app's config (MAX_CONTENT_LENGTH, BODY_GRACE_S, BODY_MIN_RATE, PARSE_THREADS).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import trio
from quart import current_app, request
from werkzeug.exceptions import RequestEntityTooLarge

from actors.openai_requests import ApiError, parse_json

T = TypeVar("T")

# A request body gets BODY_GRACE_S, then must keep arriving at BODY_MIN_RATE bytes a
# second on average: a 4 MiB body has 69 s, a 10 kB chat 5 s (it takes milliseconds).
BODY_GRACE_S = 5.0
BODY_MIN_RATE = 64 << 10


# A body past this size is parsed on a worker thread, one at a time: a 4 MB batch of a
# million token-id prompts held the event loop 1.3-1.6 s (JSON, then each prompt
# checked), every stream and /health standing still. On a thread the loop gets turns
# except inside json's C scanner (~0.4 s of it); small bodies skip the thread hop.
PARSE_OFF_LOOP_BYTES = 256 << 10


async def request_api(parse: Callable[[dict[str, Any]], T]) -> T:
    """The request's JSON body, `parse`d (an ApiError for a body that is no JSON object)."""
    raw = await _read_json_bytes()
    if len(raw) < PARSE_OFF_LOOP_BYTES:
        return parse(parse_json(raw))
    limiter = current_app.config["PARSE_THREADS"]
    return await trio.to_thread.run_sync(lambda: parse(parse_json(raw)), limiter=limiter)


async def _read_json_bytes() -> bytes:
    raw = await _read_body(current_app.config["BODY_GRACE_S"], current_app.config["BODY_MIN_RATE"])
    # Checked after the body is read, so the connection stays usable. Only JSON: a
    # text/plain or form POST is a "simple" cross-site request any web page can send
    # without a CORS preflight.
    if request.mimetype != "application/json":
        shown = request.content_type or "none"
        raise ApiError(415, f"Content-Type must be application/json, got {shown[:80]}")
    # A compressed body was read as text and refused as "not valid UTF-8". Codings are
    # case-insensitive (RFC 9110, 8.4.1): "Identity" is the body as is.
    if (coding := request.headers.get("Content-Encoding", "").strip()).lower() not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding {coding[:40]!r} is not supported; send the body as is")
    return raw


async def _read_body(grace_s: float, min_rate: int) -> bytes:
    """The request body, which must keep arriving: after `grace_s`, at `min_rate` bytes a
    second on average (Apache's mod_reqtimeout rule), or the answer is a 408.

    Quart's own limit, the whole body within 60 s, let a client that sends a byte every
    few seconds hold one of --max-http-requests' slots for a minute: a few hundred such
    connections shut every other client out. Under this rule a slot is held long only
    by a client that sends at the rate, and for no longer than the largest body takes.
    """
    limit = request.max_content_length
    body, start = bytearray(), trio.current_time()
    chunks = aiter(request.body)
    while True:
        with trio.move_on_at(start + grace_s + len(body) / min_rate):
            try:
                body += await anext(chunks)
            except StopAsyncIteration:
                return bytes(body)
            except RequestEntityTooLarge:  # its Content-Length said so
                raise ApiError(413, f"the request body is larger than {limit} bytes") from None
            if limit is not None and len(body) > limit:  # a chunked body grew past it
                raise ApiError(413, f"the request body is larger than {limit} bytes")
            continue
        raise ApiError(
            408,
            f"the request body arrived too slowly: {len(body)} bytes in "
            f"{trio.current_time() - start:.1f} s, after {grace_s:g} s it must keep up "
            f"{min_rate} bytes a second",
            code="request_timeout",
        )
