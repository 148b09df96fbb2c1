"""Fixtures for the runtime tests: the trained tokenizer checkpoints
(tests/runtime/tokenizer_checkpoints.py), built once a session."""

from __future__ import annotations

from pathlib import Path

from runtime.tokenizer import Tokenizer

import pytest

from tests.runtime.tokenizer_checkpoints import BUILDERS


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="session")
def ours(checkpoint_dirs) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_dir(path) for name, path in checkpoint_dirs.items()}
