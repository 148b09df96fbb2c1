"""runtime/stop_strings.py: stop strings in streamed text, however the text is split."""

from runtime.stop_strings import MarkupSplitter, StopMatcher

from hypothesis import given, settings
from hypothesis import strategies as st


def run_stops(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for delta in deltas:
        emitted, hit = matcher.feed(delta)
        out.append(emitted)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def reference_stop(stops: list[str], text: str) -> tuple[str, bool]:
    """The text before whichever stop string completes first, scanning the whole text."""
    for end in range(len(text) + 1):
        for stop in sorted(filter(None, stops), key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)], True
    return text, False


def test_stop_split_across_deltas():
    assert run_stops(["</answer>"], ["The answer is 4</an", "swer> trailing"]) == (
        "The answer is 4",
        True,
    )


def test_stop_at_the_very_start():
    assert run_stops(["STOP"], ["STOP and more"]) == ("", True)
    assert run_stops(["STOP"], ["ST", "OP"]) == ("", True)


def test_overlapping_stops_first_to_complete_wins():
    assert run_stops(["abc", "bcd"], ["xab", "cd"]) == ("x", True)
    assert run_stops(["abc", "bcd"], ["xbc", "d"]) == ("x", True)
    assert run_stops(["abcd", "bc"], ["ab", "cd"]) == ("a", True)


def test_of_stops_completing_together_the_longer_starts_first():
    # "b" and "ab" both complete at the same character; "ab" began earlier, so the text
    # ends before it, whichever order the stops were given in.
    assert run_stops(["ab", "b"], ["xab"]) == ("x", True)
    assert run_stops(["b", "ab"], ["xa", "b"]) == ("x", True)
    assert run_stops(["c", "abc", "bc"], ["xabc"]) == ("x", True)


def test_a_stop_found_after_a_partial_match_of_itself_fails():
    # "aa" then "a": the match falls back to "aa" (KMP), not to nothing, so "aab" is seen.
    assert run_stops(["aab"], ["aaab"]) == ("a", True)
    assert run_stops(["aab"], ["aa", "a", "b!"]) == ("a", True)
    assert run_stops(["abab"], ["abaabab"]) == ("aba", True)
    assert run_stops(["abcabd"], ["abcab", "cabd"]) == ("abc", True)
    # The fallback table itself needs fallbacks: "aabaaa" fails on "b" back to "aab".
    assert run_stops(["aabaaaa"], ["aabaaab", "aaaa"]) == ("aaba", True)


def test_a_failed_partial_match_falls_back_only_to_a_real_prefix():
    # No proper suffix of "aaab" starts the stop, so a mismatch after it falls back to
    # nothing; a table built with one fallback step (not as many as needed) said "a",
    # and then "found" "aaabb" in a text that does not hold it.
    assert run_stops(["aaabb"], ["aaabaabb"]) == ("aaabaabb", False)


def test_a_mismatch_falls_back_as_many_times_as_it_takes():
    # "aa" then "b": one step back leaves "a", which "b" does not extend either; stopping
    # there kept "a" matched, and "aa" after it "completed" a stop the text never holds.
    assert run_stops(["aaa"], ["aabaa"]) == ("aabaa", False)
    assert run_stops(["aaa"], ["aa", "b", "aa", "a"]) == ("aab", True)


def test_multiple_stops():
    assert run_stops(["\n\n", "User:", "###"], ["line one\nline two ", "###", " rest"]) == (
        "line one\nline two ",
        True,
    )


def test_no_hold_back_once_a_partial_stop_fails():
    matcher = StopMatcher(["<end>"])
    assert matcher.feed("a <en") == ("a ", False)
    assert matcher.feed("x more") == ("<enx more", False)
    assert matcher.feed("<") == ("", False)
    assert matcher.flush() == "<"


def test_flush_returns_held_text():
    matcher = StopMatcher(["abc", "abd"])
    assert matcher.feed("zzab") == ("zz", False)
    assert matcher.flush() == "ab"


