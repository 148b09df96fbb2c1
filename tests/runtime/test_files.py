"""runtime/files.py: a checkpoint's files are read only when regular, and fail naming themselves."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from runtime.errors import CheckpointError
from runtime.files import one_line, read_json, read_text, shortened

import pytest


def releasing_fifo(path: Path) -> threading.Timer:
    """A FIFO at `path`, and a timer that unblocks any reader after 10 s (by opening the
    write end and closing it), so that a regression fails instead of hanging the suite."""
    os.mkfifo(path)

    def release() -> None:
        with contextlib.suppress(OSError):  # no reader: nothing to release
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(10, release)
    timer.start()
    return timer


@pytest.mark.parametrize("read", [read_text, read_json])
def test_a_fifo_is_refused_without_being_opened(tmp_path, read):
    timer = releasing_fifo(tmp_path / "config.json")
    try:
        with pytest.raises(CheckpointError, match=r"config\.json: not a regular file"):
            read(tmp_path / "config.json")
    finally:
        timer.cancel()


def test_a_directory_is_refused_naming_it(tmp_path):
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a regular file"):
        read_json(tmp_path / "tokenizer.json")


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"{not json", "not valid JSON (Expecting property name"),
        (b"\n\n[1,", "line 3"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"\xff\xfe{}", "unreadable ('utf-8' codec can't decode"),
        (b'{"vocab_size": ' + b"1" * 5000 + b"}", "a number of too many digits"),
        (b'{"unk_token": "\\ud800x"}', "half a UTF-16 surrogate pair"),  # was a traceback
        (b'{"a": ["\\udfff"]}', "half a UTF-16 surrogate pair"),
    ],
    ids=["syntax", "line", "nesting", "not-utf-8", "digits", "lone-high-surrogate", "lone-low-surrogate"],
)
def test_bad_content_is_one_line_naming_the_file(tmp_path, content, said):
    (tmp_path / "x.json").write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        read_json(tmp_path / "x.json")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'x.json'}: ") and said in message
    assert "\n" not in message


def test_escaped_surrogate_pairs_and_escaped_backslashes_are_read(tmp_path):
    (tmp_path / "x.json").write_bytes(b'{"emoji": "\\ud83d\\ude00", "text": "\\\\ud800"}')
    assert read_json(tmp_path / "x.json") == {"emoji": "\U0001f600", "text": "\\ud800"}


def test_a_link_to_a_regular_file_is_read(tmp_path):
    (tmp_path / "blob").write_text('{"a": 1}')
    (tmp_path / "config.json").symlink_to(tmp_path / "blob")  # the Hugging Face cache's way
    assert read_json(tmp_path / "config.json") == {"a": 1}


def test_shortened_keeps_short_text_and_counts_what_it_cut():
    assert shortened("abc") == "abc"
    assert shortened("x" * 10, 10) == "x" * 10  # at the limit: kept whole
    assert shortened("x" * 5000, 10) == "xxxxxxxxxx... (5000 characters)"


def test_a_missing_file_is_named_once_with_the_systems_reason(tmp_path):
    with pytest.raises(CheckpointError) as info:
        read_json(tmp_path / "config.json")
    assert str(info.value) == f"{tmp_path / 'config.json'}: unreadable (No such file or directory)"


def test_one_line_joins_lines_and_names_a_messageless_exception_by_its_type():
    assert one_line(ValueError("bad\n  tensor\tname")) == "bad tensor name"
    assert one_line(ValueError()) == "ValueError"


def test_a_read_failing_after_the_check_is_named_with_the_systems_reason(tmp_path, monkeypatch):
    """As a file the user may not read does (the suite may run as root, who may)."""
    (tmp_path / "config.json").write_text("{}")

    def refuse(self, encoding=None):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(CheckpointError) as info:
        read_json(tmp_path / "config.json")
    assert str(info.value) == f"{tmp_path / 'config.json'}: unreadable (Permission denied)"
