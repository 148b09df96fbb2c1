// The inner loops of cadence's CPU attention and activation kernels, one copy per
// instruction set, as row_kernels.h: attention_kernels.cpp is compiled once per ISA,
// each copy in its own namespace, and includes only C headers.
#pragma once

#include <stdint.h>

namespace cadence_cpu {

// Limits of the kernels' stack buffers; the op checks them before any kernel runs.
constexpr int kMaxQueriesPerKv = 64;  // query heads per KV head
constexpr int kMaxTileHeadDim = 256;  // head dim a prefill tile holds; larger go token by token

// Paged attention over a ragged step (see kernels/paged_attention.py for the layout).
// Item i = (tile i / Hkv, KV head i % Hkv). A tile is `count` consecutive tokens of one
// row at consecutive positions; each of its count x G query heads (G = H / Hkv)
// attends its row's keys (first, pos], first = pos - window (or -1), online softmax.
// A tile of one token (decode) goes key by key through dot products; a tile of a
// prefill chunk makes its query heads the lanes of a vector, so each key is read once
// for all of them and no dot product needs a horizontal sum (attention_lanes()
// query heads at most).
struct PagedAttentionJob {
  const float* q;  // [N, H, D]
  const float* keys;  // [Hkv * num_slots, D]: head-major pools
  const float* values;
  const int32_t* tables;  // [R, table_width] block ids
  const int32_t* token_row;  // [N]: the table row of each token
  const int32_t* token_pos;  // [N]: its position in that row
  const int32_t* tile_first;  // [tiles]: a tile's first token
  const int32_t* tile_count;  // [tiles]: its tokens
  float* out;  // [N, H, D]
  int H, Hkv, D, num_slots, block_size, table_width;
  int window;  // keys a query sees, itself included; 0: all before it
  float scale;
  float softcap = 0.0f;  // > 0: a score s becomes softcap * tanh(s / softcap) (Gemma 2)
  // [H] or null: each query head's sink, a logit in its softmax's sum with no value
  // (gpt-oss): out = sum_i e^(s_i) v_i / (sum_i e^(s_i) + e^(sink)).
  const float* sinks = nullptr;
};

// out = silu(gate) * up over [begin, end) elements.
struct SiluMulJob {
  const float* gate;
  const float* up;
  float* out;
};

using AttentionItems = void (*)(const PagedAttentionJob&, int begin, int end);
using SiluMulRange = void (*)(const SiluMulJob&, int64_t begin, int64_t end);
// The same job with Gemma's activation: out = gelu_tanh(gate) * up, where
// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as nn.gelu_approx.

#define CADENCE_DECLARE_ATTENTION_KERNELS(ns)                                       \
  namespace ns {                                                                    \
  int attention_lanes();                                                            \
  void paged_attention_items(const PagedAttentionJob& job, int begin, int end);    \
  void silu_mul_range(const SiluMulJob& job, int64_t begin, int64_t end);           \
  void gelu_tanh_mul_range(const SiluMulJob& job, int64_t begin, int64_t end);      \
  }

CADENCE_DECLARE_ATTENTION_KERNELS(baseline)
CADENCE_DECLARE_ATTENTION_KERNELS(avx2)
CADENCE_DECLARE_ATTENTION_KERNELS(avx512)

}  // namespace cadence_cpu
