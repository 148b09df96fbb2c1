// Which instruction set the CPU kernels run with, chosen once at run time.
#pragma once

namespace cadence_cpu {

enum class Isa { baseline, avx2, avx512 };

// The widest set this CPU supports (and this build has), capped by
// CADENCE_CPU_ISA=baseline|avx2 for comparisons and tests.
Isa best_isa();
const char* isa_name(Isa isa);

}  // namespace cadence_cpu
