"""Put an optimized BLAS under mlx's CPU backend.

mlx's Linux CPU wheel links the reference (netlib) BLAS: an fp32 2048x2048
matmul runs at ~8 GFLOP/s. `libmlx.so` imports `cblas_sgemm` by name, so a
library loaded with RTLD_GLOBAL *before* `mlx.core` interposes it (~250 GFLOP/s).

Tried in order, first that works wins:
  1. a system OpenBLAS (`libopenblas.so.0`, e.g. Debian's libopenblas0-pthread);
  2. PyPI's `scipy-openblas32` (a dependency on Linux). It exports only
     `scipy_`-prefixed symbols, so a ten-line shim (`blas_shim.c`) that forwards
     `cblas_sgemm` & co. is compiled once with the system C compiler and cached;
  3. nothing: the reference BLAS stays, and `active_blas()` says so.

On macOS mlx uses Accelerate and Metal; nothing is done there.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_SHIM_SOURCE = Path(__file__).with_name("blas_shim.c")
_state: dict[str, str] = {}


def active_blas() -> str:
    """A short description of the BLAS mlx will use, for the logs."""
    return _state.get("blas", "not configured")


def ensure_fast_blas() -> str:
    """Load an optimized BLAS with global visibility; call before `import mlx.core`.

    Idempotent. Returns the same description as `active_blas()`.
    """
    if "blas" in _state:
        return _state["blas"]
    if sys.platform != "linux":
        _state["blas"] = "platform default (Accelerate/Metal)"
    elif os.environ.get("CADENCE_BLAS", "").lower() == "reference":
        _state["blas"] = "reference (CADENCE_BLAS=reference)"
    elif "mlx.core" in sys.modules:
        _state["blas"] = "reference (mlx.core was imported before cadence could load a BLAS)"
    else:
        _state["blas"] = _load_system_openblas() or _load_scipy_openblas() or "reference (netlib)"
    return _state["blas"]


def _with_kernels(description: str, library: Any, corename: str, pinned: str) -> str:
    """`description` plus the kernels OpenBLAS chose for this CPU, and the environment
    variable that chose them where one did: OPENBLAS_CORETYPE can pin older kernels than
    the CPU runs (Haswell's AVX2 on an AVX-512 CPU ran an fp32 matmul at 262 against
    452 GFLOP/s), which slows what mlx runs on OpenBLAS, such as mlx-lm's layers, while
    cadence's own kernels read the CPU itself."""
    try:
        function = getattr(library, corename)
    except AttributeError:  # an OpenBLAS too old to say
        return description
    function.restype = ctypes.c_char_p
    core = (function() or b"").decode(errors="replace").strip()
    if not core:
        return description
    return f"{description}, {core} kernels" + (f" (OPENBLAS_CORETYPE={pinned})" if pinned else "")


def _load_system_openblas() -> str | None:
    for name in ("libopenblas.so.0", "libopenblas.so"):
        try:
            library = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return _with_kernels(f"system OpenBLAS ({name})", library, "openblas_get_corename", openblas_pin())
    return None


def _load_scipy_openblas() -> str | None:
    try:
        import scipy_openblas32
    except ImportError:
        return None
    lib_dir = Path(scipy_openblas32.get_lib_dir())
    libs = sorted(lib_dir.glob("libscipy_openblas*.so*"))
    if not libs:
        return None
    shim = _shim_path(libs[0])
    if not shim.exists() and not _build_shim(shim):
        return None
    try:
        library = ctypes.CDLL(str(libs[0]), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    description = f"scipy-openblas32 {scipy_openblas32.__version__} via cadence shim"
    return _with_kernels(description, library, "scipy_openblas_get_corename", openblas_pin())


def openblas_pin() -> str:
    """The kernels OPENBLAS_CORETYPE names for OpenBLAS ("Haswell"), or "" where unset."""
    return os.environ.get("OPENBLAS_CORETYPE", "").strip()


def _shim_path(openblas: Path) -> Path:
    # Keyed by the shim's source and the library it forwards to, so an upgrade rebuilds it.
    key = hashlib.sha256(_SHIM_SOURCE.read_bytes() + str(openblas.resolve()).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cadence"
    return cache / f"blas_shim-{key}.so"


def _build_shim(target: Path) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    # The shim resolves scipy_cblas_* at load time from the already-global OpenBLAS.
    cmd = [compiler, "-O2", "-shared", "-fPIC", str(_SHIM_SOURCE), "-o", str(partial)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        partial.unlink(missing_ok=True)
        return False
    os.replace(partial, target)  # atomic: two processes building at once both end well
    return True
