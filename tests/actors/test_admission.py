"""Admission's sans-IO parts: how a request becomes SequenceParams (`prepare`) and
which grammar its output must match (`grammar_spec`), on the demo tokenizer."""

import json
import shutil
import threading

from runtime.errors import RequestError
from runtime.glm45_reply import GLM45_TAGS
from runtime.grammar import GrammarCompiler, GrammarSpec
from runtime.sequence import SamplingParams
from runtime.tokenizer import Tokenizer
from runtime.tool_grammars import tool_call_grammar
from runtime.tools import HERMES_TAGS, SEED_TAGS

import pytest
import tokenizers
import trio

from actors.admission import Admission
from actors.messages import Admit
from actors.requests import GenerateRequest
from tests.actors.conftest import DEMO_DIR

MAX_CONTEXT = 256
TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}},
        },
    },
)
ASK = ({"role": "user", "content": "What time is it?"},)
JSON_ANSWER = GrammarSpec("json_object", "", "response_format")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(DEMO_DIR)


def admission_for(tokenizer, *, tool_style="hermes", grammars=None):
    to_scheduler, _ = trio.open_memory_channel(1)
    to_streamer, _ = trio.open_memory_channel(1)
    _, inbox = trio.open_memory_channel(1)
    return Admission(
        tokenizer,
        MAX_CONTEXT,
        tokenizer.vocab_size,
        None,
        inbox,
        to_scheduler,
        to_streamer,
        trio.Semaphore(1),
        grammars,
        tool_style,
    )


def prepared(tokenizer, **request):
    return admission_for(tokenizer).prepare(GenerateRequest(**request), "r1")


def test_a_text_prompt_is_tokenized_and_token_ids_are_taken_as_they_are(tokenizer):
    text = prepared(tokenizer, prompt="Hello there", max_tokens=4)
    assert text.prompt_tokens == tuple(tokenizer.encode("Hello there"))
    ids = prepared(tokenizer, prompt=(5, 6, 7), max_tokens=4)
    assert ids.prompt_tokens == (5, 6, 7)


def test_the_params_carry_the_requests_own_settings(tokenizer):
    sampling = SamplingParams(temperature=0.5, seed=3)
    params = prepared(
        tokenizer, prompt=(5, 6), max_tokens=9, sampling=sampling, ignore_eos=True, priority=2
    )
    assert (params.max_tokens, params.sampling, params.ignore_eos) == (9, sampling, True)
    assert (params.request_id, params.priority) == ("r1", 2)


def test_chat_messages_are_rendered_through_the_chat_template(tokenizer):
    params = prepared(tokenizer, messages=ASK, max_tokens=4)
    assert params.prompt_tokens == tuple(tokenizer.encode_chat(list(ASK)))


def test_tools_reach_the_prompt_unless_tool_choice_is_none(tokenizer):
    bare = prepared(tokenizer, messages=ASK, max_tokens=4).prompt_tokens
    none = prepared(tokenizer, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    auto = prepared(tokenizer, messages=ASK, tools=TOOLS, max_tokens=4)
    assert none.prompt_tokens == bare
    assert len(auto.prompt_tokens) > len(bare)
    assert "get_time" in tokenizer.decode(list(auto.prompt_tokens))


def test_a_template_that_knows_tools_is_given_them_itself(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if tools %} tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(tmp_path)
    params = prepared(tokenizer, messages=ASK, tools=TOOLS, max_tokens=4)
    assert tokenizer.decode(list(params.prompt_tokens)) == "What time is it? tools: get_time"


def with_template(tmp_path, template):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(tmp_path)


# Knows tools, reads a past call's arguments as a mapping (as Qwen3-Coder's does), and
# refuses a system turn in its own words.
READS_A_MAPPING = (
    "{% if tools %}tools {% endif %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('no system turns here') }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments|items %}{{ k }}{% endfor %}{% endfor %}"
    "{{ m['content'] or '' }}{% endfor %}"
)


def test_a_past_calls_arguments_of_no_object_are_named_unless_the_template_refuses_the_chat_for_more(
    tmp_path,
):
    """A template that reads arguments as a mapping refused in its own words, naming no
    message: the 400 names the arguments, but only where the chat renders with objects
    there; a chat refused for something else too keeps the template's own words."""
    tokenizer = with_template(tmp_path, READS_A_MAPPING)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "[1, 2]"}}
    history = (*ASK, {"role": "assistant", "content": None, "tool_calls": [call]})
    with pytest.raises(RequestError) as raised:
        prepared(tokenizer, messages=history, tools=TOOLS, max_tokens=4)
    where = "messages[1].tool_calls[0].function.arguments"
    assert raised.value.param == where
    assert str(raised.value).startswith(f"{where} must be a JSON object's text")
    with pytest.raises(RequestError, match="no system turns here") as raised:
        prepared(tokenizer, messages=({"role": "system", "content": "Hi."}, *history), tools=TOOLS, max_tokens=4)
    assert raised.value.param != where


