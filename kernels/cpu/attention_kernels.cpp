// See attention_kernels.h. GCC/Clang vector extensions, as row_kernels.cpp: F is one
// vector of L fp32 lanes (16 on AVX-512, 8 elsewhere), K16 a chunk of 16 keys' scores.
//
// mlx's CPU exp is scalar and single-threaded (~13 ns an element here); these loops
// use Cephes' expf scheme on whole vectors (kernels/poly_exp.py has its derivation
// and error: 7.6e-8 relative at worst), threaded by the caller over items or rows.
#include <math.h>
#include <string.h>

#include "attention_kernels.h"

#ifndef CADENCE_ISA
#error "compile with -DCADENCE_ISA=<namespace>"
#endif
#ifndef CADENCE_LANES
#define CADENCE_LANES 8
#endif

namespace cadence_cpu {
namespace CADENCE_ISA {
namespace {

constexpr int L = CADENCE_LANES;
constexpr int kChunk = 16;  // keys scored, exponentiated and summed together
constexpr int kMaxGroup = 64;  // query heads per KV head (checked by the op)

typedef float F __attribute__((vector_size(4 * L)));
typedef int32_t FI __attribute__((vector_size(4 * L)));
typedef float K16 __attribute__((vector_size(4 * kChunk)));
typedef int32_t K16I __attribute__((vector_size(4 * kChunk)));

template <class V>
inline V load(const float* p) {
  V v;
  memcpy(&v, p, sizeof v);
  return v;
}

template <class V>
inline void store(float* p, V v) {
  memcpy(p, &v, sizeof v);
}

// e^x lane by lane, x clamped to [-87, 88].
template <class V, class VI>
inline V exp_approx(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + magic) - magic;
  const V r = x - n * 0.693359375f - n * -2.12194440e-4f;  // ln 2 in two parts
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;  // 2^n
  V two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

template <class V>
inline float sum_lanes(V v) {
  constexpr int n = sizeof(V) / 4;
  float lanes[n];
  memcpy(lanes, &v, sizeof v);
  for (int width = n / 2; width > 0; width /= 2) {  // pairwise: the compiler shuffles
    for (int i = 0; i < width; ++i) {
      lanes[i] += lanes[i + width];
    }
  }
  return lanes[0];
}

template <class V>
inline float max_lanes(V v) {
  constexpr int n = sizeof(V) / 4;
  float lanes[n];
  memcpy(lanes, &v, sizeof v);
  float m = lanes[0];
  for (int i = 1; i < n; ++i) {
    m = lanes[i] > m ? lanes[i] : m;
  }
  return m;
}

inline float dot(const float* a, const float* b, int D) {
  const int vector_end = D / L * L;
  F even = {}, odd = {};
  int d = 0;
  for (; d + 2 * L <= vector_end; d += 2 * L) {  // two chains: FMA latency, not loads
    even += load<F>(a + d) * load<F>(b + d);
    odd += load<F>(a + d + L) * load<F>(b + d + L);
  }
  if (d < vector_end) {
    even += load<F>(a + d) * load<F>(b + d);
    d += L;
  }
  float total = sum_lanes(even + odd);
  for (; d < D; ++d) {
    total += a[d] * b[d];
  }
  return total;
}

// acc[0..D) = acc * keep + sum_j p[j] * v[j * D ..], j < count.
inline void rescale_add(float* acc, float keep, const float* p, const float* v, int count, int D) {
  const int vector_end = D / L * L;
  int d = 0;
  for (; d < vector_end; d += L) {
    F a = load<F>(acc + d) * keep;
    for (int j = 0; j < count; ++j) {
      a += p[j] * load<F>(v + static_cast<int64_t>(j) * D + d);
    }
    store(acc + d, a);
  }
  for (; d < D; ++d) {
    float a = acc[d] * keep;
    for (int j = 0; j < count; ++j) {
      a += p[j] * v[static_cast<int64_t>(j) * D + d];
    }
    acc[d] = a;
  }
}

}  // namespace

void paged_attention_items(const PagedAttentionJob& job, int begin, int end) {
  const int G = job.H / job.Hkv, D = job.D, bs = job.block_size;
  K16 lane = {};
  for (int j = 0; j < kChunk; ++j) {
    lane[j] = static_cast<float>(j);
  }
  float scores[kMaxGroup][kChunk];
  float running_max[kMaxGroup], total[kMaxGroup];
  for (int item = begin; item < end; ++item) {
    const int n = item / job.Hkv, h = item % job.Hkv;
    const int pos = job.token_pos[n];
    const int first = job.window > 0 && pos - job.window + 1 > 0 ? pos - job.window + 1 : 0;
    const int32_t* table = job.tables + static_cast<int64_t>(job.token_row[n]) * job.table_width;
    const int64_t head0 = (static_cast<int64_t>(n) * job.H + static_cast<int64_t>(h) * G) * D;
    const float* q = job.q + head0;  // [G, D]
    float* acc = job.out + head0;  // [G, D], normalised at the end
    memset(acc, 0, sizeof(float) * G * D);
    for (int g = 0; g < G; ++g) {
      running_max[g] = -INFINITY;
      total[g] = 0.0f;
    }
    const float* head_keys = job.keys + static_cast<int64_t>(h) * job.num_slots * D;
    const float* head_values = job.values + static_cast<int64_t>(h) * job.num_slots * D;
    for (int p = first; p <= pos;) {
      const int in_block = p % bs;
      int count = bs - in_block;
      count = count < pos + 1 - p ? count : pos + 1 - p;
      count = count < kChunk ? count : kChunk;
      const int64_t slot = static_cast<int64_t>(table[p / bs]) * bs + in_block;
      const float* k = head_keys + slot * D;  // `count` consecutive keys of one block
      const float* v = head_values + slot * D;
      for (int j = 0; j < count; ++j) {
        for (int g = 0; g < G; ++g) {
          scores[g][j] = dot(q + g * D, k + static_cast<int64_t>(j) * D, D) * job.scale;
        }
      }
      const K16I is_key = lane < static_cast<float>(count);
      for (int g = 0; g < G; ++g) {
        const K16 s = is_key ? load<K16>(scores[g]) : K16{} - INFINITY;
        const float new_max = fmaxf(running_max[g], max_lanes(s));
        const K16 e = exp_approx<K16, K16I>(s - new_max);
        const K16 weights = is_key ? e : K16{};
        // The first chunk has nothing to rescale (and -inf - -inf would be NaN).
        const float keep = running_max[g] == -INFINITY ? 0.0f : expf(running_max[g] - new_max);
        running_max[g] = new_max;
        total[g] = total[g] * keep + sum_lanes(weights);
        float w[kChunk];
        store(w, weights);
        rescale_add(acc + g * D, keep, w, v, count, D);
      }
      p += count;
    }
    for (int g = 0; g < G; ++g) {
      const float inverse = 1.0f / total[g];
      for (int d = 0; d < D; ++d) {
        acc[g * D + d] *= inverse;
      }
    }
  }
}

void masked_softmax_rows(const MaskedSoftmaxJob& job, int begin, int end) {
  const int Lc = job.L;
  for (int i = begin; i < end; ++i) {
    const int bound = (i / job.group) % job.num_bounds;
    const int lo = job.lo[bound], hi = job.hi[bound];
    const float* s = job.scores + static_cast<int64_t>(i) * Lc;
    float* o = job.out + static_cast<int64_t>(i) * Lc;
    for (int j = 0; j < lo; ++j) o[j] = 0.0f;
    for (int j = hi; j < Lc; ++j) o[j] = 0.0f;
    if (lo >= hi) {
      continue;
    }
    const int vector_end = lo + (hi - lo) / L * L;
    F vmax = F{} - INFINITY;
    for (int j = lo; j < vector_end; j += L) {
      const F x = load<F>(s + j);
      vmax = x > vmax ? x : vmax;
    }
    float top = max_lanes(vmax);
    for (int j = vector_end; j < hi; ++j) top = fmaxf(top, s[j]);
    const float shift = top * job.scale;
    F vsum = {};
    for (int j = lo; j < vector_end; j += L) {
      const F e = exp_approx<F, FI>(load<F>(s + j) * job.scale - shift);
      store(o + j, e);
      vsum += e;
    }
    float sum = sum_lanes(vsum);
    if (vector_end < hi) {  // the tail, padded into one vector
      float tail[L];
      for (int j = 0; j < L; ++j) tail[j] = vector_end + j < hi ? s[vector_end + j] * job.scale - shift : -87.0f;
      store(tail, exp_approx<F, FI>(load<F>(tail)));
      for (int j = vector_end; j < hi; ++j) {
        o[j] = tail[j - vector_end];
        sum += o[j];
      }
    }
    const float inverse = 1.0f / sum;
    for (int j = lo; j < hi; ++j) o[j] *= inverse;
  }
}

void silu_mul_range(const SiluMulJob& job, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + L <= end; i += L) {
    const F g = load<F>(job.gate + i);
    store(job.out + i, g / (1.0f + exp_approx<F, FI>(-g)) * load<F>(job.up + i));
  }
  if (i < end) {
    float g[L] = {}, u[L] = {};
    const int64_t count = end - i;
    memcpy(g, job.gate + i, sizeof(float) * count);
    memcpy(u, job.up + i, sizeof(float) * count);
    const F gv = load<F>(g);
    store(g, gv / (1.0f + exp_approx<F, FI>(-gv)) * load<F>(u));
    memcpy(job.out + i, g, sizeof(float) * count);
  }
}

}  // namespace CADENCE_ISA
}  // namespace cadence_cpu
