"""The request parser's own messages, without a server (HTTP cases: test_http.py)."""

from runtime.errors import CadenceError, CapacityError
from runtime.sequence import SamplingParams

import attrs
import pytest

from actors.openai_requests import ApiError, parse_chat, parse_completion, parse_json
from actors.requests import GenerateRequest


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


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\uDFFF", b"\\uDbFf", b"x\\ud83d"])
def test_a_lone_surrogate_escape_is_refused_however_its_hex_is_cased(escape):
    with pytest.raises(ApiError) as raised:
        parse_json(b'{"model": "m", "prompt": "' + escape + b'"}')
    assert raised.value.message == "the request body contains an unpaired UTF-16 surrogate escape"


def test_a_paired_surrogate_escape_and_a_spelled_out_backslash_u_are_taken():
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}
    assert parse_json(b'{"prompt": "\\\\ud800"}') == {"prompt": "\\ud800"}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_max_completion_tokens_wins_over_max_tokens_and_both_are_checked():
    both = parse_chat({**CHAT, "max_tokens": 5, "max_completion_tokens": 2})
    assert both.request.max_tokens == 2  # OpenAI's newer name
    assert parse_chat({**CHAT, "max_tokens": 5}).request.max_tokens == 5
    with pytest.raises(ApiError) as raised:
        parse_chat({**CHAT, "max_tokens": 0, "max_completion_tokens": 2})
    assert raised.value.param == "max_tokens"


def test_a_whole_number_written_as_a_float_is_an_integer_as_json_schema_and_vllm_take_it():
    """`"max_tokens": 5.0` is an integer to JSON Schema (and to /openapi.json) and to
    vLLM's pydantic; it was a 400 here alone."""
    parsed = parse_chat({**CHAT, "max_tokens": 5.0, "n": 2.0, "seed": -3.0, "top_k": 4.0})
    request = parsed.request
    assert (request.max_tokens, parsed.n, request.sampling.seed, request.sampling.top_k) == (
        5,
        2,
        -3,
        4,
    )
    assert type(request.max_tokens) is int
    for field, value in (("max_tokens", 5.5), ("n", float("inf")), ("seed", 1e300)):
        with pytest.raises(ApiError) as raised:
            parse_chat({**CHAT, field: value})
        assert raised.value.param == field


@pytest.mark.parametrize("top_k", [-1, 0, 2**40])
def test_top_k_of_minus_one_or_past_any_vocabulary_is_off(top_k):
    # -1 is what OpenAI-compatible clients commonly send for "off"
    assert parse_chat({**CHAT, "top_k": top_k}).request.sampling.top_k == 0


def test_an_unknown_stream_option_is_refused_naming_it_and_openais_are_accepted():
    stream = {**CHAT, "stream": True}
    # vLLM's usage in every chunk: dropped silently, its client would wait for it.
    with pytest.raises(ApiError) as raised:
        parse_chat({**stream, "stream_options": {"continuous_usage_stats": True}})
    assert raised.value.status == 400
    assert (raised.value.param, raised.value.code) == (
        "stream_options.continuous_usage_stats",
        "unknown_field",
    )
    options = {"include_usage": True, "include_obfuscation": False}
    assert parse_chat({**stream, "stream_options": options}).include_usage
    with pytest.raises(ApiError) as raised:
        parse_chat({**stream, "stream_options": {"include_obfuscation": "no"}})
    assert raised.value.param == "stream_options.include_obfuscation"


@pytest.mark.parametrize("error", [CadenceError("engine broke"), CapacityError("pool too small")])
def test_an_error_with_no_mapping_of_its_own_is_a_500_that_keeps_its_message(error):
    api_error = ApiError.from_error(error)
    assert api_error.status == 500
    assert api_error.body()["error"]["message"] == str(error)
    assert api_error.body()["error"]["type"] == "server_error"


@pytest.mark.parametrize("name", ["tools", "tool_choice", "functions", "function_call"])
def test_tool_fields_on_a_completion_are_refused_as_chat_only(name):
    value = "auto" if name in ("tool_choice", "function_call") else []
    with pytest.raises(ApiError) as caught:
        parse_completion({"model": "m", "prompt": "x", name: value})
    assert caught.value.status == 400 and caught.value.param == name
    assert caught.value.message == f"'{name}' applies to chat only"


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        ([1, "x"], "prompt"),
        ([1, True], "prompt"),
        ([1, 2.0], "prompt"),
        ([[1, 2], ["a"]], "prompt[1]"),  # a batch: its prompt is named
        (["a", 1], "prompt"),
    ],
)
def test_a_completion_prompt_list_is_token_ids_or_a_batch_of_prompts_only(prompt, param):
    with pytest.raises(ApiError) as caught:
        parse_completion({"model": "m", "prompt": prompt})
    assert caught.value.status == 400 and caught.value.param == param
    assert "a list of token ids" in caught.value.message


