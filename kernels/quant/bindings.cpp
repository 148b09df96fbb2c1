// The Python module `kernels._quant_ext` (loaded by kernels/quant_extension.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "mlx/version.h"

#include "quant_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

#define CADENCE_STR2(x) #x
#define CADENCE_STR(x) CADENCE_STR2(x)

NB_MODULE(_quant_ext, m) {
  m.doc() = "cadence's quantized matmul primitives for mlx's CPU backend";
  // The mlx this was compiled against; the loader refuses a different runtime mlx.
  m.attr("built_for_mlx") = CADENCE_STR(MLX_VERSION_MAJOR) "." CADENCE_STR(
      MLX_VERSION_MINOR) "." CADENCE_STR(MLX_VERSION_PATCH);
  m.def("matmul", &cadence_quant::matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x[M, K] @ dequantize(w).T -> [M, N] float32 (mlx affine layout, 4 or 8 bits).");
  m.def("dequantize", &cadence_quant::dequantize, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "dequantize(w) -> [N, K] float32.");
  m.def("num_kernel_calls", &cadence_quant::num_kernel_calls,
        "How many times the kernels have run, for tests that must see them run.");
  m.def("isa", &cadence_quant::isa, "The instruction set the kernels use.");
  m.def("num_threads", &cadence_quant::num_threads);
  m.def("set_num_threads", &cadence_quant::set_threads, "num_threads"_a);
}
