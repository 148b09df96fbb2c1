// Custom mlx primitives for quantized weights on the CPU (see kernels/quantized_matmul.py).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace cadence_cpu {

namespace mx = mlx::core;

// x[M, K] @ dequantize(w, scales, biases).T -> [M, N] float32. Without biases, mlx's
// mxfp4 (4 bits, group 32; scales float32 2^(e - 127), see MatmulJob).
mx::array matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits);

// The matmul primitive's work, for ops that run it inside their own (block_ops.cpp):
// out[M, N] = x @ dequantize(w).T, x[m, k] at x + m * row_stride + k * col_stride,
// on the kernel threads. Call it from the stream's thread (its buffers are per thread).
void quantized_matmul_rows(const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
                           const uint32_t* w, const float* scales, const float* biases, int N,
                           int group_size, int bits, float* out);

// Throws std::invalid_argument unless w, scales, biases are a kernel layout of bits, group_size
// (biases null: mxfp4, 4 bits in groups of 32).
void check_quantized_operands(const mx::array& w, const mx::array& scales,
                              const mx::array* biases, int group_size, int bits);

uint64_t num_kernel_calls();  // quantized matmuls run on the CPU, ever
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

}  // namespace cadence_cpu
