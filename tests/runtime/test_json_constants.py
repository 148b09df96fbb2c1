import json
import math
import random
import time

from runtime.json_constants import NonFiniteAsNull, with_non_finite_as_null

import pytest

SPECIAL = [math.nan, math.inf, -math.inf]


def random_text(rng):  # the values' letters, quotes and escapes, inside strings
    return "".join(rng.choice('NaIfity-"\\ :,[]') for _ in range(rng.randint(0, 10)))


def random_value(rng, depth=0):
    kind = rng.choice(["str", "num", "list", "dict"] if depth < 3 else ["str", "num"])
    if kind == "str":
        return random_text(rng)
    if kind == "num":
        return rng.choice([*SPECIAL, 0, -1, 2.5, True, None])
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {random_text(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [finite(v) for v in value]
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return value


def fed(text, cuts):
    literals, out, start = NonFiniteAsNull(), "", 0
    for cut in [*sorted(cuts), len(text)]:
        out, start = out + literals.feed(text[start:cut]), cut
    return out + literals.finish()


def test_non_finite_values_become_null_whatever_the_split():
    rng = random.Random(0)
    for _ in range(300):
        value = random_value(rng)
        text = json.dumps(value, separators=rng.choice([(",", ":"), (", ", ": ")]))
        expected = with_non_finite_as_null(text)
        assert json.loads(expected, parse_constant=pytest.fail) == finite(value), text
        for _ in range(5):
            cuts = rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(1, 6)))
            assert fed(text, cuts) == expected, (text, cuts)


@pytest.mark.parametrize(
    "text",
    ['a=NaNa', "BaNaNa", "x-Infinity", '"NaN"', '"\\"NaN"', "NaNo", "-1", "Inf", '-", NaN, "...'],
)
def test_what_is_no_non_finite_value_stays(text):
    assert with_non_finite_as_null(text) == text
    assert fed(text, range(1, len(text))) == text


@pytest.mark.parametrize("text", ['{"a": "x, NaN, y"}', '["\\", NaN, -Infinity]"]', '{"k": ": Infinity}"}'])
def test_a_string_that_holds_what_reads_as_a_value_stays(text):
    """Inside a string (escaped quotes and all) `, NaN,` is text, not a value."""
    assert json.loads(text)  # a string holds it
    assert with_non_finite_as_null(text) == text
    assert fed(text, range(1, len(text))) == text


def test_long_arguments_take_linear_time_whole_as_in_pieces():
    # Each '-' or 'N' where a value may begin once copied the rest of the text to see
    # whether it could still grow into -Infinity or NaN: 1 MB of [-1, -1, ...] took
    # seconds whole, though fed in pieces it takes a fraction of one.
    text = "[" + ", ".join(["-1"] * 250_000) + "]"
    started = time.perf_counter()
    assert fed(text, range(1000, len(text), 1000)) == text
    in_pieces = time.perf_counter() - started
    started = time.perf_counter()
    assert with_non_finite_as_null(text) == text
    assert time.perf_counter() - started < 5 * in_pieces + 0.5
