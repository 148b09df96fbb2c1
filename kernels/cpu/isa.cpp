#include "isa.h"

#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace cadence_cpu {

namespace {

bool is_allowed(Isa isa) {
  const char* cap = std::getenv("CADENCE_CPU_ISA");
  if (cap == nullptr || *cap == '\0') {
    return true;
  }
  for (Isa known : {Isa::baseline, Isa::avx2, Isa::avx512}) {
    if (std::strcmp(cap, isa_name(known)) == 0) {
      return static_cast<int>(isa) <= static_cast<int>(known);
    }
  }
  return true;  // an unknown cap caps nothing
}

Isa detect() {
#if defined(CADENCE_HAS_X86_KERNELS)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && is_allowed(Isa::avx2);
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      is_allowed(Isa::avx512)) {
    return Isa::avx512;
  }
  if (avx2) {
    return Isa::avx2;
  }
#endif
  return Isa::baseline;
}

}  // namespace

Isa best_isa() {
  static const Isa isa = detect();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace cadence_cpu
