#include "quant_ops.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <vector>

#include "mlx/ops.h"
#include "mlx/utils.h"

#include "cpu_dispatch.h"
#include "dense_ops.h"
#include "isa.h"
#include "row_kernels.h"
#include "row_pool.h"

namespace cadence_cpu {

namespace {

std::atomic<uint64_t> kernel_calls{0};

// A chunk should stream at least this many weights: waking a sleeping worker costs
// ~10-20 us, about what one core needs to read 256K 4-bit weights.
constexpr int64_t kMinValuesPerChunk = 1 << 16;
constexpr int kMostRowsForWideLanes = 3;
// From this many rows of x, each weight is dequantized once into a panel tile
// (QuantizedPanelJob) instead of once per 4 rows by the row kernel. 576 -> 3072 at
// 4 bits, ms: 4 rows 0.19 vs 0.14 (row kernel), 8 rows 0.25-0.27 vs 0.25-0.49, 12 rows
// 0.62 vs 0.88, 16 rows 0.39-0.42 vs 0.60, 24 rows 0.52 vs 0.96-1.84.
constexpr int kMinRowsForPanels = 8;

struct Kernels {
  MatmulRows matmul;
  int lanes;  // how the activations are packed for `matmul`
  const char* name;
};

#if defined(__aarch64__)
constexpr const char* kBaselineName = "neon";
#else
constexpr const char* kBaselineName = "baseline";
#endif

// The best kernels for x with `num_rows` rows. AVX-512's 16 lanes halve the
// instructions per weight, which pays when few rows share each decoded block; with
// more rows the 8-lane AVX2 loop measured faster here (4-bit, group 64, M=16:
// 120 vs 150 ms of CPU for a SmolLM2-135M-shaped pass; M=1: 24 vs 24 ms; 8-bit M=1: 35 vs 28).
const Kernels& kernels(int num_rows) {
  static const Kernels baseline_kernels{
      baseline::matmul_rows, baseline::matmul_lanes(), kBaselineName};
#if defined(CADENCE_HAS_X86_KERNELS)
  static const Kernels avx2_kernels{
      avx2::matmul_rows, avx2::matmul_lanes(), "avx2+fma"};
  static const Kernels avx512_kernels{
      avx512::matmul_rows, avx512::matmul_lanes(), "avx512"};
  if (best_isa() == Isa::avx512 && num_rows <= kMostRowsForWideLanes) {
    return avx512_kernels;
  }
  if (best_isa() != Isa::baseline) {
    return avx2_kernels;
  }
#endif
  (void)num_rows;
  return baseline_kernels;
}

}  // namespace

void check_quantized_operands(
    const mx::array& w,
    const mx::array& scales,
    const mx::array* biases,
    int group_size,
    int bits) {
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument("cadence quantized kernels: bits must be 4 or 8");
  }
  if (biases == nullptr && (bits != 4 || group_size != 32)) {
    throw std::invalid_argument("cadence quantized kernels: without biases (mxfp4), 4 bits in groups of 32");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("cadence quantized kernels: group_size must be 32, 64 or 128");
  }
  if (w.ndim() != 2 || w.dtype() != mx::uint32) {
    throw std::invalid_argument("cadence quantized kernels: w must be a 2-D uint32 array");
  }
  const int64_t K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  if (K % group_size != 0) {
    throw std::invalid_argument("cadence quantized kernels: K is not a multiple of group_size");
  }
  const mx::Shape groups{w.shape(0), static_cast<int>(K / group_size)};
  if (scales.shape() != groups || (biases != nullptr && biases->shape() != groups)) {
    throw std::invalid_argument(
        "cadence quantized kernels: scales and biases must be [N, K / group_size]");
  }
}

namespace {

mx::array as_float32(const mx::array& a, mx::Stream s) {
  return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s);
}

void require_row_contiguous(const mx::array& a, const char* what) {
  if (!a.flags().row_contiguous) {
    throw std::runtime_error(std::string("cadence quantized kernels: ") + what +
                             " must be row-contiguous");
  }
}

// inputs[first..first+2] are w, scales and biases (if any), read in place by the row kernels.
void require_packed_weight(const std::vector<mx::array>& inputs, size_t first) {
  require_row_contiguous(inputs[first], "w");
  require_row_contiguous(inputs[first + 1], "scales");
  if (inputs.size() > first + 2) {
    require_row_contiguous(inputs[first + 2], "biases");
  }
}

struct MatmulTask {
  MatmulJob job;
  MatmulRows rows;
};

void run_matmul_chunk(const void* context, int row_begin, int row_end) {
  const auto& task = *static_cast<const MatmulTask*>(context);
  task.rows(task.job, row_begin, row_end);
}

}  // namespace

