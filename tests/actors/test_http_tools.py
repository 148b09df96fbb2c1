"""Tools and structured output through real HTTP, read by the official openai client.

Random weights never choose to call a tool, so calls are forced: by `tool_choice`
required or named (a grammar), or, for `auto`, by a guided regex that writes a call
which the parser must then find. Each tool-call format runs on a tiny checkpoint
whose chat template takes tools (tests/actors/tool_templates.py).
"""

import http.client
import json
import pathlib
import re
import urllib.parse

from runtime.glm45_reply import GLM45_TAGS
from runtime.think_reply import THINK_TAGS
from runtime.tokenizer import Tokenizer
from runtime.tools import HERMES_TAGS, SEED_TAGS

import jsonschema
import openai
import pytest
import transformers

from tests.actors import tool_templates
from tests.actors.test_http import in_thread, request, serving
from tests.actors.tool_templates import TEMPLATES, with_markers, with_template

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def shape_for(style):
    """The tiny checkpoint's shape for `style`: Command R7B's template writes a long
    preamble (about 2,500 demo tokens), past the demo's context."""
    return {"max_position_embeddings": 4096} if style == "command_r7b" else {}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def styled(request, make_checkpoint, tmp_path_factory):
    """(tool style, a tiny checkpoint whose template writes calls in that style)."""
    out = tmp_path_factory.mktemp("tools") / request.param
    return request.param, with_template(make_checkpoint("llama", **shape_for(request.param)), out, TEMPLATES[request.param])


def whole(server, **body):
    return server.client().chat.completions.create(model=server.model, **body)


def streamed(server, **body):
    """(content, calls as {index: [id, name, arguments]}, finish_reason) from the deltas."""
    content, calls, finish = "", {}, None
    for chunk in server.client().chat.completions.create(model=server.model, stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:  # the first delta: id, type and name
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index][2] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
async def test_forced_calls_streamed_reassemble_to_the_whole_call(styled, choice):
    style, checkpoint = styled
    body = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80)
    async with serving(checkpoint) as server:
        assert server.llm.tool_style == style
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # Mistral's templates take back only ids of 9 letters and digits.
    assert re.fullmatch("[A-Za-z0-9]{9}" if style == "mistral" else "call_[0-9a-f]{24}", call.id)
    assert call.type == "function"
    # Greedy, so the stream is the same reply: its deltas add up to the whole call.
    assert (content, finish) == ("", "tool_calls")
    assert [(name, arguments) for _, name, arguments in calls.values()] == [
        (call.function.name, call.function.arguments)
    ]


CALL_TEXT = {
    "hermes": 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
    "gemma": 'Checking.\n```tool_code\nget_weather(city="Rome", days=2)\n```',
    "mistral": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}',
    "qwen3_coder": "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "olmo3": 'Checking.<function_calls>get_weather(city="Rome", days=2)</function_calls>',
    "granite": 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
    "glm4": 'get_weather\n{"city": "Rome", "days": 2}',  # a reply of a call alone: no text before
    "lfm2": 'Checking.<|tool_call_start|>[get_weather(city="Rome", days=2)]<|tool_call_end|>',
    "glm45": "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    "seed_oss": "Checking.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>\n"
    "<parameter=days>2</parameter>\n</function>\n</seed:tool_call>",
    "command_r7b": 'Checking.<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
    '"parameters": {"city": "Rome", "days": 2}}]<|END_ACTION|>',
}


async def test_auto_finds_the_call_the_model_writes(styled):
    """A guided regex makes the model write a call in its format; `auto` must parse it."""
    style, checkpoint = styled
    text = CALL_TEXT[style]
    regex = "".join("\\" + c if c in "{}[]().*+?|^$\\" else c for c in text)
    body = dict(messages=ASK, tools=TOOLS, max_tokens=120, extra_body={"guided_regex": regex})
    async with serving(checkpoint) as server:
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
        plain = await in_thread(whole, server, **{**body, "tool_choice": "none"})
        untooled = await in_thread(whole, server, **{k: v for k, v in body.items() if k != "tools"})
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 2})
    ]
    expected_content = None if style in ("llama3_json", "glm4") else "Checking."
    assert message.content == expected_content
    assert (content or None, finish) == (expected_content, "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    # With tool_choice none the same text is just text, and the tools stay out of the prompt.
    assert plain.choices[0].message.content == text and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage.prompt_tokens == untooled.usage.prompt_tokens < done.usage.prompt_tokens


def literally(text):
    """A guided regex that makes the model write exactly `text`."""
    return "".join("\\" + c if c in "{}[]().*+?|^$\\" else c for c in text)


@pytest.fixture(scope="module")
def checkpoint_for(make_checkpoint, tmp_path_factory):
    """style -> a tiny checkpoint whose template writes calls in that style."""
    return lambda style: with_template(
        make_checkpoint("llama", **shape_for(style)), tmp_path_factory.mktemp("tools") / style, TEMPLATES[style]
    )


async def answers_writing(checkpoint, text, max_tokens=120):
    """The whole and the streamed answer of a model made to write exactly `text`."""
    body = dict(
        messages=ASK,
        tools=TOOLS,
        max_tokens=max_tokens,
        extra_body={"guided_regex": literally(text)},
    )
    async with serving(checkpoint) as server:
        done = await in_thread(whole, server, **body)
        return done, await in_thread(streamed, server, **body)


async def test_arguments_that_are_no_json_stream_without_the_closing_marker(checkpoint_for):
    """The demo tokenizer spells `</tool_call>` in pieces, so a delta ends inside it:
    arguments that are no JSON run to the marker, and its first pieces went out as
    argument text before it was whole."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": city=Rome}\n</tool_call>'
    done, (content, calls, finish) = await answers_writing(checkpoint_for("hermes"), text)
    (call,) = done.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", "city=Rome}\n")
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", "city=Rome}\n")]
    assert (content, finish) == ("", "tool_calls")


async def test_a_python_tag_inside_a_llama3_argument_is_kept(checkpoint_for):
    """Only a call's leading `<|python_tag|>` is markup; the first one anywhere, here
    in an argument's text, was blanked to spaces."""
    text = '{"name": "get_weather", "parameters": {"city": "<|python_tag|>"}}'
    done, (content, calls, finish) = await answers_writing(checkpoint_for("llama3_json"), text)
    (call,) = done.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "<|python_tag|>"}
    assert [a for _, _, a in calls.values()] == [call.function.arguments]
    assert (content, finish) == ("", "tool_calls")


