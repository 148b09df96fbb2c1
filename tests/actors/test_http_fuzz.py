"""Schemathesis against a live server's /openapi.json: valid and invalid requests alike
get no 5xx, and every 4xx is OpenAI's error object.

Each operation's Hypothesis strategy (positive, then negative: bodies that break the
schema) drives `case.call_and_validate` from a worker thread while the server runs on
the test's trio loop. (schemathesis's `pytest.from_fixture` fails on pytest 9.2.)
"""

import contextlib
import functools
import json
import re

import hypothesis
import jsonschema
import pytest
import requests
import schemathesis
import trio
from schemathesis import GenerationMode

import actors
from actors.choices import DEFAULT_MAX_N
from actors.http_app import ServerState, create_app
from actors.http_server import serving_on_loopback
from actors.openai_requests import ApiError, parse_chat, parse_completion
from actors.openai_tools import MAX_TOOLS
from actors.openapi import OPENAPI
from actors.requests import MAX_PRIORITY, MAX_SEED, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, MIN_SEED

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 3  # generation is the slow part: every valid request stops this soon
MAX_EXAMPLES = 150  # per operation and generation mode
# A schema-valid prompt may still hold token ids past the vocabulary or overflow the
# context; both are the model's, not the document's, so they are 400s the schema allows.
MODEL_DEPENDENT_CHECKS = [schemathesis.checks.positive_data_acceptance]
REFUSALS = [400, 401, 403, 404, 405, 406, 409, 415, 422, 428, 429]  # schemathesis's own


@contextlib.asynccontextmanager
async def serving(checkpoint):
    """A real server on a loopback port, with an API key; yields (url, model name)."""
    state = ServerState()
    app = create_app(state, max_body_bytes=1 << 16, api_keys=(API_KEY,))
    async with (
        serving_on_loopback(app, graceful_timeout=0.1) as url,
        actors.open_llm(checkpoint) as llm,
    ):
        state.llm = llm
        yield url, llm.name


def load_schema(url):
    config = schemathesis.Config.from_dict(
        {
            "generation": {"database": "none"},
            "headers": AUTH,
            # A body past the server's limit is refused whole, before its fields are read:
            # a negative case's hundreds of tools got a 413, which is a refusal too.
            "checks": {"negative_data_rejection": {"expected-statuses": [*REFUSALS, 413]}},
        }
    )
    return schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)


def within_budget(case, model):
    """Aim valid bodies at the served model, and stop their generation after MAX_TOKENS.

    Only values already of the right type are changed, so a negative case stays invalid.
    """
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    limits = [
        name
        for name in ("max_completion_tokens", "max_tokens")
        if type(body.get(name)) is int and body[name] > MAX_TOKENS
    ]
    for name in limits:
        body[name] = MAX_TOKENS
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


def assert_openai_error(response):
    if 400 <= response.status_code < 500:
        body = response.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        assert isinstance(error["message"], str) and error["message"], body
        assert isinstance(error["type"], str), body
        assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), body


def assert_stream_completed(content_type, text, cut_short):
    """A stream's failure is an error event in a 200: as much a server error as a 500.
    schemathesis stops reading a stream after 20 events (`cut_short`): what it read
    must then hold no error, though the [DONE] is past where it stopped."""
    if content_type.startswith("text/event-stream"):
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        if not cut_short:
            assert events[-1] == "data: [DONE]", events[-3:]
            events = events[:-1]
        assert not any(json.loads(e[6:]).get("error") for e in events), events


