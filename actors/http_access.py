"""Who is asking and whether to answer: API keys, the Host a request names, and the
request ids that tie a response to its log lines (actors/http_app.py, the CLI and the
HTTP server's transport use them)."""

from __future__ import annotations

import hmac
import ipaddress
import re
import uuid
from typing import Any

from werkzeug.exceptions import BadHost
from werkzeug.routing import Map
from werkzeug.sansio.utils import get_host

_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def is_authorized(incoming: Any, keys: tuple[bytes, ...]) -> bool:
    scheme, _, sent = incoming.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    sent_bytes = sent.strip().encode("utf-8", "surrogateescape")
    # Compare against every key, always: the time taken says nothing about which matched.
    return sum(hmac.compare_digest(sent_bytes, key) for key in keys) > 0


def request_ids(sent: str | None) -> tuple[str, str]:
    """(the id echoed in `x-request-id`, the id in logs and the response body).

    A well-formed id the client sent is echoed and starts the internal one; a random
    suffix keeps the internal id unique, since a client may send one id twice.
    """
    unique = uuid.uuid4().hex
    if sent is None or _CLIENT_REQUEST_ID.fullmatch(sent) is None:
        return unique, unique
    return sent, f"{sent}-{unique[:12]}"


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """Whether a `--host` binds this machine's loopback only, however it is spelled:
    "LOCALHOST", "127.0.0.2" (all of 127/8 is loopback), "[::1]"."""
    name = hostname(host)
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # "::ffff:127.0.0.1" is 127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def hostname(host: str) -> str:
    """A Host header's name, lower case, without its port or a final dot:
    "[::1]:8000" -> "::1", "LocalHost.:80" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name = host.rpartition(":")[0] if host.count(":") == 1 else host
    return name.removesuffix(".")


# Quart binds its URL map to each request's host before any handler runs, and werkzeug
# refuses a name IDNA cannot encode (an empty label, "localhost..", or one over 63
# characters): raised there, outside every error handler, it was a bodiless 500 and a
# traceback. An empty map binds as Quart's does, so it refuses exactly those hosts.
_HOST_CHECK = Map()


def is_bindable_host(scheme: str, host_header: str | None, server: Any) -> bool:
    """Whether a request's Host header (None: absent) is a host name the app can serve,
    `server` the ASGI scope's (address, port) it falls back on."""
    if not _is_bracketed_soundly(host_header or ""):
        return False
    host = get_host(scheme, host_header, server)
    try:
        _HOST_CHECK.bind(host.lower())
    except BadHost:
        return False
    return True


# An IPv6 literal and its port (RFC 3986): the brackets enclose the whole address.
_BRACKETED_HOST = re.compile(r"\[([^\[\]]*)\](?::[0-9]*)?")


def _is_bracketed_soundly(host: str) -> bool:
    """No brackets, or an IPv6 address in a pair of them: "[::1" was read as "::1" (a
    loopback name, answered), where werkzeug sees no host at all."""
    host = host.strip()
    if "[" not in host and "]" not in host:
        return True
    if (bracketed := _BRACKETED_HOST.fullmatch(host)) is None:
        return False
    try:
        ipaddress.IPv6Address(bracketed[1])
    except ValueError:
        return False
    return True
