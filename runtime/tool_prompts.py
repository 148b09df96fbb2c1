"""Tools on the way in: which call format a model writes and the chat it is shown (the
grammar that forces a call in that format: runtime/tool_grammars.py).

The format follows the chat template, the thing that taught the model: a template that
writes `[TOOL_CALLS]` is Mistral's, one that writes `<function=` and `<parameter=` is
Qwen3-Coder's and Qwen3.5's XML, one that writes `<function_calls>` OLMo 3's Python calls,
one that writes `<|tool_call|>` Granite 3's JSON list, one that lists the tools in
`<|tool_list_start|>` LFM2's Python call list,
one with an `<|observation|>` turn and no `<tool_call>` GLM-4-0414's name-then-JSON,
one that writes `<arg_key>` in `<tool_call>` GLM-4.5's (and 4.6's, 4.7's) key and value tags,
one that writes `<tool_call>` otherwise is Hermes/Qwen's, one
with `<|python_tag|>` or an `ipython` role is Llama 3's JSON form, and Gemma (whose template has no tools at all) gets the
```tool_code form from Google's function-calling guide. Anything else: Hermes, the
most common. Templates that take `tools` get them as transformers passes them; for one
that does not, the tool list is written into the first user turn as the guide does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

from runtime.chat_template import reads_variable
from runtime.command_r7b_reply import END_ACTION, START_ACTION
from runtime.gemma4_reply import CALL_CLOSE, CALL_OPEN, gemma4_arguments
from runtime.glm45_reply import ARG_KEY, key_value_call
from runtime.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE
from runtime.json_calls import means_no_arguments
from runtime.qwen3_coder_reply import (
    FUNCTION,
    PARAMETER,
    xml_call,
)
from runtime.tools import (
    ARGS,
    FUNCTION_CALLS,
    FUNCTION_CALLS_END,
    GRANITE_TOOL_CALL,
    LFM2_CALL_END,
    LFM2_CALL_START,
    SEED_CALL_TAG,
    SEED_TAGS,
    TOOL_CALLS,
    TOOLCALL,
    TOOLCALL_END,
)


def tool_style_for(template_source: str, model_type: str) -> str:
    """One of TOOL_STYLES for a model with this chat template and config `model_type`."""
    if TOOL_CALLS in template_source:
        return "mistral"
    if START_ACTION in template_source:
        return "command_r7b"
    if CALL_OPEN in template_source:
        return "gemma4"
    if CHANNEL in template_source and MESSAGE in template_source:
        return "harmony"
    # Seed-OSS's writes Qwen3-Coder's calls in its own blocks, so before Qwen3-Coder's.
    if SEED_CALL_TAG in template_source:
        return "seed_oss"
    # Inside `<tool_call>` too, so before Hermes: its JSON templates write neither.
    if FUNCTION in template_source and PARAMETER in template_source:
        return "qwen3_coder"
    if FUNCTION_CALLS in template_source:
        return "olmo3"
    if GRANITE_TOOL_CALL in template_source:
        return "granite"
    if TOOLCALL in template_source:  # Nemotron Nano v2's
        return "nemotron"
    # LFM2's template writes its tool list so, and never a call (they are the reply's text).
    if "<|tool_list_start|>" in template_source or LFM2_CALL_START in template_source:
        return "lfm2"
    if "<tool_call>" in template_source and ARG_KEY in template_source:
        return "glm45"
    if "<tool_call>" in template_source:
        return "hermes"
    # GLM-4-0414's and GLM-Z1's results are `observation` turns (GLM-4.5's write <tool_call>).
    if "<|observation|>" in template_source:
        return "glm4"
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3_json"
    if model_type.startswith("gemma") or "<start_of_turn>" in template_source:
        return "gemma"
    return "hermes"


def template_knows_tools(template_source: str) -> bool:
    # SmolLM3's reads its tools from `xml_tools` alone: given `tools`, it showed none.
    return reads_variable(template_source, "tools")


def tools_for_template(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as a template reads them: a function without `parameters`
    (OpenAI: no parameters) given an empty object schema, as Qwen3-Coder's template reads
    `tool.parameters.properties` and refused the chat without them; and a schema without
    `properties` ({}, an MCP server's {"type": "object"}) given empty ones, which
    Seed-OSS's template iterates (`properties.items()`)."""
    shown = []
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, Mapping):
            parameters = function.get("parameters") or {}
            if isinstance(parameters, Mapping) and "properties" not in parameters:
                parameters = {"type": "object", **parameters, "properties": {}}
                tool = {**tool, "function": {**function, "parameters": parameters}}
        shown.append(dict(tool))
    return shown


