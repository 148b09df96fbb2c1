#include "row_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>

namespace cadence_cpu {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

template <class Done>
bool RowPool::spin_until(Done done) const {
  if (spin_us_ <= 0) {
    return done();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (done()) {
        return true;
      }
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return done();
    }
  }
}

RowPool::RowPool(int num_threads) : spin_us_(spin_microseconds()) {
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

RowPool::~RowPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    is_stopping_ = true;
  }
  wake_workers_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void RowPool::run(Work work, const void* context, int num_rows, int min_rows_per_chunk) {
  const int most_chunks = std::max(1, num_rows / std::max(1, min_rows_per_chunk));
  // A few chunks per thread: if another process holds a core, the others take its share.
  const int num_chunks = std::min(most_chunks, 4 * num_threads());
  // One job at a time: a second stream's call meanwhile runs on its own thread alone.
  std::unique_lock<std::mutex> only_job(run_mutex_, std::try_to_lock);
  if (num_chunks <= 1 || workers_.empty() || !only_job.owns_lock()) {
    work(context, 0, num_rows);
    return;
  }
  uint32_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation = ++generation_;
    work_ = work;
    context_ = context;
    num_rows_ = num_rows;
    num_chunks_ = num_chunks;
    rows_per_chunk_ = (num_rows + num_chunks - 1) / num_chunks;
    chunks_left_.store(num_chunks);
    cursor_.store(static_cast<uint64_t>(generation) << 32);
  }
  wake_workers_.notify_all();
  if (run_claimed_chunks(generation)) {
    return;
  }
  if (spin_until([this] { return chunks_left_.load() == 0; })) {
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  chunks_done_.wait(lock, [this] { return chunks_left_.load() == 0; });
}

// Claims and runs chunks of `generation` until none is left; true if it ran the last.
bool RowPool::run_claimed_chunks(uint32_t generation) {
  Work work;
  const void* context;
  int num_rows, rows_per_chunk, num_chunks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (generation_ != generation) {
      return false;
    }
    work = work_;
    context = context_;
    num_rows = num_rows_;
    rows_per_chunk = rows_per_chunk_;
    num_chunks = num_chunks_;
  }
  bool ran_last = false;
  uint64_t cursor = cursor_.load();
  while ((cursor >> 32) == generation && static_cast<int>(cursor & 0xffffffffu) < num_chunks) {
    if (!cursor_.compare_exchange_weak(cursor, cursor + 1)) {
      continue;  // cursor now holds the fresh value
    }
    const int chunk = static_cast<int>(cursor & 0xffffffffu);
    const int begin = chunk * rows_per_chunk;
    const int end = std::min(num_rows, begin + rows_per_chunk);
    if (begin < end) {
      work(context, begin, end);
    }
    if (chunks_left_.fetch_sub(1) == 1) {
      ran_last = true;
    }
    cursor = cursor_.load();
  }
  return ran_last;
}

void RowPool::worker_loop() {
  uint32_t seen = 0;
  while (true) {
    uint32_t generation;
    spin_until([&] { return generation_.load() != seen; });  // is_stopping_ waits for the lock
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_workers_.wait(lock, [&] { return is_stopping_ || generation_ != seen; });
      if (is_stopping_) {
        return;
      }
      seen = generation = generation_;
    }
    if (run_claimed_chunks(generation)) {
      std::lock_guard<std::mutex> lock(mutex_);
      chunks_done_.notify_all();
    }
  }
}

namespace {

int integer_from_environment(const char* name, int fallback, int most) {
  if (const char* value = std::getenv(name)) {
    char* end = nullptr;
    const long n = std::strtol(value, &end, 10);
    if (end != value && *end == '\0' && n >= 0) {
      return static_cast<int>(std::min<long>(n, most));
    }
  }
  return fallback;
}

int threads_from_environment() {
  if (const char* value = std::getenv("CADENCE_CPU_THREADS")) {
    const int n = std::atoi(value);
    if (n > 0) {
      return std::min(n, 256);
    }
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

std::shared_ptr<RowPool>& pool_slot() {
  static std::shared_ptr<RowPool> pool;
  return pool;
}

std::mutex& pool_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

std::shared_ptr<RowPool> row_pool() {
  std::lock_guard<std::mutex> lock(pool_mutex());
  auto& pool = pool_slot();
  if (!pool) {
    pool = std::make_shared<RowPool>(threads_from_environment());
  }
  return pool;
}

int spin_microseconds() {
  static const int spin = integer_from_environment("CADENCE_CPU_SPIN_US", 50, 10000);
  return spin;
}

void set_num_threads(int num_threads) {
  std::lock_guard<std::mutex> lock(pool_mutex());
  pool_slot() = std::make_shared<RowPool>(std::max(1, std::min(num_threads, 256)));
}

}  // namespace cadence_cpu
