// The inner loops of cadence's quantized CPU matmul, one copy per instruction set.
//
// row_kernels.cpp is compiled twice (see CMakeLists.txt): once for the baseline
// target (SSE2 on x86-64, NEON on arm64) and once with AVX2+FMA on x86-64, each
// into its own namespace. It includes only C headers, so no inline function
// compiled with AVX2 can be picked by the linker for the baseline copy.
#pragma once

#include <stdint.h>

namespace cadence_quant {

// One quantized matmul, out = x @ dequantize(w).T, over mlx's affine layout:
// w[n] packs K values of `bits` bits, lowest bits first, 32/bits per uint32;
// value k of row n is q * scales[n, k / group] + biases[n, k / group].
struct MatmulJob {
  const uint32_t* w;  // [N, K * bits / 32]
  const float* scales;  // [N, K / group_size]
  const float* biases;  // [N, K / group_size]
  const float* xt;  // [M, K]: x with each block of 8 words' values transposed (see quant_ops.cpp)
  const float* xsum;  // [M, K / group_size]: x summed over each group (for the biases)
  float* out;  // [M, N]
  int M, N, K, group_size, bits;
};

struct DequantizeJob {
  const uint32_t* w;
  const float* scales;
  const float* biases;
  float* out;  // [N, K]
  int N, K, group_size, bits;
};

using MatmulRows = void (*)(const MatmulJob&, int row_begin, int row_end);
using DequantizeRows = void (*)(const DequantizeJob&, int row_begin, int row_end);

#define CADENCE_DECLARE_ROW_KERNELS(ns)                                  \
  namespace ns {                                                         \
  void matmul_rows(const MatmulJob& job, int row_begin, int row_end);    \
  void dequantize_rows(const DequantizeJob& job, int row_begin, int row_end); \
  }

CADENCE_DECLARE_ROW_KERNELS(baseline)
CADENCE_DECLARE_ROW_KERNELS(avx2)

}  // namespace cadence_quant
