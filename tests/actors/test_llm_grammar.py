"""Structured output through the embedding API: `llm.generate(grammar=...)`."""

import json
import threading
import time
from functools import partial

from runtime.errors import RequestError
from runtime.grammar import GrammarCompiler, GrammarSpec
from runtime.tokenizer import Tokenizer

import jsonschema
import pytest
import trio

import actors
from actors import admission

SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"enum": [1, 2, 3]}},
    "required": ["word", "n"],
    "additionalProperties": False,
}


async def text_of(llm, prompt, **kwargs):
    async with llm.generate(prompt, max_tokens=60, **kwargs) as generation:
        return "".join([delta.text async for delta in generation]), generation.finish_reason


async def test_constrained_and_free_generations_share_the_batch(tiny):
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA), "grammar")
    results = {}
    async with actors.open_llm(tiny, max_batch=4) as llm:
        free_alone = await text_of(llm, "Hello", ignore_eos=True)

        async def one(name, **kwargs):
            results[name] = await text_of(llm, "Hello", **kwargs)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(one, "json0", grammar=grammar))
            nursery.start_soon(partial(one, "json1", grammar=grammar, temperature=1.0, seed=3))
            nursery.start_soon(partial(one, "free", ignore_eos=True))
    for name in ("json0", "json1"):
        text, reason = results[name]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == "stop"
    assert results["free"] == free_alone


async def test_a_completed_grammar_finishes_on_its_last_token(tiny):
    """Nothing but EOS could follow: the row stops there, not a step later on an EOS."""
    async with actors.open_llm(tiny) as llm:
        grammar = GrammarSpec("regex", "x", "grammar")  # one character: one token
        async with llm.generate("Hello", max_tokens=60, grammar=grammar) as generation:
            text = "".join([delta.text async for delta in generation])
    assert (text, generation.finish_reason) == ("x", "stop")
    assert generation.usage.completion_tokens == 1


async def test_a_grammar_that_does_not_compile_fails_start(tiny):
    async with actors.open_llm(tiny) as llm:
        with pytest.raises(RequestError) as raised:
            await text_of(llm, "Hi", grammar=GrammarSpec("regex", "([", "grammar"))
    assert raised.value.param == "grammar"


async def test_a_reply_cut_inside_a_character_keeps_the_bytes_held_for_it(tiny):
    """max_tokens ends the reply two bytes into an emoji: the detokenizer held them for
    the rest of the character, and the last delta must carry them (as U+FFFD), so the
    text is the tokens' decode, not one that silently drops what they said."""
    tokenizer = Tokenizer.from_dir(tiny)
    ids = tokenizer.encode("x😀", add_special_tokens=False)[:3]  # x and two of 😀's bytes
    async with actors.open_llm(tiny) as llm:
        grammar = GrammarSpec("regex", "x😀", "grammar")
        async with llm.generate("Hello", max_tokens=3, grammar=grammar) as generation:
            text = "".join([delta.text async for delta in generation])
    assert generation.finish_reason == "length"
    assert text == tokenizer.decode(ids) and text.startswith("x") and "\ufffd" in text


async def test_a_compile_past_its_deadline_holds_no_other_requests_thread(tiny, monkeypatch):
    """An abandoned compile runs on (llguidance cannot be stopped) on the compile
    thread: a later grammar that never gets the thread is a 503, not a 400, and plain
    requests, whose prompts are prepared on trio's worker threads, never wait for it."""
    monkeypatch.setattr(admission, "GRAMMAR_TIMEOUT_S", 0.5)
    stuck = threading.Event()
    compile_now = GrammarCompiler.compile

    def compile_slowly(self, spec):
        if spec.source == "slow":
            stuck.wait(30)
        return compile_now(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", compile_slowly)
    try:
        async with actors.open_llm(tiny, max_batch=4) as llm:
            # One worker thread for everything but compiles: a compile holding it starves all.
            trio.to_thread.current_default_thread_limiter().total_tokens = 1
            with pytest.raises(RequestError, match="longer than 0.5 s to compile"):
                await text_of(llm, "Hello", grammar=GrammarSpec("regex", "slow", "grammar"))
            with pytest.raises(actors.OverloadedError, match="'guided_regex'.*busy"):
                await text_of(llm, "Hello", grammar=GrammarSpec("regex", "[ab]+", "guided_regex"))
            with trio.fail_after(60):  # a hang guard: it waits for no compile
                text, _ = await text_of(llm, "Hello")
            assert text
    finally:
        stuck.set()


async def test_a_grammar_that_waited_for_the_compile_thread_still_gets_its_own_time(
    tiny, monkeypatch
):
    """One deadline covered the wait and the compile: a grammar queued behind another
    and then quick to compile was refused as too slow, a 400 blaming the client."""
    monkeypatch.setattr(admission, "GRAMMAR_TIMEOUT_S", 1.0)
    compile_now = GrammarCompiler.compile
    seconds = {"[a]+": 0.5, "[b]+": 0.7}  # the second starts at 0.5 and ends at 1.2

    def compile_slowly(self, spec):
        time.sleep(seconds[spec.source])
        return compile_now(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", compile_slowly)
    texts = {}
    async with actors.open_llm(tiny, max_batch=4) as llm:

        async def one(source):
            grammar = GrammarSpec("regex", source, "guided_regex")
            texts[source], _ = await text_of(llm, "Hello", grammar=grammar)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "[a]+")
            await trio.sleep(0.05)  # the first has the thread
            nursery.start_soon(one, "[b]+")
    assert set(texts["[a]+"]) == {"a"} and set(texts["[b]+"]) == {"b"}
