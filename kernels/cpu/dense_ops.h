// A custom mlx primitive for float32 linear layers with few rows (see kernels/dense_matmul.py).
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "row_kernels.h"

namespace cadence_cpu {

namespace mx = mlx::core;

// x[M, K] @ w[N, K].T -> [M, N] float32, w read in place (for small M: decode).
mx::array dense_matmul(const mx::array& x, const mx::array& w);

uint64_t num_dense_calls();  // evaluations on the CPU, ever

// The dense primitive's work, for ops that run it inside their own (expert_ops.cpp):
// out[M, N] = x[M, K] (rows K apart) @ w.T for w [N, K] of `w_kind` read in place.
// Call it from the stream's thread (its buffers are per thread).
void dense_matmul_rows(const float* x, int M, int K, const void* w, WeightKind w_kind, int N,
                       float* out);

// x[..., K] @ W.T -> [..., N] float32 for a W [N, K] (float32, or 16 bits widened exactly
// as read) packed into panels of 32 columns, [ceil(N / 32), K, 32] (row_kernels.h): every
// number of rows, decode to prefill.
mx::array panel_matmul(const mx::array& x, const mx::array& w_panels, int N);

// The panel primitive's work, for ops that run it inside their own (block_ops.cpp):
// out[M, N] = x[M, K] (dense rows) @ W.T for W packed in w_panels [ceil(N / 32), K, 32].
// Call it from the stream's thread (its buffers are per thread).
void panel_matmul_rows(const float* x, int M, const mx::array& w_panels, int N, float* out);

// The same for a quantized weight (mlx's affine layout), each 32-column panel dequantized
// into a tile on the way (QuantizedPanelJob, row_kernels.h): out[M, N] = x @
// dequantize(w).T for x [M, K] dense rows x_stride apart. From the stream's thread.
void quantized_panel_matmul_rows(const float* x, int64_t x_stride, int M, int K, const uint32_t* w,
                                 const float* scales, const float* biases, int N, int group_size,
                                 int bits, float* out);

// w [N, K] (float32 or 16 bits) -> [ceil(N / 32), K, 32], same dtype: column n at panel
// n / 32, lane n % 32, the last panel's missing columns zero (kernels/dense_matmul.py).
// Evaluates w; the result is evaluated.
mx::array pack_panels(const mx::array& w);

// Throws std::invalid_argument unless w_panels packs N output columns of K inputs.
void check_panels(const mx::array& w_panels, int K, int N);
uint64_t num_panel_calls();  // evaluations on the CPU, ever

class PanelMatmulOp : public mx::UnaryPrimitive {
 public:
  PanelMatmulOp(mx::Stream stream, int N) : mx::UnaryPrimitive(stream), N_(N) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadencePanelMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return N_ == static_cast<const PanelMatmulOp&>(other).N_;
  }

 private:
  int N_;
};

class DenseRowsMatmul : public mx::UnaryPrimitive {
 public:
  explicit DenseRowsMatmul(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadenceDenseRowsMatmul";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

}  // namespace cadence_cpu
