"""Native glue and attention kernels. `kernels.blas` must run before mlx is imported."""
