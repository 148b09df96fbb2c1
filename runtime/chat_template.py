"""Chat templates: the Jinja program a checkpoint ships to turn messages into one prompt.

Rendered the way Hugging Face transformers renders them (the same sandbox, options,
globals and `tojson`), so a prompt here is byte-identical to transformers'
`apply_chat_template(..., tokenize=False)` for the same messages.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from runtime.errors import RequestError

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.utils
from jinja2.exceptions import SecurityError
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
        # OpenAI's `developer` role is the newer name for `system`. A template that never
        # names it would print an unknown role or reject the chat, so there it renders as
        # `system`, as OpenAI-compatible servers do; a template that knows it gets it as is.
        self._is_developer_known = "developer" in source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt for `messages` ({role, content} dicts), as text.

        `variables` are extra template variables (e.g. `enable_thinking`); they cannot
        replace `messages`, `add_generation_prompt` or the special tokens. `tools` are
        OpenAI tool definitions (`{"type": "function", "function": {...}}`), passed to the
        template as transformers passes them.
        Raises `RequestError` when a message is malformed or the template rejects the chat.
        """
        chat = checked_messages(messages)
        if not self._is_developer_known:
            chat = [{**m, "role": "system"} if m["role"] == "developer" else m for m in chat]
        context = {
            **(variables or {}),
            **self._special_tokens,
            "messages": chat,
            "tools": list(tools) if tools else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except (
            Exception
        ) as exc:  # a template is third-party code: any failure is its verdict on this chat
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise RequestError(
                f"the chat template rejected these messages: {reason}", param="messages"
            ) from exc

    def render_with_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any] | None,
        is_located: Callable[[str], bool],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, list[tuple[int, int]]]:
        """The prompt, and the [start, end) character spans in it where the strings that
        `is_located` picks were written: strings of `messages`, `tools` and `variables`
        at any depth, dict keys among them (a tool call's parsed arguments).

        When some string is picked, the template runs a second time with each picked
        string replaced by a sentinel (one per distinct string, so a template comparing
        two messages still finds them equal), and the prompt must read as that render
        with each sentinel replaced by its string (or the string with whitespace
        trimmed, as `| trim` does). Raises `RequestError` otherwise: a template that
        escapes, splits or branches on the string leaves no way to tell its text from
        the template's.
        """
        prompt = self.render(messages, add_generation_prompt, variables, tools)
        picked: dict[str, int] = {}  # text -> its sentinel's index
        nonce = secrets.token_hex(8)  # unguessable, so no message can contain a sentinel

        def to_sentinel(text: str) -> str:
            if not is_located(text):
                return text
            return f"@{nonce}:{picked.setdefault(text, len(picked))}@"

        try:
            with_sentinels = [
                _map_strings(given, to_sentinel) for given in (messages, variables, tools)
            ]
        except RecursionError:  # parsed tool-call arguments nesting ~500 deep: 2 frames a level
            raise RequestError("the messages nest too deeply to render", param="messages") from None
        if not picked:
            return prompt, []
        chat, sentinel_variables, sentinel_tools = with_sentinels
        skeleton = self.render(chat, add_generation_prompt, sentinel_variables, sentinel_tools)
        spans = _spans(prompt, re.split(f"@{nonce}:([0-9]+)@", skeleton), list(picked))
        if spans is None:
            raise RequestError(
                "a message or tool spells out a special token, and this chat template "
                "rewrites such text, so it cannot be kept as plain text",
                param="messages",
            )
        return prompt, spans


@functools.lru_cache(maxsize=16)
def reads_variable(source: str, name: str) -> bool:
    """Whether the template `source` (one that compiles) reads the variable `name` from
    what it is given: the name inside another (`xml_tools`), a comment or text is not it."""
    return name in jinja2.meta.find_undeclared_variables(_ENVIRONMENT.parse(source))


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


def _map_strings(value: Any, transform: Callable[[str], str]) -> Any:
    """A copy of a JSON-like `value` with `transform` applied to every string in it, keys
    too: a tool call's arguments reach the template as a dict, printed by `tojson`."""
    if isinstance(value, str):
        return transform(value)
    if isinstance(value, Mapping):
        return {
            _map_strings(key, transform): _map_strings(item, transform)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_map_strings(item, transform) for item in value]
    return value


def _spans(prompt: str, parts: list[str], picked: list[str]) -> list[tuple[int, int]] | None:
    """Where the picked strings lie in `prompt`, given `parts` = the sentinel render split
    at its sentinels: [template text, sentinel index, template text, ...]; None if
    `prompt` does not read as those parts with each sentinel replaced by its string."""
    if not prompt.startswith(parts[0]):
        return None
    position, spans = len(parts[0]), []
    for index, after in zip(parts[1::2], parts[2::2], strict=True):
        text = picked[int(index)]
        for written in (text, text.strip(), text.lstrip(), text.rstrip()):
            if prompt.startswith(written + after, position):
                break
        else:
            return None
        spans.append((position, position + len(written)))
        position += len(written) + len(after)
    return spans if position == len(prompt) else None


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


MAX_REPEATED = 1 << 20  # items a template's `*` may build; `**` exponents past 1,024


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox caps `range` alone: `{{ "x" * 4000000000 }}` in a checkpoint's
    template took ~4 GB as it compiled (jinja folds constants), and `**` can take as
    long as it likes. Intercepted, neither is folded, and each is checked as it runs."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for items, times in ((left, right), (right, left)):
                is_repeat = isinstance(items, str | list | tuple) and isinstance(times, int)
                if is_repeat and len(items) * times > MAX_REPEATED:
                    raise SecurityError(f"a repetition of over {MAX_REPEATED} items")
        elif isinstance(right, int | float) and abs(right) > 1024:
            raise SecurityError("a power past 1024")
        return super().call_binop(context, operator, left, right)


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body as it is, as in
    transformers, whose AssistantTracker marks those spans for training masks (TRL's
    `assistant_only_loss` fine-tunes ship such templates); an unknown tag did not compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)  # the tag's own name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)  # type: ignore[no-any-return]


def _build_environment() -> ImmutableSandboxedEnvironment:
    # Templates come from the Hub and are untrusted: the immutable sandbox stops them
    # from touching Python internals or mutating the caller's messages.
    environment = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _Namespace
    return environment


_ENVIRONMENT = _build_environment()
