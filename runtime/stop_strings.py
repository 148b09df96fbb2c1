"""Stop strings found in streamed text: what may be sent now, and whether a stop was hit.

    matcher = StopMatcher(["</answer>", "\\n\\n"])
    text, is_stop = matcher.feed(delta)   # per detokenized delta
    tail = matcher.flush()                # at the end: what was held back
"""

from __future__ import annotations

from collections.abc import Sequence


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

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit).

        On a hit the text ends right before the stop string; feed nothing afterwards
        (a later call returns ("", True)).
        """
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
