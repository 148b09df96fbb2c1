#include "norm_rope_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/ops.h"

#include "cpu_dispatch.h"
#include "isa.h"
#include "norm_rope_kernels.h"
#include "row_pool.h"

namespace cadence_cpu {

namespace {

std::atomic<uint64_t> rms_norm_calls{0}, rope_calls{0};

// Below this many elements a call runs on the stream's thread alone: waking a
// sleeping worker costs more than a decode step's norm (16 x 4096).
constexpr int64_t kMinElementsPerChunk = 1 << 16;

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("cadence CPU kernels: " + what);
  }
}

mx::Stream cpu_stream() {
  return mx::to_stream(mx::StreamOrDevice{}, mx::Device::cpu);
}

int min_rows_per_chunk(int64_t row_elements) {
  return static_cast<int>(std::max<int64_t>(1, kMinElementsPerChunk / std::max<int64_t>(1, row_elements)));
}

struct NormRopeKernels {
  NormRows rms_norm;
  RopeTokens rope;
};

const NormRopeKernels& kernels() {
  static const NormRopeKernels chosen = [] {
    switch (best_isa()) {
#if defined(CADENCE_HAS_X86_KERNELS)
      case Isa::avx512:
        return NormRopeKernels{avx512::rms_norm_rows, avx512::rope_tokens};
      case Isa::avx2:
        return NormRopeKernels{avx2::rms_norm_rows, avx2::rope_tokens};
#endif
      default:
        return NormRopeKernels{baseline::rms_norm_rows, baseline::rope_tokens};
    }
  }();
  return chosen;
}

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  require(x.dtype() == mx::float32 && weight.dtype() == mx::float32,
          "rms_norm needs float32 x and weight");
  require(x.ndim() >= 1 && weight.ndim() == 1 && weight.shape(0) == x.shape(-1),
          "rms_norm: weight must be [D] for x [..., D]");
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps), {x, weight});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  run_on_stream(stream(), inputs, out, [eps = eps_](std::vector<mx::array>& in, mx::array& out) {
    rms_norm_calls.fetch_add(1, std::memory_order_relaxed);
    const int D = in[0].shape(-1);
    const int rows = D == 0 ? 0 : static_cast<int>(in[0].size() / D);
    std::vector<float> x_copy, weight_copy;
    rms_norm_rows(row_major_data(in[0], x_copy), row_major_data(in[1], weight_copy),
                  out.data<float>(), rows, D, eps);
  });
}

void rms_norm_rows(const float* x, const float* weight, float* out, int rows, int D, float eps) {
  const NormJob job{x, weight, out, D, eps};
  row_pool()->run(
      [](const void* context, int begin, int end) {
        kernels().rms_norm(*static_cast<const NormJob*>(context), begin, end);
      },
      &job, rows, min_rows_per_chunk(D));
}

mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& inv_freqs,
               float scale) {
  require(x.dtype() == mx::float32 && inv_freqs.dtype() == mx::float32 &&
              positions.dtype() == mx::int32,
          "rope needs float32 x and inv_freqs, int32 positions");
  require(x.ndim() == 3 && positions.ndim() == 1 && positions.shape(0) == x.shape(0),
          "rope: x must be [N, H, D] with positions [N]");
  require(inv_freqs.ndim() == 1 && 2 * inv_freqs.shape(0) <= x.shape(2),
          "rope: inv_freqs must be [dims / 2] with dims <= D");
  require(inv_freqs.shape(0) <= 512, "rope: at most 1024 rotated dims");
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, scale),
                   {x, positions, inv_freqs});
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  run_on_stream(stream(), inputs, out, [scale = scale_](std::vector<mx::array>& in, mx::array& out) {
    rope_calls.fetch_add(1, std::memory_order_relaxed);
    const auto& x = in[0];
    std::vector<float> x_copy, inv_freqs_copy;
    std::vector<int32_t> positions_copy;
    const int H = x.shape(1), D = x.shape(2);
    rope_tokens(RopeJob{row_major_data(x, x_copy), row_major_data(in[1], positions_copy),
                        row_major_data(in[2], inv_freqs_copy), out.data<float>(), H, D,
                        in[2].shape(0), scale, static_cast<int64_t>(H) * D, nullptr, nullptr, 0},
                x.shape(0));
  });
}

void rope_tokens(const RopeJob& job, int num_tokens) {
  row_pool()->run(
      [](const void* context, int begin, int end) {
        kernels().rope(*static_cast<const RopeJob*>(context), begin, end);
      },
      &job, num_tokens, min_rows_per_chunk(static_cast<int64_t>(job.H + job.H2) * job.D));
}

uint64_t num_rms_norm_calls() {
  return rms_norm_calls.load();
}

uint64_t num_rope_calls() {
  return rope_calls.load();
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's RMSNorm kernel runs on the CPU only");
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's RoPE kernel runs on the CPU only");
}

}  // namespace cadence_cpu
