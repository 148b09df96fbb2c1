"""The OpenAPI schema of a chat message, as actors/chat_messages.py reads one."""

from __future__ import annotations

from typing import Any

from actors.openapi_tools import TOOL_MESSAGE_FIELDS
from actors.openapi_tools import or_null as _or_null

_REF = "#/components/schemas/"

_REFUSAL_PART: dict[str, Any] = {
    "type": "object",
    "required": ["type", "refusal"],
    "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
}

TEXT_PART_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"$ref": _REF + "TextPart"}},
                {
                    "type": "array",
                    "description": "an assistant turn's, as OpenAI's replies hold them",
                    "items": {"anyOf": [{"$ref": _REF + "TextPart"}, _REFUSAL_PART]},
                },
                {"type": "null"},
            ]
        },
        **TOOL_MESSAGE_FIELDS,
        # An assistant turn's reasoning as replied, under either name.
        "reasoning": _or_null({"type": "string"}),
        "reasoning_content": _or_null({"type": "string"}),
    },
    # Refusal parts and reasoning on an assistant turn only.
    "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
    "then": {
        "properties": {
            "content": {"not": {"type": "array", "contains": _REFUSAL_PART}},
            "reasoning": {"type": "null"},
            "reasoning_content": {"type": "null"},
        }
    },
}
