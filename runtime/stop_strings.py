"""Stop strings found in streamed text: what may be sent now, and whether a stop was hit.

    matcher = StopMatcher(["</answer>", "\\n\\n"])
    text, is_stop = matcher.feed(delta)   # per detokenized delta
    tail = matcher.flush()                # at the end: what was held back
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs


class StopMatcher:
    """Finds stop strings in streamed text, holding back only what could start one.

    When several stops could match, the one that completes first in the text wins, so
    the result does not depend on how the text was split into deltas. Each stop runs
    a KMP automaton over the text as it arrives: linear in the text, whatever the
    stops' lengths (holding every prefix of a 100 KB stop took gigabytes).
    """

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(stop for stop in stops if stop)  # "" would stop before any text
        self._fallbacks = tuple(_kmp_fallbacks(stop) for stop in self._stops)
        self._matched = [0] * len(self._stops)  # per stop: its prefix ending the text so far
        self._held = ""
        self.is_stopped = False

    def feed(self, delta: str, markup: str = "") -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit).

        On a hit the text ends right before the stop string; feed nothing afterwards
        (a later call returns ("", True)). `markup` follows `delta`: text of the reply's
        format (MarkupSplitter) that no stop matches inside or across, so it leaves at
        once with what was held.
        """
        text, is_stop = self._feed(delta)
        if markup and not is_stop:
            text, self._held = text + self._held + markup, ""
            self._matched = [0] * len(self._stops)
        return text, is_stop

    def _feed(self, delta: str) -> tuple[str, bool]:
        if self.is_stopped:
            return "", True
        text = self._held + delta
        for offset, char in enumerate(delta):
            end = len(self._held) + offset + 1
            longest = 0  # of the stops completing at `end`, the longest starts first
            for i, stop in enumerate(self._stops):
                matched = self._matched[i]
                while matched and stop[matched] != char:
                    matched = self._fallbacks[i][matched - 1]
                matched += stop[matched] == char
                self._matched[i] = matched
                if matched == len(stop):
                    longest = max(longest, matched)
            if longest:
                self._held, self.is_stopped = "", True
                return text[: end - longest], True
        num_held = max(self._matched, default=0)
        self._held = text[len(text) - num_held :]
        return text[: len(text) - num_held], False

    def flush(self) -> str:
        """The held-back text, at the end of a stream that hit no stop."""
        held, self._held = self._held, ""
        self._matched = [0] * len(self._stops)
        return held


@attrs.define
class MarkupSplitter:
    """Splits each token's text into what stop strings read and the reply format's
    markup, which they never match inside: a stop "call" must not cut Gemma 4's
    `<|tool_call>`, nor "assistant" gpt-oss's `<|start|>assistant<|channel|>final`.

    Markup is a control token's spelling (text only where a request keeps control
    tokens for its parser: actors/admission.py) and, in a format with headers
    (harmony), all of a header: from a control token in `header_opens` through the
    one in `body_opens`.
    """

    spellings: Mapping[int, str] = attrs.field(factory=dict)  # control token id -> text
    header_opens: frozenset[str] = frozenset()
    body_opens: frozenset[str] = frozenset()
    in_header: bool = False

    def split(self, token: int, piece: str) -> tuple[str, str]:
        """(text, markup) of `piece`, the detokenizer's text for `token` (it may lead
        with text the detokenizer held back before it)."""
        spelling = self.spellings.get(token)
        if self.in_header:
            self.in_header = spelling not in self.body_opens
            return "", piece
        if spelling is None or not piece.endswith(spelling):
            return piece, ""
        self.in_header = spelling in self.header_opens
        return piece[: len(piece) - len(spelling)], spelling


def _kmp_fallbacks(stop: str) -> list[int]:
    """fallback[n - 1]: the longest proper prefix of stop[:n] that is also its suffix."""
    fallbacks = [0] * len(stop)
    matched = 0
    for n in range(1, len(stop)):
        while matched and stop[n] != stop[matched]:
            matched = fallbacks[matched - 1]
        matched += stop[n] == stop[matched]
        fallbacks[n] = matched
    return fallbacks