async def test_lfm2_json_list_calls_are_calls_whole_and_streamed(checkpoint_for):
    """LFM2 writes its calls as a JSON list of {"name", "arguments"} where its system
    prompt asks for JSON: that list was content, its markers and all."""
    text = (
        'Checking.<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]<|tool_call_end|>'
    )
    done, (content, calls, finish) = await answers_writing(checkpoint_for("lfm2"), text, max_tokens=150)
    message = done.choices[0].message
    expected = [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert (message.content, done.choices[0].finish_reason) == ("Checking.", "tool_calls")
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.parametrize(
    ("style", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": NaN, "days": [Infinity]}}\n</tool_call>'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": NaN, "days": [-Infinity]}}'),
    ],
)
async def test_nan_or_infinity_in_arguments_is_null_streamed_or_not(checkpoint_for, style, text):
    """Python's json writes and reads NaN and Infinity, no JSON reader of a client's
    does: the arguments went out as written, and JSON.parse refused the whole call."""
    done, (content, calls, finish) = await answers_writing(checkpoint_for(style), text)
    (call,) = done.choices[0].message.tool_calls
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]
    assert json.loads(call.function.arguments, parse_constant=pytest.fail) == {"city": None, "days": [None]}
    assert (content, finish, done.choices[0].finish_reason) == ("", "tool_calls", "tool_calls")


@pytest.mark.parametrize(
    ("style", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": null}\n</tool_call>'),
        ("llama3_json", '{"parameters": null, "name": "get_weather"}'),
        ("mistral", "[TOOL_CALLS]get_weather[ARGS]null"),
    ],
)
async def test_arguments_written_as_null_are_an_empty_object_streamed_or_not(checkpoint_for, style, text):
    """OpenAI's arguments are a JSON object's text: "null" went out, which a client's
    `json.loads` reads as None, no arguments to call a function with."""
    done, (content, calls, finish) = await answers_writing(checkpoint_for(style), text)
    (call,) = done.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", "{}")
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", "{}")]
    assert (content, finish, done.choices[0].finish_reason) == ("", "tool_calls", "tool_calls")


NOTE = "Rome is the city of seven hills and of many fountains, of old walls and narrow streets"
LONG_CALL = {
    "hermes": 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"note": "%s"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"note": "%s"}}',
    "gemma": 'Checking.\n```tool_code\n{"name": "get_weather", "arguments": {"note": "%s"}}\n```',
    "mistral": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"note": "%s"}',
    "qwen3_coder": "Checking. <tool_call>\n<function=get_weather>\n<parameter=note>\n%s\n</parameter>\n</function>\n</tool_call>",
    "olmo3": 'Checking.<function_calls>get_weather(note="%s")</function_calls>',
    "granite": 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"note": "%s"}}]',
    "glm4": 'get_weather\n{"note": "%s"}',
    "lfm2": 'Checking.<|tool_call_start|>[get_weather(note="%s")]<|tool_call_end|>',
    "glm45": "Checking. <tool_call>get_weather\n<arg_key>note</arg_key>\n<arg_value>%s</arg_value>\n</tool_call>",
    "seed_oss": "Checking. <seed:tool_call>\n<function=get_weather>\n<parameter=note>%s</parameter>\n</function>\n"
    "</seed:tool_call>",
    "command_r7b": 'Checking.<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"note": "%s"}}]'
    "<|END_ACTION|>",
}
CUT_CONTENT = {  # the markup is left out, as of a call cut before its name is whole
    "hermes": 'Checking. {"name": "get_weather", "arguments": {"note": "Rome is',
    "llama3_json": '{"name": "get_weather", "parameters": {"note": "Rome is',
    "gemma": 'Checking.\n{"name": "get_weather", "arguments": {"note": "Rome is',
    "mistral": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"note": "Rome is',
    "qwen3_coder": "Checking. <function=get_weather>\n<parameter=note>\nRome is",
    "olmo3": 'Checking.<function_calls>get_weather(note="Rome is',
    "granite": 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"note": "Rome is',
    "glm4": 'get_weather\n{"note": "Rome is',
    "lfm2": 'Checking.<|tool_call_start|>[get_weather(note="Rome is',
    "glm45": "Checking. get_weather\n<arg_key>note</arg_key>\n<arg_value>Rome is",
    "seed_oss": "Checking. <function=get_weather>\n<parameter=note>Rome is",
    "command_r7b": 'Checking.<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"note": "Rome is',
}


async def test_a_call_max_tokens_ends_in_is_text_in_the_whole_response(styled):
    """Cut inside its arguments, a call was a whole response's call, its arguments no
    JSON. Now it is the text it is, in content, as vLLM gives it, and finish_reason is
    "length"; streamed, it goes out as written, and "length" says it stops short."""
    style, checkpoint = styled
    text = LONG_CALL[style] % (NOTE * 3)
    done, (content, calls, finish) = await answers_writing(checkpoint, text, max_tokens=60)
    (choice,) = done.choices
    assert choice.finish_reason == finish == "length"
    assert choice.message.tool_calls is None
    assert choice.message.content.startswith(CUT_CONTENT[style])
    if style in ("gemma", "mistral", "olmo3", "granite", "glm4", "lfm2", "command_r7b"):  # their calls go out when whole
        assert (content, calls) == (choice.message.content, {})
        return
    ((_, name, arguments),) = calls.values()
    if style in ("qwen3_coder", "glm45", "seed_oss"):  # their arguments go out a pair at a time: none closed
        assert (content, name, arguments) == ("Checking.", "get_weather", "")
        return
    assert (content, name) == (CUT_CONTENT[style].split("{")[0].strip(), "get_weather")
    assert arguments.startswith('{"note": "Rome is') and choice.message.content.endswith(arguments)


async def test_a_tool_history_is_accepted_and_shapes_the_prompt(styled):
    _, checkpoint = styled
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and warm"},
    ]
    async with serving(checkpoint) as server:
        short = await in_thread(whole, server, messages=ASK, tools=TOOLS, max_tokens=1)
        longer = await in_thread(whole, server, messages=history, tools=TOOLS, max_tokens=1)
        bare = await in_thread(whole, server, messages=ASK, max_tokens=1)
    assert longer.usage.prompt_tokens > short.usage.prompt_tokens > bare.usage.prompt_tokens


