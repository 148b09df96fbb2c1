#include "dense_ops.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/ops.h"

#include "cpu_dispatch.h"
#include "isa.h"
#include "row_kernels.h"
#include "row_pool.h"

namespace cadence_cpu {

namespace {

std::atomic<uint64_t> dense_calls{0};

// A chunk should stream at least this many weights (1 MB): waking a worker costs ~10-20 us.
constexpr int64_t kMinWeightsPerChunk = 1 << 18;

DenseMatmulRows dense_kernel() {
  switch (best_isa()) {
#if defined(CADENCE_HAS_X86_KERNELS)
    case Isa::avx512:
      return avx512::dense_matmul_rows;
    case Isa::avx2:
      return avx2::dense_matmul_rows;
#endif
    default:
      return baseline::dense_matmul_rows;
  }
}

struct DenseTask {
  DenseMatmulJob job;
  DenseMatmulRows rows;
};

// A float32 or 16-bit weight as stored: a parameter is dense (16-bit values viewed as
// their bits); anything else is copied into one of the buffers first.
struct StoredWeight {
  explicit StoredWeight(const mx::array& w)
      : data(w.dtype() == mx::float32 ? static_cast<const void*>(row_major_data(w, f32_copy))
                                      : static_cast<const void*>(row_major_data(w, bits_copy))),
        kind(w.dtype() == mx::float32   ? WeightKind::f32
             : w.dtype() == mx::float16 ? WeightKind::f16
                                        : WeightKind::bf16) {}
  std::vector<float> f32_copy;
  std::vector<uint16_t> bits_copy;
  const void* data;
  WeightKind kind;
};

std::atomic<uint64_t> panel_calls{0};

struct PanelKernels {
  int (*rows)();  // rows of x a register tile holds
  void (*pack)(const PanelMatmulJob&, float*);
  PanelMatmul matmul;
  QuantizedPanelMatmul quantized;
};

const PanelKernels& panel_kernels() {
  static const PanelKernels chosen = [] {
    switch (best_isa()) {
#if defined(CADENCE_HAS_X86_KERNELS)
      case Isa::avx512:
        return PanelKernels{avx512::panel_rows, avx512::pack_panel_block, avx512::panel_matmul,
                            avx512::quantized_panel_matmul};
      case Isa::avx2:
        return PanelKernels{avx2::panel_rows, avx2::pack_panel_block, avx2::panel_matmul,
                            avx2::quantized_panel_matmul};
#endif
      default:
        return PanelKernels{baseline::panel_rows, baseline::pack_panel_block, baseline::panel_matmul,
                            baseline::quantized_panel_matmul};
    }
  }();
  return chosen;
}

// x [M, K] (rows x_stride apart) transposed into blocks of the register tile's rows
// (pack_panel_block), on the kernel threads, into the calling thread's buffer. A unit of
// work is one block's k in [k0, k0 + kPackDepth): by blocks alone, the two blocks of a
// 16-row decode step were one chunk, packed by one thread while the other waited (~2%
// of the step).
constexpr int kPackDepth = 512;

const float* pack_x_panels(const float* x, int64_t x_stride, int M, int K) {
  const PanelKernels& kernels = panel_kernels();
  const PanelMatmulJob job{x, nullptr, nullptr, nullptr, M, 0, K, x_stride, WeightKind::f32};
  thread_local std::vector<float> x_panels;  // the stream's one thread
  const int rows = kernels.rows(), blocks = (M + rows - 1) / rows;
  const int depths = std::max(1, (K + kPackDepth - 1) / kPackDepth);
  const struct {
    const PanelMatmulJob* job;
    const PanelKernels* kernels;
    float* x_panels;
    int rows, depths;
  } task{&job, &kernels, scratch(x_panels, static_cast<size_t>(blocks) * rows * K), rows, depths};
  row_pool()->run(
      [](const void* context, int begin, int end) {
        const auto& t = *static_cast<const decltype(task)*>(context);
        for (int unit = begin; unit < end; ++unit) {
          // Block b's k in [k0, k0 + depth): the block of x from row b x rows, column k0
          // on, K = depth; it lands at b's panel, k0 rows in.
          const int b = unit / t.depths, k0 = unit % t.depths * kPackDepth;
          PanelMatmulJob part = *t.job;
          part.x = t.job->x + static_cast<int64_t>(b) * t.rows * t.job->x_stride + k0;
          part.M = t.job->M - b * t.rows;
          part.K = std::min(kPackDepth, t.job->K - k0);
          t.kernels->pack(part, t.x_panels + (static_cast<int64_t>(b) * t.job->K + k0) * t.rows);
        }
      },
      &task, blocks * depths, 2);
  return task.x_panels;
}

// Panels of `weights_per_panel` weights a chunk of work holds at least, for M rows of x.
int min_panels_per_chunk(int64_t weights_per_panel, int M, int panels) {
  return static_cast<int>(std::clamp<int64_t>(
      kMinWeightsPerChunk / std::max<int64_t>(1, weights_per_panel * ((M + 15) / 16)), 1,
      std::max(1, panels)));
}

struct QuantizedPanelTask {
  QuantizedPanelJob job;
  QuantizedPanelMatmul matmul;
};

void run_quantized_panels(const void* context, int panel_begin, int panel_end) {
  const auto& task = *static_cast<const QuantizedPanelTask*>(context);
  thread_local std::vector<float> tile;  // each kernel thread its own
  tile.resize(static_cast<size_t>(kPanelDepth) * kPanelWidth);
  task.matmul(task.job, panel_begin, panel_end, tile.data());
}

// Packing, block by block: kPanelPackDepth k of a panel's 32 rows are read (each row
// a contiguous run) and written as one contiguous kPanelPackDepth x 32 block, so both
// sides stream; the panels are shared among the kernel threads. 1.2-1.7 GB/s on the
// 2-core box, where mlx's transposing copy of the same layout ran ~0.3 GB/s: that was
// 4.9 s of a 1.3 GB bf16 model's 6.4 s of preparation at load.
constexpr int64_t kPanelPackDepth = 64;

template <typename T>
struct PackJob {
  const T* w;
  int64_t N, K;
  T* panels;
};

template <typename T>
void pack_panel_range(const void* context, int panel_begin, int panel_end) {
  const auto& job = *static_cast<const PackJob<T>*>(context);
  const int64_t K = job.K;
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    T* panel = job.panels + p * K * kPanelWidth;
    for (int64_t k0 = 0; k0 < K; k0 += kPanelPackDepth) {
      const int64_t k1 = std::min(K, k0 + kPanelPackDepth);
      for (int lane = 0; lane < kPanelWidth; ++lane) {
        const int64_t n = p * kPanelWidth + lane;
        if (n >= job.N) {  // past the last column: zeros, which the kernel multiplies
          for (int64_t k = k0; k < k1; ++k) {
            panel[k * kPanelWidth + lane] = T{0};
          }
          continue;
        }
        const T* row = job.w + n * K;
        for (int64_t k = k0; k < k1; ++k) {
          panel[k * kPanelWidth + lane] = row[k];
        }
      }
    }
  }
}

template <typename T>
void pack_rows(const T* w, int64_t N, int64_t K, T* panels) {
  const PackJob<T> job{w, N, K, panels};
  const int num_panels = static_cast<int>((N + kPanelWidth - 1) / kPanelWidth);
  row_pool()->run(&pack_panel_range<T>, &job, num_panels, 4);
}

}  // namespace

