"""The weights on 2 MB pages, once they have their final form at load.

A decode step streams every weight from memory. With 4 KB pages each 4 KB of that
stream is another TLB entry and a point where the hardware prefetchers stop: on the
2-core box a plain two-thread read ran 25-28 GB/s on 4 KB pages and 32-34 GB/s on 2 MB
ones, and an offline copy of the bench model's 16-client burst ran ~3% faster with its
weights on 2 MB pages (README, "The CPU kernels").

The extension copies each array of 2 MB or more into a fresh mapping advised
MADV_HUGEPAGE before its first write (kernels/cpu/huge_pages.h). Where the system
grants no 2 MB pages (THP "never") the copy sits on 4 KB pages and works the same.
The KV pools stay on mlx's allocation: they are sized for the whole memory budget (4 GB
for the bench model), and on this box's VM every fresh 2 MB page cost ~14 ms to fault
in (the host backs it anew), so the pools on them took the server's start from ~10 to
~35 s, where the weights' copy costs 0.2-4 s once.

Off with CADENCE_HUGE_PAGES=off, and everywhere but Linux with mlx's CPU-only build
(a GPU build's buffers are not plain memory).
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import mlx.nn as nn

from kernels.cpu_extension import cpu_extension
from kernels.freed_memory import release_freed_memory

HUGE_PAGE_BYTES = 2 << 20


def huge_pages_wanted() -> bool:
    """Whether the weights go onto 2 MB pages here (see the module docstring)."""
    if os.environ.get("CADENCE_HUGE_PAGES", "").lower() in ("off", "0", "no"):
        return False
    cuda = getattr(mx, "cuda", None)
    return (
        sys.platform == "linux"
        and mx.default_device() == mx.cpu
        and not mx.metal.is_available()
        and not (cuda is not None and cuda.is_available())
        and cpu_extension() is not None
    )


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Replace each of `model`'s arrays of 2 MB or more by a copy on 2 MB pages, one at a
    time (loading never holds a second copy of the model); the bytes moved."""
    ext = cpu_extension()
    if ext is None or not huge_pages_wanted():
        return 0
    moved = 0
    for _, module in model.named_modules():
        # Names, not arrays: a list of the arrays would keep each old buffer alive.
        large = [
            name
            for name, value in module.items()
            if isinstance(value, mx.array) and value.nbytes >= HUGE_PAGE_BYTES
        ]
        for name in large:
            moved += module[name].nbytes
            module[name] = ext.copy_to_huge_pages(module[name])
            release_freed_memory()  # the old buffer: kept, the peak would hold two models
    return moved