async def test_past_call_arguments_of_no_object_render_or_are_a_400_naming_them(styled):
    """A past call's arguments that are no JSON object's text (a client's mistake) were
    a 400 in the template's own words where it reads them as a mapping ("Can only get
    item pairs from a mapping", naming `messages`): now one naming the field. Other
    templates write them as sent; `null` is no arguments, `{}`, in every one."""
    style, checkpoint = styled
    reads_a_mapping = style in ("qwen3_coder", "olmo3", "glm45", "seed_oss")
    answers = {}
    async with serving(checkpoint) as server:
        for arguments in ("{oops", "[1, 2]", "7", '"text"', "null"):
            call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
            payload = {"model": server.model, "messages": history, "tools": TOOLS, "max_tokens": 1}
            answers[arguments] = await in_thread(request, server.url, "POST", "/v1/chat/completions", payload)
    assert answers.pop("null")[0] == 200
    for arguments, (status, _, answer) in answers.items():
        if not reads_a_mapping:
            assert status == 200, (arguments, answer)
            continue
        assert status == 400, (arguments, answer)
        where = "messages[1].tool_calls[0].function.arguments"
        assert answer["error"]["param"] == where, arguments
        assert answer["error"]["message"].startswith(f"{where} must be a JSON object's text"), arguments


async def test_a_named_tool_use_template_renders_a_chat_with_tools_and_sets_the_format(
    make_checkpoint, tmp_path
):
    """A Hermes-style checkpoint names a `default` template and a `tool_use` one: a chat
    with tools is rendered through `tool_use`, as transformers renders it, and the call
    format is read from it; a chat without tools keeps `default`."""
    named = [
        {"name": "default", "template": TEMPLATES["gemma"]},
        {"name": "tool_use", "template": TEMPLATES["llama3_json"]},
    ]
    checkpoint = with_template(make_checkpoint("llama"), tmp_path / "named", named)
    reference = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    async with serving(checkpoint) as server:
        assert server.llm.tool_style == "llama3_json"
        tooled = await in_thread(
            whole, server, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80
        )
        bare = await in_thread(whole, server, messages=ASK, max_tokens=1)
    for usage, tools in ((tooled.usage, TOOLS), (bare.usage, None)):
        want = reference.apply_chat_template(
            ASK, tools=tools, add_generation_prompt=True, return_dict=False
        )
        assert usage.prompt_tokens == len(want)
    (call,) = tooled.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
async def test_response_format_json_schema_validates(tiny, stream):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    async with serving(tiny) as server:
        client = server.client()
        args = dict(
            model=server.model, messages=ASK, max_tokens=60, response_format=response_format
        )
        if stream:
            chunks = await in_thread(
                lambda: list(client.chat.completions.create(**args, stream=True))
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            done = await in_thread(client.chat.completions.create, **args)
            text, finish = done.choices[0].message.content, done.choices[0].finish_reason
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == "stop"


async def test_the_vllm_style_extensions_constrain_text(tiny):
    async with serving(tiny) as server:
        client = server.client()

        def complete(**extra):
            done = client.completions.create(
                model=server.model, prompt="Answer:", max_tokens=40, extra_body=extra
            )
            return done.choices[0].text

        assert await in_thread(complete, guided_choice=["alpha", "beta"]) in ("alpha", "beta")
        assert (await in_thread(complete, structured_outputs={"regex": "[0-9]{4}"})).isdigit()
        grammar = 'start: "(" WORD ")"\nWORD: /[a-z]{2,5}/'
        text = await in_thread(complete, guided_grammar=grammar)
        assert text.startswith("(") and text.endswith(")") and text[1:-1].isalpha()
        # A bias towards "}" (token 95) would write "}}}..." free; JSON mode makes it "{}".
        obj = await in_thread(
            complete, response_format={"type": "json_object"}, logit_bias={"95": 30}
        )
        assert json.loads(obj) == {}
        cut = await in_thread(
            client.completions.create,
            model=server.model,
            prompt="x",
            max_tokens=2,
            extra_body={"guided_json": PERSON},
        )
        assert cut.choices[0].finish_reason == "length"  # a JSON cut short, as OpenAI does


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        # A name is required, and a string (any: it changes nothing).
        *(
            (
                {"response_format": {"type": "json_schema", "json_schema": spec}},
                "response_format.json_schema.name",
            )
            for spec in ({"schema": {}}, {"name": None, "schema": {}}, {"name": 7})
        ),
        ({"guided_regex": "([a-z]"}, "guided_regex"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"guided_regex": "a{100000}{100000}"}, "guided_regex"),  # past the lexer's limits
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        (  # two tools by one name: a call to it would be ambiguous
            {"tools": [TOOLS[0], {"type": "function", "function": {"name": "get_weather"}}]},
            "tools[1].function.name",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0]",
        ),
    ],
)
async def test_bad_structured_output_or_tools_are_a_400_naming_the_field(tiny, body, param):
    async with serving(tiny) as server:
        payload = {"model": server.model, "messages": ASK, "max_tokens": 4, **body}
        status, _, answer = await in_thread(
            request, server.url, "POST", "/v1/chat/completions", payload
        )
    assert status == 400, answer
    assert (
        answer["error"]["param"] == param
        and param.split(".")[0].split("[")[0] in answer["error"]["message"]
    )


async def test_tool_settings_without_tools_are_a_400_as_openais(tiny):
    """parallel_tool_calls without tools was accepted, and did nothing: OpenAI answers
    400 to it, as to a tool_choice without tools."""
    async with serving(tiny) as server:
        for field, value in (("parallel_tool_calls", False), ("tool_choice", "none")):
            with pytest.raises(openai.BadRequestError) as raised:
                await in_thread(whole, server, messages=ASK, max_tokens=2, **{field: value})
            assert raised.value.param == field
            assert f"'{field}' is only allowed when 'tools' are specified" in str(raised.value)
        done = await in_thread(
            whole, server, messages=ASK, max_tokens=2, tools=TOOLS, parallel_tool_calls=False
        )
    assert done.usage.completion_tokens >= 1


