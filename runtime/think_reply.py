"""Replies that think between `<think>` and `</think>` before they answer.

Qwen3, QwQ, DeepSeek-R1's distills, SmolLM3 and Phi-4-reasoning write

    <think>
    The user asks ...
    </think>

    Paris is sunny.<tool_call>...</tool_call>

Some templates open the thought themselves (QwQ's and R1's generation prompt ends in
`<think>\\n`), so the reply starts inside it; Qwen3's writes an empty thought into the
prompt when `enable_thinking` is false, and the reply starts past it. Admission tells
them apart by the prompt (`opens_thought`, `closes_thought`), and the reply's text then
begins with the `<think>` the prompt wrote (actors/streamer.py), so the parser reads
one form only. Under a grammar the thought comes first (runtime/grammar.py).

The rule for a checkpoint being such a model (`think_tag_ids`): its tokenizer holds
`<think>` and `</think>` as added tokens (single tokens, so a tag is never split
across tokens, nor mistaken for text the model spelled out) and its chat template
writes `<think>`. Tags that are special tokens are kept in the reply's text.

`ThinkParser` turns the text, fed in any split, into `Reasoning` for the thought and
the content's own parser's events (a Hermes call's, or `Content`) for the rest, so a
`<tool_call>` inside the thought is no call. As llama.cpp returns it, the thought is
stripped of the blanks around it and the answer of those before it; a `<think>`
repeated at the thought's start (the model writing the tag its prompt opened) is
dropped. A reply with no thought is content as written; one that ends inside its
thought (max_tokens) is all reasoning.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from runtime.tools import Content, Event, Reasoning, marker_prefix_length

import attrs

if TYPE_CHECKING:
    from runtime.tokenizer import Tokenizer
    from runtime.tools import ToolParser

THINK_TAGS = THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_OPEN_TAG_IN_TEMPLATE = re.compile(re.escape(THINK_OPEN))
_BLANKS_AFTER_OPENING = 4  # tokens of blanks a template may write past the tag it opens


def think_tag_ids(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """(`<think>`'s id, `</think>`'s id) for a checkpoint whose replies think in those
    tags, else None: both are added tokens and a chat template writes `<think>`."""
    open_id = tokenizer.added_token_id(THINK_OPEN)
    close_id = tokenizer.added_token_id(THINK_CLOSE)
    if open_id is None or close_id is None:
        return None
    sources = (tokenizer.chat_template_source, tokenizer.tool_use_template_source)
    if not any(_OPEN_TAG_IN_TEMPLATE.search(source) for source in sources):
        return None
    return open_id, close_id


def opens_thought(
    prompt_tokens: Sequence[int], think_ids: tuple[int, int], decode: Callable[[list[int]], str]
) -> bool:
    """Whether the prompt ends inside a thought its template opened: in `<think>` and
    at most blanks (QwQ's and R1's "\\n"), which `decode` tells (spelling special
    tokens: Qwen3's empty thought, `<think>\\n\\n</think>\\n\\n`, is closed)."""
    open_id, close_id = think_ids
    tail = list(prompt_tokens[-_BLANKS_AFTER_OPENING - 1 :])
    if open_id not in tail:
        return False
    after = tail[len(tail) - tail[::-1].index(open_id) :]
    return close_id not in after and not decode(after).strip()


def closes_thought(
    prompt_tokens: Sequence[int], think_ids: tuple[int, int], decode: Callable[[list[int]], str]
) -> bool:
    """Whether the prompt ends past a thought its template closed: in `</think>` and at
    most blanks (Qwen3's empty thought under `enable_thinking: false`), so the reply is
    the answer, with no thought of its own (vLLM's reasoning parsers read it so too)."""
    close_id = think_ids[1]
    tail = list(prompt_tokens[-_BLANKS_AFTER_OPENING - 1 :])
    if close_id not in tail:
        return False
    return not decode(tail[len(tail) - tail[::-1].index(close_id) :]).strip()


@attrs.define
class ThinkParser:
    """One reply's text -> `Reasoning` and the events of `content`'s parser (None:
    the content is text)."""

    content: ToolParser | None = None
    state: str = "start"  # start | thought | after (blanks past the thought) | answer
    pending: str = ""  # text not yet reported
    thought_began: bool = False  # some of the thought was reported
    blank: str = ""  # the thought's trailing blanks, held until more of it follows

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        return self._scan(is_final=False)

    def finish(self) -> list[Event]:
        # Cut short inside the thought, all of it is reasoning; a tag only begun at the
        # start is content as written.
        events = self._scan(is_final=True)
        if self.content is not None:
            events += self.content.finish()
        return events

    def _scan(self, is_final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            head = self.pending.lstrip()
            if self.state == "start" or (self.state == "thought" and not self.thought_began):
                if head.startswith(THINK_OPEN):  # (again, at a thought's start: dropped)
                    self.pending, self.state = head[len(THINK_OPEN) :], "thought"
                    continue
                if THINK_OPEN.startswith(head) and not is_final:
                    return events  # blanks, or what may be the tag's beginning
                if self.state == "start":  # no thought: the reply is the answer
                    self.state = "answer"
            if self.state == "thought":
                at = self.pending.find(THINK_CLOSE)
                if at < 0:  # all of it but a tail that may begin the closing tag
                    keep = 0 if is_final else marker_prefix_length(self.pending, THINK_CLOSE)
                    events += self._reasoning(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return events
                events += self._reasoning(self.pending[:at])
                self.pending, self.state, self.blank = self.pending[at + len(THINK_CLOSE) :], "after", ""
                continue
            if self.state == "after":
                if not head:
                    self.pending = ""
                    return events
                self.pending, self.state = head, "answer"
            events += self._answer(self.pending)
            self.pending = ""
            return events

    def _reasoning(self, text: str) -> list[Event]:
        if not self.thought_began:
            text = text.lstrip()
        if not text:
            return []
        self.thought_began = True
        text = self.blank + text
        kept = text.rstrip()
        self.blank = text[len(kept) :]
        return [Reasoning(kept)] if kept else []

    def _answer(self, text: str) -> list[Event]:
        if not text:
            return []
        return [Content(text)] if self.content is None else self.content.feed(text)
