"""Chat messages as the template sees them: one rule for HTTP and the embedding API.

A message is checked and rebuilt from the keys cadence knows (`role`, `content`, a
tool turn's `tool_call_id` and `name`, an assistant turn's `tool_calls` and reasoning); any other
key is dropped, as OpenAI's SDK replays an assistant message with `refusal`,
`annotations` and `audio` set to null. Bad values raise RequestError naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from runtime.errors import RequestError

# A closed set: any other string would reach the template as a role of its own.
# `developer` renders as `system` where the template does not know it (ChatTemplate).
ROLES = ("system", "user", "assistant", "tool", "developer")


def chat_messages(messages: Sequence[Any]) -> tuple[dict[str, Any], ...]:
    """`messages` checked, each as a dict of string `role` and `content` (text parts
    joined, a null content empty) and its tool keys; RequestError names the first bad one."""
    if not isinstance(messages, list | tuple):
        raise RequestError("'messages' must be a list of messages", param="messages")
    if not messages:
        raise RequestError("'messages' must not be empty", param="messages")
    return tuple(_message(message, i) for i, message in enumerate(messages))


# A content part's type -> the key holding its text. An assistant turn replayed from
# OpenAI's own reply may hold its refusal as a part: what it said, as text is.
_PARTS = {"text": "text"}
_ASSISTANT_PARTS = {"text": "text", "refusal": "refusal"}


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object", param=where)
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or role not in ROLES:
        shown = json.dumps(role, default=repr)[:40]
        raise RequestError(
            f"{where}.role must be one of {', '.join(ROLES)}, got {shown}", param=f"{where}.role"
        )
    if isinstance(content, list):  # content parts: only text ones (and refusals, said)
        kinds = _ASSISTANT_PARTS if role == "assistant" else _PARTS
        content = "".join(_part_text(part, kinds, f"{where}.content") for part in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RequestError(
            f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
        )
    return {"role": role, "content": content, **_tool_keys(message, where), **_reasoning(message, where)}


def _reasoning(message: dict[str, Any], where: str) -> dict[str, str]:
    """An assistant turn's reasoning as replied (`reasoning`, or `reasoning_content`),
    under the names templates read it by: `reasoning_content` (Qwen3's) and `thinking`
    (gpt-oss's, which drops it from turns before the last)."""
    given = []
    for name in ("reasoning", "reasoning_content"):
        if (text := message.get(name)) is None:
            continue
        if not isinstance(text, str) or message.get("role") != "assistant":
            raise RequestError(f"{where}.{name} must be a string on an assistant message", param=f"{where}.{name}")
        given.append(text)
    text = next((text for text in given if text), "")
    return {"reasoning_content": text, "thinking": text} if text else {}


def _part_text(part: Any, kinds: dict[str, str], where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    text = part.get(kinds[kind]) if isinstance(kind, str) and kind in kinds else None
    if not isinstance(text, str):
        raise RequestError(f"{where} parts must be {' or '.join(kinds)} parts", param=where)
    return text


def _tool_keys(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant turn's `tool_calls`, a tool turn's `tool_call_id` (and `name`), checked."""
    keys: dict[str, Any] = {}
    for name in ("tool_call_id", "name"):
        if (value := message.get(name)) is not None:
            if not isinstance(value, str):
                raise RequestError(f"{where}.{name} must be a string", param=f"{where}.{name}")
            keys[name] = value
    calls = message.get("tool_calls")
    if calls is None:
        return keys
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise RequestError(
            f"{where}.tool_calls must be a list on an assistant message",
            param=f"{where}.tool_calls",
        )
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise RequestError(
                f"{where}.tool_calls[{i}] must have function.name and function.arguments (a string)",
                param=f"{where}.tool_calls[{i}]",
            )
        if not isinstance(call.get("id", ""), str):
            param = f"{where}.tool_calls[{i}].id"
            raise RequestError(f"{param} must be a string", param=param)
        keys.setdefault("tool_calls", []).append(
            {"id": call.get("id", ""), "type": "function", "function": dict(function)}
        )
    return keys
