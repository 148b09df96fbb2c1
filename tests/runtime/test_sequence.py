"""`check_sequence`, the one gate every request passes before it may take a row: its
bounds, each at its edge."""

from runtime.errors import RequestError
from runtime.sequence import (
    GREEDY_BELOW,
    FinishCause,
    SamplingParams,
    SequenceParams,
    check_sequence,
)

import pytest

VOCAB, CONTEXT = 100, 64


def check(prompt=(1, 2, 3), max_tokens=8, logit_bias=(), kv_tokens=None):
    sampling = SamplingParams(logit_bias=tuple(logit_bias))
    params = SequenceParams(prompt_tokens=tuple(prompt), max_tokens=max_tokens, sampling=sampling)
    check_sequence(params, max_context=CONTEXT, vocab_size=VOCAB, kv_tokens=kv_tokens)


def refusal(**kwargs) -> RequestError:
    with pytest.raises(RequestError) as raised:
        check(**kwargs)
    return raised.value


def test_a_sequence_may_fill_the_context_exactly_and_not_one_token_more():
    check(prompt=[1] * 60, max_tokens=4)
    error = refusal(prompt=[1] * 60, max_tokens=5)
    assert (error.code, error.param) == ("context_length_exceeded", "max_tokens")
    check(prompt=[1] * 63, max_tokens=None)  # no max_tokens: room for one token will do
    assert refusal(prompt=[1] * 64, max_tokens=None).param == "prompt"
    # A prompt that leaves no room for one token is the prompt's fault, whatever max_tokens.
    assert refusal(prompt=[1] * 64, max_tokens=5).param == "prompt"
    assert refusal(prompt=[1] * 63, max_tokens=5).param == "max_tokens"


def test_a_context_refusal_says_what_the_prompt_has_and_max_tokens_asks_for():
    said = str(refusal(prompt=[1] * 60, max_tokens=5))
    assert said == (
        f"this model's maximum context length is {CONTEXT} tokens; the prompt has 60 tokens "
        "and max_tokens asks for 5 more"
    )
    assert str(refusal(prompt=[1] * 64, max_tokens=None)).endswith(
        "the prompt has 64 tokens and max_tokens asks for at least 1 more"
    )


def test_the_kv_budget_is_named_when_it_is_the_bound():
    assert "--kv-budget" in str(refusal(prompt=[1] * 60, max_tokens=5, kv_tokens=CONTEXT))
    assert "--kv-budget" not in str(refusal(prompt=[1] * 60, max_tokens=5, kv_tokens=10_000))


@pytest.mark.parametrize("token", [-1, VOCAB, VOCAB + 1])
def test_a_prompt_token_outside_the_vocabulary_is_refused(token):
    check(prompt=[0, VOCAB - 1])
    assert refusal(prompt=[0, token]).param == "prompt"


@pytest.mark.parametrize("token", [-1, VOCAB])
def test_a_logit_bias_outside_the_vocabulary_is_refused(token):
    check(logit_bias=[(0, 1.0), (VOCAB - 1, -1.0)])
    assert refusal(logit_bias=[(token, 1.0)]).param == "logit_bias"


def test_an_empty_prompt_and_a_max_tokens_below_one_are_refused():
    assert refusal(prompt=[]).param == "prompt"
    assert refusal(max_tokens=0).param == "max_tokens"
    assert str(refusal(max_tokens=-3)) == "'max_tokens' must be at least 1"
    check(max_tokens=1)


def test_a_token_id_refusal_names_the_vocabularys_range():
    assert str(refusal(prompt=[VOCAB])) == f"token ids in 'prompt' must be in 0..{VOCAB - 1}"
    said = str(refusal(logit_bias=[(-1, 1.0)]))
    assert said == f"logit_bias keys must be token ids in 0..{VOCAB - 1}"


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.3}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.25},
     {"presence_penalty": -0.5}],
)
def test_any_one_penalty_turns_penalties_on(penalty):
    assert SamplingParams(**penalty).has_penalties
    assert not SamplingParams(temperature=1.0, top_k=5, logit_bias={3: 1.0}).has_penalties


def test_a_temperature_is_greedy_only_under_greedy_below():
    assert SamplingParams().is_greedy and SamplingParams(temperature=GREEDY_BELOW / 2).is_greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).is_greedy


def test_equal_logit_biases_compare_equal_however_given():
    by_mapping = SamplingParams(logit_bias={7: -1.0, 2: 0.5})
    by_pairs = SamplingParams(logit_bias=[(2, 0.5), (7, -1)])
    assert by_mapping == by_pairs and by_mapping.logit_bias == ((2, 0.5), (7, -1.0))


@pytest.mark.parametrize(
    ("cause", "reason"),
    [(FinishCause.ERROR, "error"), (FinishCause.EOS, "stop"), (FinishCause.STOP_SEQUENCE, "stop"),
     (FinishCause.LENGTH, "length"), (FinishCause.CONTEXT_EXHAUSTED, "length"),
     (FinishCause.REPETITION_LOOP, "stop")],
)
def test_each_finish_cause_reports_its_openai_reason(cause, reason):
    assert cause.openai_reason == reason


@pytest.mark.parametrize("bias", [[1], 5, [(1, 2, 3)]])
def test_a_logit_bias_that_is_no_pairs_is_refused_saying_what_it_must_be(bias):
    """It said "cannot unpack non-iterable int object" through the embedding API."""
    with pytest.raises(TypeError, match="logit_bias must map token ids to biases"):
        SamplingParams(logit_bias=bias)
