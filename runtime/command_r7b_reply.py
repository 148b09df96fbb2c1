"""Command R7B's and Command A's replies (Cohere's `cohere2` checkpoints).

Their tool-use template teaches a plan, then calls or an answer, each between control
tokens:

    <|START_THINKING|>I will look the weather up.<|END_THINKING|><|START_ACTION|>[
        {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
    ]<|END_ACTION|>

or `<|START_RESPONSE|>It is sunny.<|END_RESPONSE|>` (Command A Reasoning's answer is
between `<|START_TEXT|>` and `<|END_TEXT|>`), as llama.cpp's Command R7B format and
SGLang's `cohere_command4` reader take them. The plan is a thought
(runtime/think_reply.py); the calls are Granite's JSON list form between the action
tokens, each naming its tool in `tool_name` (its `tool_call_id` the template's count,
not OpenAI's id). A request offering tools keeps control tokens in its text, so the
answer's tags reach the parser too: they are markup, left out of the content.
"""

from __future__ import annotations

from runtime.marked_calls_reply import MarkedCalls
from runtime.think_reply import TagsDropped

ACTION_TAGS = START_ACTION, END_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"
# The answer's tags: R7B's and Command A's, and Command A Reasoning's.
ANSWER_TAGS = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>")


def command_r7b_parser() -> TagsDropped:
    calls = MarkedCalls(START_ACTION, takes_named_calls=False, closing=END_ACTION, name_key="tool_name")
    return TagsDropped(calls, ANSWER_TAGS)
