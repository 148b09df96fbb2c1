"""The KV pool's size: the --kv-budget values a user types, and the blocks they buy."""

import io

from runtime.errors import CadenceError
from runtime.kv import budget
from runtime.kv.budget import parse_kv_budget

import pytest


@pytest.mark.parametrize(
    ("text", "value"),
    [("2GiB", 2 << 30), ("512MB", 512 * 10**6), (" 8 gib ", 8 << 30), ("1073741824", 1 << 30),
     ("0.3", 0.3), ("2.5KiB", 2560), ("0.0001KiB", 1),  # a sliver of a unit: one byte
     ("3MiB", 3 << 20), ("2kb", 2000), ("1GB", 10**9), ("100b", 100), ("1", 1)],
)
def test_bytes_and_fractions(text, value):
    assert parse_kv_budget(text) == value


@pytest.mark.parametrize("text", ["abc", "-1", "0", "0.0", "1.0", "1.5", "inf", "nan", "1e9", "5 TB", "0KiB", ""])
def test_anything_else_is_a_clear_error(text):
    with pytest.raises(ValueError, match="KV budget"):
        parse_kv_budget(text)


# --- pool_blocks: the pool's size under a budget ----------------------------------------

GIB = 1 << 30


@pytest.fixture
def eight_gib_free(monkeypatch):
    monkeypatch.setattr(budget, "available_memory", lambda: 8 * GIB)


