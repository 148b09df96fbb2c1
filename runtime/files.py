"""A checkpoint's files, read so that every failure is a CheckpointError naming the file.

Only regular files are opened: a FIFO by a config's name would block the load forever,
and a directory by a weight file's name failed with a bare "Is a directory".
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from runtime.errors import CheckpointError

GGUF_MAGIC = b"GGUF"
# A \u escape of a UTF-16 surrogate: Python's json takes one unpaired (tokenizers'
# Rust reader refuses it), and the string it makes cannot be encoded.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def is_gguf_file(path: Path) -> bool:
    """A regular file that starts with GGUF's magic bytes."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def is_present(file: Path) -> bool:
    """Anything by `file`'s name, a link that loops or dangles included: `exists()`
    follows links and took such a one for no file, so a tokenizer_config.json that
    looped loaded without its chat template; read, it is named with the system's reason."""
    return os.path.lexists(file)


def check_regular(file: Path) -> None:
    """Raise CheckpointError unless `file` is (or links to) a regular file."""
    try:
        mode = file.stat().st_mode
    except OSError as exc:
        raise CheckpointError(f"{file}: unreadable ({one_line(exc)})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{file}: not a regular file")


def read_text(file: Path) -> str:
    """`file` as UTF-8 text."""
    check_regular(file)
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable ({one_line(exc)})") from None


def read_json(file: Path) -> Any:
    """The JSON value in `file`."""
    text = read_text(file)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc.msg}: line {exc.lineno})") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise CheckpointError(f"{file}: not valid JSON (nested too deeply)") from None
    except ValueError:  # an integer past Python's 4,300 digits
        raise CheckpointError(f"{file}: not valid JSON (a number of too many digits)") from None
    if _SURROGATE_ESCAPE.search(text) is not None:  # rare: most write such characters as UTF-8
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # was a traceback wherever the string was next encoded
            raise CheckpointError(
                f"{file}: not valid JSON (a \\u escape of half a UTF-16 surrogate pair, which is "
                "no character)"
            ) from None
    return value


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (mlx and tokenizers quote names verbatim)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror  # its filename is the one the caller names already
    return " ".join(str(exc).split()) or type(exc).__name__


def shortened(text: str, limit: int = 200) -> str:
    """`text`, or its start and a count of what was cut, for one line of a message."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
