"""runtime/memory_limits.py: what a container's memory limit leaves, read from fake
cgroup trees of both hierarchies, and what `ulimit -v` leaves."""

import io
import resource
from pathlib import Path

from runtime.kv import budget
from runtime.memory_limits import address_space_headroom, cgroup_headroom

GIB = 1 << 30
V1_UNLIMITED = 9223372036854771712


def write(directory: Path, **files: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name.replace("_", ".", 1)).write_text(f"{value}\n")


def self_cgroup(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "self-cgroup"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def stat(key: str, value: int) -> str:
    return f"anon 1\n{key} {value}\nactive_file 7"


def test_a_v2_limit_leaves_its_limit_less_what_is_used_less_reclaimable_page_cache(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "app", memory_max=8 * GIB, memory_current=5 * GIB, memory_stat=stat("inactive_file", GIB))
    assert cgroup_headroom(root, self_cgroup(tmp_path, "0::/app")) == 4 * GIB


def test_the_tightest_of_nested_v2_limits_wins_and_max_is_no_limit(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "outer", memory_max=6 * GIB, memory_current=5 * GIB)  # 1 GiB left
    write(root / "outer" / "inner", memory_max="max", memory_current=5 * GIB)
    assert cgroup_headroom(root, self_cgroup(tmp_path, "0::/outer/inner")) == GIB
    write(root / "outer", memory_max="max")
    assert cgroup_headroom(root, self_cgroup(tmp_path, "0::/outer/inner")) is None


def test_a_v1_limit_is_read_at_the_mount_when_the_named_cgroup_is_not_there(tmp_path):
    """Docker's v1 mount starts at the container's cgroup: /proc/self/cgroup names a path
    (/docker/<id>) the mount does not hold."""
    root = tmp_path / "cgroup"
    write(
        root / "memory",
        memory_limit_in_bytes=16 * GIB,
        memory_usage_in_bytes=10 * GIB,
        memory_stat=stat("total_inactive_file", 3 * GIB),
    )
    lines = ("12:pids:/docker/abc", "4:memory:/docker/abc", "0::/")
    assert cgroup_headroom(root, self_cgroup(tmp_path, *lines)) == 9 * GIB
    write(root / "memory", memory_limit_in_bytes=V1_UNLIMITED)  # v1's "no limit"
    assert cgroup_headroom(root, self_cgroup(tmp_path, *lines)) is None


def test_only_the_memory_controllers_line_names_the_v1_cgroup(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "memory", memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes=GIB)
    write(root / "memory" / "job", memory_limit_in_bytes=2 * GIB, memory_usage_in_bytes=GIB)
    lines = ("12:pids:/elsewhere", "5:cpu,cpuacct:/elsewhere", "4:memory:/job")
    assert cgroup_headroom(root, self_cgroup(tmp_path, *lines)) == GIB


def test_a_hybrid_hierarchy_reads_v1s_memory_controller_and_the_unified_tree_alike(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "memory" / "job", memory_limit_in_bytes=4 * GIB, memory_usage_in_bytes=GIB)
    write(root / "unified" / "job", memory_max=2 * GIB, memory_current=GIB)
    lines = ("4:memory:/job", "0::/job")
    assert cgroup_headroom(root, self_cgroup(tmp_path, *lines)) == GIB


def test_use_past_the_limit_leaves_nothing_and_unreadable_files_are_no_limit(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "a", memory_max=GIB, memory_current=3 * GIB)
    assert cgroup_headroom(root, self_cgroup(tmp_path, "0::/a")) == 0
    write(root / "a", memory_current="garbage")
    assert cgroup_headroom(root, self_cgroup(tmp_path, "0::/a")) is None
    assert cgroup_headroom(root, tmp_path / "no-such-file") is None  # not Linux


def test_a_limit_above_the_hierarchys_root_is_not_read(tmp_path):
    """The walk stops at the mount: files beside it belong to nothing of ours."""
    write(tmp_path, memory_max=GIB, memory_current=0)
    root = tmp_path / "cgroup"
    root.mkdir()
    assert cgroup_headroom(root, self_cgroup(tmp_path, "0::/")) is None


def test_available_memory_is_the_least_of_the_machines_and_the_cgroups(monkeypatch):
    meminfo = "MemTotal:       64000000 kB\nMemAvailable:    60000000 kB\n"
    monkeypatch.setattr(budget, "open", lambda path: io.StringIO(meminfo), raising=False)
    monkeypatch.setattr(budget, "cgroup_headroom", lambda: 8 * GIB)
    assert budget.available_memory() == 8 * GIB  # the container's 8 GiB, not the host's 57
    monkeypatch.setattr(budget, "cgroup_headroom", lambda: 100 * GIB)
    assert budget.available_memory() == 60000000 * 1024
    monkeypatch.setattr(budget, "cgroup_headroom", lambda: None)
    assert budget.available_memory() == 60000000 * 1024


def test_ulimit_v_leaves_its_limit_less_what_is_mapped(monkeypatch, tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t 9000000 kB\nVmSize:\t 1048576 kB\nVmRSS:\t 10 kB\n")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * GIB, 8 * GIB))
    assert address_space_headroom(status) == 7 * GIB  # 8 GiB less the 1 GiB mapped
    monkeypatch.setattr(resource, "getrlimit", lambda which: (GIB // 2, GIB // 2))
    assert address_space_headroom(status) == 0
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert address_space_headroom(status) is None


def test_available_memory_takes_the_address_spaces_headroom_too(monkeypatch):
    meminfo = "MemAvailable:    60000000 kB\n"
    monkeypatch.setattr(budget, "open", lambda path: io.StringIO(meminfo), raising=False)
    monkeypatch.setattr(budget, "cgroup_headroom", lambda: 8 * GIB)
    monkeypatch.setattr(budget, "address_space_headroom", lambda: 5 * GIB)
    assert budget.available_memory() == 5 * GIB
    monkeypatch.setattr(budget, "address_space_headroom", lambda: None)
    assert budget.available_memory() == 8 * GIB
