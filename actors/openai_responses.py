"""The OpenAI wire format going out: streamed chunks, whole responses, SSE framing."""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Sequence
from typing import Any

import attrs

from actors.requests import LogprobEntry, Usage

# OpenAI's logprob for "very unlikely": what a token the sampler's masks excluded
# (-inf, which JSON cannot carry) is reported as, as vLLM does.
MIN_LOGPROB = -9999.0


@attrs.define
class ChunkWriter:
    """Builds one response's chunks: one `id` and `created` for all of them.

    Each chunk carries one choice, named by its `index` (0 to n-1); the chunks of
    different choices interleave. With `has_logprobs`, every choice carries OpenAI's
    logprobs object for its tokens; completions' `text_offset` counts the characters
    the tokens' bytes complete, from the start of that choice's generated text, across
    chunks (the bytes of one emoji, four tokens, all start at its offset; a token after
    bytes it does not finish a character of starts after their U+FFFD).
    """

    kind: str
    id: str
    model: str
    include_usage: bool = False
    has_logprobs: bool = False
    created: int = attrs.Factory(lambda: int(time.time()))
    # Per choice: characters the tokens' bytes completed so far (the next text_offset),
    # and the decoder holding a character's first bytes until its last arrives.
    num_chars: dict[int, int] = attrs.Factory(dict)
    decoders: dict[int, codecs.IncrementalDecoder] = attrs.Factory(dict)

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage_json(usage) if usage is not None else None
        return sse(chunk)

    def _choice(
        self,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: Sequence[LogprobEntry] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        logprobs_json = self._logprobs(logprobs, index) if logprobs is not None else None
        if self.kind == "completion":
            return {
                "index": index,
                "text": text or "",
                "logprobs": logprobs_json,
                "finish_reason": finish_reason,
            }
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs_json,
            "finish_reason": finish_reason,
        }

    def _logprobs(self, entries: Sequence[LogprobEntry], index: int) -> dict[str, Any] | None:
        if not self.has_logprobs:
            return None
        if self.kind == "chat":
            return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
        offsets = []
        decoder = self.decoders.setdefault(index, codecs.getincrementaldecoder("utf-8")("replace"))
        for entry in entries:
            raw = _token_bytes(entry.token, entry.token_bytes)
            num_chars = self.num_chars.get(index, 0)
            held = decoder.getstate()[0]
            # Held bytes this token does not go on with were no character: their
            # U+FFFD stands first, so the token starts a character after it.
            is_after_held = bool(held) and bool(raw) and not _continues(held, raw[0])
            offsets.append(num_chars + 1 if is_after_held else num_chars)
            self.num_chars[index] = num_chars + len(decoder.decode(raw))
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            # OpenAI's completions list the sampled token beside the top alternatives.
            "top_logprobs": [
                {e.token: _finite(e.logprob)} | {t: _finite(v) for t, v in e.top} for e in entries
            ],
            "text_offset": offsets,
        }

    def start(self, num_choices: int = 1) -> bytes | None:
        """Chat's first chunk of each choice, with the role; completions have none."""
        if self.kind != "chat":
            return None
        return b"".join(
            self._chunk([self._choice("", None, role=True, index=i)]) for i in range(num_choices)
        )

    def text(self, text: str, logprobs: Sequence[LogprobEntry] = (), index: int = 0) -> bytes:
        return self._chunk([self._choice(text, None, logprobs=logprobs, index=index)])

    def finish(self, finish_reason: str, index: int = 0) -> bytes:
        return self._chunk([self._choice(None, finish_reason, index=index)])

    def reasoning(
        self, text: str, index: int = 0, logprobs: Sequence[LogprobEntry] = ()
    ) -> bytes:
        """A chat chunk of reasoning (gpt-oss's analysis channel, a <think> block), under
        both names clients read it by: `reasoning` (vLLM's, as OpenAI advises for
        gpt-oss) and `reasoning_content` (DeepSeek's, which many clients still expect)."""
        delta = reasoning_fields(text)
        return self._chunk([self._delta_choice(delta, logprobs, index)])

    def tool_calls(
        self, calls: Sequence[dict[str, Any]], index: int = 0, logprobs: Sequence[LogprobEntry] = ()
    ) -> bytes:
        """A chat chunk of OpenAI `tool_calls` delta items (actors/openai_tools.py)."""
        return self._chunk([self._delta_choice({"tool_calls": list(calls)}, logprobs, index)])

    def _delta_choice(
        self, delta: dict[str, Any], logprobs: Sequence[LogprobEntry], index: int
    ) -> dict[str, Any]:
        logprobs_json = self._logprobs(logprobs, index) if logprobs else None
        return {"index": index, "delta": delta, "logprobs": logprobs_json, "finish_reason": None}

    def usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def choice(
        self,
        text: str,
        finish_reason: str,
        logprobs: Sequence[LogprobEntry] = (),
        index: int = 0,
        reasoning: str = "",
    ) -> dict[str, Any]:
        """One choice of the non-streaming response."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            return {
                "index": index,
                "message": message | reasoning_fields(reasoning) if reasoning else message,
                "logprobs": self._logprobs(logprobs, index),
                "finish_reason": finish_reason,
            }
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(logprobs, index),
            "finish_reason": finish_reason,
        }

    def whole(self, choices: Sequence[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        """The non-streaming response: `choices` from `choice()`, by index."""
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": list(choices),
            "usage": usage_json(usage),
        }


def reasoning_fields(text: str) -> dict[str, str]:
    return {"reasoning": text, "reasoning_content": text}


def _chat_logprob(entry: LogprobEntry) -> dict[str, Any]:
    top_bytes = entry.top_bytes or (None,) * len(entry.top)
    return {
        **_token_json(entry.token, entry.logprob, entry.token_bytes),
        "top_logprobs": [
            _token_json(token, value, raw)
            for (token, value), raw in zip(entry.top, top_bytes, strict=True)
        ],
    }


def _token_json(token: str, logprob: float, raw: bytes | None) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(_token_bytes(token, raw))}


def _continues(held: bytes, byte: int) -> bool:
    """Whether `byte` goes on with the character whose first bytes are `held`."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(held + bytes([byte]))
    except UnicodeDecodeError:
        return False
    return True


def _token_bytes(token: str, raw: bytes | None) -> bytes:
    return raw if raw is not None else token.encode("utf-8", "surrogatepass")


def _finite(logprob: float) -> float:
    # NaN too: JSON has no NaN (strict parsers refuse the whole response).
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def wire_json(data: dict[str, Any]) -> bytes:
    """`data` as compact JSON in UTF-8. A lone surrogate (a tool call's name decoded
    from a model's "\\ud800") has no UTF-8 form: then the text goes out \\u-escaped,
    as JSON allows, rather than failing the response."""
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(data, separators=(",", ":")).encode()


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + wire_json(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
