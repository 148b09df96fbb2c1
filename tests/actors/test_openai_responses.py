"""actors/openai_responses.py: the chunks' and responses' OpenAI shapes, without a server
(the same shapes read through the openai client: test_http.py, test_http_logprobs.py)."""

import json

from actors.openai_responses import SSE_DONE, ChunkWriter, sse, wire_json
from actors.requests import LogprobEntry, Usage


def frames(sse):
    """The JSON objects of SSE bytes (one or more `data: ...` events)."""
    events = [e for e in sse.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e.removeprefix("data: ")) for e in events]


def test_chat_chunks_carry_the_role_once_per_choice_and_usage_null_until_the_last():
    writer = ChunkWriter("chat", "chatcmpl-1", "m", include_usage=True)
    starts = frames(writer.start(num_choices=2))
    (text,) = frames(writer.text("hi", index=1))
    (finish,) = frames(writer.finish("length", index=1))
    (usage,) = frames(writer.usage(Usage(3, 2, cached_tokens=1)))
    role = {"role": "assistant", "content": ""}
    assert [s["choices"] for s in starts] == [
        [{"index": i, "delta": role, "logprobs": None, "finish_reason": None}] for i in (0, 1)
    ]
    for chunk in (*starts, text, finish, usage):
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-1"
    assert all(chunk["usage"] is None for chunk in (*starts, text, finish))  # present, null
    assert text["choices"] == [
        {"index": 1, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
    ]
    assert finish["choices"] == [
        {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_completion_streams_have_no_start_chunk_and_no_usage_unless_asked():
    writer = ChunkWriter("completion", "cmpl-1", "m")
    assert writer.start(num_choices=2) is None
    (chunk,) = frames(writer.text("hi", index=1))
    assert "usage" not in chunk and chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 1, "text": "hi", "logprobs": None, "finish_reason": None}]


def test_chat_logprobs_hold_the_content_and_a_null_refusal():
    writer = ChunkWriter("chat", "chatcmpl-1", "m", has_logprobs=True)
    entry = LogprobEntry("a", -0.5, (("a", -0.5), ("b", float("-inf"))))
    (chunk,) = frames(writer.text("a", [entry]))
    assert chunk["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [
                    {"token": "a", "logprob": -0.5, "bytes": [97]},
                    {"token": "b", "logprob": -9999.0, "bytes": [98]},  # -inf is no JSON
                ],
            }
        ],
        "refusal": None,
    }


def test_logprobs_below_openais_floor_or_nan_are_reported_at_the_floor():
    writer = ChunkWriter("completion", "cmpl-1", "m", has_logprobs=True)
    entries = [LogprobEntry(t, v) for t, v in (("a", -1e5), ("b", float("nan")), ("c", -3.0))]
    (chunk,) = frames(writer.text("abc", entries))
    assert chunk["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0, -9999.0, -3.0]


def test_each_choice_counts_its_own_text_offsets_across_a_split_character():
    """Two choices each write "😀x" as three tokens, interleaved: the first two tokens
    complete one character between them, whichever choice's bytes arrive in between."""
    writer = ChunkWriter("completion", "cmpl-1", "m", has_logprobs=True)
    pieces = [b"\xf0\x9f", b"\x98\x80", b"x"]
    offsets = {0: [], 1: []}
    for piece in pieces:
        for index in (0, 1):
            entry = LogprobEntry(f"bytes:{piece!r}", -1.0, token_bytes=piece)
            (chunk,) = frames(writer.text("", [entry], index=index))
            offsets[index] += chunk["choices"][0]["logprobs"]["text_offset"]
    assert offsets == {0: [0, 0, 1], 1: [0, 0, 1]}


def test_a_tool_call_chunk_names_its_choice():
    writer = ChunkWriter("chat", "chatcmpl-1", "m")
    call = {"index": 0, "function": {"arguments": "{}"}}
    (chunk,) = frames(writer.tool_calls([call], index=2))
    assert chunk["choices"] == [
        {"index": 2, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}
    ]


def test_a_whole_chat_response_holds_each_choices_message_and_the_usage_once():
    writer = ChunkWriter("chat", "chatcmpl-1", "m", created=1700000000)
    choices = [writer.choice("hi", "stop", index=0), writer.choice("yo", "length", index=1)]
    assert writer.whole(choices, Usage(3, 4, cached_tokens=2)) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            for i, text, reason in ((0, "hi", "stop"), (1, "yo", "length"))
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    }


