"""The pieces of `n` that need no server: per-choice seeds, admission and the combined usage."""

import types

from runtime.errors import RequestError
from runtime.sequence import SamplingParams

import attrs
import pytest
import trio

from actors.choices import choice_requests, combined_usage, interleaved, start_together
from actors.openai_requests import ApiError, parse_completion
from actors.requests import (
    MAX_SEED,
    MIN_SEED,
    GenerateRequest,
    OverloadedError,
    ServiceClosedError,
    SiblingRefusedError,
    Usage,
    check_request,
)


def test_choice_i_samples_with_seed_plus_i_and_stays_a_valid_seed():
    request = GenerateRequest(prompt="x", sampling=SamplingParams(temperature=1.0, seed=MAX_SEED))
    choices = choice_requests(request, 3)
    assert [c.sampling.seed for c in choices] == [MAX_SEED, MIN_SEED, MIN_SEED + 1]  # int64's wrap
    assert all(check_request(c) for c in choices)
    negative = attrs.evolve(request, sampling=attrs.evolve(request.sampling, seed=-2))
    assert [c.sampling.seed for c in choice_requests(negative, 3)] == [-2, -1, 0]
    assert all(c.sampling.temperature == 1.0 and c.prompt == "x" for c in choices)


def test_two_seeded_choices_sample_with_different_seeds_and_one_keeps_its_own():
    request = GenerateRequest(prompt="x", sampling=SamplingParams(temperature=1.0, seed=5))
    assert [c.sampling.seed for c in choice_requests(request, 2)] == [5, 6]
    assert choice_requests(request, 1) == [request]


def test_unseeded_choices_are_the_request_itself():
    request = GenerateRequest(prompt="x", sampling=SamplingParams(temperature=0.7))
    assert choice_requests(request, 4) == [request] * 4


def test_usage_counts_the_prompt_once_and_sums_the_completions():
    usage = combined_usage([Usage(100, 7, 0), Usage(100, 9, 96), Usage(100, 3, 96)], 3)
    assert usage == Usage(prompt_tokens=100, completion_tokens=19, cached_tokens=0)
    assert usage.total_tokens == 119


def test_usage_of_a_batch_of_prompts_counts_each_prompt_once_with_its_own_cache():
    prompt_a = [Usage(10, 3, 0), Usage(10, 4, 8)]  # n=2: choices 0 and 1
    prompt_b = [Usage(20, 5, 16), Usage(20, 6, 16)]  # choices 2 and 3
    usage = combined_usage(prompt_a + prompt_b, 2)
    assert usage == Usage(prompt_tokens=30, completion_tokens=18, cached_tokens=16)


def test_one_choices_usage_is_its_own():
    assert combined_usage([Usage(100, 7, 48)], 1) == Usage(100, 7, 48)


class FakeChoice:
    def __init__(self, log, name, fails=False):
        self.log, self.name, self.fails = log, name, fails

    def submit(self, group=None):
        self.log.append(("submit", self.name))
        self.group = group

    async def start(self):
        if self.fails:
            raise self.fails if isinstance(self.fails, Exception) else RequestError("bad", param="prompt")
        self.log.append(("start", self.name))

    cancel_cause = "cancelled"

    async def aclose(self, cause="cancelled"):
        self.log.append(("close", self.name))


async def test_one_choice_failing_to_start_aborts_every_choice_queued_with_it():
    log = []
    choices = [FakeChoice(log, 0), FakeChoice(log, 1, fails=True), FakeChoice(log, 2)]
    llm = types.SimpleNamespace(max_waiting=8, num_waiting=0)
    with pytest.raises(RequestError):
        await start_together(llm, choices)
    # All three were queued (one go, no await between); the failure closes all of them,
    # so none is left waiting for a slot or decoding for nobody.
    assert [e for e in log if e[0] == "submit"] == [("submit", i) for i in range(3)]
    assert sorted(e for e in log if e[0] == "close") == [("close", i) for i in range(3)]
    assert choices[0].group is choices[2].group is not None  # admitted together or refused together


