"""KV budget parsing: the --kv-budget values a user types."""

from runtime.kv.paged import parse_kv_budget

import pytest


@pytest.mark.parametrize(
    ("text", "value"),
    [("2GiB", 2 << 30), ("512MB", 512 * 10**6), (" 8 gib ", 8 << 30), ("1073741824", 1 << 30),
     ("0.3", 0.3), ("2.5KiB", 2560), ("0.0001KiB", 1)],  # a sliver of a unit: one byte
)
def test_bytes_and_fractions(text, value):
    assert parse_kv_budget(text) == value


@pytest.mark.parametrize("text", ["abc", "-1", "0", "0.0", "1.0", "1.5", "inf", "nan", "1e9", "5 TB", "0KiB", ""])
def test_anything_else_is_a_clear_error(text):
    with pytest.raises(ValueError, match="KV budget"):
        parse_kv_budget(text)
