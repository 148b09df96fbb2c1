"""Whether OPENBLAS_CORETYPE handicaps the peer in `cadence bench serve --compare`.

Some machines set OPENBLAS_CORETYPE (and OPENBLAS_L2_SIZE) for older OpenBLAS builds
that misread their CPU. A current OpenBLAS pinned that way can run slower kernels
than the CPU allows: on a 2-core AVX-512 EPYC, Haswell's ran the floor's fp32 matmul
at 262 GFLOP/s against SkylakeX's 452. mlx-lm's layers run on OpenBLAS and cadence's
on its own kernels, so such a pin slows the peer (and the printed floor) alone. The
bench times the same matmul in a child without the pin and says so when it is faster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs

from actors.bench_model import Floor
from kernels.blas import openblas_pin

PIN_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
# Below this speed-up the pin is within the box's run-to-run noise: no note.
NOTABLE_SPEEDUP = 1.1

_CHILD = """
import json, sys
from pathlib import Path
from actors.bench_model import measure_floor
from kernels.blas import active_blas
floor = measure_floor(Path(sys.argv[1]))
print(json.dumps({"gemm_flops": floor.gemm_flops, "blas": active_blas()}))
"""


@attrs.frozen
class Unpinned:
    pinned: str  # OPENBLAS_CORETYPE's value here
    gemm_flops: float  # the floor's matmul, FLOP/s, with neither variable set
    blas: str  # active_blas() there


def measure_unpinned(checkpoint: Path, timeout: float = 300.0) -> Unpinned | None:
    """The floor's matmul in a child without the pin; None where nothing pins OpenBLAS
    or the child fails (an OpenBLAS that misreads this CPU unpinned can crash)."""
    pinned = openblas_pin()
    if not pinned:
        return None
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARIABLES}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(checkpoint.resolve())],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return Unpinned(pinned, float(found["gemm_flops"]), str(found["blas"]))
    except (OSError, subprocess.SubprocessError, ValueError, LookupError, TypeError):
        return None


def pin_note(floor: Floor, unpinned: Unpinned | None) -> str | None:
    """The note to print where the pin slows OpenBLAS past the noise, else None."""
    if unpinned is None or unpinned.gemm_flops < NOTABLE_SPEEDUP * floor.gemm_flops:
        return None
    m, k, n = floor.gemm_shape
    return (
        f"note: OPENBLAS_CORETYPE={unpinned.pinned} pins OpenBLAS's kernels. Without it "
        f"(BLAS {unpinned.blas}) the floor's [{m}, {k}] @ [{k}, {n}] matmul ran at "
        f"{unpinned.gemm_flops / 1e9:.1f} against {floor.gemm_flops / 1e9:.1f} GFLOP/s. "
        "mlx-lm's layers run on OpenBLAS and cadence's on its own kernels, so the pin slows "
        "the peer and the floor, not cadence: for the peer's best, run this command with "
        "both unset (env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE cadence bench serve ...)"
    )