@pytest.mark.parametrize(
    ("kv_budget", "blocks"),
    [
        (1000 + 10 * 100, 10),  # bytes: the windows' pools first, then whole blocks
        (1000 + 10 * 100 + 99, 10),
        (1050, 1),  # never no block at all
        (1000, 1),  # exactly the windows' pools: they fit, and one block beside them
        (0.5, (4 * GIB - 1000) // 100),  # a fraction of what is free, whatever is wanted
        (None, 50),  # the default: 30% of what is free, but only what max_batch rows want
    ],
)
def test_a_budget_buys_blocks_past_the_window_pools(eight_gib_free, kv_budget, blocks):
    assert budget.pool_blocks(kv_budget, 50, bytes_per_block=100, window_bytes=1000) == blocks


def test_a_budget_below_one_block_still_buys_one(eight_gib_free):
    assert budget.pool_blocks(50, 50, bytes_per_block=100, window_bytes=0) == 1
    assert budget.pool_blocks(1e-9, 50, bytes_per_block=100, window_bytes=0) == 1


@pytest.mark.parametrize(
    ("kv_budget", "named"),
    [(500, "the KV budget"), (1e-7, "the KV budget"), (None, "the default KV budget (30%")],
)
def test_a_budget_the_sliding_window_pools_alone_outgrow_is_refused(
    monkeypatch, kv_budget, named
):
    """The full-attention layers got one block (16 tokens of context) and the budget
    was exceeded without a word: a server that refused nearly every request."""
    monkeypatch.setattr(budget, "available_memory", lambda: 10 * GIB)
    with pytest.raises(CadenceError, match="sliding-window") as refused:
        budget.pool_blocks(kv_budget, 50, bytes_per_block=100, window_bytes=4 * GIB)
    assert named in str(refused.value) and "--max-batch" in str(refused.value)


def test_a_tiny_budget_is_refused_in_a_unit_that_shows_it():
    """It read "takes 0.00 GiB, more than the KV budget ... of 0.00 GiB"."""
    with pytest.raises(CadenceError) as refused:
        budget.pool_blocks(10, 50, bytes_per_block=100, window_bytes=3 << 19)
    assert "takes 1.50 MiB, more than the KV budget (--kv-budget) of 10 bytes" in str(refused.value)


def test_the_default_budget_is_capped_by_what_is_free(monkeypatch):
    monkeypatch.setattr(budget, "available_memory", lambda: 10_000)
    assert budget.pool_blocks(None, 1_000, bytes_per_block=100, window_bytes=0) == 30


@pytest.mark.parametrize("kv_budget", [0, -5, 1.0, 0.0, True, "1GiB"])
def test_a_budget_of_no_known_form_is_refused(eight_gib_free, kv_budget):
    with pytest.raises(ValueError, match="kv_budget must be"):
        budget.pool_blocks(kv_budget, 50, bytes_per_block=100, window_bytes=0)


def test_bytes_beyond_the_memory_available_are_refused(eight_gib_free):
    with pytest.raises(CadenceError, match=r"9\.0 GiB is more than the 8\.0 GiB"):
        budget.pool_blocks(9 * GIB, 50, bytes_per_block=100, window_bytes=0)


@pytest.mark.parametrize("size", [0, 1025, 16.0, True, None])
def test_a_block_size_outside_1_to_1024_is_refused(size):
    with pytest.raises(CadenceError, match="block_size"):
        budget.check_block_size(size)
    budget.check_block_size(1024)  # the largest allowed
    budget.check_block_size(1)  # and the smallest


def test_one_byte_is_a_budget_and_so_is_a_fraction_just_above_zero():
    assert budget.is_kv_budget(1) and budget.is_kv_budget(1e-9) and budget.is_kv_budget(None)
    assert not budget.is_kv_budget(0) and not budget.is_kv_budget(1.0)


def test_available_memory_reads_memavailable_in_kib(monkeypatch):
    meminfo = "MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\n"
    monkeypatch.setattr(budget, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert budget.available_memory() == 2048 * 1024


def test_without_meminfo_the_backends_memory_limit_is_what_is_available(monkeypatch):
    """macOS has no /proc/meminfo: mlx's recommended working set is the figure the
    budget and its checks go by, and with no figure at all the caller falls back."""

    def no_meminfo(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(budget, "open", no_meminfo, raising=False)
    monkeypatch.setattr(budget.mx, "get_memory_limit", lambda: 6 * GIB)
    assert budget.available_memory() == 6 * GIB

    def no_limit():
        raise RuntimeError("no backend limit")

    monkeypatch.setattr(budget.mx, "get_memory_limit", no_limit)
    assert budget.available_memory() is None


def test_bytes_of_exactly_the_memory_available_are_accepted(eight_gib_free):
    assert budget.pool_blocks(8 * GIB, 50, bytes_per_block=GIB, window_bytes=0) == 8


def test_with_no_memory_figure_the_default_budget_is_what_the_rows_want(monkeypatch):
    monkeypatch.setattr(budget, "available_memory", lambda: None)
    assert budget.pool_blocks(None, 50, bytes_per_block=100, window_bytes=1000) == 50


@pytest.mark.parametrize("kv_budget", [None, 0.5, GIB])
def test_sliding_window_pools_beyond_the_memory_available_are_refused(eight_gib_free, kv_budget):
    """They are reserved for max_batch rows whatever the budget: Gemma 3 at a large
    --max-batch crashed in mlx, or swapped, while they filled."""
    with pytest.raises(CadenceError, match=r"sliding-window .* 9\.0 GiB, more than the 8\.0 GiB"):
        budget.pool_blocks(kv_budget, 50, bytes_per_block=100, window_bytes=9 * GIB)


@pytest.mark.parametrize("kv_budget", [None, 0.99])
def test_sliding_window_pools_that_leave_no_room_for_one_block_are_refused(monkeypatch, kv_budget):
    """The windows' pools fit, but not beside a single block of the first group's (at
    0.99 the budget holds the pools, so only the memory can refuse them)."""
    monkeypatch.setattr(budget, "available_memory", lambda: 1000)
    with pytest.raises(CadenceError, match="sliding-window .* memory available: lower --max-batch"):
        budget.pool_blocks(kv_budget, 50, bytes_per_block=100, window_bytes=950)
    assert budget.pool_blocks(0.99, 50, bytes_per_block=100, window_bytes=900) == 1  # the pools and one block: all there is


def test_on_a_cuda_gpu_its_free_memory_is_what_is_available(monkeypatch):
    """The pool lives on the card: an H200 box reported 128 GB of host memory beside the
    card's 139 GiB free, and a 24 GB card in a 64 GB box would get a pool sized from the
    host's."""
    meminfo = "MemAvailable:    64000000 kB\n"
    monkeypatch.setattr(budget, "open", lambda path: io.StringIO(meminfo), raising=False)
    monkeypatch.setattr(budget.mx, "default_device", lambda: budget.mx.gpu)
    cuda = {"total_memory": 24 * GIB, "free_memory": 22 * GIB, "device_name": "a GPU"}
    monkeypatch.setattr(budget.mx, "device_info", lambda: cuda)
    assert budget.available_memory() == 22 * GIB
    metal = {"memory_size": 32 * GIB, "device_name": "Apple M2"}  # no free figure
    monkeypatch.setattr(budget.mx, "device_info", lambda: metal)
    assert budget.available_memory() == 64000000 * 1024
    monkeypatch.setattr(budget.mx, "device_info", lambda: cuda)
    monkeypatch.setattr(budget.mx, "default_device", lambda: budget.mx.cpu)
    assert budget.available_memory() == 64000000 * 1024  # on the CPU, the host's