mx::array pack_panels(const mx::array& w) {
  const auto dtype = w.dtype();
  if (w.ndim() != 2 || (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16)) {
    throw std::invalid_argument("cadence pack_panels: w [N, K] float32, float16 or bfloat16");
  }
  mx::array source = mx::contiguous(w, false, mx::Device::cpu);
  source.eval();
  const int64_t N = source.shape(0), K = source.shape(1);
  const int64_t num_panels = (N + kPanelWidth - 1) / kPanelWidth;
  mx::Shape shape = {static_cast<int>(num_panels), static_cast<int>(K), kPanelWidth};
  auto data = mx::allocator::malloc(num_panels * K * kPanelWidth * mx::size_of(dtype));
  void* out = data.buffer().raw_ptr();
  if (dtype == mx::float32) {
    pack_rows(source.data<uint32_t>(), N, K, static_cast<uint32_t*>(out));
  } else {  // 16 bits moved as they are
    pack_rows(source.data<uint16_t>(), N, K, static_cast<uint16_t*>(out));
  }
  return mx::array(std::move(data), std::move(shape), dtype);
}

void check_panels(const mx::array& w_panels, int K, int N) {
  const auto w_dtype = w_panels.dtype();
  if (w_panels.ndim() != 3 ||
      (w_dtype != mx::float32 && w_dtype != mx::float16 && w_dtype != mx::bfloat16) ||
      w_panels.shape(2) != kPanelWidth || w_panels.shape(1) != K || N < 0 ||
      static_cast<int64_t>(w_panels.shape(0)) * kPanelWidth < N ||
      static_cast<int64_t>(w_panels.shape(0) - 1) * kPanelWidth >= std::max(N, 1)) {
    throw std::invalid_argument(
        "cadence panel matmul: x [..., K] float32, w_panels [ceil(N / 32), K, 32] float32, "
        "float16 or bfloat16");
  }
}

mx::array panel_matmul(const mx::array& x, const mx::array& w_panels, int N) {
  if (x.ndim() < 1 || x.dtype() != mx::float32) {
    throw std::invalid_argument(
        "cadence panel matmul: x [..., K] float32, w_panels [ceil(N / 32), K, 32] float32, "
        "float16 or bfloat16");
  }
  check_panels(w_panels, x.shape(-1), N);
  auto s = mx::to_stream(mx::StreamOrDevice{}, mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = N;
  return mx::array(std::move(shape), mx::float32, std::make_shared<PanelMatmulOp>(s, N),
                   {x, w_panels});
}

void PanelMatmulOp::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  run_on_stream(stream(), inputs, out, [N = N_](std::vector<mx::array>& in, mx::array& out) {
    std::vector<float> x_copy;
    panel_matmul_rows(row_major_data(in[0], x_copy), leading_rows(in[0]), in[1], N,
                      out.data<float>());
  });
}

