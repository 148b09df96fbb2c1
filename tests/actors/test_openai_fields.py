"""actors/openai_fields.py: the fields OpenAI defines that change nothing here, checked
as OpenAI checks them (the HTTP answers are in test_http.py's ERROR_CASES)."""

from __future__ import annotations

import pytest

from actors.openai_fields import ApiError, check_bookkeeping


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "null"),  # JSON's null, by its JSON name
        (5, "an integer"),
        (0.5, "a number"),
        (True, "a boolean"),
        ({"a": "b"}, "an object"),
        (["a"], "an array"),
    ],
)
def test_a_metadata_value_not_a_string_is_named_with_its_json_kind(value, shown):
    with pytest.raises(ApiError) as raised:
        check_bookkeeping({"metadata": {"team": "a", "tag": value}})
    error = raised.value
    assert (error.status, error.param) == (400, "metadata.tag")
    assert error.message == f"'metadata.tag' must be a string, got {shown}"


def test_metadata_at_openais_limits_passes_and_one_past_each_is_refused_naming_it():
    """16 pairs, keys of 64 characters, values of 512 (OpenAI's limits, and its codes)."""
    check_bookkeeping({"metadata": {f"{i:064}": "v" * 512 for i in range(16)}})
    check_bookkeeping({"metadata": None})  # null: no metadata, as OpenAI's clients send it
    past = {
        "'metadata' holds at most 16 pairs, got 17": (
            {f"k{i}": "v" for i in range(17)},
            "metadata",
            "object_above_max_properties",
        ),
        "'metadata' keys are at most 64 characters, got 65": (
            {"k" * 65: "v"},
            "metadata",
            "string_above_max_length",
        ),
        "'metadata.k' is at most 512 characters, got 513": (
            {"k": "v" * 513},
            "metadata.k",
            "string_above_max_length",
        ),
    }
    for message, (metadata, param, code) in past.items():
        with pytest.raises(ApiError) as raised:
            check_bookkeeping({"metadata": metadata})
        error = raised.value
        assert (error.status, error.message, error.param, error.code) == (400, message, param, code)
