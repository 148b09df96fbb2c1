// The inner loops of the RMSNorm and RoPE primitives (norm_rope_ops.cpp), one copy per
// instruction set as row_kernels.h: norm_rope_kernels.cpp is compiled once per ISA.
#pragma once

#include <stdint.h>

namespace cadence_cpu {

struct NormJob {
  const float* x;  // [rows, D]
  const float* weight;  // [D]
  float* out;  // [rows, D]
  int D;
  float eps;
};

struct RopeJob {
  const float* x;  // token n's H heads [H, D] at x + n * x_stride
  const int32_t* positions;  // [N]
  const float* inv_freqs;  // [half]
  float* out;  // [N, H, D]
  int H, D, half;
  float scale;
  int64_t x_stride;  // H * D for a dense x
  // Optionally a second group of H2 heads at x2 + n * x_stride, rotated by the same
  // angles into out2 [N, H2, D]: a stacked q/k projection's k (attention_ops.cpp).
  const float* x2;
  float* out2;
  int H2;
};

using NormRows = void (*)(const NormJob& job, int begin, int end);
using RopeTokens = void (*)(const RopeJob& job, int begin, int end);

#define CADENCE_DECLARE_NORM_ROPE_KERNELS(ns)                     \
  namespace ns {                                                  \
  void rms_norm_rows(const NormJob& job, int begin, int end);     \
  void rope_tokens(const RopeJob& job, int begin, int end);       \
  }

CADENCE_DECLARE_NORM_ROPE_KERNELS(baseline)
CADENCE_DECLARE_NORM_ROPE_KERNELS(avx2)
CADENCE_DECLARE_NORM_ROPE_KERNELS(avx512)

}  // namespace cadence_cpu
