"""Tool calls in generated text: one streaming parser per family's format.

    parser = parser_for(style)             # "hermes", "llama3_json" or "gemma"
    for delta in text_deltas:
        events = parser.feed(delta)         # Content, CallStart and CallArguments, in order
    events = parser.finish()                # ... and CallCutShort if it ended inside a call

The formats, as the families' chat templates teach them:
  hermes       Qwen 2.5/3, Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
               text allowed around the calls.
  llama3_json  Llama 3.1+: the whole reply is `{"name": ..., "parameters": {...}}` (optionally
               after `<|python_tag|>`), several calls joined by `;`.
  gemma        Gemma 3 (its template has no tools; Google's function-calling guide):
               a ```tool_code block holding `name(arg=value, ...)` calls, or JSON calls.
  mistral      Mistral Small 3.2, Devstral, Magistral, Ministral 3: `[TOOL_CALLS]name[ARGS]{...}`
               a call, one after another; Mistral 7B v0.3, Nemo, Small 3.1:
               `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. Text may come first.
  harmony      gpt-oss: messages on channels, a call addressed `to=functions.NAME`; its
               parser also tells reasoning from the answer (runtime/harmony.py).
  gemma4       Gemma 4: `<|tool_call>call:NAME{key:value,...}<tool_call|>` in its own notation,
               reasoning in a `<|channel>` block (runtime/gemma4_reply.py).
  qwen3_coder  Qwen3-Coder, Qwen3.5: `<tool_call>` blocks of `<function=NAME>` and
               `<parameter=KEY>` text, typed by the tool's schema (runtime/qwen3_coder_reply.py).
  seed_oss     Seed-OSS: Qwen3-Coder's calls in `<seed:tool_call>` blocks.
  granite      Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, Mistral's
               list form after Granite's marker. Text may come first.
  glm4         GLM-4-0414, GLM-Z1: the reply is a tool's name alone on its first line, then the
               arguments' JSON object; no marker, so the request's tool names tell a call
               (runtime/glm4_reply.py).
  olmo3        OLMo 3 Instruct: `<function_calls>name(key=value, ...)</function_calls>`, a
               call a line, each value JSON (`true`, `null`, `"text"`).
  lfm2         LFM2: `<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>`, a
               Python list of calls, each value a Python or JSON literal; or, where its
               system prompt asks for JSON, a JSON list of {"name", "arguments"} there.
  nemotron     Nemotron Nano v2 (`nemotron_h`): `<TOOLCALL>[{"name": ..., "arguments": {...}},
               ...]</TOOLCALL>`, Granite's list form between NVIDIA's tags. Text may come first.
  glm45        GLM-4.5, 4.6, 4.7: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`
               ...`</tool_call>`, values typed by the tool's schema (runtime/glm45_reply.py).
  command_r7b  Command R7B, Command A: `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ...,
               "parameters": {...}}, ...]<|END_ACTION|>`, the answer in `<|START_RESPONSE|>`
               ... `<|END_RESPONSE|>` (runtime/command_r7b_reply.py).

Feeding the text in any split yields the same calls with the same argument text, so
streamed deltas reassemble to the whole response: parsing state is the text, never
the split. A call's name is reported as soon as it is complete; its arguments stream
as raw JSON text (hermes, llama3_json) as they are generated, or whole when the call
closes (gemma's, olmo3's and lfm2's Python syntax must be converted; mistral's calls are
reported whole as each one's JSON closes).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TypeAlias

from runtime.call_values import python_calls
from runtime.json_calls import JsonCalls, json_list_calls, whole_call
from runtime.tool_events import CallArguments as CallArguments
from runtime.tool_events import CallCutShort as CallCutShort
from runtime.tool_events import CallStart as CallStart
from runtime.tool_events import Content as Content
from runtime.tool_events import Event as Event
from runtime.tool_events import Reasoning as Reasoning

import attrs

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from runtime.gemma4_reply import Gemma4Parser
    from runtime.glm4_reply import FirstLineCall
    from runtime.glm45_reply import KeyValueCallParser
    from runtime.harmony import HarmonyParser
    from runtime.marked_calls_reply import MarkedCalls
    from runtime.qwen3_coder_reply import XmlCallParser
    from runtime.think_reply import TagsDropped, ThinkParser

TOOL_STYLES = (
    "hermes", "llama3_json", "gemma", "mistral", "harmony", "gemma4", "qwen3_coder", "olmo3", "granite", "glm4", "lfm2",
    "nemotron",
    "glm45",
    "seed_oss",
    "command_r7b",
)
# Styles whose chat replies are parsed whether tools were offered or not: they hold
# reasoning apart from the answer, in markup the request keeps (actors/admission.py).
REASONING_STYLES = ("harmony", "gemma4")
# Other styles' models may think in `<think>` tags before they answer (Qwen3, QwQ,
# DeepSeek-R1's distills), or Mistral's in `[THINK]` (Magistral): a tokenizer's
# property, not a call format (runtime/think_reply.py).


@attrs.define
class _Delimited:
    """Calls inside `opening` ... `closing` markers, with text allowed around them."""

    opening: str
    closing: str
    streams_arguments: bool  # JSON bodies stream; gemma's Python calls go whole
    # OLMo 3 writes its Python calls' values as JSON: `true`, `false` and `null` are values.
    json_literals: bool = False
    # LFM2 writes a JSON list of {"name", "arguments"} calls instead where asked to.
    json_lists: bool = False
    pending: str = ""  # text not yet reported
    in_call: bool = False
    calls: JsonCalls = attrs.Factory(JsonCalls)
    num_calls: int = 0
    closing_searched: int = 0  # pending holds no closing marker before this

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while True:
            if not self.in_call:
                at = self.pending.find(self.opening)
                if at < 0:  # hold back a tail that may begin a marker
                    keep = marker_prefix_length(self.pending, self.opening)
                    events += _content(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return events
                events += _content(self.pending[:at])
                self.pending, self.in_call = self.pending[at + len(self.opening) :], True
                self.calls, self.closing_searched = JsonCalls(num_calls=self.num_calls), 0
            # Searched from where the last search left off: a long call is not rescanned.
            at = self.pending.find(self.closing, self.closing_searched)
            self.closing_searched = max(0, len(self.pending) - len(self.closing) + 1)
            # A tail that may begin the closing marker waits until it is decided: arguments
            # that are no JSON run to the marker, and "</tool_" went out as their text.
            held = marker_prefix_length(self.pending, self.closing) if at < 0 else 0
            body = self.pending[: len(self.pending) - held] if at < 0 else self.pending[:at]
            if self.streams_arguments or at >= 0:
                events += self._body_events(body, is_final=at >= 0, closing=self.closing)
            if at < 0:
                return events
            self.pending, self.in_call = self.pending[at + len(self.closing) :], False

    def finish(self) -> list[Event]:
        if not self.in_call:
            events, self.pending = _content(self.pending), ""
            return events
        # A call cut short (max_tokens): its closing marker was never written, or only
        # begun ("</tool_call"), which is markup, not content.
        keep = marker_prefix_length(self.pending, self.closing)
        body = self.pending[: len(self.pending) - keep]
        events = self._body_events(body, is_final=True, closing="")
        self.pending, self.in_call = "", False
        if (cut := self.calls.cut_short(body)) is None:
            return events
        if self.streams_arguments:  # the call went out as it grew: only now is it cut
            return [*events, cut]
        # Nothing of it went out yet: it is text, as a Python call cut short is.
        return [e for e in events if not _is_part_of(e, cut.index)] + [Content(cut.text)]

    def _body_events(self, body: str, is_final: bool, closing: str) -> list[Event]:
        if not self.streams_arguments and not body.lstrip().startswith("{"):
            calls = python_calls(body, self.json_literals) if is_final else None
            if calls is None and is_final and self.json_lists:
                calls = json_list_calls(body)
            if calls is None:  # not a call: the text as the model wrote it
                return [Content(self.opening + body + closing)] if is_final else []
            events = [
                e for i, call in enumerate(calls) for e in whole_call(self.num_calls + i, call)
            ]
            self.num_calls += len(calls)
            return events
        events = self.calls.update(body, is_final)
        self.num_calls = self.calls.num_calls + self.calls.name_seen
        return events


_PYTHON_TAG = "<|python_tag|>"


@attrs.define
class _WholeReply:
    """Llama 3's form: the reply is calls from its first character, or plain text."""

    pending: str = ""
    mode: str = "undecided"  # "calls" or "text" once the first visible characters tell
    # Only a call's leading tag is markup: the first one anywhere was blanked, in an
    # argument's text too.
    calls: JsonCalls = attrs.Factory(lambda: JsonCalls(leading_tag=_PYTHON_TAG))

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        if self.mode == "undecided":
            head = self.pending.lstrip()
            if head.startswith(_PYTHON_TAG) or head.startswith("{"):
                self.mode = "calls"
            elif head and not _PYTHON_TAG.startswith(head):
                self.mode = "text"
        if self.mode == "text":
            events, self.pending = _content(self.pending), ""
            return events
        return self.calls.update(self.pending, is_final=False) if self.mode == "calls" else []

    def finish(self) -> list[Event]:
        if self.mode != "calls":
            events, self.pending = _content(self.pending), ""
            return events
        events = self.calls.update(self.pending, is_final=True)
        cut = self.calls.cut_short(self.pending)
        return events if cut is None else [*events, cut]


TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"  # Mistral's control tokens, kept in its text
GRANITE_TOOL_CALL = "<|tool_call|>"  # Granite 3's special token, kept in its text
HERMES_TAGS = CALL_TAG, CALL_END_TAG = "<tool_call>", "</tool_call>"  # Qwen's: added tokens
OLMO3_TAGS = FUNCTION_CALLS, FUNCTION_CALLS_END = "<function_calls>", "</function_calls>"
# LFM2's special tokens around a call list (its template's tool list is `<|tool_list_start|>`).
LFM2_TAGS = LFM2_CALL_START, LFM2_CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
# Nemotron Nano v2's special tokens around a call list.
NEMOTRON_TAGS = TOOLCALL, TOOLCALL_END = "<TOOLCALL>", "</TOOLCALL>"
# Seed-OSS's special tokens around its Qwen3-Coder XML calls.
SEED_TAGS = SEED_CALL_TAG, SEED_CALL_END_TAG = "<seed:tool_call>", "</seed:tool_call>"


_BLANKS = re.compile(r"\S")


def _blanks_end(text: str, start: int) -> int:
    """Where the blanks from `start` on end in `text`."""
    found = _BLANKS.search(text, start)
    return len(text) if found is None else found.start()


def _is_part_of(event: Event, index: int) -> bool:
    return isinstance(event, CallStart | CallArguments) and event.index == index


