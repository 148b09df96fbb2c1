#include "expert_ops.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_dispatch.h"
#include "dense_ops.h"
#include "quant_ops.h"
#include "row_kernels.h"

namespace cadence_cpu {

namespace {

std::atomic<uint64_t> expert_calls{0};

[[noreturn]] void refuse(const std::string& why) {
  throw std::invalid_argument("cadence expert matmul: " + why);
}

void check_pairs(const mx::array& x, const mx::array& experts, const mx::array& w) {
  if (x.ndim() != 2 || x.dtype() != mx::float32) {
    refuse("x must be a 2-D float32 array [R, K]");
  }
  if (experts.ndim() != 2 || experts.dtype() != mx::uint32 || experts.shape(0) != x.shape(0)) {
    refuse("experts must be a 2-D uint32 array [R, k] with x's rows");
  }
  if (w.ndim() != 3) {
    refuse("w must be 3-D, [E, N, K]");
  }
}

mx::array pairs_out(const mx::array& x, const mx::array& experts, const mx::array& w, int group_size,
                    int bits, std::vector<mx::array> inputs) {
  auto s = mx::to_stream(mx::StreamOrDevice{}, mx::Device::cpu);
  return mx::array({x.shape(0), experts.shape(1), w.shape(1)}, mx::float32,
                   std::make_shared<ExpertMatmul>(s, group_size, bits), std::move(inputs));
}

// The pairs p = r * k + j of each expert e: order[start[e] .. start[e + 1]), in row order.
struct ExpertGroups {
  std::vector<int64_t> start;
  std::vector<int64_t> order;
};

ExpertGroups group_by_expert(const uint32_t* ids, int64_t num_pairs, int64_t num_experts) {
  ExpertGroups groups{std::vector<int64_t>(num_experts + 1, 0), std::vector<int64_t>(num_pairs)};
  for (int64_t p = 0; p < num_pairs; ++p) {
    if (ids[p] < num_experts) {
      ++groups.start[ids[p] + 1];
    }
  }
  std::partial_sum(groups.start.begin(), groups.start.end(), groups.start.begin());
  std::vector<int64_t> next(groups.start.begin(), groups.start.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) {
    if (ids[p] < num_experts) {
      groups.order[next[ids[p]]++] = p;
    }
  }
  return groups;
}

}  // namespace

mx::array expert_matmul(const mx::array& x, const mx::array& experts, const mx::array& w,
                        const mx::array& scales, const std::optional<mx::array>& biases,
                        int group_size, int bits) {
  check_pairs(x, experts, w);
  if (bits != 4 && bits != 8) {
    refuse("bits must be 4 or 8");
  }
  if (!biases && (bits != 4 || group_size != 32)) {
    refuse("without biases (mxfp4), 4 bits in groups of 32");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    refuse("group_size must be 32, 64 or 128");
  }
  const int64_t K = x.shape(1);
  if (w.dtype() != mx::uint32 || static_cast<int64_t>(w.shape(2)) * 32 / bits != K ||
      K % group_size != 0) {
    refuse("w must be uint32 [E, N, K * bits / 32] for x's K, a multiple of group_size");
  }
  const mx::Shape groups{w.shape(0), w.shape(1), static_cast<int>(K / group_size)};
  if (scales.shape() != groups || scales.dtype() != mx::float32 ||
      (biases && (biases->shape() != groups || biases->dtype() != mx::float32))) {
    refuse("scales and biases must be float32 [E, N, K / group_size]");
  }
  if (!biases) {
    return pairs_out(x, experts, w, group_size, bits, {x, experts, w, scales});
  }
  return pairs_out(x, experts, w, group_size, bits, {x, experts, w, scales, *biases});
}

mx::array dense_expert_matmul(const mx::array& x, const mx::array& experts, const mx::array& w) {
  check_pairs(x, experts, w);
  const bool is_float = w.dtype() == mx::float32 || w.dtype() == mx::float16 ||
                        w.dtype() == mx::bfloat16;
  if (!is_float || w.shape(2) != x.shape(1)) {
    refuse("w must be float32, float16 or bfloat16 [E, N, K] for x's K");
  }
  return pairs_out(x, experts, w, 0, 0, {x, experts, w});
}

void ExpertMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  for (size_t i = 2; i < inputs.size(); ++i) {  // the weights are read in place
    if (!inputs[i].flags().row_contiguous) {
      throw std::runtime_error("cadence expert matmul: the weights must be row-contiguous");
    }
  }
  run_on_stream(stream(), inputs, out, [group_size = group_size_, bits = bits_](
                                           std::vector<mx::array>& in, mx::array& out) {
    expert_calls.fetch_add(1, std::memory_order_relaxed);
    const auto &x = in[0], &experts = in[1], &w = in[2];
    const int K = x.shape(1), k = experts.shape(1), N = w.shape(1);
    const int64_t num_experts = w.shape(0), num_pairs = static_cast<int64_t>(x.shape(0)) * k;
    std::vector<float> x_copy;
    std::vector<uint32_t> ids_copy;
    const float* rows = row_major_data(x, x_copy);
    float* result = out.data<float>();
    std::fill_n(result, out.size(), 0.0f);  // pairs of no expert
    const ExpertGroups groups = group_by_expert(row_major_data(experts, ids_copy), num_pairs, num_experts);
    const WeightKind kind = w.dtype() == mx::float32   ? WeightKind::f32
                            : w.dtype() == mx::float16 ? WeightKind::f16
                                                       : WeightKind::bf16;
    thread_local std::vector<float> gathered, products;  // this runs on the stream's one thread
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t first = groups.start[e];
      const int M = static_cast<int>(groups.start[e + 1] - first);
      if (M == 0) {
        continue;
      }
      scratch(gathered, static_cast<size_t>(M) * K);
      scratch(products, static_cast<size_t>(M) * N);
      for (int m = 0; m < M; ++m) {
        std::copy_n(rows + groups.order[first + m] / k * K, K, gathered.data() + int64_t{m} * K);
      }
      if (bits != 0) {
        const int64_t words = int64_t{N} * (int64_t{K} * bits / 32), scale_count = int64_t{N} * (K / group_size);
        quantized_matmul_rows(gathered.data(), K, 1, M, K, w.data<uint32_t>() + e * words,
                              in[3].data<float>() + e * scale_count,
                              in.size() > 4 ? in[4].data<float>() + e * scale_count : nullptr,
                              N, group_size, bits, products.data());
      } else {
        const char* base = static_cast<const char*>(w.data<void>());
        dense_matmul_rows(gathered.data(), M, K, base + e * int64_t{N} * K * w.itemsize(), kind, N,
                          products.data());
      }
      for (int m = 0; m < M; ++m) {
        std::copy_n(products.data() + int64_t{m} * N, N, result + groups.order[first + m] * N);
      }
    }
  });
}

void ExpertMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's expert matmul kernel runs on the CPU only");
}

uint64_t num_expert_calls() {
  return expert_calls.load();
}

}  // namespace cadence_cpu
