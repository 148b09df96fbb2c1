"""Logprobs through real HTTP, read by the official openai client: OpenAI's chat and
completions shapes, streamed and not, and the requests that are refused."""

import codecs
import http.client
import json
import math
import pathlib
import shutil
import urllib.parse

from runtime.tokenizer import Tokenizer

import openai
import pytest
import tokenizers

from tests.actors.test_http import in_thread, request, serving
from tests.runtime.tokenizer_checkpoints import build_llama

MESSAGES = [{"role": "user", "content": "Say something."}]
MAX_TOKENS = 8


def chat_entries(server, stream, **body):
    """(each token's entry as a dict, completion_tokens), streamed or not."""
    client = server.client()
    args = dict(model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, **body)
    if not stream:
        done = client.chat.completions.create(**args)
        return [
            e.model_dump() for e in done.choices[0].logprobs.content
        ], done.usage.completion_tokens
    entries, usage = [], None
    for chunk in client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.logprobs is not None:
                entries += [e.model_dump() for e in choice.logprobs.content]
    return entries, usage.completion_tokens


def completion_logprobs(server, stream, **body):
    """(tokens, token_logprobs, top_logprobs, text_offset, text, completion_tokens)."""
    client = server.client()
    args = dict(model=server.model, prompt="Once upon", max_tokens=MAX_TOKENS, **body)
    chunks = (
        list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        if stream
        else [client.completions.create(**args)]
    )
    fields = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text, usage = "", None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                for name, values in fields.items():
                    values += getattr(choice.logprobs, name)
    return *fields.values(), text, usage.completion_tokens


async def test_chat_logprobs_streamed_equal_whole_in_openai_shape(tiny):
    async with serving(tiny) as server:
        whole, num_tokens = await in_thread(
            chat_entries, server, False, logprobs=True, top_logprobs=3
        )
        streamed, _ = await in_thread(chat_entries, server, True, logprobs=True, top_logprobs=3)
        bare, _ = await in_thread(chat_entries, server, False, logprobs=True)
        plain = await in_thread(
            server.client().chat.completions.create,
            model=server.model,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
        )
    assert plain.choices[0].logprobs is None
    assert len(whole) == num_tokens > 0
    assert streamed == whole
    for entry in whole:  # greedy: the chosen token tops its list
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode())
        values = [top["logprob"] for top in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True) and all(math.isfinite(v) for v in values)
    assert [(e["token"], e["logprob"]) for e in bare] == [(e["token"], e["logprob"]) for e in whole]
    assert all(e["top_logprobs"] == [] for e in bare)