@pytest.mark.parametrize(("prompt", "tokens"), [([5, 6, 7], (5, 6, 7)), ([[5, 6]], (5, 6))])
def test_a_completion_prompt_of_token_ids_or_a_batch_of_one_is_read(prompt, tokens):
    parsed = parse_completion({"model": "m", "prompt": prompt})
    assert parsed.request.prompt == tokens and parsed.more_prompts == ()


def test_a_batch_of_prompts_is_one_request_each_in_order_sharing_the_other_fields():
    """OpenAI's and vLLM's completions take a list of prompts (LangChain's OpenAI.batch
    and litellm send one); it was a 400."""
    parsed = parse_completion({"model": "m", "prompt": ["a", [5, 6], "b"], "max_tokens": 3, "n": 2})
    assert [r.prompt for r in parsed.requests] == ["a", (5, 6), "b"]
    assert {(r.max_tokens, parsed.n) for r in parsed.requests} == {(3, 2)}
    assert parsed.requests[1] == attrs.evolve(parsed.request, prompt=(5, 6))


@pytest.mark.parametrize("prompt", [None, "absent"])
def test_a_completion_without_a_prompt_is_refused_naming_it(prompt):
    body = {"model": "m"} if prompt == "absent" else {"model": "m", "prompt": prompt}
    with pytest.raises(ApiError) as caught:
        parse_completion(body)
    assert (caught.value.status, caught.value.param) == (400, "prompt")
    assert caught.value.message == "'prompt' is required"


def test_a_minimal_chat_body_reads_as_the_defaults_an_empty_request_has():
    """Every field left out is what GenerateRequest and SamplingParams default to (an unset
    temperature is 0, as mlx-lm's server: README), so a request that names them at those
    values ranks and samples the same."""
    parsed = parse_chat(CHAT)
    assert parsed.request == GenerateRequest(messages=parsed.request.messages)
    assert parsed.request.sampling == SamplingParams(temperature=0.0)
    assert (parsed.n, parsed.parallel_tool_calls, parsed.include_usage) == (1, True, False)
    explicit = parse_chat({**CHAT, "priority": 0, "n": 1, "temperature": 0, "top_p": 1.0})
    assert explicit.request == parsed.request


def test_best_of_must_be_at_least_n_as_openai_asks_and_only_one_is_run():
    COMPLETION = {"model": "m", "prompt": "x"}
    assert parse_completion({**COMPLETION, "best_of": 1}).n == 1
    assert parse_completion({**COMPLETION, "n": 3}).n == 3  # best_of left out: n alone
    for fields in ({"n": 2, "best_of": 1}, {"best_of": 2}):
        with pytest.raises(ApiError) as raised:
            parse_completion({**COMPLETION, **fields})
        assert (raised.value.status, raised.value.param) == (400, "best_of")


def test_a_logit_bias_key_of_many_digits_is_an_id_out_of_range_and_leading_zeros_are_dropped():
    """23 digits read as "maps token ids to numbers", as if the key were not a number."""
    many = parse_completion({"model": "m", "prompt": "x", "logit_bias": {"9" * 23: 1, "0" * 20 + "5": 2}})
    assert many.request.sampling.logit_bias == ((5, 2.0), (10**10, 1.0))


def test_an_integer_past_pythons_digit_limit_is_named_without_pythons_advice():
    with pytest.raises(ApiError) as raised:
        parse_json(b'{"model": "m", "seed": ' + b"7" * 5000 + b"}")
    assert raised.value.message == "the request body has an integer of more than 4,300 digits"


@pytest.mark.parametrize(
    ("value", "got"),
    [({"p": "SECRET words"}, "an object"), (["SECRET"], "an array"), ("SECRET", "a string"), (5.5, "5.5")],
)
def test_a_value_of_the_wrong_type_is_named_by_its_kind_so_no_prompt_text_reaches_the_log(value, got):
    with pytest.raises(ApiError) as raised:
        parse_completion({"model": "m", "prompt": "x", "max_tokens": value})
    assert raised.value.message == f"'max_tokens' must be an integer, got {got}"
    with pytest.raises(ApiError) as raised:
        parse_completion({"model": "m", "prompt": {"p": value}})
    assert "SECRET" not in raised.value.message
