"""CORS, off unless the operator names origins (`--allowed-origin`).

Off, a browser page on another origin can't read our responses, and can't send a
JSON POST at all without a preflight we don't answer. On, a named origin gets its
preflight answered before the API-key check (browsers never send credentials on a
preflight) and its responses carry `Access-Control-Allow-Origin`. A preflight may ask
for any well-formed request headers (the OpenAI SDKs in a browser send their own
`x-stainless-*` ones): the origin is trusted already, and the API key still decides.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from runtime.errors import CadenceError

import attrs

_ORIGIN = re.compile(r"https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:(?P<port>[0-9]{1,5}))?|\*")
_METHODS = "GET, POST, OPTIONS"
_HEADERS = ("Authorization", "Content-Type", "X-Request-Id")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110's token
_MAX_AGE_S = "600"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_origins(values: Iterable[str]) -> frozenset[str]:
    """`http(s)://host[:port]` each, or `*` for any origin; CadenceError otherwise."""
    origins = set()
    for value in values:
        origin = value.strip().rstrip("/")
        match = _ORIGIN.fullmatch(origin)
        if match is None or int(match["port"] or 0) > 65535:
            raise CadenceError(f"--allowed-origin {value!r}: expected http(s)://host[:port] or '*'")
        origin = origin.lower()
        port = match["port"]
        # A browser's Origin leaves out its scheme's default port (RFC 6454): named
        # with it, the origin matched no browser.
        if port is not None and int(port) == _DEFAULT_PORTS.get(origin.partition(":")[0]):
            origin = origin.removesuffix(f":{port}")
        origins.add(origin)
    return frozenset(origins)


@attrs.frozen
class CorsPolicy:
    origins: frozenset[str] = frozenset()

    def allows(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.origins or origin.lower() in self.origins)

    def preflight_headers(self, request_headers: Any) -> dict[str, str] | None:
        """The answer to an allowed preflight (an OPTIONS asking for a method), else None.

        `request_headers`: werkzeug's Headers (whose overloaded `get` no Protocol matches) or a dict.
        """
        origin = request_headers.get("Origin")
        if not self.allows(origin) or "Access-Control-Request-Method" not in request_headers:
            return None
        assert origin is not None
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": _METHODS,
            "Access-Control-Allow-Headers": _allowed_headers(
                request_headers.get("Access-Control-Request-Headers")
            ),
            "Access-Control-Max-Age": _MAX_AGE_S,
            "Vary": "Origin, Access-Control-Request-Headers",
        }

    def response_headers(self, origin: str | None) -> dict[str, str]:
        if not self.allows(origin):
            return {}
        assert origin is not None
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Expose-Headers": "X-Request-Id, Retry-After",
            "Vary": "Origin",
        }


def _allowed_headers(requested: str | None) -> str:
    """Ours and the ones a preflight asks for, when every name it gives is a token."""
    names = [name.strip() for name in (requested or "").split(",") if name.strip()]
    if not all(_HEADER_NAME.fullmatch(name) for name in names):
        names = []  # a malformed list gets ours alone: the browser then refuses it
    known = {header.lower() for header in _HEADERS}
    extra = sorted({name.lower() for name in names} - known)
    return ", ".join([*_HEADERS, *extra])