def marker_prefix_length(text: str, marker: str) -> int:
    """The longest tail of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _content(text: str) -> list[Event]:
    return [Content(text)] if text else []


ToolParser: TypeAlias = (
    "_Delimited | _WholeReply | MarkedCalls | HarmonyParser | Gemma4Parser | ThinkParser | XmlCallParser"
    " | FirstLineCall | KeyValueCallParser | TagsDropped"
)


def parser_for(
    style: str,
    parses_calls: bool = True,
    think_tags: tuple[str, str] | None = None,
    tools: Sequence[Mapping[str, Any]] = (),
    answer_tags: tuple[str, ...] = (),
) -> ToolParser:
    """A fresh parser for one response in `style` (one of TOOL_STYLES). Harmony's and
    Gemma 4's also split reasoning from content, so they run for requests without tools
    too: there (`parses_calls` False) a call is content. `think_tags`: the reply may
    think between these tags first (`<think>`, Mistral's `[THINK]`; runtime/think_reply.py),
    and only its answer holds calls, `answer_tags` left out of it (Granite 3.3's
    `<response>` tags, text around its answer). `tools`, the request's: Qwen3-Coder's
    parameters are text, which their schemas type; GLM-4's calls are known by their
    names alone."""
    if think_tags is not None:
        # They build on this module's events.
        from runtime.think_reply import TagsDropped, ThinkParser

        answer = parser_for(style, tools=tools) if parses_calls else None
        return ThinkParser(TagsDropped(answer, answer_tags) if answer_tags else answer, think_tags)
    if style == "hermes":
        return _Delimited(CALL_TAG, CALL_END_TAG, streams_arguments=True)
    if style == "gemma":
        return _Delimited("```tool_code", "```", streams_arguments=False)
    if style == "olmo3":
        return _Delimited(FUNCTION_CALLS, FUNCTION_CALLS_END, streams_arguments=False, json_literals=True)
    if style == "lfm2":  # Python literals, or JSON's (`true`, `null`) as forced calls write them
        return _Delimited(LFM2_CALL_START, LFM2_CALL_END, streams_arguments=False, json_literals=True, json_lists=True)
    if style == "llama3_json":
        return _WholeReply()
    if style in ("mistral", "granite", "nemotron"):
        from runtime.marked_calls_reply import MarkedCalls  # it builds on this module's events

        if style == "granite":
            return MarkedCalls(GRANITE_TOOL_CALL, takes_named_calls=False)
        if style == "nemotron":
            return MarkedCalls(TOOLCALL, takes_named_calls=False, closing=TOOLCALL_END)
        return MarkedCalls()
    if style == "command_r7b":
        # It builds on this module's events.
        from runtime.command_r7b_reply import command_r7b_parser

        return command_r7b_parser()
    if style == "harmony":
        from runtime.harmony import HarmonyParser  # it builds on this module's events

        return HarmonyParser(parses_calls)
    if style == "gemma4":
        from runtime.gemma4_reply import Gemma4Parser  # it builds on this module's events

        return Gemma4Parser(parses_calls)
    if style == "glm4":
        # It builds on this module's events.
        from runtime.glm4_reply import FirstLineCall, tool_names

        return FirstLineCall(tool_names(tools))
    if style in ("qwen3_coder", "seed_oss"):
        # It builds on this module's events.
        from runtime.qwen3_coder_reply import XmlCallParser, parameter_types

        return XmlCallParser(parameter_types(tools), SEED_TAGS if style == "seed_oss" else HERMES_TAGS)
    if style == "glm45":
        # It builds on this module's events.
        from runtime.glm45_reply import KeyValueCallParser
        from runtime.qwen3_coder_reply import parameter_types

        return KeyValueCallParser(parameter_types(tools))
    raise ValueError(f"unknown tool-call style {style!r} (known: {', '.join(TOOL_STYLES)})")
