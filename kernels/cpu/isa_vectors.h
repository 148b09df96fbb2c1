// The vector type and helpers of the per-instruction-set sources (attention_kernels.cpp,
// dense_kernels.cpp): F is one vector of L fp32 lanes, 16 on AVX-512 and 8 elsewhere.
// Include it inside `namespace cadence_cpu { namespace CADENCE_ISA {`, after <string.h>:
// each copy then belongs to one instruction set, so no helper compiled for AVX-512 can
// be picked by the linker for the baseline copy.
#ifndef CADENCE_ISA
#error "compile with -DCADENCE_ISA=<namespace>"
#endif
#ifndef CADENCE_LANES
#define CADENCE_LANES 8
#endif

namespace {

constexpr int L = CADENCE_LANES;
typedef float F __attribute__((vector_size(4 * L)));
typedef int32_t FI __attribute__((vector_size(4 * L)));

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

// Pairwise, so the compiler shuffles halves instead of extracting every lane.
template <class V>
inline float sum_lanes(V v) {
  constexpr int n = sizeof(V) / 4;
  float lanes[n];
  memcpy(lanes, &v, sizeof v);
  for (int width = n / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) {
      lanes[i] += lanes[i + width];
    }
  }
  return lanes[0];
}

}  // namespace
