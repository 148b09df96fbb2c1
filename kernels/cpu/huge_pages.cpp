#include "huge_pages.h"

#include <cstddef>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "mlx/allocator.h"
#include "mlx/ops.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace cadence_cpu {

namespace {

#if defined(__linux__)
constexpr size_t kHugePage = size_t{2} << 20;

// How far before an array's data mlx's CPU allocator keeps a buffer's start (its size,
// a size_t, sits there): Buffer::raw_ptr() is that offset on (8 in mlx 0.32's CPU
// build, 0 in older ones). -1 for anything else: a GPU build's buffers are not plain
// memory, and those arrays stay where mlx put them.
std::ptrdiff_t buffer_header() {
  static const std::ptrdiff_t header = [] {
    alignas(16) char probe[16] = {};
    const auto offset = static_cast<char*>(mx::allocator::Buffer(probe).raw_ptr()) - probe;
    return offset == 0 || offset == static_cast<std::ptrdiff_t>(sizeof(size_t)) ? offset : -1;
  }();
  return header;
}
#endif

}  // namespace

mx::array copy_to_huge_pages(const mx::array& a) {
#if defined(__linux__)
  const std::ptrdiff_t header = buffer_header();
  mx::array source = mx::contiguous(a);
  source.eval();
  const size_t bytes = source.nbytes();
  if (header < 0 || bytes < kHugePage) {
    return a;
  }
  // A fresh mapping whose data starts on a 2 MB boundary, advised before its first write.
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  const size_t length = rounded + 2 * kHugePage;  // room for the header and the alignment
  void* raw = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return a;
  }
  const auto start =
      (reinterpret_cast<uintptr_t>(raw) + sizeof(size_t) + kHugePage - 1) & ~(kHugePage - 1);
  char* data = reinterpret_cast<char*>(start);
  madvise(data, rounded, MADV_HUGEPAGE);  // refused (THP "never"): 4 KB pages, same result
  std::memcpy(data, source.data<char>(), bytes);
  char* buffer = data - header;
  if (header > 0) {
    std::memcpy(buffer, &bytes, sizeof bytes);  // what mlx's allocator would keep there
  }
  mx::allocator::Data owner(mx::allocator::Buffer(buffer),
                            [raw, length](mx::allocator::Buffer) { munmap(raw, length); });
  return mx::array(std::move(owner), source.shape(), source.dtype());
#else
  return a;
#endif
}

int64_t huge_page_bytes(const mx::array& a) {
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps) {
    return 0;
  }
  const auto address = reinterpret_cast<uintptr_t>(a.data<char>());
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream header(line);
    if (header >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= address && address < end;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      return std::stoll(line.substr(14)) * 1024;  // "AnonHugePages:   4096 kB"
    }
  }
  return 0;
}

}  // namespace cadence_cpu
