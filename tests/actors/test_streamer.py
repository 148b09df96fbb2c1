"""The streamer on its own: Track and StepResult in, replies and aborts out, and no
stream kept once its request has ended (a long-lived server would grow without bound)."""

from runtime.runner import RowResult
from runtime.sequence import FinishCause

import trio

from actors.messages import (
    MAX_QUEUED_DELTAS,
    REPLY_BUFFER,
    Abort,
    Failed,
    Finished,
    StepResult,
    TextDelta,
    Track,
)
from actors.metrics import Metrics
from actors.streamer import Streamer


async def streamed(
    demo_tokenizer, requests, steps, reply_capacity=64, released=(), eos=(), keep_special=False
):
    """Run a streamer over `requests` ({id: stop strings}) and `steps` (lists of
    (id, token, finish)), then a step releasing `released`; returns (each reply channel's
    messages, the aborts sent, the streamer). A request whose stop list is None has its
    reader gone before any step."""
    to_streamer, inbox = trio.open_memory_channel(16)
    to_scheduler, from_streamer = trio.open_memory_channel(16)
    streamer = Streamer(demo_tokenizer, inbox, to_scheduler, Metrics("m"), frozenset(eos))
    readers = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(streamer.run)
        async with to_streamer:
            for request_id, stop in requests.items():
                reply, readers[request_id] = trio.open_memory_channel(reply_capacity)
                track = Track(request_id, reply, tuple(stop or ()), 3, 0.0, keep_special_tokens=keep_special)
                await to_streamer.send(track)
                if stop is None:
                    readers.pop(request_id).close()
            for number, rows in enumerate(steps):
                await to_streamer.send(StepResult(number, tuple(RowResult(*row) for row in rows)))
            if released:
                await to_streamer.send(StepResult(len(steps), released=released))
    replies = {request_id: drained(reader) for request_id, reader in readers.items()}
    return replies, drained(from_streamer), streamer


def one_by_one(request_id, tokens, finish=FinishCause.LENGTH):
    """A step per token of one request, the last finishing it with `finish`."""
    return [[(request_id, t, None)] for t in tokens[:-1]] + [[(request_id, tokens[-1], finish)]]


def drained(channel):
    """Everything left in a channel its sender closed."""
    messages = []
    while True:
        try:
            messages.append(channel.receive_nowait())
        except trio.EndOfChannel:
            return messages


async def test_a_finished_request_is_streamed_then_forgotten(demo_tokenizer):
    hello = demo_tokenizer.encode(" hello world", add_special_tokens=False)
    replies, aborts, streamer = await streamed(demo_tokenizer, {"a": ()}, one_by_one("a", hello))
    *deltas, end = replies["a"]
    assert all(isinstance(d, TextDelta) for d in deltas) and isinstance(end, Finished)
    assert "".join(d.text for d in deltas) + end.text == " hello world"
    assert end.cause is FinishCause.LENGTH and end.usage.completion_tokens == len(hello)
    assert aborts == [] and streamer.streams == {}


async def test_the_token_that_ends_a_row_by_eos_is_no_text(demo_tokenizer):
    """A tokenizer whose EOS token is not flagged special decodes it as text, and the
    reply ended in '<|im_end|>': vLLM and mlx-lm leave that token out. Here the last
    piece of " hello world" stands for such a token; it still counts as a completion."""
    hello = demo_tokenizer.encode(" hello world", add_special_tokens=False)
    steps = one_by_one("a", hello, finish=FinishCause.EOS)
    replies, _, _ = await streamed(demo_tokenizer, {"a": ()}, steps, eos=[hello[-1]])
    end = replies["a"][-1]
    text = "".join(getattr(m, "text", "") for m in replies["a"])
    assert text == demo_tokenizer.decode(hello[:-1]) and text != " hello world"
    assert end.cause is FinishCause.EOS and end.usage.completion_tokens == len(hello)
    # A grammar that completes ends its row as EOS too, on a token of its text.
    replies, _, _ = await streamed(demo_tokenizer, {"a": ()}, steps, eos=[0])
    assert "".join(getattr(m, "text", "") for m in replies["a"]) == " hello world"


async def test_a_stop_string_finishes_the_request_and_asks_the_scheduler_to_close_it(
    demo_tokenizer,
):
    tokens = demo_tokenizer.encode(" hello world", add_special_tokens=False)
    steps = one_by_one("a", tokens, finish=None)
    replies, aborts, streamer = await streamed(demo_tokenizer, {"a": ("world",)}, steps)
    end = replies["a"][-1]
    assert isinstance(end, Finished) and end.cause is FinishCause.STOP_SEQUENCE
    assert "".join(getattr(m, "text", "") for m in replies["a"]) == " hello "
    assert aborts == [Abort("a", "stop_sequence")] and streamer.streams == {}


