"""The pieces of `n` that need no server: per-choice seeds and the combined usage."""

from runtime.sequence import SamplingParams

from actors.choices import choice_requests, combined_usage
from actors.requests import MAX_SEED, GenerateRequest, Usage, check_request


def test_choice_i_samples_with_seed_plus_i_and_stays_a_valid_seed():
    request = GenerateRequest(prompt="x", sampling=SamplingParams(temperature=1.0, seed=MAX_SEED))
    choices = choice_requests(request, 3)
    assert [c.sampling.seed for c in choices] == [MAX_SEED, 0, 1]  # wraps within [0, 2**63)
    assert all(check_request(c) for c in choices)
    assert all(c.sampling.temperature == 1.0 and c.prompt == "x" for c in choices)


def test_unseeded_choices_are_the_request_itself():
    request = GenerateRequest(prompt="x", sampling=SamplingParams(temperature=0.7))
    assert choice_requests(request, 4) == [request] * 4


def test_usage_counts_the_prompt_once_and_sums_the_completions():
    usage = combined_usage([Usage(100, 7, 0), Usage(100, 9, 96), Usage(100, 3, 96)])
    assert usage == Usage(prompt_tokens=100, completion_tokens=19, cached_tokens=0)
    assert usage.total_tokens == 119
