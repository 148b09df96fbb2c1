// See attention_kernels.h. GCC/Clang vector extensions, as row_kernels.cpp: F is one
// vector of L fp32 lanes (16 on AVX-512, 8 elsewhere); a chunk of 16 keys' scores is
// kChunkVectors of them.
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
// A chunk's scores as whole vectors of F. (As one 16-lane vector type, the AVX2 copy's
// masks, maxima and exponentials compiled to 128-bit pieces and stack spills, and its
// decode attention ran at a third of the speed of its own arithmetic.)
constexpr int kChunkVectors = kChunk / L;
constexpr int kTileVectors = L == 16 ? 2 : 1;  // vectors of query heads in a tile
constexpr int kTileKeys = 8;  // keys a tile scores together: its scores fill half the registers

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

// cap * tanh(s / cap) lane by lane (Gemma 2's soft-capped scores), tanh z as
// 1 - 2 / (e^2z + 1): it saturates to +-1 with the clamped exp, and near 0 its absolute
// error is float32's (~1e-7, times cap), which the softmax after it cannot tell apart.
template <class V, class VI>
inline V soft_capped_lanes(V s, float cap) {
  const V e = exp_approx<V, VI>(s * (2.0f / cap));
  return cap - (2.0f * cap) / (e + 1.0f);
}

// The greatest lane, halving the vector as sum_lanes does (through an array the lanes
// went to the stack and back).
template <class V>  // F (a template, so only its width's branch is compiled)
inline float max_lanes(V v) {
  typedef float V8 __attribute__((vector_size(32)));
  typedef float V4 __attribute__((vector_size(16)));
  V8 m8;
  if constexpr (sizeof(V) == 64) {
    const V8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const V8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    m8 = hi > lo ? hi : lo;
  } else {
    m8 = v;
  }
  const V4 lo = __builtin_shufflevector(m8, m8, 0, 1, 2, 3);
  const V4 hi = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const V4 m4 = hi > lo ? hi : lo;
  const float a = m4[0] > m4[2] ? m4[0] : m4[2], b = m4[1] > m4[3] ? m4[1] : m4[3];
  return a > b ? a : b;
}

// Asks for the key and value rows at position `at` of a row's table, into L2. A row's
// blocks lie anywhere in the pool, so the hardware prefetcher meets each one cold, and a
// decode token that only streams its history stalls on every block. A token asks for
// its first two blocks' rows at once, then, as it scores each key, for the key two
// blocks on: a steady trickle, as fast as the keys are used. (Asking for whole blocks,
// the next two at every chunk, took a sixth of the kernel's time in prefetch
// instructions; the trickle made a 16-row decode step of the bench model ~1.5 ms
// faster, 41-43 -> 39-41 ms.)
inline void prefetch_row(const float* keys, const float* values, int64_t row, int D) {
  for (int i = 0; i < D; i += 16) {  // 64-byte lines
    __builtin_prefetch(keys + row + i, 0, 1);
    __builtin_prefetch(values + row + i, 0, 1);
  }
}

inline void prefetch_position(const int32_t* table, int at, const float* keys,
                              const float* values, int bs, int D) {
  prefetch_row(keys, values, (static_cast<int64_t>(table[at / bs]) * bs + at % bs) * D, D);
}

// The first key a query at `pos` sees.
inline int first_visible(const PagedAttentionJob& job, int pos) {
  return job.window > 0 && pos - job.window + 1 > 0 ? pos - job.window + 1 : 0;
}

// Lane j of the result (of sums[j / L], lane j % L): the sum of v[j]'s lanes, for 16
// vectors at once. Each level adds the two halves of pairs of vectors, so every addition
// is a whole vector's (16 dot products reduced one by one took a horizontal sum each).
// Lanes are summed pairwise by halves, as sum_lanes does.
template <class V>  // F (a template, so only its width's branch is compiled)
inline void lane_sums(const V* v, V* sums) {
  if constexpr (sizeof(V) == 64) {
    V u[8], w[4], x[2];
    for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s halves, 8-15: v[2i + 1]'s
      u[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                     18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                     25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; ++i) {  // 4 lanes a vector
      w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                     18, 19, 24, 25, 26, 27) +
             __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                     22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; ++i) {  // 2 lanes a vector
      x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                     20, 21, 24, 25, 28, 29) +
             __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                     22, 23, 26, 27, 30, 31);
    }
    sums[0] = __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                      24, 26, 28, 30) +
              __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                      27, 29, 31);
  } else {  // 8 lanes: two sets of 8 vectors, each to one vector of 8 sums
    static_assert(sizeof(V) == 32, "8 or 16 lanes");
    for (int set = 0; set < 2; ++set) {
      V u[4], w[2];
      for (int i = 0; i < 4; ++i) {
        const V a = v[8 * set + 2 * i], b = v[8 * set + 2 * i + 1];
        u[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
      }
      for (int i = 0; i < 2; ++i) {
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
      }
      sums[set] = __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                  __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15);
    }
  }
}

