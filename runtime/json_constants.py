"""NaN and Infinity in JSON a model writes, re-spelled as null while the text grows.

Python's json reads and writes `NaN`, `Infinity` and `-Infinity`, but they are no JSON
(RFC 8259): a call whose arguments hold one is refused whole by JavaScript's
JSON.parse and by strict readers. The tool-call parsers (runtime/tools.py) pass
arguments through `NonFiniteAsNull`, which writes each such value as `null`, as
JavaScript's JSON.stringify does. It holds back only a tail that may yet be one, so
any split of the text gives the same result.

    literals = NonFiniteAsNull()
    text = literals.feed(fragment)   # per fragment of the arguments
    text += literals.finish()        # once they are whole
"""

from __future__ import annotations

import re

import attrs

_NON_FINITE = ("NaN", "Infinity", "-Infinity")
_LONGEST = max(map(len, _NON_FINITE))
# In JSON a value follows one of these, and is followed by one: elsewhere the letters
# are part of something else (a word in arguments that are no JSON), and kept.
_BEFORE_VALUE = frozenset(":[, \t\r\n")
_AFTER_VALUE = frozenset(",]} \t\r\n")
_OUTSIDE_STRING = re.compile(r'["NI-]')  # a string, or a value that may be non-finite
_INSIDE_STRING = re.compile(r'["\\]')


@attrs.define
class NonFiniteAsNull:
    in_string: bool = False
    is_escaped: bool = False  # in a string, just after a backslash
    last: str = ":"  # the last character passed on (at the start, a value may begin)
    held: str = ""  # a tail that may be a non-finite value, not yet passed on

    def feed(self, text: str) -> str:
        text, self.held = self.held + text, ""
        out: list[str] = []
        at = 0
        while at < len(text):
            if self.is_escaped:
                self.is_escaped = False
                at = self._pass(out, text, at, at + 1)
                continue
            found = (_INSIDE_STRING if self.in_string else _OUTSIDE_STRING).search(text, at)
            if found is None:
                self._pass(out, text, at, len(text))
                break
            at = self._pass(out, text, at, found.start())
            char = found.group()
            if self.in_string or char == '"':
                self.in_string = (char != '"') if self.in_string else True
                self.is_escaped = self.in_string and char == "\\"
                at = self._pass(out, text, at, at + 1)
                continue
            value = next((v for v in _NON_FINITE if text.startswith(v, at)), None)
            after = at + len(value) if value is not None else at
            if self.last not in _BEFORE_VALUE:
                at = self._pass(out, text, at, at + 1)
            elif value is None and _may_grow_into_one(text, at):
                self.held = text[at:]  # "Na", "-": what comes next tells
                break
            elif value is None:
                at = self._pass(out, text, at, at + 1)
            elif after == len(text):
                self.held = text[at:]  # "NaN" at the end: "NaNa" would be no value
                break
            elif text[after] in _AFTER_VALUE:
                out.append("null")
                self.last, at = "l", after
            else:
                at = self._pass(out, text, at, after)
        return "".join(out)

    def finish(self) -> str:
        """What is held, at the end of the arguments."""
        held, self.held = self.held, ""
        if held in _NON_FINITE and self.last in _BEFORE_VALUE:
            return "null"
        return held

    def _pass(self, out: list[str], text: str, start: int, end: int) -> int:
        if end > start:
            out.append(text[start:end])
            self.last = text[end - 1]
        return end


def _may_grow_into_one(text: str, at: int) -> bool:
    # Only a tail shorter than the longest value can: slicing the rest of a long text
    # at each '-' would take time quadratic in its length.
    tail = text[at : at + _LONGEST]
    return len(tail) < _LONGEST and any(v.startswith(tail) for v in _NON_FINITE)


def with_non_finite_as_null(text: str) -> str:
    """All of `text` at once, as `NonFiniteAsNull` passes it on."""
    literals = NonFiniteAsNull()
    return literals.feed(text) + literals.finish()