async def test_an_empty_tools_list_is_no_tools(tiny):
    """`tools: []` is no tools, not OpenAI's 400 ("[] is too short"): agent clients
    send it when they have none to offer (Koog, kimi-cli, pi --no-tools, LangGraph
    after a revoke), and vLLM's 400 to it broke each of them."""
    async with serving(tiny) as server:
        empty = await in_thread(whole, server, messages=ASK, max_tokens=3, tools=[])
        plain = await in_thread(whole, server, messages=ASK, max_tokens=3)
        with pytest.raises(openai.BadRequestError) as raised:  # as beside no tools at all
            await in_thread(whole, server, messages=ASK, max_tokens=3, tools=[], tool_choice="auto")
    assert raised.value.param == "tool_choice"
    assert empty.usage.prompt_tokens == plain.usage.prompt_tokens
    assert empty.choices[0].message.content == plain.choices[0].message.content


async def test_an_unknown_key_in_a_tool_is_a_400_naming_it_and_one_in_a_message_is_not(tiny):
    """A typo'd `paramters` was dropped, leaving a tool without parameters. Messages
    stay lenient: OpenAI's SDK replays a reply with refusal, annotations, audio null."""
    typo = {"type": "function", "function": {"name": "get_weather", "paramters": WEATHER}}
    misplaced = {**TOOLS[0], "strict": True}  # strict belongs inside `function`
    async with serving(tiny) as server:
        for tools, param in (
            (TOOLS[:1] + [typo], "tools[1].function.paramters"),
            ([misplaced], "tools[0].strict"),
        ):
            with pytest.raises(openai.BadRequestError) as raised:
                await in_thread(whole, server, messages=ASK, max_tokens=2, tools=tools)
            assert (raised.value.param, raised.value.code) == (param, "unknown_field")
            assert param in str(raised.value)
        reply = await in_thread(whole, server, messages=ASK, max_tokens=3)
        replayed = reply.choices[0].message.model_dump()  # every field, None where unset
        assert {"refusal", "annotations", "audio"} <= replayed.keys()
        again = await in_thread(
            whole,
            server,
            messages=[*ASK, replayed, {"role": "user", "content": "And in Rome?"}],
            max_tokens=3,
            tools=[
                {
                    "type": "function",
                    "function": {**TOOLS[0]["function"], "description": "d", "strict": True},
                }
            ],
        )
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens


def raw_post(url, body) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    status, payload = response.status, response.read()
    connection.close()
    return status, payload


async def test_a_grammar_failing_mid_reply_is_the_clients_error_naming_its_field(tiny):
    """`(a{100000}{100000})?` passes the compile probe, then blows past llguidance's
    lexer limits at its second "a" (forced here by logit_bias): the client's grammar is
    at fault, so the reply is a 400 naming it (it was a 500 'generation_failed'), and
    a stream ends with an invalid_request_error event and [DONE]."""
    (a,) = Tokenizer.from_dir(tiny).encode("a", add_special_tokens=False)
    async with serving(tiny) as server:
        body = {
            "model": server.model,
            "messages": ASK,
            "max_tokens": 8,
            "guided_regex": "(a{100000}{100000})?",
            "logit_bias": {str(a): 100},
        }
        status, payload = await in_thread(raw_post, server.url, body)
        assert status == 400, payload
        error = json.loads(payload)["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "guided_regex")
        assert "too many expressions" in error["message"]
        status, payload = await in_thread(raw_post, server.url, {**body, "stream": True})
        assert status == 200
        events = [e.strip() for e in payload.split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]"
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "guided_regex")
        # The server goes on: a plain request still completes.
        done = await in_thread(whole, server, messages=ASK, max_tokens=3)
        assert done.choices[0].finish_reason == "length"


ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
MARKER = {
    "hermes": "<tool_call>",
    "gemma": "```tool_code",
    "mistral": "[TOOL_CALLS]",
    "qwen3_coder": "<tool_call>",
    "olmo3": "<function_calls>",
    "granite": "<|tool_call|>",
    "glm4": "get_",  # no marker: both tools' names begin so
    "lfm2": "<|tool_call_start|>",
    "glm45": "<tool_call>",
    "seed_oss": "<seed:tool_call>",
    "command_r7b": "<|START_ACTION|>",
}


async def test_auto_beside_a_response_format_may_call_or_answer_in_the_format(styled):
    """OpenAI's response_format shapes the content and leaves the tools callable (the
    Agents SDK sends both): the grammar was the format alone, so no call could start,
    and a forced tool_choice beside it was a 400."""
    style, checkpoint = styled
    body = dict(messages=ASK, tools=TOOLS, max_tokens=80, response_format=FORMAT)
    async with serving(checkpoint) as server:
        forced = await in_thread(whole, server, **body, tool_choice="required")
        if style in MARKER:  # random weights: the marker's first token decides the branch
            tokenizer = Tokenizer.from_dir(checkpoint)
            first = tokenizer.encode(MARKER[style], add_special_tokens=False)[0]
            called = await in_thread(whole, server, **body, logit_bias={str(first): 100})
            # The answer's "{": banning the marker's first token left others to spell it
            # ("<|tool_call|>" from "<", a GLM-4 name from "ge").
            brace = tokenizer.encode("{", add_special_tokens=False)[0]
            answered = await in_thread(whole, server, **body, logit_bias={str(brace): 100})
        else:  # Llama 3's calls are bare JSON, as the answer is: there the answer alone
            called, answered = None, await in_thread(whole, server, **body, logit_bias={})
    (call,) = forced.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if called is not None:
        assert called.choices[0].finish_reason == "tool_calls"
        (call,) = called.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    message = answered.choices[0].message
    assert message.tool_calls is None
    jsonschema.validate(json.loads(message.content), ANSWER)


async def test_a_guided_json_beside_tools_holds_the_whole_reply(styled):
    """vLLM's guided fields constrain the whole reply, tools or not: under `auto` the
    reply was a call or the answer, as if the schema were a response_format, so a model
    leaning to call broke the schema the client asked for."""
    style, checkpoint = styled
    if style not in MARKER:
        pytest.skip("Llama 3's answer stands alone beside a response_format too")
    first = Tokenizer.from_dir(checkpoint).encode(MARKER[style], add_special_tokens=False)[0]
    body = dict(messages=ASK, tools=TOOLS, max_tokens=80, logit_bias={str(first): 100})
    async with serving(checkpoint) as server:
        guided = await in_thread(whole, server, **body, extra_body={"guided_json": ANSWER})
    message = guided.choices[0].message
    assert message.tool_calls is None
    jsonschema.validate(json.loads(message.content), ANSWER)


