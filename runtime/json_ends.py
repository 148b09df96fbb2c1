"""Where a JSON value ends in a text that is still growing (a reply being generated):
the tool-call parsers (runtime/tools.py) use it to tell when a call's arguments are
whole without decoding them again at every token.
"""

from __future__ import annotations

import json
import re

import attrs

_DECODER = json.JSONDecoder()


def json_end(text: str, start: int, is_final: bool) -> int | None:
    """Where the JSON value at `start` ends, or None while it is incomplete."""
    try:
        _, end = _DECODER.raw_decode(text, start)
    # Not JSON (JSONDecodeError is a ValueError), nested too deep for json, or an
    # integer past Python's 4,300 digits (a bare ValueError): never a call.
    except (ValueError, RecursionError):
        return None
    # A number may still grow while what follows it could begin the rest of one: "12" of
    # "123", and "2" of "2." or "2e-", which the decoder ends before the "." or "e".
    is_closed = (
        text[start] in "{[" or text[end - 1] in '}]"' or not _NUMBER_GOES_ON.fullmatch(text, end)
    )
    return end if is_closed or is_final else None


_NUMBER_GOES_ON = re.compile(r"(?:\.|[eE][+-]?)?")


_IN_STRING = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'["{}\[\]]')


@attrs.define
class ValueEnd:
    """Where the JSON value at `start` of a growing text ends, or None while it is
    incomplete: `json_end`, with each character of an object, array or string scanned
    once. Decoding the whole value again at every token made a call's arguments cost
    O(n^2): a 16,000-token call took ~7 s of the event loop. What the scan finds closed
    is decoded once, so invalid JSON is still never complete."""

    start: int
    at: int = attrs.field(init=False)  # the next character to scan
    depth: int = 0
    in_string: bool = False
    closed_at: int | None = None  # just past the last character, by the scan
    decoded_end: int | None = None  # ... confirmed by the decoder

    def __attrs_post_init__(self) -> None:
        self.at = self.start

    def find(self, text: str, is_final: bool) -> int | None:
        if text[self.start] not in '{["':  # a number or a literal: short, decoded whole
            return json_end(text, self.start, is_final)
        # The text only grows: a tail that may begin a closing marker is held back until
        # the marker is decided (_Delimited.feed), never taken away once scanned.
        if self.closed_at is None:
            self._scan(text)
            if self.closed_at is not None:
                self.decoded_end = json_end(text, self.start, is_final)
        return self.decoded_end

    def _scan(self, text: str) -> None:
        at = self.at
        while self.closed_at is None:
            if self.in_string:
                found = _IN_STRING.search(text, at)
                if found is None or (found.group() == "\\" and found.end() == len(text)):
                    at = len(text) if found is None else found.start()  # wait for more
                    break
                at = found.end() + (found.group() == "\\")  # an escape: skip what it escapes
                if found.group() == '"':
                    self.in_string = False
                    self.closed_at = at if self.depth == 0 else None
                continue
            found = _STRUCTURE.search(text, at)
            if found is None:
                at = len(text)
                break
            at, char = found.end(), found.group()
            if char == '"':
                self.in_string = True
            else:
                self.depth += 1 if char in "{[" else -1
                self.closed_at = at if self.depth <= 0 else None
        self.at = at
