"""The request parser's own messages, without a server (HTTP cases: test_http.py)."""

import pytest

from actors.openai_requests import ApiError, parse_json


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b'{"model": "m", "prompt": "x', "Unterminated string starting at: line 1 column 26"),
        (b'{"model": ', "Expecting value: line 1 column 11"),
        (b'{"model": "m"} x', "Extra data: line 1 column 16"),
    ],
)
def test_a_body_that_is_not_json_says_what_and_where_once(body, said):
    with pytest.raises(ApiError) as raised:
        parse_json(body)
    assert raised.value.status == 400
    assert raised.value.message == f"the request body is not valid JSON: {said}"
