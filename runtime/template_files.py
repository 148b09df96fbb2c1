"""Which chat templates a checkpoint's files name, as transformers reads them.

chat_template.jinja wins over tokenizer_config.json's `chat_template`, which may be one
template or a list of named ones (`default`, and `tool_use` for a chat with tools, as
Hermes models ship); transformers saves the named ones beside the first as
additional_chat_templates/NAME.jinja, and template files replace the config's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.chat_template import ChatTemplate
from runtime.errors import CheckpointError
from runtime.files import is_present, one_line, read_text

import jinja2

TOOL_USE_TEMPLATE_FILE = "additional_chat_templates/tool_use.jinja"


def chat_template_source(
    path: Path, config: dict[str, Any], config_file: Path
) -> tuple[str | None, Path]:
    """(template text or None, the file it came from)."""
    jinja_file = path / "chat_template.jinja"
    if is_present(jinja_file):
        return read_text(jinja_file), jinja_file
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the "default" one is for plain chat.
        named = _named_templates(config)
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise CheckpointError(
            f"{config_file}: 'chat_template' should be a string, got {type(template).__name__}"
        )
    return template, config_file


def _named_templates(config: dict[str, Any]) -> dict[Any, Any]:
    """{name: template} of a config whose `chat_template` is a list of named templates
    (`[{"name": "default", ...}, {"name": "tool_use", ...}]`, as Hermes models ship);
    {} for a single template. Each template is its user's to check."""
    entries = config.get("chat_template")
    if not isinstance(entries, list):
        return {}
    return {
        entry.get("name"): entry.get("template") for entry in entries if isinstance(entry, dict)
    }


def tool_use_template_source(
    path: Path, config: dict[str, Any], config_file: Path, special_tokens: Mapping[str, str]
) -> str | None:
    """The checkpoint's "tool_use" template, checked: a string that compiles. As in
    transformers, template files (chat_template.jinja, and additional_chat_templates/,
    where transformers saves the named ones beside it) replace the config's templates."""
    tool_use_file = path / TOOL_USE_TEMPLATE_FILE
    template: Any  # the config's value is checked below
    if is_present(tool_use_file):
        template, source = read_text(tool_use_file), tool_use_file
    elif is_present(path / "chat_template.jinja"):
        return None
    else:
        template, source = _named_templates(config).get("tool_use"), config_file
    if template is None:
        return None
    if not isinstance(template, str):
        raise CheckpointError(
            f"{source}: the 'tool_use' chat template should be a string, "
            f"got {type(template).__name__}"
        )
    try:
        ChatTemplate(template, special_tokens)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(
            f"{source}: the 'tool_use' chat template does not compile ({one_line(exc)})"
        ) from exc
    return template
