// See row_kernels.h. Written with GCC/Clang vector extensions: 8 fp32 lanes map to
// one AVX2 register, or two SSE/NEON registers, with the same source.
//
// The dot products stay in fp32 (no int8 activations as llama.cpp's Q4_1 x Q8_1):
// cadence promises greedy parity with mlx-lm, whose reference rounds only the weights.
#include <string.h>

#include "row_kernels.h"

#ifndef CADENCE_ISA
#error "compile with -DCADENCE_ISA=<namespace>"
#endif

namespace cadence_quant {
namespace CADENCE_ISA {
namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

constexpr int kLanes = 8;  // one block is 8 packed words, one per lane
constexpr int kMaxRowsTogether = 4;  // x rows sharing one decode of a weight block

inline f32x8 load8(const float* p) {
  f32x8 v;
  memcpy(&v, p, sizeof v);
  return v;
}

inline float sum_lanes(f32x8 v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) {
    s += v[l];
  }
  return s;
}

// Lane l of the block's scale vector scales word l of the block.
inline f32x8 block_scales(const float* scales, int first_element, int values_per_word, int group) {
  f32x8 s;
  for (int l = 0; l < kLanes; ++l) {
    s[l] = scales[(first_element + l * values_per_word) / group];
  }
  return s;
}

template <int BITS>
void matmul_rows_bits(const MatmulJob& job, int row_begin, int row_end) {
  constexpr int kPerWord = 32 / BITS;
  constexpr int kBlock = kLanes * kPerWord;  // values in one block
  constexpr uint32_t kMask = (1u << BITS) - 1;
  const int K = job.K, group = job.group_size;
  const int words_per_row = K / kPerWord;
  const int num_blocks = K / kBlock;
  const int num_groups = K / group;
  const bool is_one_group_per_block = group >= kBlock;
  for (int n = row_begin; n < row_end; ++n) {
    const uint32_t* w = job.w + static_cast<int64_t>(n) * words_per_row;
    const float* scales = job.scales + static_cast<int64_t>(n) * num_groups;
    const float* biases = job.biases + static_cast<int64_t>(n) * num_groups;
    for (int m0 = 0; m0 < job.M; m0 += kMaxRowsTogether) {
      const int rows = job.M - m0 < kMaxRowsTogether ? job.M - m0 : kMaxRowsTogether;
      f32x8 total[kMaxRowsTogether] = {};
      for (int b = 0; b < num_blocks; ++b) {
        u32x8 packed;
        memcpy(&packed, w + b * kLanes, sizeof packed);
        f32x8 q[kPerWord];
        for (int j = 0; j < kPerWord; ++j) {
          q[j] = __builtin_convertvector((i32x8)((packed >> (BITS * j)) & kMask), f32x8);
        }
        const f32x8 s = is_one_group_per_block
            ? f32x8{} + scales[(b * kBlock) / group]
            : block_scales(scales, b * kBlock, kPerWord, group);
        for (int r = 0; r < rows; ++r) {
          const float* xb = job.xt + static_cast<int64_t>(m0 + r) * K + b * kBlock;
          f32x8 acc = q[0] * load8(xb);
          for (int j = 1; j < kPerWord; ++j) {
            acc += q[j] * load8(xb + j * kLanes);
          }
          total[r] += s * acc;
        }
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        const float* x = job.xt + m * K;  // the tail past the last block is not transposed
        float tail = 0.0f;
        for (int word = num_blocks * kLanes; word < words_per_row; ++word) {
          for (int j = 0; j < kPerWord; ++j) {
            const int k = word * kPerWord + j;
            tail += static_cast<float>((w[word] >> (BITS * j)) & kMask) * scales[k / group] * x[k];
          }
        }
        const float* xsum = job.xsum + m * num_groups;
        float offset = 0.0f;
        for (int g = 0; g < num_groups; ++g) {
          offset += biases[g] * xsum[g];
        }
        job.out[m * job.N + n] = sum_lanes(total[r]) + tail + offset;
      }
    }
  }
}

template <int BITS>
void dequantize_rows_bits(const DequantizeJob& job, int row_begin, int row_end) {
  constexpr int kPerWord = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1;
  const int K = job.K, group = job.group_size;
  const int words_per_row = K / kPerWord;
  const int num_groups = K / group;
  // Lane l of 8 consecutive values reads word l / kPerWord at shift (l % kPerWord) * BITS.
  u32x8 shifts;
  for (int l = 0; l < kLanes; ++l) {
    shifts[l] = (l % kPerWord) * BITS;
  }
  for (int n = row_begin; n < row_end; ++n) {
    const uint32_t* w = job.w + static_cast<int64_t>(n) * words_per_row;
    float* out = job.out + static_cast<int64_t>(n) * K;
    for (int g = 0; g < num_groups; ++g) {
      const f32x8 s = f32x8{} + job.scales[static_cast<int64_t>(n) * num_groups + g];
      const f32x8 bias = f32x8{} + job.biases[static_cast<int64_t>(n) * num_groups + g];
      for (int k = g * group; k < (g + 1) * group; k += kLanes) {
        // 8 values span one word (4 bits) or two (8 bits): broadcast, then shift per lane.
        const uint32_t first = w[k / kPerWord];
        const uint32_t second = w[(k + kLanes - 1) / kPerWord];
        const u32x8 words = kPerWord >= kLanes
            ? u32x8{} + first
            : u32x8{first, first, first, first, second, second, second, second};
        const f32x8 q = __builtin_convertvector((i32x8)((words >> shifts) & kMask), f32x8);
        const f32x8 value = q * s + bias;
        memcpy(out + k, &value, sizeof value);
      }
    }
  }
}

}  // namespace

void matmul_rows(const MatmulJob& job, int row_begin, int row_end) {
  if (job.bits == 4) {
    matmul_rows_bits<4>(job, row_begin, row_end);
  } else {
    matmul_rows_bits<8>(job, row_begin, row_end);
  }
}

void dequantize_rows(const DequantizeJob& job, int row_begin, int row_end) {
  if (job.bits == 4) {
    dequantize_rows_bits<4>(job, row_begin, row_end);
  } else {
    dequantize_rows_bits<8>(job, row_begin, row_end);
  }
}

}  // namespace CADENCE_ISA
}  // namespace cadence_quant
