"""Streaming detokenization: every stream of ids, streamed, is exactly its whole decode,
each delta final when emitted, over the three trained tokenizers
(tests/runtime/tokenizer_checkpoints.py) and transformers' byte-level alphabet.
"""

from __future__ import annotations

from runtime.detokenizer import MAX_HELD_IDS, IncrementalDetokenizer
from runtime.tokenizer import Tokenizer

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer

from tests.runtime.tokenizer_checkpoints import BUILDERS, BYTE_PIECES, CORPUS


def fragment_ids(tok: Tokenizer) -> list[int]:
    """Ids whose text alone is not whole characters (byte pieces, byte-level fragments)."""
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]


def stream(
    tok: Tokenizer, ids: list[int], skip_special_tokens: bool, may_hold=frozenset()
) -> list[str]:
    """The deltas of a streamed decode, flush last, checking hold-back as it goes.

    Text may be held only while it could still change: while it ends in an unfinished
    character, or right after an id in `may_hold` (an open run of byte-fallback pieces).
    """
    detok = tok.detokenizer(skip_special_tokens)
    deltas = []
    for n, token_id in enumerate(ids, start=1):
        deltas.append(detok.add(token_id))
        assert detok.text == "".join(deltas)
        so_far = tok.decode(ids[:n], skip_special_tokens)
        if not so_far.endswith("\ufffd") and token_id not in may_hold:
            assert detok.text == so_far
    deltas.append(detok.flush())
    return deltas


def assert_streams_exactly(
    tok: Tokenizer, ids: list[int], skip_special_tokens: bool, may_hold
) -> None:
    deltas = stream(tok, ids, skip_special_tokens, may_hold)
    full = tok.decode(ids, skip_special_tokens)
    assert "".join(deltas) == full
    position = 0
    for delta in deltas:
        # Each delta is final text: a U+FFFD in it is one the whole decode has there too,
        # never a partial character that a later token completes.
        assert full[position : position + len(delta)] == delta
        position += len(delta)


@pytest.fixture(scope="session")
def run_ids(checkpoint_dirs) -> dict[tuple[str, bool], frozenset[int]]:
    """Per (kind, skip_special_tokens): ids after which a byte-fallback run may stay open."""
    runs = {}
    for kind, path in checkpoint_dirs.items():
        backend = RustTokenizer.from_file(str(path / "tokenizer.json"))
        pieces = frozenset(backend.token_to_id(p) for p in BYTE_PIECES) - {None}
        specials = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        runs[kind, False] = pieces
        runs[kind, True] = pieces | specials if pieces else pieces
    return runs


@st.composite
def token_ids(draw, tok: Tokenizer, fragments: list[int]) -> list[int]:
    pick = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(fragments))
    return draw(st.lists(pick, max_size=30))


@pytest.fixture(scope="session")
def fragments(ours) -> dict[str, list[int]]:
    return {kind: fragment_ids(tok) for kind, tok in ours.items()}


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_ids_stream_to_the_exact_decode(
    ours, fragments, run_ids, kind, skip_special_tokens, data
):
    tok = ours[kind]
    assert fragments[kind], "the vocabulary should hold multi-byte fragments"
    ids = data.draw(token_ids(tok, fragments[kind]))
    assert_streams_exactly(tok, ids, skip_special_tokens, run_ids[kind, skip_special_tokens])


@st.composite
def fragment_runs(draw, tok: Tokenizer, fragments: list[int]) -> list[int]:
    """Long runs, mostly of fragments: held back past MAX_HELD_IDS, settled text is released."""
    pick = st.one_of(
        st.sampled_from(fragments), st.sampled_from(fragments), st.integers(0, tok.vocab_size - 1)
    )
    return draw(st.lists(pick, min_size=MAX_HELD_IDS, max_size=150))


@pytest.mark.parametrize("kind", list(BUILDERS))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_long_runs_of_fragments_stream_to_the_exact_decode(ours, fragments, run_ids, kind, data):
    tok = ours[kind]
    ids = data.draw(fragment_runs(tok, fragments[kind]))
    assert_streams_exactly(tok, ids, True, run_ids[kind, True])


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_tokens_that_add_no_text_cost_the_detokenizer_no_more_each(ours, fragments, kind):
    """A skipped special token, or a byte that never makes a character, joined the
    held window, which every later token decoded whole: 8,000 of them took 8 s."""
    tok = ours[kind]
    detok = tok.detokenizer()
    decoded = []
    decode = detok._decode
    detok._decode = lambda ids: decoded.append(len(ids)) or decode(ids)
    special = min(tok.eos_token_ids)
    for token in [special] * 2000 + [fragments[kind][0]] * 2000:
        detok.add(token)
    assert sum(decoded) < 100 * 4000  # ids decoded in all: a bounded window each token
    assert detok.text + detok.flush() == tok.decode([fragments[kind][0]] * 2000)


TEXT_ALPHABET = st.one_of(
    st.characters(codec="utf-8", exclude_categories=["Cs"]),
    st.sampled_from(list("日本語한국어😀🎉👋🏽éñü ‘’—\n\t")),
)


