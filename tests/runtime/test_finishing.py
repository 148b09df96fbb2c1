"""finish_step's documented order, and the repetition-loop detector."""

from runtime.finishing import finish_step, first_cause, is_repetition_loop
from runtime.sequence import FinishCause

BASE = dict(max_tokens=10, context_length=20, max_context=100, eos_ids=frozenset({2}))


def test_nothing_applies():
    assert finish_step(token=5, num_generated=1, tokens=[9, 5], **BASE) is None


def test_order_error_eos_length_context_loop():
    loop = [1, 2] * 20
    everything = dict(BASE, max_tokens=1, context_length=100, repetition_window=8)
    assert finish_step(token=None, num_generated=len(loop), tokens=loop, **everything) is FinishCause.ERROR
    assert finish_step(token=2, num_generated=len(loop), tokens=loop, **everything) is FinishCause.EOS
    assert finish_step(token=1, num_generated=len(loop), tokens=loop, **everything) is FinishCause.LENGTH
    everything["max_tokens"] = None
    assert finish_step(token=1, num_generated=len(loop), tokens=loop, **everything) is FinishCause.CONTEXT_EXHAUSTED
    everything["context_length"] = 50
    assert finish_step(token=1, num_generated=len(loop), tokens=loop, **everything) is FinishCause.REPETITION_LOOP


def test_repetition_loop_detector():
    assert is_repetition_loop([7] * 40, 16)
    assert is_repetition_loop([1, 2, 3] * 10, 16)
    assert not is_repetition_loop(list(range(40)), 16)
    assert not is_repetition_loop([1, 2, 3, 4, 5] * 10, 16)  # period 5 > 16 // 4
    assert not is_repetition_loop([7] * 10, 16)  # not enough tokens yet
    # The smallest window allows period 1 only: one token over and over.
    assert is_repetition_loop([7] * 5, 4)
    assert not is_repetition_loop([7, 8] * 4, 4)


def test_openai_reasons():
    assert FinishCause.EOS.openai_reason == "stop"
    assert FinishCause.STOP_SEQUENCE.openai_reason == "stop"
    assert FinishCause.CONTEXT_EXHAUSTED.openai_reason == "length"
    assert FinishCause.LENGTH.openai_reason == "length"


def test_first_cause_follows_the_same_order():
    assert first_cause(None, None) is None
    assert first_cause(FinishCause.LENGTH, FinishCause.STOP_SEQUENCE) is FinishCause.STOP_SEQUENCE
    assert first_cause(FinishCause.EOS, FinishCause.STOP_SEQUENCE) is FinishCause.EOS
    assert first_cause(None, FinishCause.REPETITION_LOOP) is FinishCause.REPETITION_LOOP


def test_a_loop_in_the_prompt_alone_does_not_count():
    prompt_loop, limits = [7] * 40, dict(BASE, max_tokens=None)
    assert finish_step(token=7, num_generated=2, tokens=prompt_loop, repetition_window=16, **limits) is None
    assert (
        finish_step(token=7, num_generated=20, tokens=prompt_loop, repetition_window=16, **limits)
        is FinishCause.REPETITION_LOOP
    )


def test_the_max_tokens_th_token_is_the_last():
    limits = dict(BASE, max_tokens=3)
    assert finish_step(token=5, num_generated=2, tokens=[9, 5], **limits) is None
    assert finish_step(token=5, num_generated=3, tokens=[9, 5], **limits) is FinishCause.LENGTH


def test_a_loop_needs_a_window_and_a_quarter_of_new_tokens():
    """window 16: the 16 tokens compared and the 4 before them must all be generated."""
    loop, limits = [7] * 40, dict(BASE, max_tokens=None)
    assert finish_step(token=7, num_generated=19, tokens=loop, repetition_window=16, **limits) is None
    assert (
        finish_step(token=7, num_generated=20, tokens=loop, repetition_window=16, **limits)
        is FinishCause.REPETITION_LOOP
    )


def test_the_smallest_windows_detect_a_repeated_token():
    assert is_repetition_loop([7] * 10, 4)  # max period 1
    assert not is_repetition_loop([1, 2] * 5, 4)  # period 2 > 4 // 4
    assert not is_repetition_loop([7] * 10, 3)  # no period fits: never a loop


def test_a_window_of_varied_new_tokens_is_no_loop():
    limits = dict(BASE, max_tokens=None)
    varied = list(range(40))
    assert finish_step(token=39, num_generated=40, tokens=varied, repetition_window=16, **limits) is None


def test_the_detector_compares_a_window_and_a_quarter_of_tokens_or_none():
    """19 repeats of one token fill window 16 and 3 more: one short of the 4 before it."""
    assert not is_repetition_loop([7] * 19, 16)
    assert is_repetition_loop([7] * 20, 16)