// GB of one token's query heads (from g0 on), key by key (decode). Each key is loaded
// once for the GB heads; its GB dot products stay vectors until lane_sums, and each
// value row feeds GB independent sums (one head's sums are a chain of dependent FMAs).
// (Two keys and two vectors of values at a time, twice the independent chains, measured
// level: 16 rows x 211 keys x 16 layers 7.1-7.4 against 7.2-7.5 ms, and slower from cache.)
template <int GB>
void attend_token_heads(const PagedAttentionJob& job, int n, int h, int g0) {
  const int G = job.H / job.Hkv, D = job.D, bs = job.block_size;
  const int vector_end = D / L * L;
  F lane[kChunkVectors];  // each score lane's key in its chunk
  for (int c = 0; c < kChunkVectors; ++c) {
    for (int i = 0; i < L; ++i) lane[c][i] = static_cast<float>(c * L + i);
  }
  const F minus_inf = F{} - INFINITY;
  alignas(64) F partial[GB][kChunk];  // [head][key]: a dot product's lanes
  alignas(64) float tail[GB][kChunk];  // [head][key]: its elements past the last vector
  alignas(64) float weights[GB][kChunk];
  float running_max[GB], total[GB], keep[GB];
  const int pos = job.token_pos[n];
  const int first = first_visible(job, pos);
  const int32_t* table = job.tables + static_cast<int64_t>(job.token_row[n]) * job.table_width;
  const int64_t head0 = (static_cast<int64_t>(n) * job.H + static_cast<int64_t>(h) * G + g0) * D;
  const float* q = job.q + head0;  // [GB, D]
  float* acc = job.out + head0;  // [GB, D], normalised at the end
  memset(acc, 0, sizeof(float) * GB * D);
  memset(tail, 0, sizeof tail);
  for (int g = 0; g < GB; ++g) {
    running_max[g] = -INFINITY;
    total[g] = 0.0f;
  }
  const float* head_keys = job.keys + static_cast<int64_t>(h) * job.num_slots * D;
  const float* head_values = job.values + static_cast<int64_t>(h) * job.num_slots * D;
  const int ahead = 2 * bs;
  for (int at = first; at < first + ahead && at <= pos; ++at) {
    prefetch_position(table, at, head_keys, head_values, bs, D);
  }
  for (int p = first; p <= pos;) {
    const int block = p / bs, in_block = p % bs;
    int count = bs - in_block;
    count = count < pos + 1 - p ? count : pos + 1 - p;
    count = count < kChunk ? count : kChunk;
    const int64_t slot = static_cast<int64_t>(table[block]) * bs + in_block;
    const float* k = head_keys + slot * D;  // `count` consecutive keys of one block
    const float* v = head_values + slot * D;
    // Key p + j + ahead (prefetch_position's, without its division) sits two blocks on at
    // the same offset; the chunk's first `prefetches` keys have one (the rest, past pos).
    int prefetches = pos - ahead - p + 1;
    prefetches = prefetches < 0 ? 0 : prefetches < count ? prefetches : count;
    const int64_t ahead_row =
        prefetches > 0 ? (static_cast<int64_t>(table[block + 2]) * bs + in_block) * D : 0;
    for (int j = 0; j < kChunk; ++j) {
      F dot[GB] = {};
      if (j < count) {
        if (j < prefetches) {
          prefetch_row(head_keys, head_values, ahead_row + static_cast<int64_t>(j) * D, D);
        }
        const float* key = k + static_cast<int64_t>(j) * D;
        for (int d = 0; d < vector_end; d += L) {
          const F kv = load<F>(key + d);
          for (int g = 0; g < GB; ++g) dot[g] += load<F>(q + g * D + d) * kv;
        }
        for (int d = vector_end; d < D; ++d) {
          for (int g = 0; g < GB; ++g) tail[g][j] += q[g * D + d] * key[d];
        }
      }
      for (int g = 0; g < GB; ++g) partial[g][j] = dot[g];
    }
    for (int g = 0; g < GB; ++g) {
      F s[kChunkVectors];
      lane_sums(partial[g], s);
      F chunk_max = minus_inf;
      for (int c = 0; c < kChunkVectors; ++c) {
        if (vector_end < D) s[c] += load<F>(tail[g] + c * L);
        s[c] = s[c] * job.scale;
        if (job.softcap > 0.0f) s[c] = soft_capped_lanes<F, FI>(s[c], job.softcap);
        s[c] = lane[c] < static_cast<float>(count) ? s[c] : minus_inf;
        chunk_max = s[c] > chunk_max ? s[c] : chunk_max;
      }
      if (vector_end < D) memset(tail[g], 0, sizeof tail[g]);
      const float new_max = fmaxf(running_max[g], max_lanes(chunk_max));
      F weight_sum = {};
      for (int c = 0; c < kChunkVectors; ++c) {
        const F e = exp_approx<F, FI>(s[c] - new_max);
        const F w = lane[c] < static_cast<float>(count) ? e : F{};
        weight_sum = c == 0 ? w : weight_sum + w;  // lane i + 8 onto lane i, as sum_lanes would
        store(weights[g] + c * L, w);
      }
      // The first chunk has nothing to rescale (and -inf - -inf would be NaN).
      keep[g] = running_max[g] == -INFINITY ? 0.0f : expf(running_max[g] - new_max);
      running_max[g] = new_max;
      total[g] = total[g] * keep[g] + sum_lanes(weight_sum);
    }
    for (int d = 0; d < vector_end; d += L) {
      F a[GB];
      for (int g = 0; g < GB; ++g) a[g] = load<F>(acc + g * D + d) * keep[g];
      for (int j = 0; j < count; ++j) {
        const F value = load<F>(v + static_cast<int64_t>(j) * D + d);
        for (int g = 0; g < GB; ++g) a[g] += splat<F>(weights[g][j]) * value;
      }
      for (int g = 0; g < GB; ++g) store(acc + g * D + d, a[g]);
    }
    for (int d = vector_end; d < D; ++d) {
      for (int g = 0; g < GB; ++g) {
        float a = acc[g * D + d] * keep[g];
        for (int j = 0; j < count; ++j) a += weights[g][j] * v[static_cast<int64_t>(j) * D + d];
        acc[g * D + d] = a;
      }
    }
    p += count;
  }
  for (int g = 0; g < GB; ++g) {
    // The sink joins the sum at the end, relative to the same running max.
    const float sink = job.sinks ? expf(job.sinks[h * G + g0 + g] - running_max[g]) : 0.0f;
    const float inverse = 1.0f / (total[g] + sink);
    for (int d = 0; d < D; ++d) {
      acc[g * D + d] *= inverse;
    }
  }
}