def with_added_markers(make_checkpoint, tmp_path_factory, style, markers, *, special):
    """A `style` checkpoint whose tokenizer holds `markers` as added tokens past the demo
    vocabulary (the model has embedding rows for them), special or not."""
    size = Tokenizer.from_dir(make_checkpoint("llama")).vocab_size
    out = tmp_path_factory.mktemp("tools") / f"{style}-markers"
    checkpoint = make_checkpoint("llama", vocab_size=size + 8, **shape_for(style))
    return with_markers(checkpoint, out, TEMPLATES[style], markers, plain=() if special else markers)


@pytest.fixture(scope="module")
def mistral_with_control_tokens(make_checkpoint, tmp_path_factory):
    """[TOOL_CALLS] and [ARGS] as control tokens, as Mistral's own tokenizers hold them."""
    markers = ("[TOOL_CALLS]", "[ARGS]")
    return with_added_markers(make_checkpoint, tmp_path_factory, "mistral", markers, special=True)


async def test_a_forced_mistral_call_is_written_in_its_control_tokens_and_parsed(mistral_with_control_tokens):
    """The grammar writes the markers as the model's own control tokens (not spelled out),
    and the request offering tools keeps them in its text, where the parser finds them."""
    tokenizer = Tokenizer.from_dir(mistral_with_control_tokens)
    markers = [tokenizer.added_token_id(m) for m in ("[TOOL_CALLS]", "[ARGS]")]
    assert None not in markers
    body = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, logprobs=True)
    async with serving(mistral_with_control_tokens) as server:
        assert server.llm.tool_style == "mistral"
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    written = [entry.token for entry in choice.logprobs.content]
    assert written[0] == "[TOOL_CALLS]" and "[ARGS]" in written  # each one token, not spelled
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]


@pytest.fixture(scope="module")
def hermes_with_added_tags(make_checkpoint, tmp_path_factory):
    """<tool_call> and </tool_call> as added tokens that are not special, as Qwen 2.5's,
    Qwen 3's and QwQ's tokenizers hold them."""
    tags = ("<tool_call>", "</tool_call>")
    return with_added_markers(make_checkpoint, tmp_path_factory, "hermes", tags, special=False)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_a_forced_hermes_call_is_written_in_tags_that_are_added_tokens(hermes_with_added_tags, choice):
    """llguidance takes every added token as special and matches none against literal
    text: a grammar spelling "<tool_call>" was a 400 for every Qwen. It writes the tags
    as those tokens, which decode as text, where the parser finds the call."""
    body = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60, logprobs=True)
    async with serving(hermes_with_added_tags) as server:
        assert server.llm.tool_style == "hermes"
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    (call,) = choice_.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    written = [entry.token for entry in choice_.logprobs.content]
    assert written[0] == "<tool_call>" and written[-1] == "</tool_call>"  # each one token
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]