def test_no_stops_passes_text_through():
    matcher = StopMatcher(["", *[]])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=4), max_size=3),
    text=st.text("abcd", max_size=20),
    cuts=st.lists(st.integers(0, 20), max_size=6),
)
def test_stop_result_does_not_depend_on_how_text_is_split(stops, text, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert run_stops(stops, deltas) == reference_stop(stops, text)


def test_a_long_stop_string_costs_memory_linear_in_its_length():
    """Holding every prefix of a 20,000-character stop took ~200 MB (100 KB: 5 GB)."""
    import tracemalloc

    stop = "ab" * 10_000
    tracemalloc.start()
    matcher = StopMatcher([stop, "never"])
    emitted = ""
    for i in range(0, len(stop) + 100, 7):  # the stop arrives split across many deltas
        text, is_stop = matcher.feed(("xy" + stop)[i : i + 7])
        emitted += text
        if is_stop:
            break
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert is_stop and emitted == "xy"
    assert peak < 2_000_000


def test_a_stopped_matcher_emits_nothing_more():
    matcher = StopMatcher(["ab"])
    assert matcher.feed("xab") == ("x", True)
    assert matcher.feed("abc") == ("", True)
    assert matcher.is_stopped
    held = StopMatcher(["abc", "bx"])  # "ab" is held back when "bx" completes
    assert held.feed("ab") == ("", False) and held.feed("x") == ("a", True)
    assert held.flush() == ""


def test_flush_forgets_the_partial_match():
    matcher = StopMatcher(["abc"])
    assert matcher.feed("zab") == ("z", False)
    assert matcher.flush() == "ab"
    assert matcher.feed("c") == ("c", False)  # "ab" was flushed: "c" alone starts nothing


def test_markup_is_released_with_the_held_text_and_no_stop_matches_across_it():
    matcher = StopMatcher(["call", "ab"])
    assert matcher.feed("x a", markup="<|tool_call>") == ("x a<|tool_call>", False)
    assert matcher.feed("b") == ("b", False)  # "a" before the markup does not join "b" after it
    assert matcher.feed("ca", markup="<|y|>") == ("ca<|y|>", False)  # held "ca" leaves with it
    assert matcher.feed("ll") == ("ll", False)  # "ca" before the markup began no "call"
    assert matcher.feed(" call") == (" ", True)


def test_markup_after_a_stop_in_the_same_piece_is_dropped():
    matcher = StopMatcher(["end"])
    assert matcher.feed("the end", markup="<|end|>") == ("the ", True)
    assert matcher.feed("more", markup="<|x|>") == ("", True)


def test_a_control_tokens_spelling_is_markup_and_what_the_detokenizer_held_before_it_is_text():
    splitter = MarkupSplitter({7: "<|tool_call>"})
    assert splitter.split(7, "é<|tool_call>") == ("é", "<|tool_call>")
    assert splitter.split(3, "call") == ("call", "")
    assert splitter.split(7, "") == ("", "")  # nothing spelled (a skipped token): nothing to split


def test_a_header_is_markup_from_its_opening_marker_through_the_one_opening_its_body():
    splitter = MarkupSplitter(
        {1: "<|start|>", 2: "<|channel|>", 3: "<|message|>", 4: "<|end|>"},
        frozenset({"<|start|>", "<|channel|>"}),
        frozenset({"<|message|>"}),
    )
    pieces = [(2, "<|channel|>"), (9, "analysis"), (3, "<|message|>"), (9, "hmm"), (4, "<|end|>"),
              (1, "<|start|>"), (9, "assistant"), (2, "<|channel|>"), (9, "final"), (3, "<|message|>"), (9, "Hi")]
    split = [splitter.split(token, piece) for token, piece in pieces]
    assert "".join(text for text, _ in split) == "hmmHi"
    assert "".join(text + markup for text, markup in split) == "".join(piece for _, piece in pieces)


def test_a_stop_beginning_right_after_markup_or_a_flush_is_found():
    matcher = StopMatcher(["aa"])
    assert matcher.feed("a", markup="<|m|>") == ("a<|m|>", False)
    assert matcher.feed("aa") == ("", True)
    flushed = StopMatcher(["aa"])
    assert flushed.feed("a") == ("", False) and flushed.flush() == "a"
    assert flushed.feed("ab") == ("ab", False)  # the flushed "a" begins nothing
    assert flushed.feed("a") == ("", False) and flushed.flush() == "a"
    assert flushed.feed("aa") == ("", True)


def test_a_header_of_several_tokens_is_markup_to_its_end():
    """gpt-oss's `<|start|>assistant to=functions.f<|channel|>...`: every token of it."""
    splitter = MarkupSplitter(
        {1: "<|start|>", 3: "<|message|>"}, frozenset({"<|start|>"}), frozenset({"<|message|>"})
    )
    pieces = [(1, "<|start|>"), (9, "assistant"), (9, " to"), (9, "=functions.f"), (3, "<|message|>")]
    assert [splitter.split(token, piece)[0] for token, piece in pieces] == [""] * 5
    assert splitter.split(9, "{}") == ("{}", "")