def chat_for_template(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    style: str,
    knows_tools: bool,
) -> list[dict[str, Any]]:
    """`messages` as the template wants them.

    Assistant `tool_calls` carry their arguments as JSON text on the wire; templates
    read them as objects (`arguments | tojson`), so they are parsed, as vLLM does. For
    a template without tools, calls and results become text in the model's own format,
    and the tool list goes into the first user turn.
    """
    chat = [_with_parsed_arguments(m) for m in messages]
    if style == "mistral":
        chat = _mistral_call_ids(_results_with_call_ids(chat))
    if knows_tools:
        if style == "granite":
            return _granite_turns(chat)
        if style == "nemotron":  # its template reads every turn's content as text
            return [{**m, "content": m.get("content") or ""} for m in chat]
        if style == "glm4":
            return _glm4_turns(chat)
        if style == "lfm2":
            return _lfm2_turns(chat)
        return _responses_in_turn(chat) if style == "gemma4" else chat
    chat = _results_joined(chat, [_as_text(m, style) for m in chat])
    if tools:
        preamble = _tools_preamble(tools, style)
        first_user = next((i for i, m in enumerate(chat) if m["role"] == "user"), None)
        if first_user is None:
            chat.insert(0, {"role": "user", "content": preamble})
        else:
            content = chat[first_user].get("content") or ""
            chat[first_user] = {**chat[first_user], "content": f"{preamble}\n\n{content}"}
    return chat


# The call ids Mistral's templates (Nemo, Small 3.x) take; any other refuses the chat.
_MISTRAL_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ID_CHARACTERS = string.ascii_letters + string.digits


