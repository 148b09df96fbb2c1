"""The OpenAPI 3.1 document served at /openapi.json: every route, what it accepts, what it answers.

Written by hand to match what `actors/openai_requests.py` enforces, not what OpenAI
documents: a field the parser refuses unless it is off (`best_of`, `echo`, ...)
is described with only its "off" values, and `null` is allowed wherever the parser
reads it as "absent". tests/actors/test_http_fuzz.py fuzzes the server against this
document and checks it names every route the app registers.
"""

from __future__ import annotations

from typing import Any

from actors.choices import DEFAULT_MAX_N
from actors.openai_fields import METADATA_KEY_CHARS, METADATA_PAIRS, METADATA_VALUE_CHARS
from actors.openai_requests import UNSUPPORTED_CHAT_FIELDS
from actors.openapi_messages import MESSAGE_SCHEMA, TEXT_PART_SCHEMA
from actors.openapi_tools import (
    STRUCTURED_OUTPUT_FIELDS,
    TOOL_CALLS_REPLY,
    TOOL_FIELDS,
    TOOL_SCHEMA,
)
from actors.openapi_tools import or_null as _or_null  # one definition for both documents
from actors.requests import (
    MAX_PRIORITY,
    MAX_SEED,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    MAX_THINKING_BUDGET,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
    REASONING_EFFORTS,
)

_REF = "#/components/schemas/"


def _number(low: float, high: float, *, is_low_allowed: bool = True) -> dict[str, Any]:
    bound = "minimum" if is_low_allowed else "exclusiveMinimum"
    return _or_null({"type": "number", bound: low, "maximum": high})


_COMMON_FIELDS: dict[str, Any] = {
    "model": {"type": "string", "description": "must name the served model (GET /v1/models)"},
    "max_tokens": _or_null(
        {
            "type": "integer",
            "minimum": 1,
            "description": "unset: completions 16 (or what the context leaves), chat what the context leaves",
        }
    ),
    "max_completion_tokens": _or_null(
        {"type": "integer", "minimum": 1, "description": "takes precedence over max_tokens"}
    ),
    "temperature": _number(0.0, 2.0),
    "top_p": _number(0.0, 1.0, is_low_allowed=False),
    "min_p": _number(0.0, 1.0),
    "top_k": _or_null({"type": "integer", "minimum": -1, "description": "0 or -1: off"}),
    "repetition_penalty": _number(0.0, 10.0, is_low_allowed=False),
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "seed": _or_null({"type": "integer", "minimum": MIN_SEED, "maximum": MAX_SEED}),
    "logit_bias": _or_null(
        {
            "type": "object",
            "description": "token id (decimal digits) -> bias added to its logit",
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
    "stop": _or_null(
        {
            "description": f"stop strings, at most {MAX_STOP_BYTES} bytes of UTF-8 each",
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "minLength": 1},
                },
            ],
        }
    ),
    "ignore_eos": _or_null({"type": "boolean"}),
    "priority": _or_null(
        {
            "type": "integer",
            "minimum": -MAX_PRIORITY,
            "maximum": MAX_PRIORITY,
            "description": "lower runs first and is preempted last; equal ones FCFS",
        }
    ),
    "stream": _or_null({"type": "boolean"}),
    "stream_options": _or_null(
        {
            "type": "object",
            "description": "needs 'stream': true",
            "properties": {
                "include_usage": _or_null({"type": "boolean"}),
                "include_obfuscation": _or_null({"type": "boolean"}),  # without effect
            },
            "additionalProperties": False,  # an unknown option is a 400
        }
    ),
    "n": _or_null(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": DEFAULT_MAX_N,
            "description": "choices, each with its own index; at most --max-n (default 8)",
        }
    ),
    # Refused unless off: documented with only the values that mean "off".
    "best_of": {"enum": [1, None]},
    "functions": {"type": "null", "description": "deprecated by OpenAI: send tools"},
    "function_call": {"type": "null", "description": "deprecated by OpenAI: send tool_choice"},
    **STRUCTURED_OUTPUT_FIELDS,
    # Accepted and without effect, as OpenAI defines them.
    "user": _or_null({"type": "string"}),
    "safety_identifier": _or_null({"type": "string"}),
    "metadata": _or_null(
        {
            "type": "object",
            "maxProperties": METADATA_PAIRS,
            "propertyNames": {"maxLength": METADATA_KEY_CHARS},
            "additionalProperties": {"type": "string", "maxLength": METADATA_VALUE_CHARS},
        }
    ),
    "service_tier": _or_null({"type": "string"}),
    "prompt_cache_key": _or_null({"type": "string"}),
    "prompt_cache_retention": _or_null({"type": "string"}),
    "prompt_cache_options": _or_null({"type": "object"}),
    "store": {"enum": [False, None]},
}

