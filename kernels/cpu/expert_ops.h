// A custom mlx primitive for routed experts' matmuls on the CPU (see kernels/expert_matmul.py).
#pragma once

#include <optional>

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace cadence_cpu {

namespace mx = mlx::core;

// Each (row, expert) pair's product: out[r, j] = x[r] @ W[experts[r, j]].T, for
// x [R, K] float32 and experts [R, k] uint32 -> out [R, k, N] float32. The pairs are
// grouped by expert when the op runs, so each expert's weights stream once for all
// its rows, through the quantized or dense row kernels. A pair whose id is not an
// expert gets zeros.
//
// Quantized: w [E, N, K * bits / 32] uint32 in mlx's affine layout, scales and biases
// [E, N, K / group_size] float32; without biases, mlx's mxfp4 (4 bits, group 32, the
// scales float32 2^(e - 127): see MatmulJob).
mx::array expert_matmul(const mx::array& x, const mx::array& experts, const mx::array& w,
                        const mx::array& scales, const std::optional<mx::array>& biases,
                        int group_size, int bits);

// Dense: w [E, N, K] float32, float16 or bfloat16 (widened exactly as read).
mx::array dense_expert_matmul(const mx::array& x, const mx::array& experts, const mx::array& w);

uint64_t num_expert_calls();  // evaluations on the CPU, ever

class ExpertMatmul : public mx::UnaryPrimitive {
 public:
  // bits 0: dense weights.
  ExpertMatmul(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadenceExpertMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const ExpertMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 private:
  int group_size_;
  int bits_;
};

}  // namespace cadence_cpu
