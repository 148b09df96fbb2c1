"""cadence's sans-IO core: checkpoints, models, KV storage, sampling, finishing, the Engine.

Importing this package first puts an optimized BLAS under mlx's CPU backend, which
only works before `mlx.core` is loaded (see kernels/blas.py).
"""

from kernels.blas import ensure_fast_blas

ensure_fast_blas()