async def test_completion_logprobs_streamed_equal_whole_in_openai_shape(tiny):
    async with serving(tiny) as server:
        whole = await in_thread(completion_logprobs, server, False, logprobs=2)
        streamed = await in_thread(completion_logprobs, server, True, logprobs=2)
    assert streamed == whole
    tokens, token_logprobs, top_logprobs, text_offset, text, num_tokens = whole
    assert len(tokens) == len(token_logprobs) == len(top_logprobs) == num_tokens > 0
    # Each offset is the character its token's first byte is in (a random model writes
    # stray bytes: each invalid run is a U+FFFD, as in its text).
    assert text_offset == _char_starts(tokens)
    for token, logprob, top in zip(tokens, token_logprobs, top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and top[token] == logprob == max(top.values())


async def test_sampled_rows_report_logprobs_of_their_masked_distribution(tiny):
    async with serving(tiny) as server:
        entries, num_tokens = await in_thread(
            chat_entries,
            server,
            False,
            logprobs=True,
            top_logprobs=5,
            temperature=0.7,
            extra_body={"top_k": 2},
            seed=3,
        )
    assert len(entries) == num_tokens
    for entry in entries:  # two tokens survive top-k; the rest are OpenAI's "very unlikely"
        values = [top["logprob"] for top in entry["top_logprobs"]]
        assert all(v > -9999.0 for v in values[:2]) and values[2:] == [-9999.0] * 3
        assert math.isclose(sum(math.exp(v) for v in values[:2]), 1.0, rel_tol=1e-4)


async def test_a_special_token_is_spelled_in_logprobs_though_the_text_skips_it(tiny):
    im_start = tokenizers.Tokenizer.from_file(str(tiny / "tokenizer.json")).token_to_id(
        "<|im_start|>"
    )
    body = dict(logprobs=True, logit_bias={str(im_start): 100})  # every token is <|im_start|>
    async with serving(tiny) as server:
        done = await in_thread(
            lambda: server.client().chat.completions.create(
                model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, **body
            )
        )
        streamed, _ = await in_thread(chat_entries, server, True, **body)
    assert [e.token for e in done.choices[0].logprobs.content] == ["<|im_start|>"] * MAX_TOKENS
    assert done.choices[0].message.content == ""
    # Streamed, their entries come without text, and still one per token.
    assert [e["token"] for e in streamed] == ["<|im_start|>"] * MAX_TOKENS


def strict_json(url, path, body):
    """POST `body`; the response parsed as strict JSON (no NaN or Infinity)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    connection.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    response = connection.getresponse()
    payload = response.read()
    connection.close()

    def refuse(constant):
        raise AssertionError(f"{constant} in a response: not JSON")

    return response.status, json.loads(payload, parse_constant=refuse)


async def test_a_tiny_temperature_or_penalty_answers_greedily_in_strict_json(tiny):
    """1e-300 is 0 in float32: these answered garbage with "logprob": NaN, which strict
    JSON parsers (JavaScript's) refuse."""
    chat = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 2}
    completion = {"prompt": "Once upon", "max_tokens": MAX_TOKENS, "logprobs": 2}
    async with serving(tiny) as server:
        answers = {}
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            for extra in ({}, {"temperature": 1e-300}, {"repetition_penalty": 1e-300}):
                status, reply = await in_thread(
                    strict_json, server.url, path, {"model": server.model, **body, **extra}
                )
                assert status == 200, reply
                answers[path, tuple(extra)] = reply["choices"][0]
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert answers[path, ("temperature",)] == answers[path, ()]  # greedy, logprobs too


async def test_the_bytes_of_tokens_inside_a_character_rebuild_the_text(tiny):
    """An emoji's bytes are separate tokens here: decoded alone each is U+FFFD, so every
    entry said "\ufffd" with U+FFFD's bytes, completions' top_logprobs merged such tokens
    under one key, and text_offset counted a character per token."""
    text = "x😀é"  # 7 byte tokens, within MAX_TOKENS
    body = {"extra_body": {"guided_regex": text}}
    async with serving(tiny) as server:
        entries, _ = await in_thread(chat_entries, server, False, logprobs=True, top_logprobs=3, **body)
        streamed, _ = await in_thread(chat_entries, server, True, logprobs=True, top_logprobs=3, **body)
        tokens, _, tops, offsets, completion, _ = await in_thread(
            completion_logprobs, server, False, logprobs=3, **body
        )
    assert streamed == entries
    assert bytes(b for e in entries for b in e["bytes"]) == text.encode()
    assert all("\ufffd" not in e["token"] for e in entries)
    assert any(e["token"].startswith("bytes:\\x") for e in entries)
    for entry in entries:  # an alternative's bytes are its own too
        for top in entry["top_logprobs"]:
            if top["token"].startswith("bytes:"):
                assert len(top["bytes"]) == top["token"].count("\\x")
    assert completion == text and all("\ufffd" not in t for t in tokens)
    # Distinct tokens, distinct keys: the sampled one beside at least the top 3.
    assert all(t in top and len(top) >= 3 for t, top in zip(tokens, tops, strict=True))
    # Each token starts at the character it belongs to: x, then 4 bytes of 😀 at 1, ...
    starts = [len(completion.encode()[:i].decode("utf-8", "ignore")) for i in _byte_starts(tokens)]
    assert offsets == starts and offsets[0] == 0 and offsets[-1] <= len(text) - 1


@pytest.mark.parametrize(("text", "stop", "kept"), [("abcdefgh", "d", "abc"), ("ab😀é", "😀", "ab")])
async def test_the_tokens_a_stop_string_cut_away_have_no_logprobs(tiny, text, stop, kept):
    """The entries of the tokens that wrote the stop string (or a character's bytes it
    cut) were kept, so the tokens spelled text the reply did not hold: "abc" came with
    "abc", "def", and "ab" with the four bytes of the emoji after it."""
    body = {"extra_body": {"guided_regex": text}, "stop": stop}
    async with serving(tiny) as server:
        got = {
            stream: await in_thread(completion_logprobs, server, stream, logprobs=1, **body)
            for stream in (False, True)
        }
        chat = [
            await in_thread(chat_entries, server, stream, logprobs=True, **body)
            for stream in (False, True)
        ]
    assert got[True] == got[False] and chat[0] == chat[1]
    tokens, _, _, offsets, completion, num_tokens = got[False]
    assert completion == kept
    assert b"".join(_spelled_bytes(t) for t in tokens) == kept.encode()
    assert all(offset < len(kept) for offset in offsets)
    assert bytes(b for e in chat[0][0] for b in e["bytes"]) == kept.encode()
    # They were generated all the same, and are billed.
    assert num_tokens == chat[0][1] > len(tokens)


async def test_a_token_after_bytes_that_make_no_character_starts_after_their_u_fffd(tiny):
    """A byte starting a 4-byte character, again and again: each ends the one before as
    invalid, a U+FFFD. The token after such held bytes was given their offset, so the
    offsets went 0, 0, 1, 2 for text whose characters are at 0, 1, 2, 3."""
    tokenizer = Tokenizer.from_dir(pathlib.Path(tiny))
    lead = next(i for i in range(tokenizer.vocab_size) if tokenizer.token_piece(i)[1] == b"\xf0")
    async with serving(tiny) as server:
        got = {
            stream: await in_thread(
                completion_logprobs, server, stream, logprobs=0, logit_bias={str(lead): 100}
            )
            for stream in (False, True)
        }
    assert got[True] == got[False]
    tokens, _, _, offsets, text, _ = got[False]
    assert tokens == ["bytes:\\xf0"] * MAX_TOKENS and text == "\ufffd" * MAX_TOKENS
    assert offsets == list(range(MAX_TOKENS)) == _char_starts(tokens)


def _char_starts(tokens):
    """The character each completion token's first byte is in, its bytes decoded as
    UTF-8 with a U+FFFD for each invalid run (each maximal part of a character)."""
    data, char_at, num_chars, at = b"".join(map(_spelled_bytes, tokens)), [], 0, 0
    while at < len(data):
        size = next((n for n in range(1, 5) if _is_char(data[at : at + n])), 0)
        if not size:  # no character: the longest start of one, or the lone byte
            size = max(n for n in range(1, 5) if n == 1 or _begins_char(data[at : at + n]))
        char_at += [num_chars] * size
        num_chars, at = num_chars + 1, at + size
    return [char_at[start] for start in _byte_starts(tokens)]


def _is_char(data):
    try:
        return len(data.decode()) == 1
    except UnicodeDecodeError:
        return False


def _begins_char(data):
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data) == ""
    except UnicodeDecodeError:
        return False


