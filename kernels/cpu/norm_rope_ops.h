// RMSNorm and rotary embedding as single primitives on the CPU (see kernels/norm_rope.py).
//
// mx.fast.rms_norm and mx.fast.rope have no CPU kernel in mlx: on the CPU each call
// becomes its fallback graph, ~10 ops for a norm and ~25 for a rope. A 30-layer decode
// step built ~3,900 ops, and each op costs its dispatch whatever its size.
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "norm_rope_kernels.h"

namespace cadence_cpu {

namespace mx = mlx::core;

// x [..., D] float32, weight [D] float32 -> x * rsqrt(mean(x^2) + eps) * weight.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps);

// Rotary embedding, the non-traditional (half-split) layout, of x [N, H, D] float32:
// token n is at position positions[n] (int32); the first 2 * inv_freqs.size dims of
// each head rotate by angle (position * scale) * inv_freqs[i], the rest pass through.
mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& inv_freqs,
               float scale);

// The RmsNorm primitive's work over dense rows, on the kernel threads (block_ops.cpp);
// out may be x (each row's sum is taken before it is written).
void rms_norm_rows(const float* x, const float* weight, float* out, int rows, int D, float eps);

// The Rope primitive's work, on the kernel threads: for attention_ops.cpp, which
// rotates a stacked q/k projection's heads inside its own op.
void rope_tokens(const RopeJob& job, int num_tokens);

uint64_t num_rms_norm_calls();  // evaluations on the CPU, ever
uint64_t num_rope_calls();

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadenceRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadenceRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const Rope&>(other).scale_;
  }

 private:
  float scale_;
};

}  // namespace cadence_cpu
