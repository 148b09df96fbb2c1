// See DenseMatmulJob in row_kernels.h: few rows of x against a float32 weight read
// in place. A block of 4 weight rows x 4 rows of x keeps 16 accumulators of L lanes
// in registers (8 loads per 16 FMAs); the 4 weight rows are re-read from cache, not
// memory, for the next 4 rows of x. Compiled once per instruction set, as row_kernels.cpp.
#include <string.h>

#include "row_kernels.h"

namespace cadence_cpu {
namespace CADENCE_ISA {

#include "isa_vectors.h"

namespace {

// out[m0 + j, n0 + i] = x[m0 + j] . w[n0 + i], i < NR, j < MR.
template <int NR, int MR>
void block(const DenseMatmulJob& job, int n0, int m0) {
  const int K = job.K;
  const float* w[NR];
  const float* x[MR];
  for (int i = 0; i < NR; ++i) w[i] = job.w + static_cast<int64_t>(n0 + i) * K;
  for (int j = 0; j < MR; ++j) x[j] = job.x + static_cast<int64_t>(m0 + j) * job.x_stride;
  F acc[NR][MR] = {};
  const int vector_end = K / L * L;
  for (int k = 0; k < vector_end; k += L) {
    F wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = load<F>(w[i] + k);
    for (int j = 0; j < MR; ++j) {
      const F xv = load<F>(x[j] + k);
      for (int i = 0; i < NR; ++i) acc[i][j] += wv[i] * xv;
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < MR; ++j) {
      float total = sum_lanes(acc[i][j]);
      for (int k = vector_end; k < K; ++k) total += w[i][k] * x[j][k];
      job.out[static_cast<int64_t>(m0 + j) * job.N + n0 + i] = total;
    }
  }
}

template <int NR>
void rows_of_x(const DenseMatmulJob& job, int n0) {
  int m0 = 0;
  for (; m0 + 4 <= job.M; m0 += 4) block<NR, 4>(job, n0, m0);
  switch (job.M - m0) {
    case 3: block<NR, 3>(job, n0, m0); break;
    case 2: block<NR, 2>(job, n0, m0); break;
    case 1: block<NR, 1>(job, n0, m0); break;
    default: break;
  }
}

}  // namespace

void dense_matmul_rows(const DenseMatmulJob& job, int row_begin, int row_end) {
  int n0 = row_begin;
  for (; n0 + 4 <= row_end; n0 += 4) rows_of_x<4>(job, n0);
  for (; n0 < row_end; ++n0) rows_of_x<1>(job, n0);
}

}  // namespace CADENCE_ISA
}  // namespace cadence_cpu
