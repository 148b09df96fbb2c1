// The weights on 2 MB pages (Linux transparent huge pages), see kernels/huge_pages.py.
//
// mlx's allocator hands out memory that is already touched (its buffer cache) or mapped
// without advice, and asking the kernel to collapse it afterwards (MADV_COLLAPSE) took
// 21 s for the bench model's 2.5 GB of weights and K/V pools. So the copy goes to a
// fresh mapping, advised MADV_HUGEPAGE before its first write, which the page faults
// then fill with 2 MB pages when the system has them (THP "always" or "madvise"); else
// it stays on 4 KB pages and works the same. The mapping is handed to mlx as the
// array's buffer, laid out as mlx's CPU allocator lays out its own.
#pragma once

#include <cstdint>

#include "mlx/array.h"

namespace cadence_cpu {

namespace mx = mlx::core;

// A copy of `a` (evaluated here; any layout, copied row-major) on such a mapping; `a`
// itself when it is smaller than one 2 MB page or the platform has no such pages.
mx::array copy_to_huge_pages(const mx::array& a);

// Bytes of the mapping holding a's data that Linux backs with 2 MB pages now
// (/proc/self/smaps; neighbouring mappings alike may be merged into one), 0 where it
// cannot tell.
int64_t huge_page_bytes(const mx::array& a);

}  // namespace cadence_cpu
