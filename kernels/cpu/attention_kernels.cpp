// See attention_kernels.h. GCC/Clang vector extensions, as row_kernels.cpp: F is one
// vector of L fp32 lanes (16 on AVX-512, 8 elsewhere), K16 a chunk of 16 keys' scores.
//
// mlx's CPU exp is scalar and single-threaded (~13 ns an element here); these loops
// use Cephes' expf scheme on whole vectors (kernels/poly_exp.py has its derivation
// and error: 7.6e-8 relative at worst), threaded by the caller over items or rows.
#include <math.h>
#include <string.h>

#include "attention_kernels.h"

namespace cadence_cpu {
namespace CADENCE_ISA {

#include "isa_vectors.h"

namespace {

constexpr int kChunk = 16;  // keys scored, exponentiated and summed together
constexpr int kTileVectors = L == 16 ? 2 : 1;  // vectors of query heads in a tile
constexpr int kTileKeys = 8;  // keys a tile scores together: its scores fill half the registers

typedef float K16 __attribute__((vector_size(4 * kChunk)));
typedef int32_t K16I __attribute__((vector_size(4 * kChunk)));

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

// Asks for the keys and values of the next two blocks of a row's table, into L2, while
// block `block` is scored. A row's blocks lie anywhere in the pool, so the hardware
// prefetcher meets each one cold, and a decode token that only streams its history
// stalls on every block: with the pools past L3 (16 rows x 2,048 keys), a layer went
// from 7.1 to 4.5 ms and one row over 8,192 keys from 0.98 to 0.75 ms (the next block
// alone, into L1, changed nothing measurable; two, three or four ahead about the same).
inline void prefetch_blocks_after(const int32_t* table, int block, int last_pos,
                                  const float* keys, const float* values, int bs, int D) {
  for (int ahead = 1; ahead <= 2; ++ahead) {
    const int first_pos = (block + ahead) * bs;
    if (first_pos > last_pos) {
      return;
    }
    const int64_t begin = static_cast<int64_t>(table[block + ahead]) * bs * D;
    for (int64_t i = 0; i < static_cast<int64_t>(bs) * D; i += 16) {  // 64-byte lines
      __builtin_prefetch(keys + begin + i, 0, 1);
      __builtin_prefetch(values + begin + i, 0, 1);
    }
  }
}

// The first key a query at `pos` sees.
inline int first_visible(const PagedAttentionJob& job, int pos) {
  return job.window > 0 && pos - job.window + 1 > 0 ? pos - job.window + 1 : 0;
}

// One token's G query heads, key by key (decode).
void attend_token(const PagedAttentionJob& job, int n, int h) {
  const int G = job.H / job.Hkv, D = job.D, bs = job.block_size;
  K16 lane = {};
  for (int j = 0; j < kChunk; ++j) {
    lane[j] = static_cast<float>(j);
  }
  float scores[kMaxQueriesPerKv][kChunk];
  float running_max[kMaxQueriesPerKv], total[kMaxQueriesPerKv];
  {
    const int pos = job.token_pos[n];
    const int first = first_visible(job, pos);
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
      prefetch_blocks_after(table, p / bs, pos, head_keys, head_values, bs, D);
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
// A tile of a prefill chunk: its count x G query heads are the lanes of V vectors
// of F (kTileVectors: with 2, each key value loaded feeds two FMAs).
void attend_tile(const PagedAttentionJob& job, int first, int count, int h) {
  constexpr int V = kTileVectors, TL = V * L;
  const int G = job.H / job.Hkv, D = job.D, bs = job.block_size, lanes = count * G;
  alignas(64) float q_t[kMaxTileHeadDim * TL];  // [D][lane]: the queries, scaled, transposed
  alignas(64) float acc_t[kMaxTileHeadDim * TL];  // [D][lane]: the outputs, unnormalised
  alignas(64) float pos_lanes[TL], first_lanes[TL];
  for (int i = 0; i < TL; ++i) {
    if (i >= lanes) {  // a lane past the tile sees nothing
      pos_lanes[i] = -1.0f;
      first_lanes[i] = 0.0f;
      for (int d = 0; d < D; ++d) q_t[d * TL + i] = 0.0f;
      continue;
    }
    const int token = first + i / G, pos = job.token_pos[token];
    pos_lanes[i] = static_cast<float>(pos);
    first_lanes[i] = static_cast<float>(first_visible(job, pos));
    const float* q = job.q + (static_cast<int64_t>(token) * job.H + h * G + i % G) * D;
    for (int d = 0; d < D; ++d) q_t[d * TL + i] = q[d] * job.scale;
  }
  F lane_pos[V], lane_first[V], running_max[V], total[V];
  const F minus_inf = F{} - INFINITY;
  for (int c = 0; c < V; ++c) {
    lane_pos[c] = load<F>(pos_lanes + c * L);
    lane_first[c] = load<F>(first_lanes + c * L);
    running_max[c] = minus_inf;
    total[c] = F{};
  }
  memset(acc_t, 0, sizeof(float) * D * TL);
  const int last_pos = job.token_pos[first + count - 1];
  const int earliest_pos = job.token_pos[first];  // the real lanes' least position
  const int latest_first = first_visible(job, last_pos);  // and greatest first key
  const int32_t* table = job.tables + static_cast<int64_t>(job.token_row[first]) * job.table_width;
  const float* head_keys = job.keys + static_cast<int64_t>(h) * job.num_slots * D;
  const float* head_values = job.values + static_cast<int64_t>(h) * job.num_slots * D;
  for (int p = first_visible(job, earliest_pos); p <= last_pos;) {
    const int in_block = p % bs;
    int n = bs - in_block;
    n = n < last_pos + 1 - p ? n : last_pos + 1 - p;
    n = n < kTileKeys ? n : kTileKeys;
    const int64_t slot = static_cast<int64_t>(table[p / bs]) * bs + in_block;
    const float* k = head_keys + slot * D;
    const float* v = head_values + slot * D;
    F s[kTileKeys][V];
    for (int j = 0; j < kTileKeys; ++j) {
      for (int c = 0; c < V; ++c) s[j][c] = F{};
    }
    if (n == kTileKeys) {  // the usual case, a whole chunk: a fixed trip count
      for (int d = 0; d < D; ++d) {
        F q[V];
        for (int c = 0; c < V; ++c) q[c] = load<F>(q_t + d * TL + c * L);
        for (int j = 0; j < kTileKeys; ++j) {
          const float key = k[j * D + d];
          for (int c = 0; c < V; ++c) s[j][c] += q[c] * key;
        }
      }
    } else {
      for (int d = 0; d < D; ++d) {
        F q[V];
        for (int c = 0; c < V; ++c) q[c] = load<F>(q_t + d * TL + c * L);
        for (int j = 0; j < n; ++j) {
          const float key = k[j * D + d];
          for (int c = 0; c < V; ++c) s[j][c] += q[c] * key;
        }
      }
    }
    // Only the chunks at the edges of the tile's keys hold keys some lane must not see
    // (the padded lanes' results are never read, so they need no mask).
    const bool is_edge = p + n - 1 > earliest_pos || p < latest_first;
    F keep[V];
    F weight[kTileKeys][V];
    for (int c = 0; c < V; ++c) {
      F chunk_max = minus_inf;
      for (int j = 0; j < n; ++j) {
        if (is_edge) {
          const float key_pos = static_cast<float>(p + j);
          s[j][c] = key_pos <= lane_pos[c] && key_pos >= lane_first[c] ? s[j][c] : minus_inf;
        }
        chunk_max = s[j][c] > chunk_max ? s[j][c] : chunk_max;
      }
      const F new_max = chunk_max > running_max[c] ? chunk_max : running_max[c];
      const F shift = new_max == minus_inf ? F{} : new_max;  // a lane that has seen nothing yet
      keep[c] = running_max[c] == minus_inf ? F{} : exp_approx<F, FI>(running_max[c] - shift);
      F weight_sum = {};
      for (int j = 0; j < n; ++j) {
        weight[j][c] = exp_approx<F, FI>(s[j][c] - shift);
        if (is_edge) {
          weight[j][c] = s[j][c] == minus_inf ? F{} : weight[j][c];
        }
        weight_sum += weight[j][c];
      }
      total[c] = total[c] * keep[c] + weight_sum;
      running_max[c] = new_max;
    }
    if (n == kTileKeys) {
      for (int d = 0; d < D; ++d) {
        F a[V];
        for (int c = 0; c < V; ++c) a[c] = load<F>(acc_t + d * TL + c * L) * keep[c];
        for (int j = 0; j < kTileKeys; ++j) {
          const float value = v[j * D + d];
          for (int c = 0; c < V; ++c) a[c] += weight[j][c] * value;
        }
        for (int c = 0; c < V; ++c) store(acc_t + d * TL + c * L, a[c]);
      }
    } else {
      for (int d = 0; d < D; ++d) {
        F a[V];
        for (int c = 0; c < V; ++c) a[c] = load<F>(acc_t + d * TL + c * L) * keep[c];
        for (int j = 0; j < n; ++j) {
          const float value = v[j * D + d];
          for (int c = 0; c < V; ++c) a[c] += weight[j][c] * value;
        }
        for (int c = 0; c < V; ++c) store(acc_t + d * TL + c * L, a[c]);
      }
    }
    p += n;
  }
  alignas(64) float totals[TL];
  for (int c = 0; c < V; ++c) store(totals + c * L, total[c]);
  for (int i = 0; i < lanes; ++i) {  // every real lane saw its own key: total > 0
    const int token = first + i / G;
    float* out = job.out + (static_cast<int64_t>(token) * job.H + h * G + i % G) * D;
    const float inverse = 1.0f / totals[i];
    for (int d = 0; d < D; ++d) out[d] = acc_t[d * TL + i] * inverse;
  }
}

}  // namespace

int attention_lanes() {
  return kTileVectors * L;
}

void paged_attention_items(const PagedAttentionJob& job, int begin, int end) {
  for (int item = begin; item < end; ++item) {
    const int tile = item / job.Hkv, h = item % job.Hkv;
    if (job.tile_count[tile] == 1) {
      attend_token(job, job.tile_first[tile], h);
    } else {
      attend_tile(job, job.tile_first[tile], job.tile_count[tile], h);
    }
  }
}

namespace {

inline F silu(F g) {
  return g / (1.0f + exp_approx<F, FI>(-g));
}

// 0.5 x (1 + tanh z) = x / (1 + e^-2z): the same value with no 1 + tanh to cancel
// (at x = -5 that sum is ~7e-4), and it saturates cleanly at both ends.
inline F gelu_tanh(F x) {
  const F z = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
  return x / (1.0f + exp_approx<F, FI>(-2.0f * z));
}

// out[i] = act(gate[i]) * up[i] over [begin, end), L lanes a step, the rest padded.
template <F (*ACT)(F)>
void gated_range(const SiluMulJob& job, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + L <= end; i += L) {
    store(job.out + i, ACT(load<F>(job.gate + i)) * load<F>(job.up + i));
  }
  if (i < end) {
    float g[L] = {}, u[L] = {};
    const int64_t count = end - i;
    memcpy(g, job.gate + i, sizeof(float) * count);
    memcpy(u, job.up + i, sizeof(float) * count);
    store(g, ACT(load<F>(g)) * load<F>(u));
    memcpy(job.out + i, g, sizeof(float) * count);
  }
}

}  // namespace

void silu_mul_range(const SiluMulJob& job, int64_t begin, int64_t end) {
  gated_range<silu>(job, begin, end);
}

void gelu_tanh_mul_range(const SiluMulJob& job, int64_t begin, int64_t end) {
  gated_range<gelu_tanh>(job, begin, end);
}

}  // namespace CADENCE_ISA
}  // namespace cadence_cpu