def test_a_whole_completion_response_holds_each_choices_text_and_logprobs():
    writer = ChunkWriter("completion", "cmpl-1", "m", has_logprobs=True, created=1700000000)
    entries = [LogprobEntry("é", -0.5, (("é", -0.5), ("b", -2.0))), LogprobEntry("x", -1.0)]
    choice = writer.choice("éx", "length", entries, index=1)
    whole = writer.whole([choice], Usage(2, 2))
    assert (whole["id"], whole["object"], whole["created"], whole["model"]) == (
        "cmpl-1",
        "text_completion",
        1700000000,
        "m",
    )
    assert whole["choices"] == [
        {
            "index": 1,
            "text": "éx",
            "logprobs": {
                "tokens": ["é", "x"],
                "token_logprobs": [-0.5, -1.0],
                "top_logprobs": [{"é": -0.5, "b": -2.0}, {"x": -1.0}],
                "text_offset": [0, 1],  # characters, not bytes
            },
            "finish_reason": "length",
        }
    ]
    assert whole["usage"]["total_tokens"] == 4


def test_a_chat_choice_carries_its_logprobs_only_when_asked():
    entry = LogprobEntry("a", -0.5)
    plain = ChunkWriter("chat", "chatcmpl-1", "m").choice("a", "stop", [entry])
    asked = ChunkWriter("chat", "chatcmpl-1", "m", has_logprobs=True).choice("a", "stop", [entry])
    assert plain["logprobs"] is None
    assert asked["logprobs"] == {
        "content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}],
        "refusal": None,
    }


def test_a_single_choice_response_is_choice_0():
    """Without an index, every piece belongs to the only choice (n=1)."""
    chat = ChunkWriter("chat", "chatcmpl-1", "m")
    chunks = [
        *frames(chat.start()),
        *frames(chat.text("hi")),
        *frames(chat.tool_calls([])),
        *frames(chat.finish("stop")),
    ]
    assert len(chunks) == 4 and all(c["choices"][0]["index"] == 0 for c in chunks)
    assert chat.choice("hi", "stop")["index"] == 0
    assert ChunkWriter("completion", "cmpl-1", "m").choice("hi", "stop")["index"] == 0


def test_the_wire_is_compact_utf8_json_and_a_lone_surrogate_goes_out_escaped():
    assert sse({"text": "é 😀", "n": [1, 2]}) == 'data: {"text":"é 😀","n":[1,2]}\n\n'.encode()
    assert wire_json({"name": "a\ud800"}) == b'{"name":"a\\ud800"}'
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_a_completion_chunk_always_has_text_the_finishing_one_empty():
    """OpenAI's completion chunks carry `text` as a string, the last one's empty."""
    writer = ChunkWriter("completion", "cmpl-1", "m")
    (last,) = frames(writer.finish("stop"))
    assert last["choices"][0]["text"] == "" and last["choices"][0]["finish_reason"] == "stop"


def test_reasoning_goes_out_under_both_names_clients_read():
    writer = ChunkWriter("chat", "chatcmpl-1", "m")
    (chunk,) = frames(writer.reasoning("Hm.", index=1))
    assert chunk["choices"][0]["delta"] == {"reasoning": "Hm.", "reasoning_content": "Hm."}
    message = writer.choice("Paris.", "stop", reasoning="Hm.")["message"]
    assert (message["reasoning"], message["reasoning_content"]) == ("Hm.", "Hm.")


def test_an_alternative_token_that_is_part_of_a_character_reports_its_own_bytes():
    """A top alternative spelled "bytes:\\xf0\\x9f" (a piece of an emoji) reports its real
    bytes, not those of its spelling."""
    entry = LogprobEntry("a", -0.5, (("bytes:\\xf0\\x9f", -1.0),), top_bytes=(b"\xf0\x9f",))
    writer = ChunkWriter("chat", "chatcmpl-1", "m", has_logprobs=True)
    (top,) = writer.choice("a", "stop", [entry])["logprobs"]["content"][0]["top_logprobs"]
    assert top == {"token": "bytes:\\xf0\\x9f", "logprob": -1.0, "bytes": [0xF0, 0x9F]}


def test_a_chat_chunk_of_several_tokens_carries_each_tokens_logprob():
    writer = ChunkWriter("chat", "chatcmpl-1", "m", has_logprobs=True)
    (chunk,) = frames(writer.text("ab", [LogprobEntry("a", -0.5), LogprobEntry("b", -1.5)]))
    assert [e["token"] for e in chunk["choices"][0]["logprobs"]["content"]] == ["a", "b"]
