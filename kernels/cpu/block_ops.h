// A decoder layer's two residual blocks, each as one primitive on the CPU, for steps
// of few rows over the kernels' weights, quantized or packed in panels
// (kernels/fused_blocks.py).
//
// A single-stream decode step of a 30-layer model was ~370 ops: ten a layer (two norms,
// four matmuls, attention, the activation, two adds). Each op costs its build in
// Python, its dispatch in mlx and an output buffer, ~2.6 ms of a ~10 ms token on
// this box; here a layer is two ops. Each block runs the same kernels in the same
// order as its parts, so the result is bit-identical to them.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "attention_ops.h"

namespace cadence_cpu {

namespace mx = mlx::core;

// One linear layer of N outputs as the kernels hold it, and its optional bias ([N]
// float32, or size 0 for none): bits 4 or 8, mlx's affine layout with float32 scales
// and biases (quant_ops.h); bits 0, w packed in panels [ceil(N / 32), K, 32] of
// float32 or 16 bits (dense_ops.h), scales and biases unused.
struct BlockLayer {
  mx::array w, scales, biases, bias;
  int group_size, bits, N;
};

// x + down(act(gate_up(rms_norm(x) * norm_weight))): gate and up are the halves of
// gate_up's output (a stacked projection), act is silu or gelu_tanh. x [..., K] float32.
// With a post_norm ([K] float32; empty for none) the block's output is RMS-normed by it
// (eps) before the add, as Gemma's layers do; so in residual_attention.
mx::array residual_mlp(const mx::array& x, const mx::array& norm_weight, float eps,
                       const BlockLayer& gate_up, const BlockLayer& down,
                       Activation activation, const mx::array& post_norm);

// x + o(attention(qkv(rms_norm(x) * norm_weight))) with the paged K/V write and RoPE
// of paged_attention_rotary: {out [..., K], keys', values'} (the pools taken over as
// there; `pools_in_place`: see take_pool).
// With q_norm and k_norm ([D] float32; both empty for none), each query and key head is
// RMS-normed (eps qk_eps) before its rotation, as qwen3's attention does.
std::vector<mx::array> residual_attention(
    const mx::array& x, const mx::array& norm_weight, float eps, const BlockLayer& qkv,
    const BlockLayer& o, const mx::array& keys, const mx::array& values,
    const mx::array& tables, const mx::array& token_row, const mx::array& token_pos,
    const mx::array& inv_freqs, int num_heads, int num_kv_heads, int block_size, int window,
    float scale, float rope_scale, const mx::array& q_norm, const mx::array& k_norm,
    float qk_eps, const mx::array& post_norm, bool pools_in_place);

uint64_t num_block_calls();  // evaluations of either block on the CPU, ever

// Inputs x, norm_weight, then (w, scales, biases, bias) of gate_up and of down, post_norm.
class ResidualMlp : public mx::UnaryPrimitive {
 public:
  ResidualMlp(mx::Stream stream, float eps, const BlockLayer& gate_up, const BlockLayer& down,
              Activation activation)
      : mx::UnaryPrimitive(stream),
        eps_(eps),
        layouts_{gate_up.group_size, gate_up.bits, gate_up.N, down.group_size, down.bits, down.N},
        activation_(activation) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadenceResidualMlp";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
  int layouts_[6];  // group, bits and N of gate_up, then of down
  Activation activation_;
};

// Inputs x, norm_weight, (w, scales, biases, bias) of qkv and of o, keys, values,
// tables, token_row, token_pos, inv_freqs, q_norm, k_norm, post_norm. Outputs out,
// keys', values'.
class ResidualAttention : public mx::Primitive {
 public:
  ResidualAttention(mx::Stream stream, float eps, const BlockLayer& qkv, const BlockLayer& o,
                    int num_heads, int num_kv_heads, int block_size, int window, float scale,
                    float rope_scale, float qk_eps, bool pools_in_place)
      : mx::Primitive(stream),
        eps_(eps),
        qk_eps_(qk_eps),
        pools_in_place_(pools_in_place),
        layouts_{qkv.group_size, qkv.bits, qkv.N, o.group_size, o.bits, o.N},
        heads_{num_heads, num_kv_heads, block_size, window},
        scale_(scale),
        rope_scale_(rope_scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "CadenceResidualAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_, qk_eps_;
  bool pools_in_place_;
  int layouts_[6];  // group, bits and N of qkv, then of o
  int heads_[4];  // num_heads, num_kv_heads, block_size, window
  float scale_, rope_scale_;
};

}  // namespace cadence_cpu
