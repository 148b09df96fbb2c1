"""The OpenAI wire format going out: streamed chunks, whole responses, SSE framing."""

from __future__ import annotations

import json
import time
from typing import Any

import attrs

from actors.requests import Usage


@attrs.frozen
class ChunkWriter:
    """Builds one response's chunks: one `id` and `created` for all of them."""

    kind: str
    id: str
    model: str
    include_usage: bool = False
    created: int = attrs.Factory(lambda: int(time.time()))

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
        self, text: str | None, finish_reason: str | None, role: bool = False
    ) -> dict[str, Any]:
        if self.kind == "completion":
            return {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def start(self) -> bytes | None:
        return self._chunk([self._choice("", None, role=True)]) if self.kind == "chat" else None

    def text(self, text: str) -> bytes:
        return self._chunk([self._choice(text, None)])

    def finish(self, finish_reason: str) -> bytes:
        return self._chunk([self._choice(None, finish_reason)])

    def usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def whole(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The non-streaming response."""
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_json(usage),
        }


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
