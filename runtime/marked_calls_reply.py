"""Tool calls after a marker: Mistral's `[TOOL_CALLS]` (a `name[ARGS]{...}` call or a
JSON list of calls), Granite 3's `<|tool_call|>`, Nemotron Nano v2's
`<TOOLCALL>...</TOOLCALL>` and Command R7B's `<|START_ACTION|>...<|END_ACTION|>` (a JSON
list alone)."""

from __future__ import annotations

from runtime.json_calls import decoded_json, means_no_arguments, whole_call
from runtime.json_ends import ValueEnd
from runtime.tools import (
    ARGS,
    TOOL_CALLS,
    Event,
    _blanks_end,
    _content,
    marker_prefix_length,
)

import attrs


@attrs.define
class MarkedCalls:
    """Mistral's form: after each `[TOOL_CALLS]`, either `name[ARGS]` and the arguments'
    JSON object, or a JSON list of {"name", "arguments"} calls. Each call is reported
    whole once its JSON closes; what follows a marker and is neither stays text.
    Granite 3's is the list form alone, after its own marker; Nemotron's the list form
    between its markers (the `closing` one after a list is markup, not text); Command
    R7B's too, each call naming its tool in `tool_name` (`name_key`), its arguments in
    `parameters`."""

    marker: str = TOOL_CALLS
    takes_named_calls: bool = True  # `name[ARGS]{...}`, Mistral's newer form
    closing: str = ""
    name_key: str = "name"
    after_calls: bool = False  # pending begins just past a list of calls
    pending: str = ""  # text not yet reported, from a marker on when in a call
    in_call: bool = False  # pending begins just past a marker
    num_calls: int = 0
    value_end: ValueEnd | None = None  # where the current call's JSON ends, once it does
    blanks_end: int = 0  # pending holds only blanks before this, past a marker

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        return self._scan(is_final=False)

    def finish(self) -> list[Event]:
        return self._scan(is_final=True)

    def _scan(self, is_final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self.after_calls and self.closing:  # its closing marker, past blanks
                rest = self.pending[_blanks_end(self.pending, 0) :]
                if rest.startswith(self.closing):
                    self.pending, self.after_calls = rest[len(self.closing) :], False
                elif self.closing.startswith(rest) and not is_final:
                    return events  # it may yet be the marker
                else:
                    self.after_calls = False
            if not self.in_call:
                at = self.pending.find(self.marker)
                if at < 0:  # hold back a tail that may begin a marker
                    keep = 0 if is_final else marker_prefix_length(self.pending, self.marker)
                    events += _content(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return events
                events += _content(self.pending[:at])
                self.pending, self.in_call, self.value_end = self.pending[at + len(self.marker) :], True, None
                self.blanks_end = 0
            end, calls = self._call(is_final)
            if end is None:
                if is_final:  # cut short, or no call after all: the text as the model wrote it
                    events += _content(self.marker + self.pending)
                    self.pending, self.in_call = "", False
                return events
            if calls is None:
                events += _content(self.marker + self.pending[:end])
            for call in calls or ():
                events += whole_call(self.num_calls, call)
                self.num_calls += 1
            self.pending, self.in_call, self.after_calls = self.pending[end:], False, calls is not None

    def _call(self, is_final: bool) -> tuple[int | None, list[dict[str, object]] | None]:
        """(where the call text after the marker ends, its calls or None if it is none),
        or (None, None) while it may still grow into one."""
        body = self.pending
        # Blanks after the marker are passed once, not stripped again at every token.
        start = self.blanks_end = _blanks_end(body, self.blanks_end)
        if start == len(body):
            return None, None
        if body[start] == "[":  # the JSON list form
            end = self._value_end(body, start, is_final)
            if end is None:
                return None, None
            listed = decoded_json(body[start:end])
            if not isinstance(listed, list) or not listed:
                return end, None
            calls = [
                {**c, "name": c[self.name_key]}
                for c in listed
                if isinstance(c, dict) and isinstance(c.get(self.name_key), str)
            ]
            return end, calls if len(calls) == len(listed) else None
        if not self.takes_named_calls:  # no list: text, up to a marker that may begin one
            # (Taken to the reply's end, the next marker's call was text when one feed
            # held both and a call when the marker came in a later one.)
            at = body.find(self.marker)
            held = 0 if is_final else marker_prefix_length(body, self.marker)
            return (len(body) - held if at < 0 else at), None
        at = body.find(ARGS)
        if at < 0:
            # A name goes up to [ARGS]: anything else is text once the reply ends.
            return (len(body), None) if is_final else (None, None)
        json_at = at + len(ARGS)
        while json_at < len(body) and body[json_at] in " \t\r\n":
            json_at += 1
        if json_at == len(body):
            return (len(body), None) if is_final else (None, None)
        end = self._value_end(body, json_at, is_final)
        if end is None:
            return None, None
        written, name = body[json_at:end], body[:at].strip()
        # `null` is a call of none ({}), as in the list form (json_calls.py); not text.
        arguments = {} if means_no_arguments(written) else decoded_json(written)
        if not name or not isinstance(arguments, dict):
            return end, None
        return end, [{"name": name, "arguments": arguments}]

    def _value_end(self, body: str, start: int, is_final: bool) -> int | None:
        if self.value_end is None or self.value_end.start != start:
            self.value_end = ValueEnd(start)
        return self.value_end.find(body, is_final)
