// See row_kernels.h. Written with GCC/Clang vector extensions: a block of L packed words
// is one vector of L fp32 lanes, which the compiler maps to AVX-512 (16 lanes), AVX2 (8),
// or pairs of SSE/NEON registers (8), from the same source.
//
// The dot products stay in fp32 (no int8 activations as llama.cpp's Q4_1 x Q8_1):
// cadence promises greedy parity with mlx-lm, whose reference rounds only the weights.
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>  // always-inline intrinsics only: no symbol a baseline copy could bind
#endif

#include "row_kernels.h"

#ifndef CADENCE_ISA
#error "compile with -DCADENCE_ISA=<namespace>"
#endif
#ifndef CADENCE_LANES
#define CADENCE_LANES 8
#endif

namespace cadence_cpu {
namespace CADENCE_ISA {
namespace {

constexpr int kWideLanes = CADENCE_LANES;
constexpr int kMaxRowsTogether = 4;  // x rows sharing one decode of a weight block

template <int L>
struct Vec {
  typedef float f32 __attribute__((vector_size(4 * L)));
  typedef int32_t i32 __attribute__((vector_size(4 * L)));
  typedef uint32_t u32 __attribute__((vector_size(4 * L)));
};

template <int L>
inline typename Vec<L>::f32 load(const float* p) {
  typename Vec<L>::f32 v;
  memcpy(&v, p, sizeof v);
  return v;
}

// Horizontal sums by halving: a few shuffles instead of L lane extractions.
inline float sum_lanes(Vec<8>::f32 v) {
  typedef float f32x4 __attribute__((vector_size(16)));
  f32x4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

inline float sum_lanes(Vec<16>::f32 v) {
  return sum_lanes(Vec<8>::f32(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)) +
                   Vec<8>::f32(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
}

// The low BITS bits of each lane as float. With 16 lanes and 4 bits, one permute
// looks the value up in {0, ..., 15} (vpermps reads only an index's low 4 bits), in
// place of a mask and a conversion: AVX-512 runs conversions and shifts on one port.
template <int BITS, int L>
inline typename Vec<L>::f32 unpack(typename Vec<L>::u32 shifted) {
  using F = typename Vec<L>::f32;
  using I = typename Vec<L>::i32;
#if defined(__AVX512F__)
  if constexpr (BITS == 4 && L == 16) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (F)_mm512_permutexvar_ps((__m512i)shifted, values);
  }
#endif
  return __builtin_convertvector((I)(shifted & ((1u << BITS) - 1)), F);
}

// The E2M1 value of each lane's low 4 bits (mxfp4's codes). With AVX-512 one permute
// looks it up, with AVX2 one permute (the magnitude) and a sign flip; elsewhere its
// bits are built: exponent field e = (c >> 1) & 3 and
// mantissa bit m = c & 1 give (1 + m / 2) 2^(e - 1) for e > 0 and m / 2 for e = 0, and
// bit 3 is the sign.
template <int L>
inline typename Vec<L>::f32 unpack_e2m1(typename Vec<L>::u32 shifted) {
  using F = typename Vec<L>::f32;
  using I = typename Vec<L>::i32;
#if defined(__AVX512F__)
  if constexpr (L == 16) {
    return (F)_mm512_permutexvar_ps((__m512i)shifted, _mm512_loadu_ps(kE2M1));
  }
#endif
#if defined(__AVX2__)
  if constexpr (L == 8) {  // the magnitude looked up by the low 3 bits, bit 3 the sign
    const __m256i code = (__m256i)shifted;
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1), code);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
    return (F)_mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
  }
#endif
  using U = typename Vec<L>::u32;
  const U code = shifted & 15u;
  const U exponent = (code >> 1) & 3u, mantissa = code & 1u;
  const U normal = ((exponent + 126u) << 23) | (mantissa << 22);
  const U magnitude = (U)(exponent == 0u ? (I)(mantissa * 0x3F000000u) : (I)normal);  // 0.5f: 0x3F000000
  const U bits = magnitude | ((code >> 3) << 31);
  F value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

// Each lane's scale: lane l of a block belongs to group first + lane_group[l].
template <int L>
inline typename Vec<L>::f32 block_scale(
    const float* scales, int groups_per_block, typename Vec<L>::i32 lane_group) {
  using F = typename Vec<L>::f32;
#if defined(__AVX512F__)
  if constexpr (L == 16) {  // a masked load reads only the block's groups, never past the row
    const __m512 loaded = _mm512_maskz_loadu_ps((__mmask16)((1u << groups_per_block) - 1), scales);
    return (F)_mm512_permutexvar_ps((__m512i)lane_group, loaded);
  }
#endif
  // `x - F{}` is x in every lane, broadcast from memory (`F{} + x` is not x for -0:
  // an add and a register shuffle; see splat in isa_vectors.h).
  F s = scales[0] - F{};
  for (int g = 1; g < groups_per_block; ++g) {
    s = lane_group == g ? scales[g] - F{} : s;
  }
  return s;
}

// Adds the products of blocks [first_block, end_block) of L words to partial[0..ROWS).
// Lane l of block b holds word b * L + l; x is packed to match (MatmulJob::xt).
// ROWS is a template argument so that the totals live in registers: indexed by a
// run-time count they went through the stack on every block.
template <int BITS, bool FP4, int L, int ROWS>
__attribute__((always_inline)) inline void add_blocks(
    const uint32_t* w,
    const float* scales,
    const float* const* x_rows,
    int group,
    int first_word,
    int end_word,
    float* partial) {
  using F = typename Vec<L>::f32;
  using I = typename Vec<L>::i32;
  using U = typename Vec<L>::u32;
  constexpr int kPerWord = 32 / BITS;
  constexpr int kBlock = L * kPerWord;  // values in one block
  F total[ROWS] = {};
  // A block spans kBlock / group groups (up to 4): lane l belongs to group l * kPerWord / group.
  // group is 32, 64 or 128: shifts, not divisions (an idiv per block cost 9% of a decode).
  const int group_shift = __builtin_ctz(static_cast<unsigned>(group));
  const int groups_per_block = group >= kBlock ? 1 : kBlock >> group_shift;
  static const int32_t kLanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  I lane;
  memcpy(&lane, kLanes, sizeof lane);
  const I lane_group = (lane * kPerWord) >> group_shift;
  for (int word = first_word; word < end_word; word += L) {
    const int first_value = word * kPerWord;
    U packed;
    memcpy(&packed, w + word, sizeof packed);
    F q[kPerWord];
    for (int j = 0; j < kPerWord; ++j) {
      if constexpr (FP4) {
        q[j] = unpack_e2m1<L>(packed >> (BITS * j));
      } else {
        q[j] = unpack<BITS, L>(packed >> (BITS * j));
      }
    }
    const F s = block_scale<L>(scales + (first_value >> group_shift), groups_per_block, lane_group);
    for (int r = 0; r < ROWS; ++r) {
      const float* xb = x_rows[r] + first_value;
      // Two chains of FMAs instead of one: their latency, not the loads, bounds a row.
      F even = q[0] * load<L>(xb), odd = q[1] * load<L>(xb + L);
      for (int j = 2; j < kPerWord; j += 2) {
        even += q[j] * load<L>(xb + j * L);
        odd += q[j + 1] * load<L>(xb + (j + 1) * L);
      }
      total[r] += s * (even + odd);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    partial[r] += sum_lanes(total[r]);
  }
}

template <int BITS, bool FP4, int L>
__attribute__((always_inline)) inline void add_blocks(
    const uint32_t* w, const float* scales, const float* const* x_rows, int rows, int group,
    int first_word, int end_word, float* partial) {
  static_assert(kMaxRowsTogether == 4, "one case per row count");
  switch (rows) {
    case 1:
      return add_blocks<BITS, FP4, L, 1>(w, scales, x_rows, group, first_word, end_word, partial);
    case 2:
      return add_blocks<BITS, FP4, L, 2>(w, scales, x_rows, group, first_word, end_word, partial);
    case 3:
      return add_blocks<BITS, FP4, L, 3>(w, scales, x_rows, group, first_word, end_word, partial);
    default:
      return add_blocks<BITS, FP4, L, 4>(w, scales, x_rows, group, first_word, end_word, partial);
  }
}

// sum over g of biases[g] * xsum[g]: a group's bias times its sum of x, L groups a step.
template <int L>
inline float bias_term(const float* biases, const float* xsum, int num_groups) {
  using F = typename Vec<L>::f32;
  F sums = {};
  int g = 0;
  for (; g + L <= num_groups; g += L) {
    sums += load<L>(biases + g) * load<L>(xsum + g);
  }
  float offset = sum_lanes(sums);
  for (; g < num_groups; ++g) {
    offset += biases[g] * xsum[g];
  }
  return offset;
}

template <int BITS, bool FP4>
void matmul_rows_bits(const MatmulJob& job, int row_begin, int row_end) {
  constexpr int kPerWord = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1;
  const int K = job.K, group = job.group_size;
  const int words_per_row = K / kPerWord;
  const int wide_end = words_per_row / kWideLanes * kWideLanes;
  const int narrow_end = words_per_row / 8 * 8;  // an 8-word block after the wide ones
  const int num_groups = K / group;
  for (int n = row_begin; n < row_end; ++n) {
    const uint32_t* w = job.w + static_cast<int64_t>(n) * words_per_row;
    const float* scales = job.scales + static_cast<int64_t>(n) * num_groups;
    const float* biases = FP4 ? nullptr : job.biases + static_cast<int64_t>(n) * num_groups;
    for (int m0 = 0; m0 < job.M; m0 += kMaxRowsTogether) {
      const int rows = job.M - m0 < kMaxRowsTogether ? job.M - m0 : kMaxRowsTogether;
      const float* x_rows[kMaxRowsTogether];
      float partial[kMaxRowsTogether] = {};
      for (int r = 0; r < rows; ++r) {
        x_rows[r] = job.xt + static_cast<int64_t>(m0 + r) * K;
      }
      add_blocks<BITS, FP4, kWideLanes>(w, scales, x_rows, rows, group, 0, wide_end, partial);
      if (kWideLanes != 8 && narrow_end > wide_end) {
        add_blocks<BITS, FP4, 8>(w, scales, x_rows, rows, group, wide_end, narrow_end, partial);
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        const float* x = x_rows[r];  // the words past the last block are not transposed
        float tail = 0.0f;
        for (int word = narrow_end; word < words_per_row; ++word) {
          for (int j = 0; j < kPerWord; ++j) {
            const int k = word * kPerWord + j;
            const uint32_t q = (w[word] >> (BITS * j)) & kMask;
            tail += (FP4 ? kE2M1[q] : static_cast<float>(q)) * scales[k / group] * x[k];
          }
        }
        const float offset = FP4 ? 0.0f : bias_term<kWideLanes>(biases, job.xsum + m * num_groups, num_groups);
        job.out[m * job.N + n] = partial[r] + tail + offset;
      }
    }
  }
}

}  // namespace

int matmul_lanes() {
  return kWideLanes;
}

void matmul_rows(const MatmulJob& job, int row_begin, int row_end) {
  if (job.biases == nullptr) {
    matmul_rows_bits<4, true>(job, row_begin, row_end);
  } else if (job.bits == 4) {
    matmul_rows_bits<4, false>(job, row_begin, row_end);
  } else {
    matmul_rows_bits<8, false>(job, row_begin, row_end);
  }
}

}  // namespace CADENCE_ISA
}  // namespace cadence_cpu
