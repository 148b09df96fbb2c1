"""argparse types for the CLI's numbers: a bad value is argparse's one-line error, never
a run that starts and then fails (or runs zero clients) on it."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import urllib.parse
from collections.abc import Callable
from pathlib import Path


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An integer in low..high, both included."""

    def checked(text: str) -> int:
        value = integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {text}")
        return value

    return checked


port = int_in(0, 65535)


def http_url(text: str) -> str:
    """An http(s) URL naming its host: "gpu-box:12345" (no scheme) read as scheme
    "gpu-box" and no host, and the load went to 127.0.0.1:80 under another name."""
    try:
        url = urllib.parse.urlsplit(text)
        url.port  # noqa: B018  (raises ValueError for a port out of range)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no http:// or https:// URL with a host (http://host:port)"
        )
    return text


def shell_words(text: str) -> list[str]:
    """`text` split as a shell would: an unclosed quote is this one-line error."""
    try:
        return shlex.split(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def host(text: str) -> str:
    """A name or address to bind: not empty, and one the socket layer can encode (a
    byte that is not UTF-8 on the command line arrives as a lone surrogate)."""
    text = non_empty(text)
    try:
        text.encode("idna")
    except UnicodeError:
        raise argparse.ArgumentTypeError(f"is no host name or address: {text!r}") from None
    return text


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = _finite(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def output_file(text: str) -> Path:
    """A path a report can be written to, checked before a run whose result it would lose."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("'' is not a file name")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no directory {str(path.parent)!r}")
    # A file is written beside itself and renamed into place (actors/atomic_write.py),
    # so its directory must take a new file; a device or FIFO is written as it is.
    target = Path(os.path.realpath(path))
    is_special = target.exists() and not target.is_file()
    if not os.access(target if is_special else target.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: permission denied")
    return path