// One token's G query heads (decode), four at a time: each group reads the row's keys
// and values again, from cache by then.
void attend_token(const PagedAttentionJob& job, int n, int h) {
  const int G = job.H / job.Hkv;
  int g0 = 0;
  for (; g0 + 4 <= G; g0 += 4) attend_token_heads<4>(job, n, h, g0);
  switch (G - g0) {
    case 3: return attend_token_heads<3>(job, n, h, g0);
    case 2: return attend_token_heads<2>(job, n, h, g0);
    case 1: return attend_token_heads<1>(job, n, h, g0);
    default: return;
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
    if (job.softcap > 0.0f) {
      for (int j = 0; j < n; ++j) {
        for (int c = 0; c < V; ++c) s[j][c] = soft_capped_lanes<F, FI>(s[j][c], job.softcap);
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
  alignas(64) float totals[TL], maxes[TL];
  for (int c = 0; c < V; ++c) {
    store(totals + c * L, total[c]);
    store(maxes + c * L, running_max[c]);
  }
  for (int i = 0; i < lanes; ++i) {  // every real lane saw its own key: total > 0
    const int token = first + i / G;
    float* out = job.out + (static_cast<int64_t>(token) * job.H + h * G + i % G) * D;
    const float sink = job.sinks ? expf(job.sinks[h * G + i % G] - maxes[i]) : 0.0f;
    const float inverse = 1.0f / (totals[i] + sink);
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
