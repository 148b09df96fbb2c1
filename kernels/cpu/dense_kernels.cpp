// See DenseMatmulJob in row_kernels.h: few rows of x against a weight read in place,
// float32 or 16-bit (float16, bfloat16: widened as loaded, exactly, so the products and
// their order are those of the float32 expansion: 16-bit storage at half the bytes).
// A block of 4 weight rows x 4 rows of x (3 with 8 lanes: kBlockX) keeps 16 (12)
// accumulators of L lanes in registers (8 loads per 16 FMAs); the 4 weight rows are
// re-read from cache, not memory, for the next rows of x. Compiled once per
// instruction set, as row_kernels.cpp.
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>  // always-inline intrinsics only: no symbol a baseline copy could bind
#endif

#include "row_kernels.h"

namespace cadence_cpu {
namespace CADENCE_ISA {

#include "isa_vectors.h"

namespace {

typedef uint16_t H __attribute__((vector_size(2 * L)));
typedef uint32_t U __attribute__((vector_size(4 * L)));

// IEEE half to float, exactly (subnormals, infinities and NaNs included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: shift until the leading 1 is the implicit bit
    uint32_t shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

template <WeightKind KIND>
inline float weight_at(const void* w, int64_t i) {
  if constexpr (KIND == WeightKind::f32) {
    return static_cast<const float*>(w)[i];
  } else if constexpr (KIND == WeightKind::bf16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return half_to_float(static_cast<const uint16_t*>(w)[i]);
  }
}

// L weights from element i on, as float32.
template <WeightKind KIND>
inline F load_weights(const void* w, int64_t i) {
  if constexpr (KIND == WeightKind::f32) {
    return load<F>(static_cast<const float*>(w) + i);
  } else if constexpr (KIND == WeightKind::bf16) {  // the high half of a float's bits
    H h;
    memcpy(&h, static_cast<const uint16_t*>(w) + i, sizeof h);
    const U bits = __builtin_convertvector(h, U) << 16;
    F f;
    memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(w) + i;
#if defined(__AVX512F__)
    if constexpr (L == 16) {
      return (F)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
#endif
#if defined(__F16C__)
    if constexpr (L == 8) {
      return (F)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
#endif
    F f;
    for (int l = 0; l < L; ++l) {
      f[l] = half_to_float(p[l]);
    }
    return f;
  }
}

// out[m0 + j, n0 + i] = x[m0 + j] . w[n0 + i], i < NR, j < MR.
template <WeightKind KIND, int NR, int MR>
void block(const DenseMatmulJob& job, int n0, int m0) {
  const int K = job.K;
  int64_t w[NR];
  const float* x[MR];
  for (int i = 0; i < NR; ++i) w[i] = static_cast<int64_t>(n0 + i) * K;
  for (int j = 0; j < MR; ++j) x[j] = job.x + static_cast<int64_t>(m0 + j) * job.x_stride;
  F acc[NR][MR] = {};
  const int vector_end = K / L * L;
  for (int k = 0; k < vector_end; k += L) {
    F wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = load_weights<KIND>(job.w, w[i] + k);
    for (int j = 0; j < MR; ++j) {
      const F xv = load<F>(x[j] + k);
      for (int i = 0; i < NR; ++i) acc[i][j] += wv[i] * xv;
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < MR; ++j) {
      float total = sum_lanes(acc[i][j]);
      for (int k = vector_end; k < K; ++k) total += weight_at<KIND>(job.w, w[i] + k) * x[j][k];
      job.out[static_cast<int64_t>(m0 + j) * job.N + n0 + i] = total;
    }
  }
}

// A block's weight rows x rows of x: 4 x 4 with 16 lanes (16 of the 32 registers for
// sums); 4 x 3 with 8 (12 of 16, beside the 4 weight vectors: x is read by the FMAs
// from memory). At 4 x 4 the 16 registers spilled: on a 2-core Zen 3, one core's
// [16, 2048] -> 16384 took 44 ms against 30-34 ms at 4 x 3 (32 rows: 76-81 vs 59-62;
// 1 to 4 rows level; 3 x 4 measured between the two).
constexpr int kBlockW = 4;
constexpr int kBlockX = L == 16 ? 4 : 3;

template <WeightKind KIND, int NR>
void rows_of_x(const DenseMatmulJob& job, int n0) {
  int m0 = 0;
  for (; m0 + kBlockX <= job.M; m0 += kBlockX) block<KIND, NR, kBlockX>(job, n0, m0);
  switch (job.M - m0) {
    case 3: block<KIND, NR, 3>(job, n0, m0); break;
    case 2: block<KIND, NR, 2>(job, n0, m0); break;
    case 1: block<KIND, NR, 1>(job, n0, m0); break;
    default: break;
  }
}

template <WeightKind KIND>
void weight_rows(const DenseMatmulJob& job, int row_begin, int row_end) {
  int n0 = row_begin;
  for (; n0 + kBlockW <= row_end; n0 += kBlockW) rows_of_x<KIND, kBlockW>(job, n0);
  for (; n0 < row_end; ++n0) rows_of_x<KIND, 1>(job, n0);
}

// A register tile is kPanelRows rows of x by kTileVectors vectors of a panel's columns:
// with 16 lanes, 12 rows x the whole 32-column panel (24 of the 32 registers, beside the
// panel's 2 vectors and x's broadcast); with 8 (16 registers), 6 rows x half a panel
// (12 + 2 + 1), the panel's two halves one after the other. Each k's 2 loads of the
// panel then feed 2 x kPanelRows FMAs. (Tiles of 2 rows x the whole panel, 4 loads for 8
// FMAs, re-read the panel from L2 for every 2 rows: on a 2-core Zen 3 (AVX2), [176, 1024]
// -> 5632 ran at ~40 GFLOP/s a core against OpenBLAS's ~60.)
constexpr int kPanelRows = L == 16 ? 12 : 6;
constexpr int kTileVectors = 2;
constexpr int kTileWidth = kTileVectors * L;
static_assert(kPanelWidth % kTileWidth == 0, "a panel is a whole number of tiles wide");
// With 16 lanes (AVX-512) a pass is kPanelDepth (row_kernels.h) k deep: each pass past
// the first reloads and adds to the outputs; a panel's 2048 x 32 slice (256 KB) and a
// row block's x (96 KB) stay in L2 across the row blocks, which fed the 12-row tiles as
// well as L1 did: at 256, [176, 2816] -> 1024 ran 186 against 198 GFLOP/s and [176,
// 1024] -> 5632 194 against 206 (OpenBLAS 180-201). With 8 lanes, see kPassDepth.

// The weights' lines a tile asks for while it multiplies: one line every 2^shift k,
// from `at` on (nullptr: none). See panel_matmul_of.
constexpr int kCacheLine = 64;
struct Lookahead {
  const char* at = nullptr;
  int shift = 0;
};

// out[0..ROWS) x [0, cols) (+)= xp . w over kc: xp is [kc][kPanelRows] (x transposed;
// the tile's first row), w the tile's VECS vectors of columns of the panel's [kc][32]
// slice from element `first` on (widened as loaded if 16-bit), out the tile's first
// column; cols <= VECS x L.
template <WeightKind KIND, int ROWS, int VECS>
void panel_tile(int kc, const float* xp, const void* w, int64_t first, float* out,
                int64_t out_stride, bool accumulate, int cols, Lookahead ahead) {
  F sums[ROWS][VECS] = {};
  const int ahead_every = (1 << ahead.shift) - 1;
  for (int k = 0; k < kc; ++k) {
    if (ahead.at != nullptr && (k & ahead_every) == 0) {
      __builtin_prefetch(ahead.at + (k >> ahead.shift) * kCacheLine, 0, 1);  // into L2
    }
    F wv[VECS];
    for (int v = 0; v < VECS; ++v) {
      wv[v] = load_weights<KIND>(w, first + k * kPanelWidth + v * L);
    }
    for (int r = 0; r < ROWS; ++r) {
      const F xv = splat<F>(xp[k * kPanelRows + r]);
      for (int v = 0; v < VECS; ++v) sums[r][v] += xv * wv[v];
    }
  }
  // Unrolled, so each row's sums stay in their registers (rolled, GCC kept a zeroed copy
  // of all of them on the stack: a 1.5 KB `rep stos` a tile).
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    float* o = out + r * out_stride;
    if (cols == VECS * L) {  // whole vectors: vector stores (the loop below became a
      for (int v = 0; v < VECS; ++v) {  // memmove call a row)
        store(o + v * L, accumulate ? load<F>(o + v * L) + sums[r][v] : sums[r][v]);
      }
      continue;
    }
    float row[VECS * L];
    for (int v = 0; v < VECS; ++v) store(row + v * L, sums[r][v]);
    for (int c = 0; c < cols; ++c) o[c] = accumulate ? o[c] + row[c] : row[c];
  }
}

// panel_tile for `rows` (1..ROWS) rows: each count its own unrolled copy.
template <WeightKind KIND, int ROWS, int VECS = kTileVectors>
void panel_tiles_of(int rows, int kc, const float* xp, const void* w, int64_t first, float* out,
                    int64_t out_stride, bool accumulate, int cols, Lookahead ahead) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      return panel_tiles_of<KIND, ROWS - 1, VECS>(rows, kc, xp, w, first, out, out_stride,
                                                  accumulate, cols, ahead);
    }
  }
  panel_tile<KIND, ROWS, VECS>(kc, xp, w, first, out, out_stride, accumulate, cols, ahead);
}

// Up to 3 rows where tiles are narrower than a panel (AVX2): tiles of 2 rows x the whole
// panel (8 sums, 4 panel vectors and x's broadcast: 13 of 16 registers), one pass over
// each row of the slice instead of one per half. From 4 rows the 6 x 16 tiles win, now
// that a pass's slice stays in L1 (kPassDepth): the bench model's 64 layers on 2 Zen 3
// cores, ms, best of 3 rounds, 2 x 32 tiles up to 32 rows against 6 x 16 tiles:
// 1 row 36-37 / 37, 3 rows 37-40 / 36-39, 4 rows 38-41 / 35-37, 8 rows 42-50 / 42,
// 16 rows 66-79 / 50-59, 24 rows 108 / 62, 32 rows 151 / 83. (With one 2048-deep pass
// it had been the other way round up to 32 rows: 16 rows 92-96 against 130-142.)
constexpr int kWideTileRows = 2;
constexpr int kMostRowsForWideTiles = kTileWidth < kPanelWidth ? 3 : 0;

// k per pass over a panel: kPanelDepth (2048) with 16 lanes, 256 with fewer. At 2048,
// every tile of rows after the first re-read its 256 KB slice from L2, at one 128-byte
// row of the panel per 8 FMAs, and the first tile's wait on memory was not overlapped
// with anything: a 16-row decode step's layers ran at ~1/3 of two cores' FMA rate.
// Each pass also asks for the slice kPassesAhead passes on, its lines shared out among
// the pass's tiles, so that memory streams while the tiles multiply. The bench model's
// 64 layers through ext.panel_matmul on 2 Zen 3 cores, ms, the best of 3 rounds
// (two runs where a range):
//
// | rows | 2048, none ahead | 128, none | 128, 2 ahead | 256, 1 | 256, 2 | 256, 3 | 512, 2 |
// |---|---|---|---|---|---|---|---|
// | 8 | 60-64 | 65 | 51 | 46 | 47-49 | 49 | 48 |
// | 16 | 90-92 | 107 | 89 | 79 | 68-80 | 73 | 81 |
// | 32 | 167-177 | 180 | 168 | 152 | 127-150 | 138 | 156 |
// | 48 | 163-167 | 172 | 144 | 137 | 113-142 | 116 | 148 |
// | 176 | 448-518 | 541 | 504 | 502 | 404-479 | 508 | 386 |
constexpr int kPassDepth = kTileWidth < kPanelWidth ? 256 : kPanelDepth;
constexpr int kPassesAhead = 2;

template <WeightKind KIND>
constexpr int64_t weight_bytes() {
  return KIND == WeightKind::f32 ? 4 : 2;
}

// Tile `tile` of `tiles` in a pass over w's [first, first + kc x 32): its share of the
// lines kPassesAhead passes on, or none where that share reaches past `end` (w's
// elements the chunk may read; 0: ask for none) or is more than a line per k.
template <WeightKind KIND>
Lookahead lookahead_for(const void* w, int64_t first, int kc, int64_t end, int tile, int tiles) {
  const int64_t lines = kc * kPanelWidth * weight_bytes<KIND>() / kCacheLine;
  const int64_t share = (lines + tiles - 1) / tiles;
  const int64_t at = (first + static_cast<int64_t>(kPassesAhead) * kc * kPanelWidth) *
                         weight_bytes<KIND>() +
                     tile * share * kCacheLine;  // in bytes from w
  const bool past_end = at + share * kCacheLine > end * weight_bytes<KIND>();
  if (kPassDepth == kPanelDepth || share > kc || past_end) return {};
  int shift = 0;  // a line every 2^shift k covers the share: kc >> shift >= share
  while ((kc >> (shift + 1)) >= share) ++shift;
  return {static_cast<const char*>(w) + at, shift};
}

template <WeightKind KIND>
void wide_tiles(int M, int K, int k0, int kc, const PanelMatmulJob& job, int64_t first, int n0,
                int cols, int64_t end) {
  const int tiles = (M + kWideTileRows - 1) / kWideTileRows;
  for (int m0 = 0, tile = 0; m0 < M; m0 += kWideTileRows, ++tile) {
    const int b = m0 / kPanelRows, r0 = m0 % kPanelRows;  // its rows in x's packed blocks
    const float* xp = job.x_panels + (static_cast<int64_t>(b) * K + k0) * kPanelRows + r0;
    const int rows = M - m0 < kWideTileRows ? M - m0 : kWideTileRows;
    panel_tiles_of<KIND, kWideTileRows, kPanelWidth / L>(
        rows, kc, xp, job.w, first, job.out + static_cast<int64_t>(m0) * job.N + n0, job.N,
        k0 > 0, cols, lookahead_for<KIND>(job.w, first, kc, end, tile, tiles));
  }
}

// Every tile of a panel's kc-deep slice `w` + `first`, kTileWidth columns at a time,
// each over x's blocks of kPanelRows rows; out is the panel's first column.
template <WeightKind KIND>
void narrow_tiles(int M, int K, int k0, int kc, const float* x_panels, const void* w,
                  int64_t first, float* out, int N, int cols, int64_t end) {
  const int blocks = (M + kPanelRows - 1) / kPanelRows;
  const int tiles = blocks * ((cols + kTileWidth - 1) / kTileWidth);
  for (int c0 = 0, tile = 0; c0 < cols; c0 += kTileWidth) {  // the panel's tiles of columns
    const int tile_cols = cols - c0 < kTileWidth ? cols - c0 : kTileWidth;
    for (int b = 0; b < blocks; ++b, ++tile) {
      const int m0 = b * kPanelRows;
      const float* xp = x_panels + (static_cast<int64_t>(b) * K + k0) * kPanelRows;
      panel_tiles_of<KIND, kPanelRows>(
          M - m0, kc, xp, w, first + c0, out + static_cast<int64_t>(m0) * N + c0, N, k0 > 0,
          tile_cols, lookahead_for<KIND>(w, first, kc, end, tile, tiles));
    }
  }
}

// Panel by panel, each in passes of kPassDepth k: a chunk's panels are one contiguous
// stream. Every output's sum runs over k in passes at the same bounds whatever the
// number of rows, so a row's result never depends on the rows beside it.
template <WeightKind KIND>
void panel_matmul_of(const PanelMatmulJob& job, int panel_begin, int panel_end) {
  const int M = job.M, K = job.K;
  const int64_t end = static_cast<int64_t>(panel_end) * K * kPanelWidth;  // past the chunk
  for (int panel = panel_begin; panel < panel_end; ++panel) {
    const int n0 = panel * kPanelWidth;
    const int cols = job.N - n0 < kPanelWidth ? job.N - n0 : kPanelWidth;
    for (int k0 = 0; k0 < K; k0 += kPassDepth) {
      const int kc = K - k0 < kPassDepth ? K - k0 : kPassDepth;
      const int64_t first = (static_cast<int64_t>(panel) * K + k0) * kPanelWidth;
      if (M <= kMostRowsForWideTiles) {
        wide_tiles<KIND>(M, K, k0, kc, job, first, n0, cols, end);
      } else {
        narrow_tiles<KIND>(M, K, k0, kc, job.x_panels, job.w, first, job.out + n0, job.N, cols,
                           end);
      }
    }
  }
}

// tile[k - k0][j] = dequantize(w)[32 panel + j][k] for k in [k0, k0 + kc), j < 32: q x
// scale + bias of its group, as mlx's dequantize; columns past N are zeros. The 32
// columns' words at one k are gathered into vectors, so each of a word's values is a
// shift, a mask, a conversion and an FMA across L columns, stored as one row of the tile.
constexpr int kPanelVectors = kPanelWidth / L;  // a whole panel's columns, in vectors

// The E2M1 value of each lane's 4-bit code (row_kernels.cpp's unpack_e2m1, its bits
// built): exponent field e and mantissa bit m give (1 + m / 2) 2^(e - 1), or m / 2 for
// e = 0; bit 3 is the sign.
inline F e2m1_values(FI signed_code) {
  const U code = (U)signed_code;
  const U exponent = (code >> 1) & 3u, mantissa = code & 1u;
  const U normal = ((exponent + 126u) << 23) | (mantissa << 22);
  const U magnitude = (U)(exponent == 0u ? (FI)(mantissa * 0x3F000000u) : (FI)normal);  // 0.5f: 0x3F000000
  const U bits = magnitude | ((code & 8u) << 28);
  F value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

void dequantize_panel(const QuantizedPanelJob& job, int panel, int k0, int kc, float* tile) {
  const int bits = job.bits, per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const int words_per_row = job.K / per_word, groups_per_row = job.K / job.group_size;
  const int n0 = panel * kPanelWidth;
  const int cols = job.N - n0 < kPanelWidth ? job.N - n0 : kPanelWidth;
  const uint32_t* rows[kPanelWidth];
  for (int j = 0; j < kPanelWidth; ++j) {  // a missing column reads row n0, zeroed by its scale
    rows[j] = job.w + static_cast<int64_t>(j < cols ? n0 + j : n0) * words_per_row;
  }
  F scale[kPanelVectors], bias[kPanelVectors];
  int group = -1;
  for (int k = k0; k < k0 + kc; k += per_word) {
    if (k / job.group_size != group) {  // a word's values share one group (group >= 32)
      group = k / job.group_size;
      for (int v = 0; v < kPanelVectors; ++v) {
        for (int l = 0; l < L; ++l) {
          const int j = v * L + l;
          const int64_t at = static_cast<int64_t>(n0 + j) * groups_per_row + group;
          scale[v][l] = j < cols ? job.scales[at] : 0.0f;
          bias[v][l] = j < cols && job.biases != nullptr ? job.biases[at] : 0.0f;
        }
      }
    }
    U words[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) {
      for (int l = 0; l < L; ++l) words[v][l] = rows[v * L + l][k / per_word];
    }
    for (int t = 0; t < per_word; ++t) {
      float* row = tile + static_cast<int64_t>(k + t - k0) * kPanelWidth;
      for (int v = 0; v < kPanelVectors; ++v) {
        const FI code = (FI)((words[v] >> (bits * t)) & mask);
        if (job.biases == nullptr) {  // mxfp4: the E2M1 value of the code, times the scale
          store(row + v * L, e2m1_values(code) * scale[v]);
        } else {
          store(row + v * L, __builtin_convertvector(code, F) * scale[v] + bias[v]);
        }
      }
    }
  }
}

// out[i * stride + j] = x[j][k + i] for i, j < 4: four rows' values at four k, one
// 4-wide write per k.
inline void transpose_4x4(const float* const* x, int k, float* out, int stride) {
  typedef float F4 __attribute__((vector_size(16)));
  const F4 a = load<F4>(x[0] + k), b = load<F4>(x[1] + k);
  const F4 c = load<F4>(x[2] + k), d = load<F4>(x[3] + k);
  const F4 ab_low = __builtin_shufflevector(a, b, 0, 4, 1, 5);  // a0 b0 a1 b1
  const F4 ab_high = __builtin_shufflevector(a, b, 2, 6, 3, 7);
  const F4 cd_low = __builtin_shufflevector(c, d, 0, 4, 1, 5);
  const F4 cd_high = __builtin_shufflevector(c, d, 2, 6, 3, 7);
  store(out, __builtin_shufflevector(ab_low, cd_low, 0, 1, 4, 5));  // a0 b0 c0 d0
  store(out + stride, __builtin_shufflevector(ab_low, cd_low, 2, 3, 6, 7));
  store(out + 2 * stride, __builtin_shufflevector(ab_high, cd_high, 0, 1, 4, 5));
  store(out + 3 * stride, __builtin_shufflevector(ab_high, cd_high, 2, 3, 6, 7));
}

}  // namespace

void quantized_panel_matmul(const QuantizedPanelJob& job, int panel_begin, int panel_end,
                            float* tile) {
  const int M = job.M, K = job.K;
  for (int panel = panel_begin; panel < panel_end; ++panel) {
    const int n0 = panel * kPanelWidth;
    const int cols = job.N - n0 < kPanelWidth ? job.N - n0 : kPanelWidth;
    for (int k0 = 0; k0 < K; k0 += kPanelDepth) {
      const int kc = K - k0 < kPanelDepth ? K - k0 : kPanelDepth;
      dequantize_panel(job, panel, k0, kc, tile);
      narrow_tiles<WeightKind::f32>(M, K, k0, kc, job.x_panels, tile, 0, job.out + n0, job.N,
                                    cols, 0);
    }
  }
}

int panel_rows() {
  return kPanelRows;
}

void pack_panel_block(const PanelMatmulJob& job, float* t) {
  const int rows = job.M < kPanelRows ? job.M : kPanelRows;
  const float* x[kPanelRows];
  for (int r = 0; r < rows; ++r) x[r] = job.x + static_cast<int64_t>(r) * job.x_stride;
  // k outer: each k's kPanelRows values are one contiguous write, and each row is read
  // in order (row by row, every write strode across the whole block: ~2.5% of a 16-row
  // decode step). Whole groups of 4 rows go 4 k at a time through a 4 x 4 transpose in
  // registers: one value at a time, packing was ~3% of a 176-token prefill step. A last
  // block's missing rows are zeros, never read back out.
  const int grouped = rows / 4 * 4;
  const int k_grouped = grouped > 0 ? job.K / 4 * 4 : 0;
  for (int k = 0; k < k_grouped; k += 4, t += 4 * kPanelRows) {
    for (int r = 0; r < grouped; r += 4) transpose_4x4(x + r, k, t + r, kPanelRows);
    for (int i = 0; i < 4; ++i) {
      int r = grouped;
      for (; r < rows; ++r) t[i * kPanelRows + r] = x[r][k + i];
      for (; r < kPanelRows; ++r) t[i * kPanelRows + r] = 0.0f;
    }
  }
  for (int k = k_grouped; k < job.K; ++k, t += kPanelRows) {
    int r = 0;
    for (; r < rows; ++r) t[r] = x[r][k];
    for (; r < kPanelRows; ++r) t[r] = 0.0f;
  }
}

void panel_matmul(const PanelMatmulJob& job, int panel_begin, int panel_end) {
  switch (job.w_kind) {
    case WeightKind::f16:
      return panel_matmul_of<WeightKind::f16>(job, panel_begin, panel_end);
    case WeightKind::bf16:
      return panel_matmul_of<WeightKind::bf16>(job, panel_begin, panel_end);
    default:
      return panel_matmul_of<WeightKind::f32>(job, panel_begin, panel_end);
  }
}

void dense_matmul_rows(const DenseMatmulJob& job, int row_begin, int row_end) {
  switch (job.w_kind) {
    case WeightKind::f16:
      return weight_rows<WeightKind::f16>(job, row_begin, row_end);
    case WeightKind::bf16:
      return weight_rows<WeightKind::bf16>(job, row_begin, row_end);
    default:
      return weight_rows<WeightKind::f32>(job, row_begin, row_end);
  }
}

}  // namespace CADENCE_ISA
}  // namespace cadence_cpu
