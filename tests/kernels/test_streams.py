"""kernels/streams.py: a second CPU stream per thread, and which work is split over it."""

import threading

import mlx.core as mx

from kernels import streams


def test_each_thread_makes_its_side_stream_once_and_its_own():
    mine = streams.side_stream()
    assert streams.side_stream() == mine
    assert mine != mx.default_stream(mx.cpu) and mine.device == mx.cpu
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(streams.side_stream()))
    thread.start()
    thread.join()
    assert theirs[0] != mine


def test_work_is_split_from_the_threshold_on_the_cpu_only(monkeypatch):
    assert streams.is_worth_splitting(100, 100) and not streams.is_worth_splitting(99, 100)
    monkeypatch.setattr(streams.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not streams.is_worth_splitting(10**9, 100)
