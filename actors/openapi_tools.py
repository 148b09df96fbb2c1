"""The OpenAPI fields and schemas of tools and structured output (actors/openai_tools.py)."""

from __future__ import annotations

from typing import Any

from actors.openai_tools import MAX_TOOLS

_REF = "#/components/schemas/"


def or_null(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema`, or null: the parser reads a null optional field as an absent one."""
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    if "type" in schema:
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


# Chat and completions; at most one of these per request.
STRUCTURED_OUTPUT_FIELDS: dict[str, Any] = {
    "response_format": or_null(
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                # Read only when the type is json_schema; then an object with a name.
                "json_schema": {
                    "description": "{name, description, schema (a JSON schema), strict}; "
                    "for json_schema"
                },
            },
            "additionalProperties": False,  # an unknown key is a 400
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {
                "required": ["json_schema"],
                "properties": {
                    "json_schema": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    }
                },
            },
        }
    ),
    "structured_outputs": or_null(
        {
            "type": "object",
            "description": "vLLM's: exactly one of json (a schema), regex, choice, grammar (Lark)",
            "minProperties": 1,
            "maxProperties": 1,
            "properties": {
                "json": {"type": ["object", "string", "boolean"]},
                "regex": {"type": "string", "minLength": 1},
                "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                "grammar": {"type": "string", "minLength": 1},
            },
            "additionalProperties": False,
        }
    ),
    "guided_json": or_null(
        {
            "anyOf": [{"type": "object"}, {"type": "string"}, {"type": "boolean"}],
            "description": "a JSON schema",
        }
    ),
    "guided_regex": or_null({"type": "string", "minLength": 1}),
    "guided_choice": or_null({"type": "array", "minItems": 1, "items": {"type": "string"}}),
    "guided_grammar": or_null(
        {"type": "string", "minLength": 1, "description": "Lark, llguidance's dialect"}
    ),
}

# Chat only.
TOOL_FIELDS: dict[str, Any] = {
    "tools": or_null(
        {
            "type": "array",
            "maxItems": MAX_TOOLS,
            "items": {"$ref": _REF + "Tool"},
            # Names unique, which JSON Schema cannot say: it refuses only whole copies.
            "uniqueItems": True,
            "description": "each function's name once",
        }
    ),
    "tool_choice": or_null(
        {
            "description": "only beside 'tools'",
            "anyOf": [
                {"enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string"}},
                        },
                    },
                },
            ],
        }
    ),
    "parallel_tool_calls": or_null({"type": "boolean", "description": "only beside 'tools'"}),
}

# A chat message's tool parts.
TOOL_MESSAGE_FIELDS: dict[str, Any] = {
    "tool_calls": {
        "type": ["array", "null"],
        "description": "an assistant turn's calls; arguments as JSON text",
        "items": {
            "type": "object",
            "required": ["function"],
            "properties": {
                "id": {"type": "string"},
                "function": {
                    "type": "object",
                    "required": ["name", "arguments"],
                    "properties": {
                        "name": {"type": "string"},
                        "arguments": {"type": "string"},
                    },
                },
            },
        },
    },
    "tool_call_id": {"type": ["string", "null"]},
    "name": {"type": ["string", "null"]},
}

# A whole chat reply's calls.
TOOL_CALLS_REPLY: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "string"},
                },
            },
        },
    },
}

TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},  # OpenAI's
                "description": {},
                "parameters": {
                    "type": "object",
                    "description": "a JSON schema of an object (its type, if given, 'object')",
                    "properties": {"type": {"const": "object"}},
                },
                "strict": {},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
