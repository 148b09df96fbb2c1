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

// x in every lane. `x - V{}` (exactly x, -0 included) lets the compiler broadcast
// straight from memory; `V{} + x` is not x for -0, so it was an add and a register
// shuffle on the FMA ports, ~12% of the panel kernel's speed.
template <class V>
inline V splat(float x) {
  return x - V{};
}

// Pairwise by halves: lane i with lane i + n/2, then i + n/4, ... (the order of the
// loop at the end, which the shuffles reproduce in registers: through an array, the
// compiler spilled every lane to the stack, a third of a decode step's attention).
template <class V>
inline float sum_lanes(V v) {
  constexpr int n = sizeof(V) / 4;
  typedef float V8 __attribute__((vector_size(32)));
  typedef float V4 __attribute__((vector_size(16)));
  if constexpr (n == 16) {
    return sum_lanes(V8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
  } else if constexpr (n == 8) {
    const V4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (half[0] + half[2]) + (half[1] + half[3]);
  } else {
    float lanes[n];
    memcpy(lanes, &v, sizeof v);
    for (int width = n / 2; width > 0; width /= 2) {
      for (int i = 0; i < width; ++i) {
        lanes[i] += lanes[i + width];
      }
    }
    return lanes[0];
  }
}

}  // namespace
