// The inner loops of cadence's quantized CPU matmul, one copy per instruction set.
//
// row_kernels.cpp is compiled once per instruction set (see CMakeLists.txt), each
// copy in its own namespace: the baseline target (SSE2 on x86-64, NEON on arm64),
// and on x86-64 AVX2+FMA (8 lanes) and AVX-512 (16 lanes), chosen at run time. It
// includes only C headers, so no inline function compiled for AVX2 or AVX-512 can be
// picked by the linker for the baseline copy.
#pragma once

#include <stdint.h>

namespace cadence_cpu {

// One quantized matmul, out = x @ dequantize(w).T, over mlx's affine layout:
// w[n] packs K values of `bits` bits, lowest bits first, 32/bits per uint32;
// value k of row n is q * scales[n, k / group] + biases[n, k / group].
// Or, with no biases, mlx's mxfp4 (4 bits, group 32): q is an E2M1 code, the value
// kE2M1[q] * scales[n, k / group] (the scale 2^(e - 127) of the group's exponent e).
struct MatmulJob {
  const uint32_t* w;  // [N, K * bits / 32]
  const float* scales;  // [N, K / group_size]
  const float* biases;  // [N, K / group_size], or null: mxfp4
  const float* xt;  // [M, K]: x with each block's values transposed (pack_activations)
  const float* xsum;  // [M, K / group_size]: x summed over each group (for the biases)
  float* out;  // [M, N]
  int M, N, K, group_size, bits;
};

// The 16 values of an E2M1 (4-bit float) code: 1 sign bit, 2 exponent bits, 1 mantissa bit.
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// How a dense weight is stored: float32, or 16 bits (widened to float32 exactly as
// they are read, so the products are those of the float32 expansion).
enum class WeightKind { f32, f16, bf16 };

// out = x @ w.T for w [N, K] as stored (nn.Linear's layout), few rows of x: each
// weight is read from memory once per call, never packed (an sgemm copies it).
struct DenseMatmulJob {
  const float* x;  // [M, K], rows x_stride apart
  const void* w;  // [N, K] of `w_kind`
  float* out;  // [M, N]
  int M, N, K;
  int64_t x_stride;
  WeightKind w_kind;
};

// out = x @ w.T for a float32 or 16-bit w packed once, at load, into panels of kPanelWidth output
// columns: [ceil(N / 32), K, 32], column n at panel n / 32, lane n % 32, the last
// panel's missing columns zero. A panel is one contiguous stream, and a tile of rows x
// 32 columns keeps its sums in registers across K: an sgemm's inner kernel, without
// the sgemm's copy of the whole weight on every call.
constexpr int kPanelWidth = 32;
struct PanelMatmulJob {
  const float* x;  // [M, K], rows x_stride apart
  const float* x_panels;  // x by pack_panel_block: [blocks of panel_rows() rows][K][rows]
  const void* w;  // [panels, K, kPanelWidth] of `w_kind` (16 bits widened as loaded)
  float* out;  // [M, N]
  int M, N, K;
  int64_t x_stride;
  WeightKind w_kind;
};

// k per pass of the panel kernels (dense_kernels.cpp): a quantized panel's tile holds
// kPanelDepth x kPanelWidth floats.
constexpr int kPanelDepth = 2048;

// out = x @ dequantize(w).T over mlx's affine layout (MatmulJob's w, scales, biases),
// for several rows of x: each 32-column panel of w is dequantized, kPanelDepth k at a
// time, into a [k][32] tile (`tile`, the calling thread's), and the panel kernel's
// register tiles multiply it by x_panels (pack_panel_block). Each weight is decoded
// once per call, where the row kernel decodes it once per 4 rows of x.
struct QuantizedPanelJob {
  const float* x_panels;  // x by pack_panel_block
  const uint32_t* w;  // [N, K * bits / 32]
  const float* scales;  // [N, K / group_size]
  const float* biases;  // or null: mxfp4, as MatmulJob
  float* out;  // [M, N]
  int M, N, K, group_size, bits;
};

using MatmulRows = void (*)(const MatmulJob&, int row_begin, int row_end);
using QuantizedPanelMatmul = void (*)(const QuantizedPanelJob&, int panel_begin, int panel_end,
                                      float* tile);
using PanelMatmul = void (*)(const PanelMatmulJob&, int panel_begin, int panel_end);
using DenseMatmulRows = void (*)(const DenseMatmulJob&, int row_begin, int row_end);

// x[M, K] (any strides) -> xt, xsum for a kernel of `lanes` lanes: the packed words of
// a row form blocks of `lanes` words, then one block of 8 if `lanes` is 16, then a tail;
// in a block of L words, value j of word l (x index l * 32/bits + j) goes to j * L + l.
void pack_activations(
    const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
    int group_size, int bits, int lanes, float* xt, float* xsum);

#define CADENCE_DECLARE_ROW_KERNELS(ns)                                  \
  namespace ns {                                                         \
  int matmul_lanes();                                                    \
  void matmul_rows(const MatmulJob& job, int row_begin, int row_end);    \
  void dense_matmul_rows(const DenseMatmulJob& job, int row_begin, int row_end); \
  int panel_rows();                                                      \
  void pack_panel_block(const PanelMatmulJob& job, float* x_panel);     \
  void panel_matmul(const PanelMatmulJob& job, int panel_begin, int panel_end); \
  void quantized_panel_matmul(const QuantizedPanelJob& job, int panel_begin, int panel_end, \
                              float* tile);                                  \
  }

CADENCE_DECLARE_ROW_KERNELS(baseline)
CADENCE_DECLARE_ROW_KERNELS(avx2)
CADENCE_DECLARE_ROW_KERNELS(avx512)

}  // namespace cadence_cpu
