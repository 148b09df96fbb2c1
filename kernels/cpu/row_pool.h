// Threads over output rows that sleep between calls, after at most a short spin.
//
// llama.cpp's spinning workers collapsed to 2-50 tok/s when another process shared
// this box's two cores: they spin for as long as a job lasts. Here the calling thread
// works too, and a thread that runs out of work watches for the next job for at most
// CADENCE_CPU_SPIN_US microseconds (default 50), then sleeps on a condition variable.
// The spin is there because a decode step is hundreds of calls a few tens of us
// apart, and waking a sleeping thread took longer than most of them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace cadence_cpu {

class RowPool {
 public:
  using Work = void (*)(const void* context, int row_begin, int row_end);

  explicit RowPool(int num_threads);
  ~RowPool();
  RowPool(const RowPool&) = delete;
  RowPool& operator=(const RowPool&) = delete;

  // Runs work over [0, num_rows) in chunks of at least min_rows_per_chunk rows.
  void run(Work work, const void* context, int num_rows, int min_rows_per_chunk);
  int num_threads() const {
    return static_cast<int>(workers_.size()) + 1;
  }

 private:
  void worker_loop();
  bool run_claimed_chunks(uint32_t generation);
  // Spins for at most the spin budget until done() holds; false if it never did.
  template <class Done>
  bool spin_until(Done done) const;

  std::mutex run_mutex_;  // held by the one caller whose job the workers share
  std::mutex mutex_;
  std::condition_variable wake_workers_;
  std::condition_variable chunks_done_;
  std::vector<std::thread> workers_;
  bool is_stopping_ = false;
  // The job of the current generation; workers read it under mutex_ (a spinning
  // worker watches it without the lock, then takes the lock to read the job).
  std::atomic<uint32_t> generation_{0};
  int spin_us_ = 0;
  Work work_ = nullptr;
  const void* context_ = nullptr;
  int num_rows_ = 0;
  int rows_per_chunk_ = 1;
  int num_chunks_ = 0;
  // (generation << 32) | next chunk: a worker that wakes late can't claim another job's chunk.
  std::atomic<uint64_t> cursor_{0};
  std::atomic<int> chunks_left_{0};
};

// The process-wide pool, sized by CADENCE_CPU_THREADS (default: the hardware threads).
std::shared_ptr<RowPool> row_pool();  // shared: a resize never frees a pool in use
void set_num_threads(int num_threads);
int spin_microseconds();  // CADENCE_CPU_SPIN_US, default 50; 0 never spins

}  // namespace cadence_cpu