@pytest.mark.parametrize("kind", list(BUILDERS))
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(TEXT_ALPHABET, max_size=40))
@example(text="a<|endoftext|>b")  # a special token's text encodes to the special token
def test_encoded_text_streams_back(ours, run_ids, kind, text):
    tok = ours[kind]
    ids = tok.encode(text, add_special_tokens=False)
    assert_streams_exactly(tok, ids, True, run_ids[kind, True])
    if kind == "byte_level":  # byte-level BPE round-trips any text exactly, unskipped
        assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("byte_level", "Hello there, 日本語 😀!"),
        ("llama", "Hello there, 한국어 😀!"),
        ("metaspace", " x  y 😀 z"),
    ],
)
def test_emoji_is_never_split(ours, run_ids, kind, text):
    tok = ours[kind]
    deltas = stream(tok, tok.encode(text, add_special_tokens=False), True, run_ids[kind, True])
    assert "".join(deltas) == tok.decode(tok.encode(text))
    assert not any("\ufffd" in delta for delta in deltas)


def test_long_stream_decodes_short_windows(ours):
    tok = ours["llama"]
    window_lengths = []

    def decode(ids: list[int]) -> str:
        window_lengths.append(len(ids))
        return tok.decode(ids)

    ids = tok.encode(" ".join(CORPUS[:3]), add_special_tokens=False)[:3000]
    detok = IncrementalDetokenizer(decode)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert len(ids) > 1000 and max(window_lengths) < 16


def test_a_skipped_special_token_does_not_split_a_byte_fallback_character(ours, checkpoint_dirs):
    """é as its two byte pieces with a special token between them: decoding skips the
    special token and joins the bytes, so the stream must hold the first byte across it."""
    tok = ours["llama"]
    backend = RustTokenizer.from_file(str(checkpoint_dirs["llama"] / "tokenizer.json"))
    c3, a9, e6 = (backend.token_to_id(f"<0x{b}>") for b in ("C3", "A9", "E6"))
    special = min(tok.eos_token_ids)
    for ids in ([c3, special, a9], [c3, a9, special, e6]):
        # The decode joins the pieces around the skipped token into one run, where one
        # invalid byte (a lone E6) makes every piece of the run U+FFFD: "é" is not final.
        whole = tok.decode(ids)
        deltas = stream(tok, ids, True, may_hold=frozenset(ids))
        assert "".join(deltas) == whole, ids
    assert tok.decode([c3, special, a9]) == "é" and "é" not in tok.decode([c3, a9, special, e6])


def test_a_token_that_adds_no_text_leaves_the_context_alone(ours):
    """A skipped special token (no byte-fallback runs here, so it is not held) adds no
    text: the next token still decodes after the text before it, its leading space kept."""
    tok = ours["llama"]
    ids = tok.encode("Hi there", add_special_tokens=False)
    ids.insert(-1, min(tok.eos_token_ids))
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == "Hi there"


def _byte_level_char(byte: int) -> str:
    """The character GPT-2's byte-level alphabet writes `byte` as."""
    kept = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)
    ]
    if byte in kept:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in kept].index(byte))


def test_settled_text_released_past_the_hold_limit_never_cuts_a_character(ours, checkpoint_dirs):
    """Past MAX_HELD_IDS lone continuation bytes, what is released is the text before
    the last three ids, checked to decode apart as it decodes whole: an emoji's four bytes
    and a fifth starting another arrive after thirty stray ones."""
    backend = RustTokenizer.from_file(str(checkpoint_dirs["byte_level"] / "tokenizer.json"))
    stray_then_emoji = [0x80] * 30 + [0xF0, 0x9F, 0x98, 0x80, 0xF0]
    ids = [backend.token_to_id(_byte_level_char(b)) for b in stray_then_emoji]
    assert None not in ids
    assert_streams_exactly(ours["byte_level"], ids, True, frozenset())


def bytes_decode(ids: list[int]) -> str:
    """Each id a byte, invalid UTF-8 written as U+FFFD (as a byte-fallback decoder does)."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_held_text_is_released_at_the_hold_limit_all_but_its_last_three_ids():
    """Stray continuation bytes are held while they end in U+FFFD; at MAX_HELD_IDS held
    ids (those after the text already out), not one before, the text before the last
    three (a character's room) goes out."""
    detok = IncrementalDetokenizer(bytes_decode)
    assert [detok.add(i) for i in b"Hi"] == ["H", "i"]
    deltas = [detok.add(0x80) for _ in range(MAX_HELD_IDS)]
    assert deltas[:-1] == [""] * (MAX_HELD_IDS - 1)
    assert deltas[-1] == "\ufffd" * (MAX_HELD_IDS - 3)
    assert detok.flush() == "\ufffd" * 3


def test_settled_text_is_not_released_where_a_character_straddles_the_split():
    """At the hold limit an unfinished "€" (E2 82) spans the last three ids' edge: its
    first byte apart decodes as a U+FFFD of its own, so nothing is released there, and
    the stream stays its whole decode."""
    ids = [0x80] * (MAX_HELD_IDS - 4) + [0xE2, 0x82, 0xF0, 0x9F]
    detok = IncrementalDetokenizer(bytes_decode)
    deltas = [detok.add(i) for i in ids]
    assert deltas == [""] * len(ids)
    assert detok.flush() == bytes_decode(ids) == "\ufffd" * (MAX_HELD_IDS - 2)