@pytest.mark.parametrize(  # the default, else what the context leaves
    ("prompt_length", "max_tokens"), [(10, 16), (MAX_CONTEXT - 4, 4), (MAX_CONTEXT - 1, 1)]
)
def test_default_max_tokens_is_cut_to_the_room_the_context_leaves(
    tokenizer, prompt_length, max_tokens
):
    params = prepared(tokenizer, prompt=(5,) * prompt_length, default_max_tokens=16)
    assert params.max_tokens == max_tokens


def test_an_explicit_max_tokens_overrides_the_default(tokenizer):
    params = prepared(tokenizer, prompt=(5,) * 10, max_tokens=30, default_max_tokens=16)
    assert params.max_tokens == 30


def test_without_max_tokens_or_a_default_the_row_runs_until_the_context_is_full(tokenizer):
    assert prepared(tokenizer, prompt=(5,) * 10).max_tokens is None


def test_a_prompt_that_fills_the_context_is_blamed_though_max_tokens_was_defaulted(tokenizer):
    with pytest.raises(RequestError, match="maximum context length is 256 tokens") as raised:
        prepared(tokenizer, prompt=(5,) * MAX_CONTEXT, default_max_tokens=16)
    assert (raised.value.param, raised.value.code) == ("prompt", "context_length_exceeded")


def test_a_chat_past_the_context_names_messages(tokenizer):
    with pytest.raises(RequestError) as raised:
        prepared(tokenizer, messages=ASK, max_tokens=MAX_CONTEXT)
    assert raised.value.param == "max_tokens"
    with pytest.raises(RequestError) as raised:
        prepared(tokenizer, messages=({"role": "user", "content": "word " * MAX_CONTEXT},))
    assert raised.value.param == "messages"


def spec_of(tokenizer, tool_style="hermes", **request):
    return admission_for(tokenizer, tool_style=tool_style).grammar_spec(GenerateRequest(**request))


def test_no_grammar_and_no_forced_call_constrains_nothing(tokenizer):
    assert spec_of(tokenizer, messages=ASK, tools=TOOLS) is None


@pytest.mark.parametrize(("choice", "name"), [("required", None), ("function", "get_time")])
def test_a_forced_tool_call_is_the_grammar(tokenizer, choice, name):
    got = spec_of(tokenizer, messages=ASK, tools=TOOLS, tool_choice=choice, tool_name=name)
    assert got == tool_call_grammar("hermes", TOOLS, name)


def test_auto_beside_a_response_format_may_call_a_tool_or_answer_in_the_format(tokenizer):
    got = spec_of(tokenizer, messages=ASK, tools=TOOLS, grammar=JSON_ANSWER)
    assert got == tool_call_grammar("hermes", TOOLS, None, JSON_ANSWER)
    assert got != JSON_ANSWER


@pytest.mark.parametrize(
    ("request_", "tool_style"),
    [
        (dict(grammar=JSON_ANSWER), "hermes"),  # no tools to call
        (dict(grammar=JSON_ANSWER, tools=TOOLS, tool_choice="none"), "hermes"),
        (dict(grammar=JSON_ANSWER, tools=TOOLS), "llama3_json"),  # a call is bare JSON too
        (dict(grammar=GrammarSpec("regex", "[ab]+", "response_format"), tools=TOOLS), "hermes"),
        (dict(grammar=GrammarSpec("json_object", "", "guided_json"), tools=TOOLS), "hermes"),
        (
            dict(grammar=GrammarSpec("json_schema", json.dumps({"type": "object"}), "grammar")),
            "hermes",
        ),
    ],
    ids=["no tools", "tool_choice none", "llama3_json", "not json", "guided", "embedding"],
)
def test_otherwise_the_requests_own_grammar_holds_the_whole_reply(tokenizer, request_, tool_style):
    got = spec_of(tokenizer, tool_style, messages=ASK, **request_)
    assert got == request_["grammar"]


async def test_structured_output_without_a_grammar_compiler_is_refused_naming_the_field(
    tokenizer,
):
    with pytest.raises(RequestError, match="structured output is not available") as raised:
        await admission_for(tokenizer)._compile(GrammarSpec("regex", "[ab]+", "guided_regex"))
    assert raised.value.param == "guided_regex"


async def test_a_grammar_is_compiled_for_the_request_and_a_bad_one_is_refused_naming_it(
    tokenizer,
):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    admission = admission_for(tokenizer, grammars=compiler)
    spec = GrammarSpec("regex", "[ab]+", "guided_regex")
    assert (await admission._compile(spec)).spec == spec
    with pytest.raises(RequestError) as raised:
        await admission._compile(GrammarSpec("regex", "([", "grammar"))
    assert raised.value.param == "grammar"