def fuzz(schema, model):
    """Run every operation's positive, then negative, strategy; returns the number of cases."""
    num_cases = 0

    for result in schema.get_all_operations():
        operation = result.ok()
        # A GET with no parameters has nothing to get wrong.
        modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * bool(operation.body)
        for mode in modes:

            @hypothesis.settings(
                max_examples=MAX_EXAMPLES,
                derandomize=True,  # the same cases on every run, in CI too
                database=None,
                deadline=None,
                suppress_health_check=list(hypothesis.HealthCheck),
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                nonlocal num_cases
                num_cases += 1
                within_budget(case, model)
                response = case.call_and_validate(excluded_checks=MODEL_DEPENDENT_CHECKS)
                assert response.status_code < 500
                assert_openai_error(response)
                assert_stream_completed(
                    response.headers.get("content-type", [""])[0],
                    response.text,
                    response.stream_cut_short,
                )

            check()
    return num_cases


async def test_fuzzed_requests_get_no_5xx_and_every_4xx_is_an_openai_error(tiny):
    async with serving(tiny) as (url, model):
        schema = await trio.to_thread.run_sync(load_schema, url)
        num_cases = await trio.to_thread.run_sync(fuzz, schema, model)
    assert num_cases >= 4 * MAX_EXAMPLES  # the GETs take no input: a case each


async def test_openapi_json_is_valid_open_and_documents_every_route():
    app = create_app(ServerState(), api_keys=("a-key",))
    response = await app.test_client().get("/openapi.json")  # no key: open, like /health
    assert response.status_code == 200
    served = await response.get_json()
    assert served == json.loads(json.dumps(OPENAPI))
    schemathesis.openapi.from_dict(served).validate()
    implicit = {"HEAD", "OPTIONS"}
    routes = {
        (re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method)  # Quart's <path:x> is {x}
        for rule in app.url_map.iter_rules()
        for method in rule.methods - implicit
    }
    documented = {
        (path, method.upper()) for path, item in served["paths"].items() for method in item
    }
    assert routes == documented


# Found while fuzzing. The fuzzer drew the top_k overflow (a 500, or an error event in a
# stream's 200) and the ignored max_tokens; the float overflows (500s) came from probing
# the same parser by hand.
FOUND = {
    "top_k past int32, sampled": ({"top_k": 2**31, "temperature": 0.5}, 200, None),
    "the same, streamed": ({"top_k": 2**31, "temperature": 0.5, "stream": True}, 200, None),
    "temperature too large for a float": ({"temperature": 10**400}, 400, "temperature"),
    "logit bias too large for a float": ({"logit_bias": {"5": -(10**400)}}, 400, "logit_bias"),
    "a bad max_tokens beside a good max_completion_tokens": (
        {"max_tokens": 0, "max_completion_tokens": 2},
        400,
        "max_tokens",
    ),
}


def post(url, body):
    return requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)


async def test_what_the_fuzzer_found_stays_fixed(tiny):
    async with serving(tiny) as (url, model):
        for name, (fields, status, param) in FOUND.items():
            body = {"model": model, "prompt": "hi", "max_tokens": 2, **fields}
            response = await trio.to_thread.run_sync(post, url, body)
            assert response.status_code == status, (name, response.text)
            if param is not None:
                assert response.json()["error"]["param"] == param, name
            assert_stream_completed(
                response.headers["content-type"], response.text, cut_short=False
            )
        # The schemathesis CLI's probe of undeclared methods found this 405 without Allow.
        response = await trio.to_thread.run_sync(
            functools.partial(requests.put, f"{url}/v1/models", headers=AUTH, timeout=30)
        )
        assert response.status_code == 405 and "GET" in response.headers["allow"].split(", ")
        assert_openai_error(response)


def documented(schema_name):
    """A validator for one of the document's schemas (its $refs resolved in the document)."""
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": OPENAPI["components"]}
    return jsonschema.Draft202012Validator(root)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