def _byte_starts(tokens):
    """Where each completion token starts in the text's bytes, from its spelling."""
    starts, at = [], 0
    for token in tokens:
        starts.append(at)
        at += len(_spelled_bytes(token))
    return starts


def _spelled_bytes(token):
    """A completion token's bytes: OpenAI's "bytes:\\xf0\\x9f" spelling, or its text."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token.removeprefix("bytes:").split("\\x")[1:])
    return token.encode()


BAD = [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 2, "top_logprobs": 2}, "top_logprobs"),
]


async def test_bad_logprobs_fields_are_a_400_naming_them(tiny):
    async with serving(tiny) as server:
        for path, fields, param in BAD:
            prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"}
            status, _, body = await in_thread(
                request, server.url, "POST", path, {"model": server.model, **prompt, **fields}
            )
            assert (status, body["error"]["param"]) == (400, param), (fields, body)
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            await in_thread(
                server.client().chat.completions.create,
                model=server.model,
                messages=MESSAGES,
                top_logprobs=21,
                logprobs=True,
            )


async def test_a_completions_sampled_token_is_listed_beside_the_top_alternatives(tiny):
    """OpenAI's completions logprobs: each top_logprobs dict holds the sampled token too,
    so one that was not the most likely makes the dict one longer than `logprobs`."""
    async with serving(tiny) as server:
        tokens, token_logprobs, top_logprobs, *_ = await in_thread(
            completion_logprobs, server, False, logprobs=1, temperature=1.5, seed=7
        )
    for token, logprob, top in zip(tokens, token_logprobs, top_logprobs, strict=True):
        assert top[token] == logprob
    assert any(
        len(top) == 2 for top in top_logprobs
    )  # fixed by the seed: some draw was not the top


@pytest.fixture(scope="module")
def sentencepiece_tiny(tiny, tmp_path_factory):
    """The tiny checkpoint with a Llama-2/Mistral-style tokenizer: `▁` word starts, byte
    fallback, and a Strip decoder that drops an output's first space."""
    out = tmp_path_factory.mktemp("sentencepiece")
    shutil.copytree(tiny, out, dirs_exist_ok=True)
    tokenizer = build_llama(tmp_path_factory.mktemp("tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    return out


async def test_a_sentencepiece_models_token_bytes_keep_their_word_starting_spaces(
    sentencepiece_tiny,
):
    """Decoded alone, "▁there" is "there" (the Strip decoder), so the entries' bytes for
    "Hi there again" joined to "Hithereagain"; each is now what it adds to the text."""
    text = "Hi there again"
    body = {"extra_body": {"guided_regex": text}}
    async with serving(sentencepiece_tiny) as server:
        for stream in (False, True):
            entries, _ = await in_thread(
                chat_entries, server, stream, logprobs=True, top_logprobs=2, **body
            )
            assert bytes(b for e in entries for b in e["bytes"]) == text.encode(), stream
            assert "".join(e["token"] for e in entries) == text
            assert any(e["token"] == " there" for e in entries)