async def test_a_mistral_call_id_is_one_its_templates_take_back(make_checkpoint, tmp_path):
    """Mistral's templates (Nemo, Small 3.2) refuse a chat whose call ids are not 9
    alphanumeric characters: the id of a call made here, sent back with its result, was
    a 400 the client could not fix. Published Mistral-Nemo-Instruct-2407 template."""
    template = (pathlib.Path(__file__).parent / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    checkpoint = with_template(make_checkpoint("llama"), tmp_path / "nemo", template)
    async with serving(checkpoint) as server:
        assert server.llm.tool_style == "mistral"
        done = await in_thread(whole, server, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60)
        (call,) = done.choices[0].message.tool_calls
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id)
        history = [
            *ASK,
            {"role": "assistant", "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
        ]
        answer = await in_thread(whole, server, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason == "length"


async def test_call_ids_from_other_clients_reach_a_mistral_template_as_9_characters(make_checkpoint, tmp_path):
    """A chat whose calls another server or client named (OpenAI's `call_` and 24
    characters, a short `call_1`) was a 400 from Mistral's template ("Tool call IDs
    should be alphanumeric strings with length 9!"). Each id is now shown as 9 letters
    and digits, a call and its result alike. Published Mistral-Nemo-Instruct-2407 template."""
    template = (pathlib.Path(__file__).parent / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    checkpoint = with_template(make_checkpoint("llama"), tmp_path / "nemo", template)
    ids = ["call_Xq3bZk9LmN2pR7sT4vW8yA1c", "call_1", "abc-def-ghi"]
    calls = [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
        for call_id in ids
    ]
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": call_id, "content": '{"sky": "clear"}'} for call_id in ids),
    ]
    async with serving(checkpoint) as server:
        answer = await in_thread(whole, server, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason == "length"


async def test_results_without_call_ids_reach_a_mistral_template_paired_by_place(make_checkpoint, tmp_path):
    """A client that sends results without `tool_call_id` (the other templates pair
    them by place) got a 400 in Mistral's template's words: "Tool call IDs should be
    alphanumeric strings with length 9!". Published Mistral-Nemo-Instruct-2407 template."""
    template = (pathlib.Path(__file__).parent / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    checkpoint = with_template(make_checkpoint("llama"), tmp_path / "nemo", template)
    calls = [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
        for call_id in ("call_1", "call_2")
    ]
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "content": '{"sky": "clear"}'},
        {"role": "tool", "content": '{"sky": "grey"}'},
    ]
    async with serving(checkpoint) as server:
        answer = await in_thread(whole, server, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason == "length"


TYPED = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["city", "days"],
}
TYPED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": TYPED}}, TOOLS[1]]


@pytest.fixture(scope="module")
def qwen3_coder_with_added_tags(make_checkpoint, tmp_path_factory):
    """Qwen3-Coder's template, <tool_call> and </tool_call> added tokens that are not
    special, as its tokenizer holds them."""
    return with_added_markers(make_checkpoint, tmp_path_factory, "qwen3_coder", HERMES_TAGS, special=False)


def xml_parameters(*pairs):
    return "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in pairs)


@pytest.mark.parametrize("choice", ["auto", {"type": "function", "function": {"name": "now"}}])
async def test_a_qwen3_coder_tool_without_parameters_is_offered_and_called(qwen3_coder_with_added_tags, choice):
    """OpenAI takes a function without `parameters` as one of none; Qwen3-Coder's template
    reads `tool.parameters.properties`, and the chat was a 400 ('dict object' has no
    attribute 'parameters'). The template is given an empty object schema."""
    tools = [{"type": "function", "function": {"name": "now"}}, *TOOLS]
    async with serving(qwen3_coder_with_added_tags) as server:
        status, payload = await in_thread(
            raw_post,
            server.url,
            {"model": server.model, "messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 20},
        )
    assert status == 200, payload
    if choice != "auto":
        (call,) = json.loads(payload)["choices"][0]["message"]["tool_calls"]
        assert (call["function"]["name"], call["function"]["arguments"]) == ("now", "{}")


@pytest.mark.parametrize("parallel", [True, False])
async def test_qwen3_coder_calls_are_parsed_their_text_values_typed_by_the_schema(qwen3_coder_with_added_tags, parallel):
    """Qwen3-Coder's XML calls were content: its template writes `<tool_call>`, which
    made it Hermes', whose parser found no JSON in them. Each value is text; the tool's
    schema gives it its JSON type (`True` as Python writes it, the template's own)."""
    checkpoint = qwen3_coder_with_added_tags
    weather = xml_parameters(("city", "Rome"), ("days", "2"), ("metric", "True"), ("hours", "[9, 12]"))
    parts = (
        "Checking.\n", "<tool_call>", f"\n<function=get_weather>\n{weather}</function>\n", "</tool_call>",
        "\n", "<tool_call>", f"\n<function=get_time>\n{xml_parameters(('zone', 'UTC'))}</function>\n", "</tool_call>",
    )
    grammar = tool_templates.written(checkpoint, HERMES_TAGS, *parts)
    body = dict(
        messages=ASK, tools=TYPED_TOOLS, max_tokens=150, parallel_tool_calls=parallel, extra_body={"guided_grammar": grammar}
    )
    async with serving(checkpoint) as server:
        assert server.llm.tool_style == "qwen3_coder"
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    expected = [
        ("get_weather", {"city": "Rome", "days": 2, "metric": True, "hours": [9, 12]}),
        ("get_time", {"zone": "UTC"}),
    ][: 2 if parallel else 1]
    message = done.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert (message.content, done.choices[0].finish_reason) == ("Checking.", "tool_calls")
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_a_forced_qwen3_coder_call_is_its_xml_in_its_tags_tokens(qwen3_coder_with_added_tags, choice):
    body = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, logprobs=True)
    async with serving(qwen3_coder_with_added_tags) as server:
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    (call,) = choice_.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    written = [entry.token for entry in choice_.logprobs.content]
    assert written[0] == "<tool_call>" and written[-1] == "</tool_call>"  # each one token
    assert "".join(written).startswith(f"<tool_call>\n<function={call.function.name}>\n<parameter=")
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]


async def test_a_qwen3_coder_history_renders_its_calls_arguments_as_parameters(qwen3_coder_with_added_tags):
    """The template iterates `arguments|items`: the arguments' JSON text comes back in
    `messages` and must reach it as a mapping, as transformers renders it."""
    arguments = {"city": "Paris", "days": 1, "hours": [9]}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    history = [
        *ASK,
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and warm"},
    ]
    reference = transformers.AutoTokenizer.from_pretrained(str(qwen3_coder_with_added_tags))
    as_mapping = [*history[:1], {**history[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}]}, history[2]]
    prompt = reference.apply_chat_template(as_mapping, tools=TYPED_TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<parameter=city>\nParis\n</parameter>" in prompt
    async with serving(qwen3_coder_with_added_tags) as server:
        done = await in_thread(whole, server, messages=history, tools=TYPED_TOOLS, max_tokens=1)
    assert done.usage.prompt_tokens == len(reference(prompt, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def seed_oss_with_special_tags(make_checkpoint, tmp_path_factory):
    """Seed-OSS's template, <seed:tool_call> and </seed:tool_call> special tokens, as its
    tokenizer holds them."""
    return with_added_markers(make_checkpoint, tmp_path_factory, "seed_oss", SEED_TAGS, special=True)


async def test_seed_oss_calls_are_parsed_forced_in_its_tags_tokens_and_rendered_back(seed_oss_with_special_tags):
    """Seed-OSS's calls were content: its template's `<function=` made the style
    Qwen3-Coder's, whose blocks are `<tool_call>`, and a forced call was written so. Its
    tags are special tokens, kept in the text where tools are offered; its values inline."""
    checkpoint = seed_oss_with_special_tags
    weather = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in (("city", "Rome"), ("days", "2"), ("metric", "True")))
    parts = ("Checking.\n", "<seed:tool_call>", f"\n<function=get_weather>\n{weather}</function>\n", "</seed:tool_call>")
    grammar = tool_templates.written(checkpoint, SEED_TAGS, *parts)
    body = dict(messages=ASK, tools=TYPED_TOOLS, max_tokens=150, extra_body={"guided_grammar": grammar})
    arguments = {"city": "Paris", "days": 1}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    history = [
        *ASK,
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and warm"},
    ]
    async with serving(checkpoint) as server:
        assert server.llm.tool_style == "seed_oss"
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
        forced = await in_thread(whole, server, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, logprobs=True)
        rendered = await in_thread(whole, server, messages=history, tools=TYPED_TOOLS, max_tokens=1)
    message = done.choices[0].message
    expected = [("get_weather", {"city": "Rome", "days": 2, "metric": True})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert (message.content, done.choices[0].finish_reason) == ("Checking.", "tool_calls")
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    (forced_call,) = forced.choices[0].message.tool_calls
    jsonschema.validate(json.loads(forced_call.function.arguments), SCHEMAS[forced_call.function.name])
    written = [entry.token for entry in forced.choices[0].logprobs.content]
    assert written[0] == "<seed:tool_call>" and written[-1] == "</seed:tool_call>"  # each one token
    # The history's call reaches the template as a mapping, as transformers renders it.
    reference = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    as_mapping = [*history[:1], {**history[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}]}, history[2]]
    prompt = reference.apply_chat_template(as_mapping, tools=TYPED_TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>" in prompt
    assert rendered.usage.prompt_tokens == len(reference(prompt, add_special_tokens=False)["input_ids"])


R7B_THINKING = "<|START_THINKING|>", "<|END_THINKING|>"
R7B_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"
R7B_RESPONSE = "<|START_RESPONSE|>", "<|END_RESPONSE|>"


@pytest.fixture(scope="module")
def command_r7b_with_control_tokens(make_checkpoint, tmp_path_factory):
    """Command R7B's tool-use template, its action, answer and plan tags special tokens,
    as its tokenizer holds them."""
    markers = (*R7B_ACTION, *R7B_RESPONSE, *R7B_THINKING)
    return with_added_markers(make_checkpoint, tmp_path_factory, "command_r7b", markers, special=True)


async def test_command_r7b_calls_are_parsed_forced_in_its_action_tokens_and_rendered_back(command_r7b_with_control_tokens):
    """Command R7B's and Command A's calls were content, their markers dropped as special
    tokens: `[{"tool_call_id": "0", "tool_name": ...}]` reached the client as its answer.
    With tools offered its answer's tags are kept too, and left out of the content."""
    checkpoint = command_r7b_with_control_tokens
    tokenizer = Tokenizer.from_dir(checkpoint)
    no_plan = {str(tokenizer.added_token_id(R7B_THINKING[0])): -100}  # random weights may open one
    markers = (*R7B_ACTION, *R7B_RESPONSE)
    weather = '{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'
    clock = '{"tool_call_id": "1", "tool_name": "get_time", "parameters": {"zone": "UTC"}}'
    calls_grammar = tool_templates.written(checkpoint, markers, R7B_ACTION[0], f"[\n    {weather},\n    {clock}\n]", R7B_ACTION[1])
    answer_grammar = tool_templates.written(checkpoint, markers, R7B_RESPONSE[0], "It is sunny.", R7B_RESPONSE[1])
    body = dict(messages=ASK, tools=TOOLS, max_tokens=150, logit_bias=no_plan)
    arguments = {"city": "Paris", "days": 1}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and warm"},
    ]
    async with serving(checkpoint) as server:
        assert server.llm.tool_style == "command_r7b" and server.llm.thinks
        done = await in_thread(whole, server, **body, extra_body={"guided_grammar": calls_grammar})
        content, calls, finish = await in_thread(streamed, server, **body, extra_body={"guided_grammar": calls_grammar})
        answered = await in_thread(whole, server, **body, extra_body={"guided_grammar": answer_grammar})
        answer_streamed = await in_thread(streamed, server, **body, extra_body={"guided_grammar": answer_grammar})
        forced = await in_thread(whole, server, **body, tool_choice="required", logprobs=True)
        rendered = await in_thread(whole, server, messages=history, tools=TOOLS, max_tokens=1)
    message = done.choices[0].message
    expected = [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert (message.content, done.choices[0].finish_reason) == (None, "tool_calls")
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert (answered.choices[0].message.content, answered.choices[0].message.tool_calls) == ("It is sunny.", None)
    assert answer_streamed == ("It is sunny.", {}, "stop")
    (forced_call,) = forced.choices[0].message.tool_calls
    jsonschema.validate(json.loads(forced_call.function.arguments), SCHEMAS[forced_call.function.name])
    written = [entry.token for entry in forced.choices[0].logprobs.content]
    assert written[0] == R7B_ACTION[0] and written[-1] == R7B_ACTION[1]  # each one token
    assert "".join(written[1:-1]).startswith(f'[\n    {{"tool_call_id": "0", "tool_name": "{forced_call.function.name}"')
    # The template writes the call and its result itself, from `tool_calls` and the
    # `tool` turn (arguments as a mapping), as transformers renders it.
    reference = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    as_mapping = [*history[:1], {**history[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}]}, history[2]]
    prompt = reference.apply_chat_template(as_mapping, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"tool_name": "get_weather", "parameters": {"city": "Paris", "days": 1}}' in prompt
    assert '"0": "sunny and warm"' in prompt
    assert rendered.usage.prompt_tokens == len(reference(prompt, add_special_tokens=False)["input_ids"])


async def test_a_forced_command_r7b_call_follows_its_plan(command_r7b_with_control_tokens):
    """R7B plans in `<|START_THINKING|>` before it acts: the grammar waits for the plan's
    end, which is reasoning, then the call. Greedy decoding writes the tag (the grammar's
    first token is the other choice), one word, the closing tag, then the call: biases
    set for this checkpoint's logits, 2 apart at each step once presence and frequency
    penalties take 4 from a written token's (its template names both tags in its
    preamble, so a repetition penalty, which reads the prompt too, weighs them alike)."""
    tokenizer = Tokenizer.from_dir(command_r7b_with_control_tokens)
    word = tokenizer.encode("hello", add_special_tokens=False)[0]
    ids = [tokenizer.added_token_id(R7B_THINKING[0]), word, tokenizer.added_token_id(R7B_THINKING[1])]
    body = dict(
        messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0,
        logit_bias={str(token): bias for token, bias in zip(ids, (60, 70, 66), strict=True)},
        presence_penalty=2, frequency_penalty=2,
    )
    async with serving(command_r7b_with_control_tokens) as server:
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra.get("reasoning_content") == tokenizer.decode([word])
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]


# An MCP server's schema of a tool of no arguments is {"type": "object"}: no properties.
@pytest.mark.parametrize("parameters", [None, {}, {"type": "object"}, {"type": "object", "required": []}])
async def test_a_seed_oss_tool_of_no_properties_is_offered_as_one_of_empty_properties(
    seed_oss_with_special_tags, parameters
):
    """Seed-OSS's template calls `parameters.properties.items()`: a tool whose schema has
    no properties made the chat a 400 ('dict object' has no attribute 'properties'), as a
    tool without parameters had been. The template is shown an empty `properties`."""

    def offering(now):
        tools = [{"type": "function", "function": {"name": "now", **now}}, *TOOLS]
        return {"model": server.model, "messages": ASK, "tools": tools, "max_tokens": 1}

    empty = {"parameters": {"type": "object", "properties": {}}}
    async with serving(seed_oss_with_special_tags) as server:
        status, payload = await in_thread(
            raw_post, server.url, offering({} if parameters is None else {"parameters": parameters})
        )
        _, as_empty = await in_thread(raw_post, server.url, offering(empty))
    assert status == 200, payload
    assert json.loads(payload)["usage"]["prompt_tokens"] == json.loads(as_empty)["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("style", "markers", "special"),
    [
        ("olmo3", ("<function_calls>", "</function_calls>"), True),
        ("olmo3", ("<function_calls>", "</function_calls>"), False),
        ("granite", ("<|tool_call|>",), True),  # a special token, as Granite 3's tokenizer holds it
        ("lfm2", ("<|tool_call_start|>", "<|tool_call_end|>"), True),  # special, as LFM2's tokenizer holds them
        ("hermes", ("<tool_call>", "</tool_call>"), True),  # special, as Granite 4.0's tokenizer holds them
    ],
)
async def test_call_markers_that_are_added_tokens_are_written_as_those_tokens_and_parsed(
    make_checkpoint, tmp_path_factory, style, markers, special
):
    """OLMo 3's `<function_calls>` tags and Granite's `<|tool_call|>` as added tokens: a
    forced call writes them as those tokens, and a request offering tools keeps them in
    its text (decoding drops special ones), where the parser finds the call."""
    checkpoint = with_added_markers(make_checkpoint, tmp_path_factory, style, markers, special=special)
    body = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, logprobs=True)
    async with serving(checkpoint) as server:
        assert server.llm.tool_style == style
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    written = [entry.token for entry in choice.logprobs.content]
    assert written[0] == markers[0] and markers[-1] in written  # each one token, not spelled
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]


