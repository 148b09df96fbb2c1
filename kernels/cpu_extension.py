"""Load cadence's C++ CPU kernels (kernels/cpu/, built by setup.py), or say why not.

They hold the quantized and few-row dense matmuls, paged attention and SwiGLU.

The extension links the libmlx of the mlx it was built against. pip builds it in an
isolated environment, whose mlx can differ from the one installed beside cadence, and
mlx's C++ ABI is not stable across versions: a mismatched build is refused, not loaded.
Every refusal is one line in `kernel_status()`, which the start-up log prints, and
the callers fall back to mlx's own ops.

CADENCE_CPU_KERNELS=off forces the fallback (the path a machine without a compiler takes).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import mlx.core as mx

_state: dict[str, object] = {}


def cpu_extension() -> ModuleType | None:
    """The loaded `kernels._cpu_ext` module, or None (see `kernel_status()`)."""
    if "module" not in _state:
        _state["module"], _state["status"] = _load()
    return _state["module"]  # type: ignore[return-value]


def kernel_status() -> str:
    """One line for the logs: which CPU kernels run, or why none do."""
    cpu_extension()
    return str(_state["status"])


def refusal_reason(built_for_mlx: str, runtime_mlx: str) -> str | None:
    """Why an extension built against `built_for_mlx` must not load into `runtime_mlx`."""
    runtime_release = runtime_mlx.split(".dev")[0].split("+")[0]
    if built_for_mlx != runtime_release:
        return (
            f"built against mlx {built_for_mlx} but mlx {runtime_mlx} is installed; "
            "reinstall cadence to rebuild them"
        )
    return None


def _load() -> tuple[ModuleType | None, str]:
    fallback = "mlx's own ops (quantized weights expanded to float32)"
    if os.environ.get("CADENCE_CPU_KERNELS", "").lower() in ("off", "0", "no"):
        return None, f"CPU kernels off (CADENCE_CPU_KERNELS); using {fallback}"
    try:
        module = importlib.import_module("kernels._cpu_ext")
    except ImportError as exc:
        return None, f"CPU kernels not built ({exc}); using {fallback}"
    reason = refusal_reason(module.built_for_mlx, getattr(mx, "__version__", "unknown"))
    if reason is None:
        reason = _smoke_test(module)
    if reason is not None:
        return None, f"CPU kernels refused: {reason}; using {fallback}"
    return module, (
        f"CPU kernels: quantized matmul {module.isa()}, attention {module.attention_isa()}, "
        f"{module.num_threads()} threads (idle ones spin {module.spin_microseconds()} us, then sleep) "
        f"(built for mlx {module.built_for_mlx})"
    )


def _smoke_test(module: ModuleType) -> str | None:
    """A binding-ABI mismatch (another nanobind than mlx's) shows as a TypeError here."""
    w, scales, biases = mx.quantize(mx.ones((8, 32)), group_size=32, bits=4)
    try:
        y = module.matmul(mx.ones((1, 32)), w, scales, biases, 32, 4)
        with mx.stream(mx.cpu):
            ok = bool(mx.allclose(y, mx.full((1, 8), 32.0)).item())
    except (TypeError, RuntimeError, ValueError) as exc:
        return f"they do not run with this mlx ({type(exc).__name__}: {exc})"
    return None if ok else "they computed a wrong result in the start-up check"
