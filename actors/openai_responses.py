"""The OpenAI wire format going out: streamed chunks, whole responses, SSE framing."""

from __future__ import annotations

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

    With `has_logprobs`, every choice carries OpenAI's logprobs object for its tokens;
    completions' `text_offset` counts characters of the token strings from the start
    of the generated text, across chunks.
    """

    kind: str
    id: str
    model: str
    include_usage: bool = False
    has_logprobs: bool = False
    created: int = attrs.Factory(lambda: int(time.time()))
    num_chars: int = 0  # of token strings written so far: the next text_offset

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
    ) -> dict[str, Any]:
        logprobs_json = self._logprobs(logprobs) if logprobs is not None else None
        if self.kind == "completion":
            return {
                "index": 0,
                "text": text or "",
                "logprobs": logprobs_json,
                "finish_reason": finish_reason,
            }
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {
            "index": 0,
            "delta": delta,
            "logprobs": logprobs_json,
            "finish_reason": finish_reason,
        }

    def _logprobs(self, entries: Sequence[LogprobEntry]) -> dict[str, Any] | None:
        if not self.has_logprobs:
            return None
        if self.kind == "chat":
            return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(self.num_chars)
            self.num_chars += len(entry.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            # OpenAI's completions list the sampled token beside the top alternatives.
            "top_logprobs": [
                {e.token: _finite(e.logprob)} | {t: _finite(v) for t, v in e.top} for e in entries
            ],
            "text_offset": offsets,
        }

    def start(self) -> bytes | None:
        return self._chunk([self._choice("", None, role=True)]) if self.kind == "chat" else None

    def text(self, text: str, logprobs: Sequence[LogprobEntry] = ()) -> bytes:
        return self._chunk([self._choice(text, None, logprobs=logprobs)])

    def finish(self, finish_reason: str) -> bytes:
        return self._chunk([self._choice(None, finish_reason)])

    def usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def whole(
        self,
        text: str,
        finish_reason: str,
        usage: Usage,
        logprobs: Sequence[LogprobEntry] = (),
    ) -> dict[str, Any]:
        """The non-streaming response."""
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_json(usage),
        }


def _chat_logprob(entry: LogprobEntry) -> dict[str, Any]:
    return {
        **_token_json(entry.token, entry.logprob),
        "top_logprobs": [_token_json(token, value) for token, value in entry.top],
    }


def _token_json(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": _finite(logprob),
        "bytes": list(token.encode("utf-8", "surrogatepass")),
    }


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def sse(data: dict[str, Any]) -> bytes:
    return (
        b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


SSE_DONE = b"data: [DONE]\n\n"
