// Custom mlx primitives for quantized weights on the CPU (see kernels/quantized_matmul.py).
#pragma once

#include <cstdint>
#include <string>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace cadence_cpu {

namespace mx = mlx::core;

// x[M, K] @ dequantize(w, scales, biases).T -> [M, N] float32, for small M.
mx::array matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits);

// dequantize(w, scales, biases) -> [N, K] float32, for an sgemm to consume (prefill).
mx::array dequantize(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits);

uint64_t num_kernel_calls();  // evaluations of either primitive on the CPU, ever
std::string isa();  // the instruction set the row kernels run with
int num_threads();
void set_threads(int num_threads);

class QuantizedRowsMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedRowsMatmul(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadenceQuantizedRowsMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
};

class QuantizedRowsDequantize : public mx::UnaryPrimitive {
 public:
  QuantizedRowsDequantize(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadenceQuantizedRowsDequantize";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
};

}  // namespace cadence_cpu