@pytest.fixture(scope="module")
def glm45_with_added_tags(make_checkpoint, tmp_path_factory):
    """GLM-4.6's template, its call tags and thinking tags added tokens that are not
    special, as GLM-4.5's and 4.6's tokenizers hold them."""
    return with_added_markers(make_checkpoint, tmp_path_factory, "glm45", (*GLM45_TAGS, *THINK_TAGS), special=False)


@pytest.mark.parametrize("parallel", [True, False])
async def test_glm45_calls_are_parsed_their_values_typed_by_the_schema(glm45_with_added_tags, parallel):
    """GLM-4.5's, 4.6's and 4.7's calls were content: their template writes `<tool_call>`,
    which made it Hermes', whose parser found no JSON in them. A string value is its text,
    any other its JSON, typed by the tool's schema; GLM-4.7's form has no newlines."""
    checkpoint = glm45_with_added_tags
    key, key_end, value, value_end = GLM45_TAGS[2:]
    weather = [
        part for k, v in (("city", "Rome"), ("days", "2"), ("metric", "true"), ("hours", "[9, 12]"))
        for part in ("\n", key, k, key_end, "\n", value, v, value_end)
    ]
    parts = (
        "Checking.\n", "<tool_call>", "get_weather", *weather, "\n", "</tool_call>",
        "<tool_call>", "get_time", key, "zone", key_end, value, "UTC", value_end, "</tool_call>",
    )
    grammar = tool_templates.written(checkpoint, GLM45_TAGS, *parts)
    body = dict(
        messages=ASK, tools=TYPED_TOOLS, max_tokens=150, parallel_tool_calls=parallel,
        extra_body={"guided_grammar": grammar, "chat_template_kwargs": {"enable_thinking": False}},
    )
    async with serving(checkpoint) as server:
        assert server.llm.tool_style == "glm45"
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    expected = [
        ("get_weather", {"city": "Rome", "days": 2, "metric": True, "hours": [9, 12]}),
        ("get_time", {"zone": "UTC"}),
    ][: 2 if parallel else 1]
    message = done.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert (message.content, done.choices[0].finish_reason) == ("Checking.", "tool_calls")
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_a_forced_glm45_call_is_written_in_its_tags_tokens(glm45_with_added_tags, choice):
    """With thinking off (the template's empty thought), the grammar writes the call from
    the first token, each tag one token."""
    body = dict(
        messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, logprobs=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    async with serving(glm45_with_added_tags) as server:
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    (call,) = choice_.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    written = [entry.token for entry in choice_.logprobs.content]
    assert written[0] == "<tool_call>" and written[-1] == "</tool_call>"
    assert "".join(written).startswith(f"<tool_call>{call.function.name}\n<arg_key>")
    assert written[-1] == "</tool_call>" and "<arg_key>" in written and "</arg_value>" in written
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]


