"""The request checks HTTP and the embedding API share, at the edges of each bound."""

from runtime.errors import RequestError
from runtime.sequence import SamplingParams

import pytest

from actors.requests import GenerateRequest, check_request

CHAT = ({"role": "user", "content": "hi"},)
# The published bounds (/openapi.json), written out: a test reading the constants moves
# with them. Seeds stop at int64 as vLLM's and numpy's; priorities and top_k are int32.
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 4096
MAX_PRIORITY = 2**31 - 1
MAX_SEED, MIN_SEED = 2**63 - 1, -(2**63)
MAX_TOP_LOGPROBS = 20  # OpenAI's


def sampled(**fields):
    return GenerateRequest(prompt="hi", sampling=SamplingParams(**fields))


# The last value inside each bound is taken, the first one past it is refused naming
# the field.
EDGES = [
    ("stop", GenerateRequest(prompt="hi", stop=("s",) * MAX_STOP_STRINGS),
     GenerateRequest(prompt="hi", stop=("s",) * (MAX_STOP_STRINGS + 1))),
    ("stop", GenerateRequest(prompt="hi", stop=("é" * (MAX_STOP_BYTES // 2),)),
     GenerateRequest(prompt="hi", stop=("é" * (MAX_STOP_BYTES // 2) + "s",))),
    ("priority", GenerateRequest(prompt="hi", priority=MAX_PRIORITY),
     GenerateRequest(prompt="hi", priority=MAX_PRIORITY + 1)),
    ("priority", GenerateRequest(prompt="hi", priority=-MAX_PRIORITY),
     GenerateRequest(prompt="hi", priority=-MAX_PRIORITY - 1)),
    ("seed", sampled(seed=MAX_SEED), sampled(seed=MAX_SEED + 1)),
    ("seed", sampled(seed=MIN_SEED), sampled(seed=MIN_SEED - 1)),
    ("logprobs", sampled(logprobs=MAX_TOP_LOGPROBS), sampled(logprobs=MAX_TOP_LOGPROBS + 1)),
    ("logprobs", sampled(logprobs=0), sampled(logprobs=-1)),
    ("temperature", sampled(temperature=2.0), sampled(temperature=2.001)),
    ("presence_penalty", sampled(presence_penalty=-2.0), sampled(presence_penalty=-2.001)),
    ("frequency_penalty", sampled(frequency_penalty=2.0), sampled(frequency_penalty=2.001)),
    ("logit_bias", sampled(logit_bias=((5, -100.0),)), sampled(logit_bias=((5, -100.001),))),
    ("logit_bias", sampled(logit_bias=((0, 100),)), sampled(logit_bias=((-1, 1.0),))),
    ("max_tokens", GenerateRequest(prompt="hi", max_tokens=1),
     GenerateRequest(prompt="hi", max_tokens=0)),
    ("prompt", GenerateRequest(prompt=(0, 1)), GenerateRequest(prompt=(0, -1))),
]  # fmt: skip


@pytest.mark.parametrize(("field", "inside", "past"), EDGES)
def test_the_last_value_inside_a_bound_is_taken_and_the_next_is_refused(field, inside, past):
    check_request(inside)
    with pytest.raises(RequestError) as raised:
        check_request(past)
    assert raised.value.param == field


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (GenerateRequest(prompt="hi", messages=CHAT), "prompt"),  # which one to run?
        (GenerateRequest(prompt="hi", stop=("",)), "stop"),  # would stop at once
        (GenerateRequest(prompt=""), "prompt"),  # nothing to continue
        (
            GenerateRequest(prompt="hi", chat_template_kwargs=(("enable_thinking", True),)),
            "chat_template_kwargs",  # a prompt has no template to pass it to
        ),
    ],
)
def test_a_request_that_means_nothing_runnable_is_refused_naming_the_field(request_, field):
    with pytest.raises(RequestError) as raised:
        check_request(request_)
    assert raised.value.param == field
