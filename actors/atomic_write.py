"""Reports written whole or not at all: a full disk or a Ctrl-C mid-write leaves the
file that was there (an earlier run's result) as it was, never a truncated one."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(temporary)` beside `path` (same directory and suffix, so a format read
    from the name still is), synced, then renamed over `path`; the temporary file is
    removed if anything fails. A symlink's target is what is replaced. Only a regular
    file (or a new name) is replaced: anything else, /dev/stdout or a FIFO, is written
    as it is, since renaming over it would put a file where the device was."""
    target = Path(os.path.realpath(path))
    try:
        is_special = not stat.S_ISREG(target.stat().st_mode)
    except FileNotFoundError:
        is_special = False
    if is_special:
        write(target)
        return
    temporary = target.with_name(f".{target.stem}.{os.getpid()}.partial{target.suffix}")
    try:
        write(temporary)
        with temporary.open("rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