async def test_a_stop_string_completed_by_the_final_flush_wins_over_length(demo_tokenizer):
    # " caf" then the first byte of "é" alone: the detokenizer holds that byte back until
    # the row ends, and only its flush ("\ufffd") completes the stop string.
    tokens = demo_tokenizer.encode(" caf", add_special_tokens=False)
    tokens.append(demo_tokenizer.encode("é", add_special_tokens=False)[0])
    assert demo_tokenizer.decode(tokens) == " caf\ufffd"  # the fixture still splits é
    steps = one_by_one("a", tokens)
    replies, aborts, _ = await streamed(demo_tokenizer, {"a": ("f\ufffd",)}, steps)
    end = replies["a"][-1]
    assert isinstance(end, Finished) and end.cause is FinishCause.STOP_SEQUENCE
    assert "".join(getattr(m, "text", "") for m in replies["a"]) == " ca"
    assert aborts == []  # the engine closed the row already (length)


async def test_a_reader_that_left_is_aborted_once_and_forgotten_while_others_go_on(
    demo_tokenizer,
):
    tokens = demo_tokenizer.encode(" hello world", add_special_tokens=False)
    steps = [[("gone", t, None), ("here", t, None)] for t in tokens]
    steps.append([("here", tokens[0], FinishCause.LENGTH)])
    replies, aborts, streamer = await streamed(
        demo_tokenizer, {"gone": None, "here": ()}, steps
    )
    assert aborts == [Abort("gone", "disconnected")]
    assert isinstance(replies["here"][-1], Finished) and streamer.streams == {}


async def test_a_failed_row_fails_its_request_alone(demo_tokenizer):
    hello = demo_tokenizer.encode(" hello", add_special_tokens=False)
    steps = one_by_one("ok", hello)
    steps[0].append(("bad", None, FinishCause.ERROR, "boom"))
    replies, aborts, streamer = await streamed(demo_tokenizer, {"bad": (), "ok": ()}, steps)
    assert replies["bad"] == [Failed("bad", "boom")]
    assert isinstance(replies["ok"][-1], Finished)
    assert "".join(m.text for m in replies["ok"]) == " hello"
    assert aborts == [] and streamer.streams == {}


async def test_an_aborted_request_is_told_so_and_forgotten(demo_tokenizer):
    token = demo_tokenizer.encode(" hello", add_special_tokens=False)[0]
    steps = [[("a", token, None), ("b", token, None)]]
    replies, aborts, streamer = await streamed(
        demo_tokenizer, {"a": (), "b": ()}, steps, released=(("a", ("cancelled", "running")),)
    )
    assert replies["a"][-1] == Failed("a", "the request was aborted")
    # b was still running when the inbox closed: the service stopped under it.
    assert replies["b"][-1] == Failed("b", "the service stopped", is_service_stopped=True)
    assert aborts == [] and streamer.streams == {}


async def test_a_reader_that_falls_behind_gets_the_held_back_text_coalesced(demo_tokenizer):
    """Never more than MAX_QUEUED_DELTAS deltas wait in its channel; the rest of the text
    waits in the streamer and leaves with the final message, nothing lost or doubled."""
    tokens = demo_tokenizer.encode(" hello world" * 4, add_special_tokens=False)
    steps = one_by_one("a", tokens)
    replies, _, streamer = await streamed(demo_tokenizer, {"a": ()}, steps, REPLY_BUFFER)
    *deltas, end = replies["a"]
    assert len(deltas) == MAX_QUEUED_DELTAS < len(tokens) and isinstance(end, Finished)
    assert "".join(d.text for d in deltas) + end.text == " hello world" * 4
    assert streamer.streams == {}


async def test_a_request_keeping_control_tokens_gets_them_as_text(demo_tokenizer):
    """Mistral's tool calls are written in control tokens: for them the text keeps them."""
    marker = demo_tokenizer.encode("<|im_start|>", add_special_tokens=False)  # a special token
    ids = [*marker, *demo_tokenizer.encode(" hi", add_special_tokens=False)]
    for keep, expected in ((True, "<|im_start|> hi"), (False, " hi")):
        replies, _, _ = await streamed(demo_tokenizer, {"a": ()}, one_by_one("a", ids), keep_special=keep)
        assert "".join(getattr(m, "text", "") for m in replies["a"]) == expected