_NUM_TOP_LOGPROBS = {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}

# 'top_logprobs' without 'logprobs': true is refused.
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}

# 'stream_options' without 'stream': true is refused.
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}

# 'best_of' (only ever 1) with more than one choice is refused: OpenAI asks best_of >= n.
_BEST_OF_BOUNDS_N = {
    "if": {"required": ["best_of"], "properties": {"best_of": {"type": "integer"}}},
    "then": {"properties": {"n": {"enum": [1, None]}}},
}

_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


def _completion_schema(kind: str, field: str, field_schema: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streamed) response whose choices carry `field` ("message" or "text")."""
    choice = {
        "type": "object",
        "required": ["index", field, "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            field: field_schema,
            "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
        },
    }
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": {"$ref": _REF + "Usage"},
        },
    }


_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "additionalProperties": False,  # an unknown field is a 400
        "properties": {
            **_COMMON_FIELDS,
            "messages": {"type": "array", "minItems": 1, "items": {"$ref": _REF + "Message"}},
            "logprobs": _or_null({"type": "boolean"}),
            "top_logprobs": _or_null(
                {**_NUM_TOP_LOGPROBS, "description": "alternatives per token; needs logprobs"}
            ),
            **TOOL_FIELDS,
            "modalities": _or_null(
                {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}
            ),
            "reasoning_effort": _or_null(
                {
                    "enum": list(REASONING_EFFORTS),
                    "description": "the chat template's `reasoning_effort` (gpt-oss's reasoning level)",
                }
            ),
            **{
                name: {"type": "null", "description": f"not supported: {why}"}
                for name, why in UNSUPPORTED_CHAT_FIELDS.items()
            },
            "chat_template_kwargs": _or_null(
                {
                    "type": "object",
                    "description": "variables for the chat template; only these",
                    "additionalProperties": False,
                    "properties": {
                        "enable_thinking": {"type": "boolean"},
                        "thinking": {"type": "boolean"},
                        "reasoning_effort": {"enum": list(REASONING_EFFORTS)},
                        "thinking_budget": {
                            "type": "integer",
                            "minimum": -1,
                            "maximum": MAX_THINKING_BUDGET,
                        },
                    },
                }
            ),
        },
        "allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS, _BEST_OF_BOUNDS_N],
    },
    "Message": MESSAGE_SCHEMA,
    "Tool": TOOL_SCHEMA,
    "TextPart": TEXT_PART_SCHEMA,
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "additionalProperties": False,  # an unknown field is a 400
        "properties": {
            **_COMMON_FIELDS,
            "prompt": {
                "description": (
                    "text, token ids, or a batch (a list) of either: prompt i's choice j has"
                    " index i * n + j; prompts x n at most the server's --max-waiting"
                ),
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    _TOKEN_IDS,
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
                    },
                ],
            },
            "logprobs": _or_null(
                {
                    **_NUM_TOP_LOGPROBS,
                    "description": "alternatives per token, beside the chosen one",
                }
            ),
            "echo": {"enum": [False, None]},
            "chat_template_kwargs": {"type": "null", "description": "chat only"},
            "suffix": _or_null({"type": "string", "maxLength": 0}),
        },
        "allOf": [_STREAM_OPTIONS_NEED_STREAM, _BEST_OF_BOUNDS_N],
    },
    "Usage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0},
            "prompt_tokens_details": {
                "type": "object",
                "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
            },
        },
    },
    "ChatCompletion": _completion_schema(
        "chat.completion",
        "message",
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"const": "assistant"},
                "content": {"type": ["string", "null"], "description": "null: only tool calls"},
                "tool_calls": TOOL_CALLS_REPLY,
                "reasoning": {"type": "string", "description": "the reply's reasoning (gpt-oss's analysis, Gemma 4's thought, a <think> block)"},
                "reasoning_content": {"type": "string", "description": "the same, under DeepSeek's name"},
            },
        },
    ),
    "Completion": _completion_schema("text_completion", "text", {"type": "string"}),
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"$ref": _REF + "Model"}},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"enum": ["loading", "ready", "draining"]}},
    },
    "Stats": {
        "type": "object",
        "description": "the playground's live view; the same numbers as /metrics",
        "required": ["num_running", "num_waiting", "kv_cache_usage", "generation_tokens_total"],
        "properties": {
            "num_running": {"type": "integer", "minimum": 0, "description": "in the batch"},
            "num_waiting": {"type": "integer", "minimum": 0, "description": "queued or preempted"},
            "kv_cache_usage": {"type": "number", "minimum": 0, "maximum": 1},
            "generation_tokens_total": {
                "type": "integer",
                "minimum": 0,
                "description": "since start; its growth between polls is tokens/s",
            },
        },
    },
}


def _json(schema_name: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF + schema_name}}},
    }


_ERRORS = {
    "400": _json("Error", "the request is malformed or names a bad value (`param` says which)"),
    "401": _json("Error", "no valid API key (only when the server was started with --api-key)"),
    "503": _json(
        "Error",
        "loading, draining, the waiting queue is full, or --max-http-requests are in flight "
        "(see Retry-After)",
    ),
}


def _completion_route(request: str, response: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF + request}}},
            },
            "responses": {
                "200": {
                    "description": "the whole response, or with 'stream': true an SSE stream "
                    "of chunks ending in `data: [DONE]`",
                    "content": {
                        "application/json": {"schema": {"$ref": _REF + response}},
                        "text/event-stream": {},
                    },
                },
                **_ERRORS,
                "404": _json("Error", "the model is not the one this server has"),
                "408": _json("Error", "the body arrived too slowly (after 5 s, under 64 KiB/s)"),
                "413": _json("Error", "the body is larger than --max-body-bytes"),
                "415": _json("Error", "the Content-Type is not application/json, or the body is compressed"),
                "500": _json("Error", "the generation failed in the engine"),
            },
        }
    }


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "cadence", "version": "0.1.0", "description": "OpenAI-compatible inference"},
    # The key is optional: only a server started with --api-key checks it.
    "security": [{"bearerAuth": []}],
    "paths": {
        "/": {
            "get": {
                "summary": "the playground: a chat page with the server's live stats",
                "security": [],
                "responses": {
                    "200": {"description": "HTML", "content": {"text/html": {}}},
                },
            }
        },
        "/health": {
            "get": {
                "summary": "ready, or why not",
                "security": [],
                "responses": {
                    "200": _json("Health", "ready"),
                    "503": _json("Health", "loading or draining"),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "security": [],
                "responses": {
                    "200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics, vLLM's names with the prefix cadence:",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    "401": _ERRORS["401"],
                    "503": _json("Error", "loading"),
                },
            }
        },
        "/v1/cadence/stats": {
            "get": {
                "summary": "running and waiting requests, KV usage, tokens generated",
                "responses": {
                    "200": _json("Stats", "now"),
                    "401": _ERRORS["401"],
                    "503": _json("Error", "loading, or --max-http-requests are in flight"),
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "the one model this server has",
                "responses": {"200": _json("ModelList", "the model"), **_ERRORS},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "the model, if it is this server's (404 model_not_found if not)",
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": _json("Model", "the model"),
                    "404": _json("Error", "not this server's model"),
                    **_ERRORS,
                },
            }
        },
        "/v1/chat/completions": _completion_route(
            "ChatCompletionRequest", "ChatCompletion", "chat, rendered by the model's template"
        ),
        "/v1/completions": _completion_route("CompletionRequest", "Completion", "plain text"),
    },
    "components": {
        "schemas": _SCHEMAS,
        "securitySchemes": {
            "bearerAuth": {"type": "http", "scheme": "bearer", "description": "--api-key"}
        },
    },
}
