"""Replies that think between a pair of tags before they answer.

Qwen3, QwQ, DeepSeek-R1's distills, SmolLM3 and Phi-4-reasoning write

    <think>
    The user asks ...
    </think>

    Paris is sunny.<tool_call>...</tool_call>

and Mistral's reasoning models (Magistral Small 2507 and 2509, Ministral 3 Reasoning,
Mistral Small 4 and Medium 3.5 at `reasoning_effort: high`) the same between the control
tokens `[THINK]` and `[/THINK]`: `[THINK]The user asks ...[/THINK]Paris is sunny.`, with
`[TOOL_CALLS]` calls after it; Seed-OSS between its added tokens `<seed:think>` and
`</seed:think>` (its thinking-budget notes, `<seed:cot_budget_reflect>`, inside the
thought, as vLLM's `seed_oss` reasoning parser reads them); Cohere's Command R7B and A
between `<|START_THINKING|>` and `<|END_THINKING|>` (R7B's plan before its tool calls, as
llama.cpp's Command R7B format reads it). Their templates never open the thought (a Magistral
prompt ends in `[/INST]`); the reply opens its own, as vLLM's `mistral` reasoning
parser and llama.cpp's Magistral format read it.

Some templates open the thought themselves (QwQ's and R1's generation prompt ends in
`<think>\\n`), so the reply starts inside it; Qwen3's writes an empty thought into the
prompt when `enable_thinking` is false, and the reply starts past it. Admission tells
them apart by the prompt (`opens_thought`, `closes_thought`), and the reply's text then
begins with the `<think>` the prompt wrote (actors/streamer.py), so the parser reads
one form only. Under a grammar the thought comes first (runtime/grammar.py).

The rule for a checkpoint being such a model (`think_tags`): its tokenizer holds both
tags of a pair as added tokens (single tokens, so a tag is never split across tokens,
nor mistaken for text the model spelled out) and its chat template writes the opening
one (Mistral's write `[THINK]` for a `thinking` chunk of an assistant turn: a Mistral
tokenizer may hold the tags where its template never thinks). Tags that are special
tokens (Mistral's always) are kept in the reply's text.

OLMo 3 Think writes `<think>...</think>` as plain text, tokens of the vocabulary (as
vLLM's `olmo3` reasoning parser reads it): its tags are taken as text (`ThinkTags` with
no ids) where the family is one known to think so (`TEXT_TAG_FAMILIES`), its tokenizer
holds no tag as an added token, and a chat template writes `<think>` (OLMo 3 Think's
generation prompt ends in it; OLMo 3 Instruct's never writes it). The prompt opens or
closes the thought by its decoded end, and the parser, which reads text in any split,
splits alike; stop strings read such tags as the text they are, and a grammar, which
cannot switch on one closing token, holds their thought itself (runtime/grammar.py).

Granite 3.2 and 3.3 (family `granite`) think only when a request passes `thinking: true`
to their template (`chat_template_kwargs`), which then teaches the form in its system
prompt: 3.3's `<think>...</think><response>...</response>`, its tags text (no tokens of
their own: the answer's `<response>` tags are left out of it too, as llama.cpp's Granite
format reads them), 3.2's `Here is my thought process: ... Here is my response: ...`
(as vLLM's `granite` reasoning parser reads it). Their tags are taken so where such a
template reads `thinking` and writes the tag (`GRANITE_THINKING`); a request without
that switch is not split at all (`ThinkTags.switch`).

`ThinkParser` turns the text, fed in any split, into `Reasoning` for the thought and
the content's own parser's events (a Hermes call's, or `Content`) for the rest, so a
`<tool_call>` inside the thought is no call. As llama.cpp returns it, the thought is
stripped of the blanks around it and the answer of those before it; an opening tag
repeated at the thought's start (the model writing the tag its prompt opened) is
dropped. A reply with no thought is content as written; one that ends inside its
thought (max_tokens) is all reasoning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from runtime.chat_template import reads_variable
from runtime.tools import Content, Event, Reasoning, marker_prefix_length

import attrs

if TYPE_CHECKING:
    from runtime.tokenizer import Tokenizer
    from runtime.tools import ToolParser

THINK_TAGS = THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MISTRAL_THINK_TAGS = "[THINK]", "[/THINK]"  # Mistral's control tokens
SEED_THINK_TAGS = "<seed:think>", "</seed:think>"  # Seed-OSS's added tokens
COHERE_THINK_TAGS = "<|START_THINKING|>", "<|END_THINKING|>"  # Command R7B's and A's control tokens
TAG_PAIRS = (THINK_TAGS, MISTRAL_THINK_TAGS, SEED_THINK_TAGS, COHERE_THINK_TAGS)
_BLANKS_AFTER_OPENING = 4  # tokens of blanks a template may write past the tag it opens
# Families whose replies think in `<think>` written as text, not as added tokens.
TEXT_TAG_FAMILIES = ("olmo3",)
# Granite 3.3's thought and answer tags, then 3.2's phrases (text all), as their templates
# teach them where a request passes `thinking: true` (their switch).
GRANITE_THINKING = (
    (THINK_TAGS, ("<response>", "</response>")),
    (("Here is my thought process:", "Here is my response:"), ()),
)
GRANITE_SWITCH = "thinking"
# Prompt tokens decoded to tell a thought opened or closed by text tags: a tag's
# spelling (one token a character at worst) and the blanks past it.
_TEXT_TAIL_TOKENS = 16


@attrs.frozen
class ThinkTags:
    """The tags a model's replies think between: their spellings and their token ids,
    None where they are text (OLMo 3 Think's)."""

    open: str
    close: str
    open_id: int | None = None
    close_id: int | None = None
    answer: tuple[str, ...] = ()  # text tags around the answer, left out of it (Granite 3.3's)
    # The `chat_template_kwargs` key that turns thinking on (Granite's `thinking`): a
    # request without it is no thinking reply. "": every chat reply may think.
    switch: str = ""

    def thinks_with(self, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether a chat request with these `chat_template_kwargs` may think."""
        return not self.switch or bool(template_kwargs.get(self.switch))

    @property
    def ids(self) -> tuple[int, int] | None:
        if self.open_id is None or self.close_id is None:
            return None
        return self.open_id, self.close_id

    @property
    def spellings(self) -> tuple[str, str]:
        return self.open, self.close


def think_tags(tokenizer: Tokenizer, family: str = "") -> ThinkTags | None:
    """The tag pair a checkpoint's replies think in, else None: both tags are added
    tokens and a chat template writes the opening one; or, for a `family` of
    TEXT_TAG_FAMILIES, `<think>` is no added token and a chat template writes it."""
    sources = (tokenizer.chat_template_source, tokenizer.tool_use_template_source)
    for open_tag, close_tag in TAG_PAIRS:
        open_id = tokenizer.added_token_id(open_tag)
        close_id = tokenizer.added_token_id(close_tag)
        if open_id is None or close_id is None:
            continue
        if any(open_tag in source for source in sources):
            return ThinkTags(open_tag, close_tag, open_id, close_id)
    is_added = any(tokenizer.added_token_id(tag) is not None for tag in THINK_TAGS)
    if family in TEXT_TAG_FAMILIES and not is_added and any(THINK_OPEN in source for source in sources):
        return ThinkTags(*THINK_TAGS)
    if family == "granite" and not is_added:
        for (open_tag, close_tag), answer in GRANITE_THINKING:
            if any(open_tag in source and reads_variable(source, GRANITE_SWITCH) for source in sources):
                return ThinkTags(open_tag, close_tag, answer=answer, switch=GRANITE_SWITCH)
    return None


def prompt_opens_thought(
    prompt_tokens: Sequence[int], tags: ThinkTags, decode: Callable[[list[int]], str]
) -> bool:
    """`opens_thought` for either kind of tags: text tags by the prompt's decoded end."""
    if tags.ids is not None:
        return opens_thought(prompt_tokens, tags.ids, decode)
    tail = decode(list(prompt_tokens[-_TEXT_TAIL_TOKENS:])).rstrip()
    return tail.endswith(tags.open)


def prompt_closes_thought(
    prompt_tokens: Sequence[int], tags: ThinkTags, decode: Callable[[list[int]], str]
) -> bool:
    """`closes_thought` for either kind of tags: text tags by the prompt's decoded end."""
    if tags.ids is not None:
        return closes_thought(prompt_tokens, tags.ids, decode)
    tail = decode(list(prompt_tokens[-_TEXT_TAIL_TOKENS:])).rstrip()
    return tail.endswith(tags.close)


def opens_thought(
    prompt_tokens: Sequence[int], think_ids: tuple[int, int], decode: Callable[[list[int]], str]
) -> bool:
    """Whether the prompt ends inside a thought its template opened: in the opening tag
    and at most blanks (QwQ's and R1's "\\n"), which `decode` tells (spelling special
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
    """Whether the prompt ends past a thought its template closed: in the closing tag and
    at most blanks (Qwen3's empty thought under `enable_thinking: false`), so the reply is
    the answer, with no thought of its own (vLLM's reasoning parsers read it so too)."""
    close_id = think_ids[1]
    tail = list(prompt_tokens[-_BLANKS_AFTER_OPENING - 1 :])
    if close_id not in tail:
        return False
    return not decode(tail[len(tail) - tail[::-1].index(close_id) :]).strip()


@attrs.define
class ThinkParser:
    """One reply's text -> `Reasoning` and the events of `content`'s parser (None:
    the content is text); `tags`: the (opening, closing) pair it thinks between."""

    content: ToolParser | None = None
    tags: tuple[str, str] = THINK_TAGS
    state: str = "start"  # start | thought | after (blanks past the thought) | answer
    pending: str = ""  # text not yet reported
    thought_began: bool = False  # some of the thought was reported
    # Held blanks, as pieces: joined once, not copied at every token (a run of blank
    # tokens was quadratic). `lead`: a reply's first, which a thought drops and an
    # answer keeps; `blank`: the thought's trailing ones, until more of it follows.
    lead: list[str] = attrs.Factory(list)
    blank: list[str] = attrs.Factory(list)

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
        opening, closing = self.tags
        while True:
            if self.state == "start" or (self.state == "thought" and not self.thought_began):
                head = self.pending.lstrip()
                if self.state == "start" and len(head) < len(self.pending):
                    self.lead.append(self.pending[: len(self.pending) - len(head)])
                self.pending = head  # (a thought's first blanks are dropped)
                if head.startswith(opening):  # (again, at a thought's start: dropped)
                    self.pending, self.state, self.lead = head[len(opening) :], "thought", []
                    continue
                if opening.startswith(head) and not is_final:
                    return events  # blanks, or what may be the tag's beginning
                if self.state == "start":  # no thought: the reply is the answer, as written
                    self.pending, self.state, self.lead = "".join(self.lead) + head, "answer", []
            if self.state == "thought":
                at = self.pending.find(closing)
                if at < 0:  # all of it but a tail that may begin the closing tag
                    keep = 0 if is_final else marker_prefix_length(self.pending, closing)
                    events += self._reasoning(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return events
                events += self._reasoning(self.pending[:at])
                self.pending, self.state, self.blank = self.pending[at + len(closing) :], "after", []
                continue
            if self.state == "after":
                head = self.pending.lstrip()
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
        kept = text.rstrip()
        if not kept:  # blanks alone: held, as a thought's last blanks are dropped
            self.blank.append(text)
            return []
        held, self.blank = "".join(self.blank), [text[len(kept) :]]
        return [Reasoning(held + kept)]

    def _answer(self, text: str) -> list[Event]:
        if not text:
            return []
        return [Content(text)] if self.content is None else self.content.feed(text)


@attrs.define
class TagsDropped:
    """The events of `content`'s parser (None: the text is content) for the text fed
    with `tags` left out: markup around an answer (Granite 3.3's `<response>`, Command
    R7B's `<|START_RESPONSE|>`). A tail that may begin a tag waits until it is told, so
    the text reads alike in any split."""

    content: ToolParser | None
    tags: tuple[str, ...]
    pending: str = ""

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        held = max(marker_prefix_length(self.pending, tag) for tag in self.tags)
        ready, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        return self._answer(ready)

    def finish(self) -> list[Event]:
        events = self._answer(self.pending)
        self.pending = ""
        return events if self.content is None else events + self.content.finish()

    def _answer(self, text: str) -> list[Event]:
        for tag in self.tags:
            text = text.replace(tag, "")
        if not text:
            return []
        return [Content(text)] if self.content is None else self.content.feed(text)
