"""What every OpenAI request parser shares (actors/openai_requests.py): `ApiError`, whose
body is exactly OpenAI's `{"error": {"message", "type", "param", "code"}}`; a field's
JSON type check; and the bookkeeping fields OpenAI defines as having no effect on the
output (user, metadata, store...), checked as OpenAI checks them and then ignored."""

from __future__ import annotations

import json
from typing import Any

from runtime.errors import CadenceError, RequestError

import attrs

from actors.requests import GenerationError, OverloadedError, ServiceClosedError


@attrs.frozen
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def type(self) -> str:
        """OpenAI's type for the status: it answers a bad key, an unknown model or URL
        with invalid_request_error too (`code` tells them apart), and a fault of its own
        with server_error."""
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_error(cls, error: CadenceError) -> ApiError:
        match error:
            case RequestError():
                return cls(400, str(error), param=error.param, code=error.code)
            case OverloadedError():
                headers = (("Retry-After", str(error.retry_after)),)
                return cls(503, str(error), code="overloaded", headers=headers)
            case ServiceClosedError():
                headers = (("Retry-After", "1"),)
                return cls(503, str(error), code="unavailable", headers=headers)
            case GenerationError():
                return cls(500, str(error), code="generation_failed")
        return cls(500, str(error))


# Fields OpenAI defines as having no effect on the output (end-user ids, tags, hints).
IGNORED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "user": str,
    "safety_identifier": str,
    "metadata": dict,
    "service_tier": str,
    "prompt_cache_key": str,  # prefix caching is automatic, and lasts while blocks are free
    "prompt_cache_retention": str,
    "prompt_cache_options": dict,
    "store": bool,  # false only
}


# OpenAI's limits on `metadata`, which it enforces with a 400 naming the field.
METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512


def _check_metadata(metadata: dict[str, Any]) -> None:
    """OpenAI's rules for `metadata` (string keys to string values, within its limits):
    a tag the client meant for OpenAI's dashboard then fails here as it would there."""
    if len(metadata) > METADATA_PAIRS:
        raise ApiError(
            400,
            f"'metadata' holds at most {METADATA_PAIRS} pairs, got {len(metadata)}",
            param="metadata",
            code="object_above_max_properties",
        )
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ApiError(
                400,
                f"'metadata' keys are at most {METADATA_KEY_CHARS} characters, got {len(key)}",
                param="metadata",
                code="string_above_max_length",
            )
        field = f"metadata.{key}"
        if not isinstance(value, str):
            # Only its kind is shown, as _field shows text: the message is logged.
            got = _TYPE_NAMES.get(type(value), "null" if value is None else "a value")
            raise ApiError(400, f"'{field}' must be a string, got {got}", param=field)
        if len(value) > METADATA_VALUE_CHARS:
            raise ApiError(
                400,
                f"'{field}' is at most {METADATA_VALUE_CHARS} characters, got {len(value)}",
                param=field,
                code="string_above_max_length",
            )


def check_bookkeeping(body: dict[str, Any]) -> None:
    for name, kinds in IGNORED_FIELDS.items():
        json_field(body, name, kinds)  # checked, then without effect (see the README)
    _check_metadata(body.get("metadata") or {})
    if body.get("store"):
        raise ApiError(400, "'store' is not supported: completions are never stored", param="store")


_TYPE_NAMES = {
    str: "a string",
    list: "an array",
    dict: "an object",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
}


def json_field(
    body: dict[str, Any],
    name: str,
    kinds: type | tuple[type, ...],
    *,
    required: bool = False,
    default: Any = None,
) -> Any:
    """`body[name]` checked to be one of `kinds` (None: absent, then `default`)."""
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"'{name}' is required", param=name)
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    is_bool_ok = bool in kinds
    # 5.0 for an integer field, as JSON Schema's "integer" and vLLM (pydantic) take it: a
    # client computing a token budget in floats was refused here alone.
    is_whole = isinstance(value, float) and value.is_integer() and abs(value) <= 2**63
    if int in kinds and float not in kinds and is_whole:
        value = int(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and not is_bool_ok):
        wanted = " or ".join(_TYPE_NAMES[k] for k in kinds)
        # A number is shown, text only by its kind: the message is logged, and a prompt
        # sent as {"p": "..."} must not put its words in the log.
        is_text = isinstance(value, str | list | dict)
        got = _TYPE_NAMES[type(value)] if is_text else json.dumps(value)[:40]
        raise ApiError(400, f"'{name}' must be {wanted}, got {got}", param=name)
    return value
