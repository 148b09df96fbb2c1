"""The memory a limit leaves this process: a Linux control group's (a container's), and
the address space's (`ulimit -v`).

`MemAvailable` is the machine's. In a container limited to 8 GB on a 64 GB host it reads
the host's free memory: a default KV pool of 30% of that, or weights checked against it,
is more than the container may hold, and the kernel kills the process for its cgroup.

A cgroup's headroom is its limit less what it uses, less the inactive file pages in that
use (page cache the kernel reclaims before it kills anything). Limits nest: the least
headroom from this process's cgroup up to the hierarchy's root is what is left. Both
hierarchies are read: v2 (`memory.max`, `memory.current`, `inactive_file`) and v1
(`memory.limit_in_bytes`, `memory.usage_in_bytes`, `total_inactive_file`). Inside a
container the mounted hierarchy often starts at the container's own cgroup, so a path
from /proc/self/cgroup that is not there is looked for at its ancestors.
"""

from __future__ import annotations

import resource
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
UNLIMITED_FROM = 1 << 60  # v1 writes "no limit" as 9223372036854771712 (2**63 rounded to pages)

# (the hierarchy's directory under the root, limit file, usage file, memory.stat key)
_V2 = ("", "memory.max", "memory.current", "inactive_file")
_V2_HYBRID = ("unified", "memory.max", "memory.current", "inactive_file")
_V1 = ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def cgroup_headroom(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int | None:
    """Bytes this process's cgroups let it take now, or None where none sets a limit."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:  # not Linux, or no /proc
        return None
    headrooms: list[int] = []
    for line in lines:
        hierarchy_id, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy_id == "0" and controllers == "":
            layouts = [_V2, _V2_HYBRID]
        elif "memory" in controllers.split(","):
            layouts = [_V1]
        else:
            continue
        for directory, limit_file, usage_file, inactive_key in layouts:
            base = root / directory if directory else root
            headrooms += _headrooms(base, path, limit_file, usage_file, inactive_key)
    return min(headrooms, default=None)


def _headrooms(base: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[int]:
    """The headroom of each limited cgroup from `path` up to `base`, the hierarchy's root."""
    found = []
    cgroup = base / path.strip("/")
    for directory in (cgroup, *cgroup.parents):
        if directory != base and base not in directory.parents:
            break  # above the hierarchy's root
        limit = _read_int(directory / limit_file)  # None for v2's "max"
        usage = _read_int(directory / usage_file)
        if limit is None or limit >= UNLIMITED_FROM or usage is None:
            continue
        inactive = _stat(directory / "memory.stat", inactive_key)
        found.append(max(limit - max(usage - inactive, 0), 0))
    return found


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stat(path: Path, key: str) -> int:
    """The number after `key` in a file of "key value" lines (memory.stat, /proc's status)."""
    try:
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == key:
                return int(fields[1])
    except (OSError, ValueError):
        pass
    return 0


def address_space_headroom(status: Path = Path("/proc/self/status")) -> int | None:
    """Bytes of address space `ulimit -v` (RLIMIT_AS) leaves this process, or None.

    Every allocation takes address space before memory: under such a limit, loading an
    8B bf16 checkpoint with 21 GB free ended in a segmentation fault inside mlx's eval
    when an allocation failed. What the process has mapped already (VmSize, thread
    stacks and the BLAS's buffers among it) is taken from the limit.
    """
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit == resource.RLIM_INFINITY:
        return None
    mapped = _stat(status, "VmSize:") * 1024  # "VmSize:  123456 kB"
    return max(limit - mapped, 0)
