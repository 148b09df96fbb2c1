// The inner loops of cadence's CPU attention and activation kernels, one copy per
// instruction set, as row_kernels.h: attention_kernels.cpp is compiled once per ISA,
// each copy in its own namespace, and includes only C headers.
#pragma once

#include <stdint.h>

namespace cadence_cpu {

// Paged attention over a ragged step (see kernels/paged_attention.py for the layout).
// Item i = (token i / Hkv, KV head i % Hkv) attends the token's G = H / Hkv query heads
// over its row's keys (first, pos], first = pos - window (or -1), online softmax.
struct PagedAttentionJob {
  const float* q;  // [N, H, D]
  const float* keys;  // [Hkv * num_slots, D]: head-major pools
  const float* values;
  const int32_t* tables;  // [R, table_width] block ids
  const int32_t* token_row;  // [N]: the table row of each token
  const int32_t* token_pos;  // [N]: its position in that row
  float* out;  // [N, H, D]
  int H, Hkv, D, num_slots, block_size, table_width;
  int window;  // keys a query sees, itself included; 0: all before it
  float scale;
};

// Softmax of rows of scores over the columns [lo, hi) each row sees; the rest get 0.
// Row i uses bound (i / group) % num_bounds: G query heads of one query share bounds.
struct MaskedSoftmaxJob {
  const float* scores;  // [rows, L]
  float* out;  // [rows, L]
  const int32_t* lo;  // [num_bounds]
  const int32_t* hi;
  int L, group, num_bounds;
  float scale;  // applied to the scores first
};

// out = silu(gate) * up over [begin, end) elements.
struct SiluMulJob {
  const float* gate;
  const float* up;
  float* out;
};

using AttentionItems = void (*)(const PagedAttentionJob&, int begin, int end);
using SoftmaxRows = void (*)(const MaskedSoftmaxJob&, int begin, int end);
using SiluMulRange = void (*)(const SiluMulJob&, int64_t begin, int64_t end);

#define CADENCE_DECLARE_ATTENTION_KERNELS(ns)                                       \
  namespace ns {                                                                    \
  void paged_attention_items(const PagedAttentionJob& job, int begin, int end);    \
  void masked_softmax_rows(const MaskedSoftmaxJob& job, int begin, int end);        \
  void silu_mul_range(const SiluMulJob& job, int64_t begin, int64_t end);           \
  }

CADENCE_DECLARE_ATTENTION_KERNELS(baseline)
CADENCE_DECLARE_ATTENTION_KERNELS(avx2)
CADENCE_DECLARE_ATTENTION_KERNELS(avx512)

}  // namespace cadence_cpu
