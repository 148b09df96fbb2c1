"""The extension's loader: which builds it refuses, the off switch, the start-up check."""

import mlx.core as mx
import pytest

from kernels import cpu_extension as loader


def test_a_build_for_the_same_release_loads_whatever_the_local_or_dev_suffix():
    assert loader.refusal_reason("0.29.1", "0.29.1") is None
    assert loader.refusal_reason("0.29.1", "0.29.1+cuda12") is None
    assert loader.refusal_reason("0.29.1", "0.29.1.dev20250101+abc123") is None
    reason = loader.refusal_reason("0.29.1", "0.30.0")
    assert reason is not None and "0.29.1" in reason and "0.30.0" in reason


@pytest.mark.parametrize("value", ["off", "OFF", "0", "no"])
def test_cadence_cpu_kernels_off_forces_the_fallback(monkeypatch, value):
    monkeypatch.setenv("CADENCE_CPU_KERNELS", value)
    module, status = loader._load()
    assert module is None and status.startswith("CPU kernels off")


class _Wrong:
    def matmul(self, x, w, scales, biases, group_size, bits):
        return mx.zeros((1, 8))


class _Broken:
    def matmul(self, *args):
        raise TypeError("incompatible function arguments")


def test_the_start_up_check_refuses_a_build_that_computes_wrongly_or_does_not_run():
    assert "wrong result" in loader._smoke_test(_Wrong())
    assert "TypeError" in loader._smoke_test(_Broken())
    module = loader.cpu_extension()
    if module is not None:
        assert loader._smoke_test(module) is None