TOOL = {"type": "function", "function": {"name": "f"}}
TOOLS = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
# (request, field, a value at the edge of what the parser takes, one just past it)
EDGES = [
    (COMPLETION, "max_tokens", 1, 0),
    (COMPLETION, "temperature", 2, 2.01),
    (COMPLETION, "temperature", 0, -0.01),
    (COMPLETION, "top_p", 0.01, 0),
    (COMPLETION, "top_k", -1, -2),
    (COMPLETION, "seed", MAX_SEED, MAX_SEED + 1),
    (COMPLETION, "seed", MIN_SEED, MIN_SEED - 1),
    (COMPLETION, "logit_bias", {"5": -100}, {"5": -101}),
    (COMPLETION, "stop", ["s"] * MAX_STOP_STRINGS, ["s"] * (MAX_STOP_STRINGS + 1)),
    (COMPLETION, "n", DEFAULT_MAX_N, DEFAULT_MAX_N + 1),
    ({**COMPLETION, "n": 2}, "best_of", None, 1),
    ({**CHAT, "n": 2}, "best_of", None, 1),
    (COMPLETION, "priority", -MAX_PRIORITY, -MAX_PRIORITY - 1),
    (COMPLETION, "logprobs", MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS + 1),
    (COMPLETION, "prompt", [0], [-1]),
    (COMPLETION, "prompt", ["a", [1]], ["a", 1]),
    (COMPLETION, "echo", False, True),
    (COMPLETION, "suffix", "", "x"),
    (COMPLETION, "stream_options", None, {"include_usage": True}),
    (
        {**COMPLETION, "stream": True},
        "stream_options",
        {"include_usage": True, "include_obfuscation": False},
        {"continuous_usage_stats": True},
    ),
    (COMPLETION, "no_such_field", None, 1),
    (CHAT, "no_such_field", None, 1),
    (CHAT, "messages", CHAT["messages"], []),
    (CHAT, "messages", [{"role": "developer"}], [{"role": "function"}]),
    (CHAT, "top_logprobs", None, 2),
    (CHAT, "guided_regex", "a", ""),
    (CHAT, "guided_choice", ["a"], []),
    (CHAT, "structured_outputs", {"regex": "a"}, {"regex": "a", "choice": ["a"]}),
    (CHAT, "structured_outputs", {"regex": "a"}, {"pattern": "a"}),
    (CHAT, "tools", TOOLS[:MAX_TOOLS], TOOLS),
    (CHAT, "tools", [TOOL], [TOOL, TOOL]),  # a name twice: which would a call be?
    (CHAT, "tools", [TOOL], [{"type": "function", "function": {"name": ""}}]),
    (CHAT, "tools", [TOOL], [{**TOOL, "strict": True}]),
    (CHAT, "tools", [TOOL], [{"type": "function", "function": {"name": "f", "paramters": {}}}]),
    ({**CHAT, "tools": [TOOL]}, "tool_choice", "required", "any"),
    (CHAT, "response_format", {"type": "text"}, {"type": "xml"}),
    (CHAT, "response_format", {"type": "json_object"}, {"type": "json_object", "schema": {}}),
    (
        CHAT,
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        {"type": "json_schema", "json_schema": {"schema": {}}},
    ),
    (
        CHAT,
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "My schema: Page[Item]"}},
        {"type": "json_schema", "json_schema": {"name": ["a"]}},
    ),
    (COMPLETION, "max_tokens", 5.0, 5.5),  # JSON Schema's integers, as vLLM takes them
    # OpenAI's metadata: strings to strings, 16 pairs, keys of 64 and values of 512 at most.
    (COMPLETION, "metadata", {"k": "v"}, {"k": 5}),
    (CHAT, "metadata", {f"k{i}": "v" for i in range(16)}, {f"k{i}": "v" for i in range(17)}),
    (COMPLETION, "metadata", {"k" * 64: "v"}, {"k" * 65: "v"}),
    (COMPLETION, "metadata", {"k": "v" * 512}, {"k": "v" * 513}),
    (COMPLETION, "metadata", {}, "k"),  # an object, not just any value
    # Seed-OSS's thinking budget: -1 (no limit) to 2^31 - 1 tokens.
    (CHAT, "chat_template_kwargs", {"thinking_budget": -1}, {"thinking_budget": -2}),
    (CHAT, "chat_template_kwargs", {"thinking_budget": 2**31 - 1}, {"thinking_budget": 2**31}),
    (CHAT, "chat_template_kwargs", {"thinking_budget": 0}, {"thinking_budget": "512"}),
    (
        CHAT,
        "messages",
        [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}],
        [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
    ),
    (
        CHAT,
        "tools",
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
    ),
]


@pytest.mark.parametrize(("base", "field", "edge", "past"), EDGES)
def test_the_document_takes_a_value_exactly_when_the_parser_does(base, field, edge, past):
    """The fuzzer cannot check that schema-valid bodies are accepted (a prompt may still
    overflow the model), so a document looser than the parser passes it: edges here."""
    is_chat = "messages" in base
    kind = "ChatCompletionRequest" if is_chat else "CompletionRequest"
    parse = parse_chat if is_chat else parse_completion
    at_edge = {**base, field: edge} if edge is not None else base
    assert documented(kind).is_valid(at_edge)
    parse(at_edge)
    assert not documented(kind).is_valid({**base, field: past})
    with pytest.raises(ApiError) as refused:
        parse({**base, field: past})
    assert refused.value.param.startswith(field)