@pytest.mark.parametrize(
    ("tool_style", "request_", "expected"),
    [
        ("mistral", dict(tools=TOOLS), True),
        ("mistral", dict(tools=TOOLS, tool_choice="none"), False),
        ("mistral", dict(), False),
        ("hermes", dict(tools=TOOLS), False),
        ("harmony", dict(), True),
        ("harmony", dict(tools=TOOLS, tool_choice="none"), True),
        ("harmony", dict(messages=None, prompt="raw"), False),
    ],
)
def test_mistral_requests_offering_tools_and_harmony_chats_keep_control_tokens_in_their_text(
    tokenizer, tool_style, request_, expected
):
    """Mistral's calls are [TOOL_CALLS]name[ARGS]{...}, control tokens decoding drops;
    gpt-oss marks every message of a chat reply with them (a raw completion is text)."""
    request = GenerateRequest(**{"messages": ASK, "max_tokens": 4, **request_})
    assert admission_for(tokenizer, tool_style=tool_style).keeps_control_tokens(request) is expected


@pytest.mark.parametrize(
    ("tool_style", "tags", "expected"),
    [
        ("hermes", HERMES_TAGS, True),  # Granite 4.0's tokenizer holds them so
        ("glm45", GLM45_TAGS[2:], True),  # its key and value tags alone
        ("seed_oss", SEED_TAGS, True),
        ("hermes", SEED_TAGS, False),  # another style's tags
        # Their markers always are: Nemotron's <TOOLCALL>, Granite 3's <|tool_call|>,
        # LFM2's <|tool_call_start|>; OLMo 3's <function_calls> may be.
        *((style, (), True) for style in ("nemotron", "granite", "lfm2", "olmo3")),
    ],
)
def test_a_style_whose_call_tags_are_control_tokens_keeps_them_in_a_request_offering_tools(tool_style, tags, expected):
    """Decoding drops control tokens: a style's call tags that are (special added tokens)
    are kept in the text of a request offering tools, where its parser reads them."""
    backend = tokenizers.Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    backend.add_special_tokens(list(tags))
    admission = admission_for(Tokenizer(backend), tool_style=tool_style)
    offering = GenerateRequest(messages=ASK, max_tokens=4, tools=TOOLS)
    assert admission.keeps_control_tokens(offering) is expected
    assert not admission.keeps_control_tokens(GenerateRequest(messages=ASK, max_tokens=4))


async def test_the_track_sent_for_a_mistral_request_offering_tools_keeps_control_tokens(tokenizer):
    to_scheduler, _submitted = trio.open_memory_channel(4)
    to_streamer, tracks = trio.open_memory_channel(4)
    _, inbox = trio.open_memory_channel(1)
    admission = Admission(
        tokenizer, MAX_CONTEXT, tokenizer.vocab_size, None, inbox, to_scheduler, to_streamer,
        trio.Semaphore(2), None, "mistral",
    )
    for tools, expected in ((TOOLS, True), ((), False)):
        admission.reserve()
        reply, _replies = trio.open_memory_channel(4)
        request = GenerateRequest(messages=ASK, max_tokens=4, tools=tools)
        await admission._admit(Admit("r", request, reply, 0.0))
        assert tracks.receive_nowait().keep_special_tokens is expected


async def test_a_caller_that_leaves_while_its_prompt_is_prepared_has_its_slot_back_at_once(tokenizer):
    """A 4 MB prompt takes seconds to tokenize, on a thread nothing can stop: four such
    callers that hung up held four waiting slots until it ended, and every other
    request got a 503. The threads are abandoned; the one waiting for a thread too."""
    to_scheduler, submitted = trio.open_memory_channel(4)
    to_streamer, _tracks = trio.open_memory_channel(4)
    _, inbox = trio.open_memory_channel(1)
    slots, tokenizing, done = trio.Semaphore(2), threading.Event(), threading.Event()
    started = []

    class SlowAdmission(Admission):
        def prepare(self, request, request_id):
            started.append(request_id)
            tokenizing.set()
            done.wait(10)
            return super().prepare(request, request_id)

    admission = SlowAdmission(
        tokenizer, MAX_CONTEXT, tokenizer.vocab_size, None, inbox, to_scheduler, to_streamer,
        slots, prepare_threads=trio.CapacityLimiter(1),
    )
    async with trio.open_nursery() as nursery:
        replies = []
        for request_id in ("slow", "queued"):
            admission.reserve()
            reply, receive = trio.open_memory_channel(4)
            replies.append(receive)
            nursery.start_soon(admission._admit, Admit(request_id, GenerateRequest(prompt="hi", max_tokens=2), reply, 0.0))
        await trio.to_thread.run_sync(tokenizing.wait)
        assert slots.value == 0
        with trio.fail_after(2):
            for receive in replies:
                receive.close()
            while slots.value < 2:
                await trio.sleep(0.01)
        assert len(started) == 1  # the other never took a thread: the limiter's one was busy
        done.set()
    assert submitted.statistics().current_buffer_used == 0
