"""Streaming detokenization: token ids in, text deltas out, each final when emitted.

A `Tokenizer` (runtime/tokenizer.py) makes one per generated stream (`detokenizer()`),
handing it its decode and the ids that decoding skips or joins into byte runs.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) valid UTF-8
# Held-back ids past which the detokenizer releases settled text (IncrementalDetokenizer).
MAX_HELD_IDS = 32


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    Concatenated, the deltas and `flush()` equal `decode(all ids)` exactly. Each step
    decodes a short window, not the stream: ids[prefix_offset:read_offset] were already
    emitted and only give context (so a SentencePiece leading space or a byte-level merge
    decodes as it does mid-sequence), ids[read_offset:] are pending, and the delta is
    the window's text past the context's. Text is held back while it ends in U+FFFD
    (an unfinished UTF-8 character) and while the last id is in `run_ids`: byte-fallback
    pieces decode as one run, where a single invalid byte turns all of it into U+FFFD.
    So work per token is bounded by the window, which spans the held-back ids: a few
    tokens in practice. Skipped ids never join it, and one held past MAX_HELD_IDS for
    U+FFFD (invalid bytes) releases what is settled: 8,000 such tokens cost 8 s before.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        run_ids: frozenset[int] = frozenset(),
        skipped_ids: frozenset[int] = frozenset(),
    ):
        self._decode = decode
        self._run_ids = run_ids
        self._skipped_ids = skipped_ids
        self.has_tokens = False  # any token that decoding does not skip, text or not
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._chunks: list[str] = []

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly decodable text (often "")."""
        if token_id in self._skipped_ids:
            return ""  # decoding drops it: it changes no text, now or later
        self._ids.append(token_id)
        self.has_tokens = True
        if token_id in self._run_ids:
            return ""  # nothing is final until the run of byte pieces ends
        return self._emit(is_final=False)

    def flush(self) -> str:
        """Whatever is held back; call once at the end of the stream."""
        return self._emit(is_final=True)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._chunks)

    def _emit(self, is_final: bool) -> str:
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text):
            return ""
        if window_text.endswith(REPLACEMENT_CHAR) and not is_final:
            return self._release_settled(window_text)
        return self._release(window_text, len(self._ids))

    def _release(self, text: str, end: int) -> str:
        """Emit `text` (the decode of ids[prefix_offset:end]) past the context's."""
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._chunks.append(delta)
        return delta

    def _release_settled(self, window_text: str) -> str:
        """Past MAX_HELD_IDS held ids, the text before the last three (a UTF-8 character
        has at most four bytes), where the window decodes apart there as it does whole."""
        if len(self._ids) - self._read_offset < MAX_HELD_IDS:
            return ""
        split = len(self._ids) - 3
        head = self._decode(self._ids[self._prefix_offset : split])
        if not head.startswith(self._prefix_text):
            return ""
        if head + self._decode(self._ids[split:]) != window_text:
            return ""
        return self._release(head, split)
