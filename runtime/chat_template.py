"""Chat templates: the Jinja program a checkpoint ships to turn messages into one prompt.

Rendered the way Hugging Face transformers renders them (the same sandbox, options,
globals and `tojson`), so a prompt here is byte-identical to transformers'
`apply_chat_template(..., tokenize=False)` for the same messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from runtime.errors import RequestError

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The fallback for checkpoints that ship no template: ChatML, which transformers used
# as its default before templates became mandatory. Content given as a list of
# OpenAI-style parts renders its text parts.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplate:
    """A compiled chat template; compile once per tokenizer, render once per request.

    `special_tokens` maps template variable names (`bos_token`, `eos_token`, ...) to the
    token strings, which templates splice into the prompt as text.
    Raises `jinja2.TemplateSyntaxError` if `source` does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        self.source = source
        self._special_tokens = dict(special_tokens)
        self._template = _ENVIRONMENT.from_string(source)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        """The prompt for `messages` ({role, content} dicts), as text.

        Raises `RequestError` when a message is malformed or the template rejects the chat.
        """
        chat = checked_messages(messages)
        try:
            return self._template.render(
                **self._special_tokens,
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except (
            Exception
        ) as exc:  # a template is third-party code: any failure is its verdict on this chat
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise RequestError(
                f"the chat template rejected these messages: {reason}", param="messages"
            ) from exc


def checked_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` without None-valued keys, as transformers passes them.

    Dropping None matters: clients send `content: null` next to tool calls, and templates
    handle a missing key but would print "None".
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "content" not in message:
            raise RequestError(
                f"messages[{index}] must be an object with 'role' and 'content'",
                param=f"messages[{index}]",
            )
        if not isinstance(message.get("role"), str):
            raise RequestError(
                f"messages[{index}].role must be a string", param=f"messages[{index}].role"
            )
        chat.append({key: value for key, value in message.items() if value is not None})
    return chat


def _raise_exception(message: str) -> None:
    # Templates call this to reject a chat (e.g. roles out of order).
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which could reach interpreter internals."""

    # No named `self`, as in Namespace itself, so `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _refuse_private(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _refuse_private(name)
        super().__setitem__(name, value)


def _refuse_private(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")


def _build_environment() -> ImmutableSandboxedEnvironment:
    # Templates come from the Hub and are untrusted: the immutable sandbox stops them
    # from touching Python internals or mutating the caller's messages.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _Namespace
    return environment


_ENVIRONMENT = _build_environment()
