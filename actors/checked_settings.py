"""`open_llm`'s settings checked before anything loads: each a CadenceError naming it."""

from __future__ import annotations

import math
from pathlib import Path

from runtime.cpu_weights import CPU_QUANTIZE_CHOICES, DEFAULT_CPU_QUANTIZE
from runtime.errors import CadenceError
from runtime.kv.budget import check_block_size, is_kv_budget


def check_settings(
    model: object,
    block_size: object,
    counts: dict[str, object],
    optional_counts: dict[str, object],
    drain_timeout: object,
    kv_budget: object = None,
    cpu_quantize: object = DEFAULT_CPU_QUANTIZE,
    flags: dict[str, object] | None = None,
    optional_flags: dict[str, object] | None = None,
    on_progress: object = None,
) -> None:
    """open_llm's settings, as their types and ranges require: a float max_batch was a
    std::bad_cast from mlx, a bad drain_timeout an error only at exit, max_waiting 0 a
    service that refuses every request, a bad kv_budget or cpu_quantize a ValueError
    once the model had loaded, and a flag was read by its truth (prefix_cache="no"
    left caching on)."""
    if model is not None and not isinstance(model, str | Path):
        raise CadenceError(f"model must be a path, a Hugging Face repo id or None, got {model!r}")
    if isinstance(model, str) and not model.strip():  # it read the current directory
        raise CadenceError(f"model must not be empty (None loads the demo), got {model!r}")
    check_block_size(block_size)
    if not is_kv_budget(kv_budget):
        raise CadenceError(
            f"kv_budget must be None, bytes > 0 or a fraction in (0, 1), got {kv_budget!r}"
        )
    if cpu_quantize not in CPU_QUANTIZE_CHOICES:
        raise CadenceError(f"cpu_quantize must be one of {CPU_QUANTIZE_CHOICES}, got {cpu_quantize!r}")
    for name, value in (flags or {}).items():
        if not isinstance(value, bool):
            raise CadenceError(f"{name} must be True or False, got {value!r}")
    for name, value in (optional_flags or {}).items():  # None: the default for the device
        if value is not None and not isinstance(value, bool):
            raise CadenceError(f"{name} must be True, False or None, got {value!r}")
    if on_progress is not None and not callable(on_progress):
        raise CadenceError(f"on_progress must be None or a callable, got {on_progress!r}")
    counts |= {name: value for name, value in optional_counts.items() if value is not None}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CadenceError(f"{name} must be a positive integer, got {value!r}")
    if drain_timeout is not None and (
        isinstance(drain_timeout, bool)
        or not isinstance(drain_timeout, int | float)
        or not math.isfinite(drain_timeout)
        or drain_timeout < 0
    ):
        raise CadenceError(f"drain_timeout must be None or seconds >= 0, got {drain_timeout!r}")