async def test_a_forced_glm45_call_follows_the_thought(glm45_with_added_tags):
    """Thinking on (GLM's default: the prompt ends at `<|assistant|>`), the grammar waits
    for `</think>`: the thought is reasoning, then the call. Sampling writes `<think>`,
    one word that is nowhere in the prompt, `</think>` (biases 20 and more apart, and a
    repetition penalty that takes two thirds of a used token's logit), then the call."""
    tokenizer = Tokenizer.from_dir(glm45_with_added_tags)
    word = tokenizer.encode("hello", add_special_tokens=False)[0]
    ids = [tokenizer.added_token_id("<think>"), word, tokenizer.added_token_id("</think>")]
    body = dict(
        messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, seed=7,
        logit_bias={str(token): bias for token, bias in zip(ids, (100, 75, 55), strict=True)},
        extra_body={"repetition_penalty": 3.0},
    )
    async with serving(glm45_with_added_tags) as server:
        assert server.llm.thinks
        done = await in_thread(whole, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra.get("reasoning_content") == tokenizer.decode([word])
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_a_glm45_history_renders_its_calls_as_key_and_value_tags(glm45_with_added_tags):
    """The template iterates `arguments.items()`: the arguments' JSON text comes back in
    `messages` and must reach it as a mapping, as transformers renders it."""
    arguments = {"city": "Paris", "days": 1, "hours": [9]}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    history = [
        *ASK,
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and warm"},
    ]
    reference = transformers.AutoTokenizer.from_pretrained(str(glm45_with_added_tags))
    as_mapping = [*history[:1], {**history[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}]}, history[2]]
    prompt = reference.apply_chat_template(as_mapping, tools=TYPED_TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in prompt
    assert "<|observation|>\n<tool_response>\nsunny and warm\n</tool_response>" in prompt
    async with serving(glm45_with_added_tags) as server:
        done = await in_thread(whole, server, messages=history, tools=TYPED_TOOLS, max_tokens=1)
    assert done.usage.prompt_tokens == len(reference(prompt, add_special_tokens=False)["input_ids"])


async def test_a_forced_glm45_string_value_ends_at_the_closing_tag_token(glm45_with_added_tags):
    """A string's value is any text up to `</arg_value>`, which is a token that ends the
    text (the grammar's text cannot spell it): biased to it, the value closes as soon
    as it may, and the call parses back whole, typed by the schema."""
    closing = Tokenizer.from_dir(glm45_with_added_tags).added_token_id("</arg_value>")
    body = dict(
        messages=ASK, tools=TYPED_TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, logit_bias={str(closing): 100},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    async with serving(glm45_with_added_tags) as server:
        done = await in_thread(whole, server, **body)
        content, calls, finish = await in_thread(streamed, server, **body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, TYPED)
    assert call.function.name == "get_weather" and arguments["city"] == ""
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]