void panel_matmul_rows(const float* x, int M, const mx::array& w, int N, float* out) {
  panel_calls.fetch_add(1, std::memory_order_relaxed);
  const int K = w.shape(1), panels = w.shape(0);
  if (M == 0 || N == 0) {
    return;
  }
  if (K == 0) {  // an empty sum
    std::fill_n(out, static_cast<int64_t>(M) * N, 0.0f);
    return;
  }
  StoredWeight weight(w);
  const struct {
    PanelMatmulJob job;
    PanelMatmul matmul;
  } task{PanelMatmulJob{x, pack_x_panels(x, K, M, K), weight.data, out, M, N, K, K, weight.kind},
         panel_kernels().matmul};
  row_pool()->run(
      [](const void* context, int begin, int end) {
        const auto& t = *static_cast<const decltype(task)*>(context);
        t.matmul(t.job, begin, end);
      },
      &task, panels, min_panels_per_chunk(static_cast<int64_t>(K) * kPanelWidth, M, panels));
}

void quantized_panel_matmul_rows(const float* x, int64_t x_stride, int M, int K, const uint32_t* w,
                                 const float* scales, const float* biases, int N, int group_size,
                                 int bits, float* out) {
  const QuantizedPanelTask task{
      QuantizedPanelJob{pack_x_panels(x, x_stride, M, K), w, scales, biases, out, M, N, K,
                        group_size, bits},
      panel_kernels().quantized};
  // A chunk of at least 64K weights whatever M: dequantizing a panel costs as much as
  // multiplying it by a few rows, so chunks stay small enough to split small layers.
  const int panels = (N + kPanelWidth - 1) / kPanelWidth;
  const int min_panels = static_cast<int>(std::clamp<int64_t>(
      (int64_t{1} << 16) / std::max<int64_t>(1, int64_t{K} * kPanelWidth), 1, std::max(1, panels)));
  row_pool()->run(run_quantized_panels, &task, panels, min_panels);
}

void PanelMatmulOp::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's panel matmul kernel runs on the CPU only");
}

uint64_t num_panel_calls() {
  return panel_calls.load();
}

mx::array dense_matmul(const mx::array& x, const mx::array& w) {
  const bool w_ok = w.dtype() == mx::float32 || w.dtype() == mx::float16 || w.dtype() == mx::bfloat16;
  if (x.ndim() < 1 || w.ndim() != 2 || x.shape(-1) != w.shape(1) || x.dtype() != mx::float32 ||
      !w_ok) {
    throw std::invalid_argument(
        "cadence dense matmul: x [..., K] float32 and w [N, K] float32, float16 or bfloat16");
  }
  auto s = mx::to_stream(mx::StreamOrDevice{}, mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), mx::float32, std::make_shared<DenseRowsMatmul>(s), {x, w});
}

void DenseRowsMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  run_on_stream(stream(), inputs, out, [](std::vector<mx::array>& in, mx::array& out) {
    const auto& w = in[1];
    std::vector<float> x_copy;
    StoredWeight weight(w);
    dense_matmul_rows(row_major_data(in[0], x_copy), leading_rows(in[0]), w.shape(1), weight.data,
                      weight.kind, w.shape(0), out.data<float>());
  });
}

void dense_matmul_rows(const float* x, int M, int K, const void* w, WeightKind w_kind, int N,
                       float* out) {
  dense_calls.fetch_add(1, std::memory_order_relaxed);
  if (M == 0 || N == 0) {
    return;
  }
  // x's rows copied a cache line further apart than K floats: with K a multiple of
  // 1024 they would all fall in one L1 set, and evict each other (measured 2x slower).
  const int64_t stride = K + 16;
  thread_local std::vector<float> spaced;  // this runs on the stream's one thread
  scratch(spaced, static_cast<size_t>(M) * stride);
  for (int m = 0; m < M; ++m) {
    std::copy_n(x + static_cast<int64_t>(m) * K, K, spaced.data() + m * stride);
  }
  const DenseTask task{DenseMatmulJob{spaced.data(), w, out, M, N, K, stride, w_kind}, dense_kernel()};
  const int min_rows = static_cast<int>(
      std::clamp<int64_t>(kMinWeightsPerChunk / std::max(1, K), 4, std::max(4, N)));
  row_pool()->run(
      [](const void* context, int begin, int end) {
        const auto& t = *static_cast<const DenseTask*>(context);
        t.rows(t.job, begin, end);
      },
      &task, N, min_rows);
}

void DenseRowsMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's dense matmul kernel runs on the CPU only");
}

uint64_t num_dense_calls() {
  return dense_calls.load();
}

}  // namespace cadence_cpu
