"""How big the KV pool is: the block size, the budget a user gives, and the memory there is.

    num_blocks = pool_blocks(kv_budget, wanted_blocks, bytes_per_block, window_bytes)

A budget is bytes, a fraction of the memory available now, or None: 30% of it, but no
more than `max_batch` rows of the longest context need (the Engine's `wanted_blocks`).
"""

from __future__ import annotations

import re

from runtime.errors import CadenceError
from runtime.memory_limits import address_space_headroom, cgroup_headroom

import mlx.core as mx

DEFAULT_BLOCK_SIZE = 16
# Past this a block outgrows any sensible context, and the kernels' int32 slot numbers
# (block x block_size) overflow: --block-size 100000000 crashed the process.
MAX_BLOCK_SIZE = 1024
DEFAULT_FREE_FRACTION = 0.3  # of available memory, when no --kv-budget is given


def check_block_size(block_size: object) -> None:
    """Raise CadenceError unless `block_size` is an integer in 1..MAX_BLOCK_SIZE."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise CadenceError(f"block_size must be an integer, got {block_size!r}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CadenceError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {block_size}")


def is_kv_budget(kv_budget: object) -> bool:
    """None (the default), bytes > 0, or a fraction of available memory in (0, 1)."""
    return not isinstance(kv_budget, bool) and (
        kv_budget is None
        or (isinstance(kv_budget, int) and kv_budget > 0)
        or (isinstance(kv_budget, float) and 0 < kv_budget < 1)
    )


def pool_blocks(
    kv_budget: int | float | None,
    wanted_blocks: int,
    bytes_per_block: int,
    window_bytes: int,
    reserved: str = "the sliding-window layers' KV",
) -> int:
    """The pool's blocks under `kv_budget`, past the sliding-window pools' `window_bytes`
    (or whatever else is reserved per row first: `reserved` names it in an error)."""
    if not is_kv_budget(kv_budget):
        raise ValueError(f"kv_budget must be bytes > 0 or a fraction in (0, 1), got {kv_budget!r}")
    available = available_memory()
    # The sliding-window pools are reserved for --max-batch rows whatever the budget
    # (runtime/kv/layout.py), beside at least one block: past the memory there is
    # (Gemma 3 12B, bf16, at --max-batch 64: 30 GiB of them) they crashed in mlx or
    # swapped the machine to a halt while they filled, as an oversized budget did.
    if available is not None and window_bytes + bytes_per_block > available:
        raise CadenceError(
            f"{reserved} for --max-batch rows takes "
            f"{window_bytes / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB of "
            "memory available: lower --max-batch"
        )
    if isinstance(kv_budget, int):
        # A pool the OS cannot back would fail deep in mlx (std::bad_cast, an
        # OverflowError) or swap the machine to a halt while it fills.
        if available is not None and kv_budget > available:
            raise CadenceError(
                f"KV budget of {kv_budget / 2**30:.1f} GiB is more than the "
                f"{available / 2**30:.1f} GiB of memory available (--kv-budget)"
            )
        _check_holds_windows(kv_budget, window_bytes, "the KV budget (--kv-budget)", reserved)
        return max((kv_budget - window_bytes) // bytes_per_block, 1)
    if available is None:
        return wanted_blocks
    fraction = DEFAULT_FREE_FRACTION if kv_budget is None else kv_budget
    share = int(available * fraction)
    if kv_budget is None:
        what = f"the default KV budget ({DEFAULT_FREE_FRACTION:.0%} of the memory available)"
    else:
        what = "the KV budget (--kv-budget)"
    _check_holds_windows(share, window_bytes, what, reserved)
    affordable = max((share - window_bytes) // bytes_per_block, 1)
    return min(wanted_blocks, affordable) if kv_budget is None else affordable


def _check_holds_windows(budget_bytes: int, window_bytes: int, what: str, reserved: str) -> None:
    """A budget the sliding-window pools alone outgrow left the full-attention layers one
    block, 16 tokens of context: a server that refused nearly every request, over a
    budget exceeded without a word."""
    if window_bytes > budget_bytes:
        raise CadenceError(
            f"{reserved} for --max-batch rows takes "
            f"{_size(window_bytes)}, more than {what} of "
            f"{_size(budget_bytes)}: lower --max-batch or raise --kv-budget"
        )


def _size(num_bytes: int) -> str:
    """Bytes in the largest unit that keeps a figure before the point: a tiny budget read
    "0.00 GiB, more than ... 0.00 GiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.2f} {unit}"
    return f"{num_bytes} bytes"


def available_memory() -> int | None:
    """Bytes the pool and weights could take now: a CUDA GPU's free memory, where they
    live (not the host's: a 24 GB card in a 64 GB box); Linux's MemAvailable, or less
    where a cgroup (a container's limit) or `ulimit -v` leaves less
    (runtime/memory_limits.py); mlx's limit elsewhere (Metal's recommended working set)."""
    if (gpu_free := gpu_free_memory()) is not None:
        return gpu_free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
                    limits = [h for h in (cgroup_headroom(), address_space_headroom()) if h is not None]
                    return min([machine, *limits])
    except OSError:
        pass
    try:
        return int(mx.get_memory_limit())  # Metal: the recommended working set
    except Exception:  # noqa: BLE001  (no backend limit: the caller falls back)
        return None


def gpu_free_memory() -> int | None:
    """The default device's free memory where mlx reports it (CUDA; Metal shares the
    host's memory and reports none); None on the CPU."""
    if mx.default_device() == mx.cpu:
        return None
    try:
        free = mx.device_info().get("free_memory")
    except Exception:  # noqa: BLE001  (an mlx without device_info: the host's figures)
        return None
    return free if isinstance(free, int) and free > 0 else None


_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
_BUDGET = re.compile(r"(\d+(?:\.\d+)?)\s*(kib|mib|gib|kb|mb|gb|b)?", re.IGNORECASE)


def parse_kv_budget(text: str) -> float | int:
    """"2GiB", "512MB", "1073741824" -> bytes; "0.3" -> a fraction of free memory."""
    if (match := _BUDGET.fullmatch(text.strip())) is not None:
        number, unit = match.groups()
        if unit is not None and float(number) > 0:
            return max(int(float(number) * _UNITS[unit.lower()]), 1)
        if unit is None and "." in number and 0 < float(number) < 1:
            return float(number)
        if unit is None and "." not in number and int(number) > 0:
            return int(number)
    raise ValueError(
        f"KV budget {text!r}: give bytes (a whole number, or a number and one of B, KB, MB, "
        "GB, KiB, MiB, GiB: 2GiB, 512MB) or a fraction of free memory in (0, 1)"
    )
