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

constexpr size_t kHugePage = size_t{2} << 20;

#if defined(__linux__)
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

// An array of `shape` on a fresh zero-filled mapping whose data starts on a 2 MB
// boundary, advised for huge pages before anything touches it; *data is nullptr if the
// platform or the system refuses.
mx::array mapped_array(const mx::Shape& shape, mx::Dtype dtype, char** data) {
  *data = nullptr;
  size_t bytes = dtype.size();
  for (const auto dim : shape) {
    bytes *= static_cast<size_t>(dim);
  }
  const std::ptrdiff_t header = buffer_header();
  if (header < 0) {
    return mx::array(0.0f);
  }
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  const size_t length = rounded + 2 * kHugePage;  // room for the header and the alignment
  void* raw = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return mx::array(0.0f);
  }
  const auto start =
      (reinterpret_cast<uintptr_t>(raw) + sizeof(size_t) + kHugePage - 1) & ~(kHugePage - 1);
  *data = reinterpret_cast<char*>(start);
  madvise(*data, rounded, MADV_HUGEPAGE);  // refused (THP "never"): 4 KB pages, same result
  char* buffer = *data - header;
  if (header > 0) {
    std::memcpy(buffer, &bytes, sizeof bytes);  // what mlx's allocator would keep there
  }
  mx::allocator::Data owner(mx::allocator::Buffer(buffer),
                            [raw, length](mx::allocator::Buffer) { munmap(raw, length); });
  return mx::array(std::move(owner), shape, dtype);
}
#endif

}  // namespace

mx::array copy_to_huge_pages(const mx::array& a) {
#if defined(__linux__)
  mx::array source = mx::contiguous(a);
  source.eval();
  if (source.nbytes() < kHugePage) {
    return a;
  }
  char* data = nullptr;
  mx::array copy = mapped_array(source.shape(), source.dtype(), &data);
  if (data == nullptr) {
    return a;
  }
  std::memcpy(data, source.data<char>(), source.nbytes());
  return copy;
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