async def test_the_refusal_raised_is_the_one_of_its_own_not_the_ones_it_caused():
    """Admission refuses a refused choice's siblings too (AdmitGroup); which choice
    is named (a batch's `prompt[i]`) must be the one refused for itself."""
    log, own = [], RequestError("too long", param="prompt")
    caused = [SiblingRefusedError("another request admitted with it was refused") for _ in range(2)]
    choices = [FakeChoice(log, 0, caused[0]), FakeChoice(log, 1, own), FakeChoice(log, 2, caused[1])]
    with pytest.raises(RequestError) as raised:
        await start_together(types.SimpleNamespace(max_waiting=8, num_waiting=0), choices)
    assert raised.value is own


async def test_a_choice_refused_at_submit_refuses_the_siblings_queued_before_it():
    """The first choice is queued, waiting in admission for its group (AdmitGroup); if
    the second's submit is refused (a server that began draining), the group must be
    refused too, or the first waits there for ever, holding its waiting slot."""

    class RefusedAtSubmit(FakeChoice):
        def submit(self, group=None):
            raise ServiceClosedError("the server is shutting down")

    class Queued(FakeChoice):
        cancel_cause = "disconnected"  # as the HTTP app's choices are

        async def aclose(self, cause="cancelled"):
            self.log.append(("close", self.name, cause))

    log = []
    choices = [Queued(log, 0), RefusedAtSubmit(log, 1), Queued(log, 2)]
    with pytest.raises(ServiceClosedError):
        await start_together(queue(8, 0), choices)
    assert choices[0].group.is_refused and choices[0].group.settled.is_set()
    assert [e for e in log if e[0] == "close"] == [("close", 0, "disconnected"), ("close", 1), ("close", 2, "disconnected")]


class FakeStream:
    """A running choice: its deltas, then its error if it fails; how it was closed."""

    def __init__(self, closed, name, deltas, error=None):
        self.closed, self.name, self.deltas, self.error = closed, name, deltas, error

    async def __aiter__(self):
        for delta in self.deltas:
            yield delta
        if self.error is not None:
            raise self.error
        await trio.sleep_forever()  # still generating

    async def aclose(self, cause="cancelled"):
        self.closed.append((self.name, cause))


async def test_a_choice_that_fails_sends_its_error_and_leaving_aborts_the_others_as_disconnected():
    """The reader learns of a failed choice (it fails the whole response), and leaving
    aborts every choice as disconnected: the scheduler then reports a row whose reader
    left while its last tokens were computed (actors/scheduler.py), which it does not for
    a plain cancel."""
    closed, error = [], RequestError("the grammar refused a token")
    generations = [FakeStream(closed, 0, ["a"]), FakeStream(closed, 1, ["b"], error)]
    received = []
    with trio.fail_after(10):  # an error swallowed leaves the reader waiting on choice 0
        async with interleaved(generations) as events:
            async for event in events:
                received.append(event)
                if isinstance(event[1], RequestError):
                    break
    assert (1, error) in received and (0, "a") in received
    assert sorted(closed) == [(0, "disconnected"), (1, "disconnected")]


def queue(max_waiting, num_waiting):
    return types.SimpleNamespace(max_waiting=max_waiting, num_waiting=num_waiting)


async def test_choices_that_exactly_fill_the_free_waiting_slots_are_all_admitted():
    log = []
    await start_together(queue(4, 1), [FakeChoice(log, i) for i in range(3)])
    assert log == [("submit", i) for i in range(3)] + [("start", i) for i in range(3)]
    log.clear()
    await start_together(queue(3, 0), [FakeChoice(log, i) for i in range(3)])  # the whole queue
    assert [e for e in log if e[0] == "start"] == [("start", i) for i in range(3)]


async def test_more_choices_than_free_slots_are_overloaded_and_none_is_queued():
    log = []
    with pytest.raises(OverloadedError):  # a 503: retrying later can succeed
        await start_together(queue(3, 1), [FakeChoice(log, i) for i in range(3)])
    assert log == []


async def test_more_choices_than_the_queue_holds_are_a_request_error_naming_n():
    log = []
    with pytest.raises(RequestError) as refused:  # a 400: retrying cannot help
        await start_together(queue(3, 0), [FakeChoice(log, i) for i in range(4)])
    assert refused.value.param == "n" and "n=4" in str(refused.value)
    assert log == []


def test_n_is_at_most_8_by_default():
    body = {"model": "m", "prompt": "x"}
    assert parse_completion(body | {"n": 8}).n == 8
    with pytest.raises(ApiError) as refused:
        parse_completion(body | {"n": 9})
    assert refused.value.param == "n"