void pack_activations(
    const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
    int group_size, int bits, int lanes, float* xt, float* xsum) {
  const int per_word = 32 / bits;
  const int words = K / per_word;
  const int wide_end = words / lanes * lanes;
  const int narrow_end = words / 8 * 8;
  const int num_groups = K / group_size;
  for (int m = 0; m < M; ++m) {
    const float* row = x + m * row_stride;
    float* t = xt + static_cast<int64_t>(m) * K;
    auto pack_blocks = [&](int first_word, int end_word, int L) {
      for (int word = first_word; word < end_word; word += L) {
        const int base = word * per_word;
        for (int l = 0; l < L; ++l) {
          for (int j = 0; j < per_word; ++j) {
            t[base + j * L + l] = row[(base + l * per_word + j) * col_stride];
          }
        }
      }
    };
    pack_blocks(0, wide_end, lanes);
    pack_blocks(wide_end, narrow_end, 8);
    for (int k = narrow_end * per_word; k < K; ++k) {
      t[k] = row[k * col_stride];
    }
    for (int g = 0; g < num_groups; ++g) {
      float s = 0.0f;
      for (int k = g * group_size; k < (g + 1) * group_size; ++k) {
        s += row[k * col_stride];
      }
      xsum[static_cast<int64_t>(m) * num_groups + g] = s;
    }
  }
}

mx::array matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits) {
  check_quantized_operands(w, scales, biases ? &*biases : nullptr, group_size, bits);
  const int K = w.shape(1) * 32 / bits;
  if (x.ndim() < 1 || x.shape(-1) != K) {
    throw std::invalid_argument("cadence quantized matmul: x must be [..., K] with K = w's columns");
  }
  auto s = mx::to_stream(mx::StreamOrDevice{}, mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      std::move(shape),
      mx::float32,
      std::make_shared<QuantizedRowsMatmul>(s, group_size, bits),
      biases ? std::vector<mx::array>{as_float32(x, s), w, as_float32(scales, s), as_float32(*biases, s)}
             : std::vector<mx::array>{as_float32(x, s), w, as_float32(scales, s)});
}

void quantized_matmul_rows(const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
                           const uint32_t* w, const float* scales, const float* biases, int N,
                           int group_size, int bits, float* out) {
  kernel_calls.fetch_add(1, std::memory_order_relaxed);
  if (M >= kMinRowsForPanels && col_stride == 1 && K > 0 && N > 0) {
    quantized_panel_matmul_rows(x, row_stride, M, K, w, scales, biases, N, group_size, bits, out);
    return;
  }
  // Reused across calls: this runs on the stream's one thread.
  thread_local std::vector<float> xt, xsum;
  scratch(xt, static_cast<size_t>(M) * K);
  scratch(xsum, static_cast<size_t>(M) * (K / group_size));
  const Kernels& chosen = kernels(M);
  pack_activations(x, row_stride, col_stride, M, K, group_size, bits, chosen.lanes, xt.data(),
                   xsum.data());
  const MatmulTask task{
      MatmulJob{w, scales, biases, xt.data(), xsum.data(), out, M, N, K, group_size, bits},
      chosen.matmul};
  // Rows sharing a decode (4 at a time) make a row's work grow with M (at least 1:
  // an empty x or K gives no work, and must not divide by zero).
  const int64_t work_per_row = std::max<int64_t>(1, static_cast<int64_t>(K) * ((M + 3) / 4));
  const int min_rows = static_cast<int>(std::max<int64_t>(1, kMinValuesPerChunk / work_per_row));
  row_pool()->run(run_matmul_chunk, &task, N, min_rows);
}

void QuantizedRowsMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  require_packed_weight(inputs, 1);
  run_on_stream(stream(), inputs, out, [group_size = group_size_, bits = bits_](
                                           std::vector<mx::array>& in, mx::array& out) {
    const auto &x = in[0], &w = in[1];
    const int K = x.shape(-1);
    // [M, K] as strides: a 2-D x as it lies, a deeper one dense (copied if it is not).
    std::vector<float> x_copy;
    const bool is_2d = x.ndim() == 2;
    quantized_matmul_rows(
        is_2d ? x.data<float>() : row_major_data(x, x_copy), is_2d ? x.strides(0) : K,
        is_2d ? x.strides(1) : 1, leading_rows(x), K, w.data<uint32_t>(), in[2].data<float>(),
        in.size() > 3 ? in[3].data<float>() : nullptr, w.shape(0), group_size, bits, out.data<float>());
  });
}

void QuantizedRowsMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence quantized kernels run on the CPU only");
}

bool QuantizedRowsMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedRowsMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

uint64_t num_kernel_calls() {
  return kernel_calls.load();
}

std::string isa() {
  const std::string decode = kernels(1).name, batch = kernels(kMostRowsForWideLanes + 1).name;
  const std::string rows = decode == batch ? decode + " (1-" : decode + " (1-" +
      std::to_string(kMostRowsForWideLanes) + " rows), " + batch + " (" +
      std::to_string(kMostRowsForWideLanes + 1) + "-";
  return rows + std::to_string(kMinRowsForPanels - 1) + " rows), panels from " +
      std::to_string(kMinRowsForPanels) + " rows";
}

int num_threads() {
  return row_pool()->num_threads();
}

void set_threads(int n) {
  set_num_threads(n);
}

}  // namespace cadence_cpu