def _mistral_call_ids(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`chat` with each call id as Mistral's templates take it: 9 letters and digits. An
    id another client or server wrote (OpenAI's `call_` and 24 characters) was a 400 the
    client could not fix; it is shown as 9 characters of its hash, the same in the call
    and in its result, and in every request that sends it (a cached prefix still
    matches). vLLM keeps the last 9 characters, which left shorter ids refused and made
    two that end alike one call; here two ids are one only where their hashes agree."""
    ids = [call.get("id") for m in chat for call in m.get("tool_calls") or ()]
    ids += [m.get("tool_call_id") for m in chat if m["role"] == "tool"]
    kept = {i for i in ids if isinstance(i, str) and _MISTRAL_CALL_ID.fullmatch(i)}
    taken = set(kept)  # grows with each id shown: copying it per id took quadratic time
    shown: dict[str, str] = {}
    for call_id in ids:
        if isinstance(call_id, str) and call_id not in kept and call_id not in shown:
            shown[call_id] = _nine_characters(call_id, taken)
            taken.add(shown[call_id])
    if not shown:
        return chat
    out = []
    for message in chat:
        if message.get("tool_calls"):
            calls = [{**c, "id": shown.get(c.get("id"), c.get("id"))} for c in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        if message["role"] == "tool" and message.get("tool_call_id") in shown:
            message = {**message, "tool_call_id": shown[message["tool_call_id"]]}
        out.append(message)
    return out


def _results_with_call_ids(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`chat` with each result sent without a `tool_call_id` given that of the call it
    answers by its place, the k-th result after a turn of calls the k-th call's, as
    templates without ids pair them (a result with none to answer gets an empty id):
    Mistral's write each result's id, and refused the chat ("Tool call IDs should be
    alphanumeric strings with length 9!") for a client that sent none."""
    out = []
    calls: list[dict[str, Any]] = []
    answered = 0
    for message in chat:
        if message.get("tool_calls"):
            calls, answered = message["tool_calls"], 0
        if message["role"] == "tool":
            if message.get("tool_call_id") is None:
                call_id = calls[answered].get("id", "") if answered < len(calls) else ""
                message = {**message, "tool_call_id": call_id}
            answered += 1
        out.append(message)
    return out


def _nine_characters(call_id: str, taken: set[str]) -> str:
    """9 letters and digits from the hash of `call_id`, none of `taken`."""
    attempt = 0
    while True:  # a clash (about one in 62**9 for each id taken) draws again
        digest = int.from_bytes(hashlib.sha256(f"{attempt}:{call_id}".encode()).digest(), "big")
        chosen = ""
        for _ in range(9):
            digest, index = divmod(digest, len(_ID_CHARACTERS))
            chosen += _ID_CHARACTERS[index]
        if chosen not in taken:
            return chosen
        attempt += 1


def _results_joined(chat: list[dict[str, Any]], texts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`texts` (`chat` as text) with the results of one turn's calls in one user turn:
    templates that make user and assistant alternate (Gemma 2 and 3, Mixtral) refused
    two in a row, so a round trip of parallel calls was a 400."""
    out: list[dict[str, Any]] = []
    for index, (message, text) in enumerate(zip(chat, texts, strict=True)):
        if message["role"] == "tool" and index and chat[index - 1]["role"] == "tool":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{text['content']}"}
        else:
            out.append(text)
    return out


def _responses_in_turn(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's `tool` messages as Gemma 4's template takes results: the `tool_responses`
    ({name, response}) of the assistant turn that made the calls, the name that of the
    call whose id the result answers, the response its JSON where it is JSON. The
    template writes them inside the model's turn, and the model goes on from there."""
    out: list[dict[str, Any]] = []
    for message in chat:
        calls = out[-1].get("tool_calls") if out and out[-1]["role"] == "assistant" else None
        if message["role"] != "tool" or not calls:
            out.append(message)
            continue
        name = next(
            (c["function"].get("name") for c in calls if c.get("id") == message.get("tool_call_id")),
            message.get("name") or "unknown",
        )
        content = message.get("content") or ""
        if not isinstance(content, str):  # text parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
        response: Any = content
        with contextlib.suppress(ValueError, RecursionError):
            response = json.loads(content)
        responses = [*out[-1].get("tool_responses", []), {"name": name, "response": response}]
        out[-1] = {**out[-1], "tool_responses": responses}
    return out


def _granite_turns(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's calls and results as Granite 3's templates take them: those write each
    turn's role and `content` alone, so a call is its `<|tool_call|>` list in the
    assistant's content (its `tool_calls` were never shown, and a null content broke the
    template), and a result the `tool_response` role Granite was taught (as Ollama and
    llama.cpp write it), not `tool`."""
    out = []
    for message in chat:
        if message["role"] == "tool":
            message = {**message, "role": "tool_response"}
        elif message["role"] == "assistant" and message.get("tool_calls"):
            written = _call_text_granite([call["function"] for call in message["tool_calls"]])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = (message.get("content") or "") + written
        out.append(message)
    return out


def _glm4_turns(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's calls and results as GLM-4-0414's template takes them: each call an
    assistant turn of its own, the tool's name its `metadata` and the arguments' JSON its
    text, after one for the turn's text if it has any, and a result an `observation`
    turn. The template writes neither `tool_calls` nor a `tool` turn: both were dropped."""
    out: list[dict[str, Any]] = []
    for message in chat:
        if message["role"] == "tool":
            out.append({"role": "observation", "content": message.get("content") or ""})
        elif message["role"] == "assistant" and message.get("tool_calls"):
            if message.get("content"):
                out.append({k: v for k, v in message.items() if k != "tool_calls"})
            for call in message["tool_calls"]:
                name, arguments = _glm4_call(call["function"])
                out.append({"role": "assistant", "metadata": name, "content": arguments})
        else:
            out.append(message)
    return out


def _lfm2_turns(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's calls as LFM2's template takes them: it writes each turn's `content`
    alone (its `tool_calls` were dropped, a null content written as `null`), so a turn's
    calls are its one `<|tool_call_start|>[...]` list, before its text as LFM2 writes
    them. Results stay `tool` turns, which the template marks."""
    out = []
    for message in chat:
        if message["role"] == "assistant" and message.get("tool_calls"):
            written = _call_text_lfm2([call["function"] for call in message["tool_calls"]])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = written + (message.get("content") or "")
        out.append(message)
    return out


def _call_text_lfm2(functions: Sequence[Mapping[str, Any]]) -> str:
    return LFM2_CALL_START + "[" + ", ".join(map(_python_call_text, functions)) + "]" + LFM2_CALL_END


def _python_call_text(function: Mapping[str, Any]) -> str:
    """`name(key=value, ...)`, each value JSON (arguments that are no JSON object as sent)."""
    arguments = function.get("arguments") or {}
    pairs = ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items()) if isinstance(arguments, dict) else arguments
    return f"{function['name']}({pairs})"


def _glm4_call(function: Mapping[str, Any]) -> tuple[str, str]:
    """A call's name and its arguments' JSON text, as GLM-4 writes them."""
    arguments = function.get("arguments") or {}
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return function["name"], text


def _call_text_command_r7b(functions: Sequence[Mapping[str, Any]]) -> str:
    calls = [
        {"tool_call_id": str(i), "tool_name": f["name"], "parameters": f.get("arguments") or {}}
        for i, f in enumerate(functions)
    ]
    return START_ACTION + json.dumps(calls) + END_ACTION


def _call_text_granite(functions: Sequence[Mapping[str, Any]]) -> str:
    calls = [{"name": f["name"], "arguments": f.get("arguments") or {}} for f in functions]
    return GRANITE_TOOL_CALL + json.dumps(calls)


def _with_parsed_arguments(message: Mapping[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    parsed = []
    for call in calls:
        function = dict(call.get("function") or {})
        function["arguments"] = _parsed_arguments(function.get("arguments"))
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


def _parsed_arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    if means_no_arguments(arguments):
        # No arguments, as some clients send a call of a tool without parameters (and
        # as a reply's `null` arguments go out): an object, as vLLM takes "" (templates
        # that read `arguments|items` failed).
        return {}
    # Text that is not JSON reaches the template as the client sent it, and so does
    # JSON that Python cannot read: an integer past 4,300 digits (ValueError) or
    # nesting past the recursion limit.
    with contextlib.suppress(ValueError, RecursionError):
        return json.loads(arguments)
    return arguments


def arguments_of_no_object(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """Where the first past call whose arguments are no JSON object's text is
    (`messages[1].tool_calls[0].function.arguments`), or None: text that is no JSON,
    a list, a number."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            if not isinstance(_parsed_arguments(call["function"].get("arguments")), dict):
                return f"messages[{i}].tool_calls[{j}].function.arguments"
    return None


def with_object_arguments(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each past call's arguments that are no JSON object's text as `{}`."""
    out = []
    for message in messages:
        calls = [
            {**call, "function": {**call["function"], "arguments": "{}"}}
            if not isinstance(_parsed_arguments(call["function"].get("arguments")), dict)
            else call
            for call in message.get("tool_calls") or ()
        ]
        out.append({**message, "tool_calls": calls} if calls else dict(message))
    return out


def _as_text(message: Mapping[str, Any], style: str) -> dict[str, Any]:
    """Tool turns for a template that knows only user and assistant text."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"```tool_output\n{message.get('content', '')}\n```"}
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return dict(message)
    if style == "granite":  # one list of the turn's calls, as its template shows them
        written = _call_text_granite([call["function"] for call in calls])
    elif style == "nemotron":  # one list between its tags, as its template writes them
        listed = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments") or {}} for c in calls]
        written = f"{TOOLCALL}{json.dumps(listed)}{TOOLCALL_END}"
    elif style == "lfm2":
        written = _call_text_lfm2([call["function"] for call in calls])
    elif style == "command_r7b":  # one list of the turn's calls, as its template writes them
        written = _call_text_command_r7b([call["function"] for call in calls])
    else:
        written = "\n".join(_call_text(call["function"], style) for call in calls)
    content = message.get("content") or ""
    text = f"{content}\n{written}" if content else written
    return {"role": "assistant", "content": text}


def _call_text(function: Mapping[str, Any], style: str) -> str:
    arguments = function.get("arguments") or {}
    if style == "gemma" and isinstance(arguments, dict):
        pairs = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        return f"```tool_code\n{function['name']}({pairs})\n```"
    call = {"name": function["name"], "arguments": arguments}
    if style == "mistral":
        return f"{TOOL_CALLS}{function['name']}{ARGS}{json.dumps(arguments)}"
    if style == "harmony":
        header = f"{CHANNEL}commentary to=functions.{function['name']} {CONSTRAIN}json{MESSAGE}"
        return f"{header}{json.dumps(arguments)}{CALL}"
    if style == "hermes":
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    if style == "gemma4":
        return f"{CALL_OPEN}call:{function['name']}{gemma4_arguments(arguments)}{CALL_CLOSE}"
    if style == "qwen3_coder":
        return xml_call(function["name"], arguments)
    if style == "seed_oss":
        return xml_call(function["name"], arguments, SEED_TAGS)
    if style == "glm4":
        return "\n".join(_glm4_call(function))
    if style == "glm45":
        return key_value_call(function["name"], arguments)
    if style == "olmo3":  # as its template writes them; text that is no JSON as it is
        return f"{FUNCTION_CALLS}{_python_call_text(function)}{FUNCTION_CALLS_END}"
    return json.dumps({"name": function["name"], "parameters": arguments})


def _tools_preamble(tools: Sequence[Mapping[str, Any]], style: str) -> str:
    listed = "\n".join(json.dumps(tool["function"]) for tool in tools)
    if style == "gemma":
        how = (
            "If you decide to invoke any of the function(s), you MUST put it in the format of\n"
            "```tool_code\nfunction_name(param_name=param_value, ...)\n```\n"
            "You SHOULD NOT include any other text in the response if you call a function."
        )
    elif style == "granite":
        how = f'To call a function, reply with {GRANITE_TOOL_CALL}[{{"name": <function-name>, "arguments": <args-json-object>}}]'
    elif style == "nemotron":
        how = f'To call functions, reply with {TOOLCALL}[{{"name": <function-name>, "arguments": <args-json-object>}}, ...]{TOOLCALL_END}'
    elif style == "command_r7b":
        how = (
            f'To call functions, reply with {START_ACTION}[{{"tool_call_id": "0", "tool_name": <function-name>,'
            f' "parameters": <args-json-object>}}, ...]{END_ACTION}'
        )
    elif style == "glm4":
        how = "To call a function, reply with its name alone on the first line, then its arguments as a JSON object."
    elif style == "olmo3":
        how = f"To call a function, reply with {FUNCTION_CALLS}<function-name>(<param-name>=<json-value>, ...){FUNCTION_CALLS_END}"
    elif style == "lfm2":
        how = f"To call functions, reply with {LFM2_CALL_START}[<function-name>(<param-name>=<value>, ...), ...]{LFM2_CALL_END}"
    elif style == "glm45":
        how = "To call a function, reply with\n" + key_value_call("<function-name>", {"<key>": "<value>"})
    elif style == "qwen3_coder":
        how = "To call a function, reply with\n" + xml_call("<function-name>", {"<parameter-name>": "<value>"})
    elif style == "seed_oss":
        how = "To call a function, reply with\n" + xml_call("<function-name>", {"<parameter-name>": "<value>"}, SEED_TAGS)
    elif style == "hermes":
        how = (
            "To call a function, reply with\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )
    elif style == "mistral":
        how = f"To call a function, reply with {TOOL_CALLS}<function-name>{ARGS}<args-json-object>"
    elif style == "harmony":
        how = "To call a function, send its JSON arguments on the commentary channel to=functions.<function-name>."
    else:
        how = 'To call a function, reply with only {"name": <function-name>, "parameters": <args>}.'
    return f"You have access to the following functions:\n{listed}\n\n{how}"
