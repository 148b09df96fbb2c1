#include "block_ops.h"

#include <atomic>
#include <stdexcept>
#include <string>

#include "mlx/ops.h"

#include "cpu_dispatch.h"
#include "dense_ops.h"
#include "norm_rope_ops.h"
#include "quant_ops.h"

namespace cadence_cpu {

namespace {

std::atomic<uint64_t> block_calls{0};

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("cadence residual blocks: " + what);
  }
}

// A layer reading K values a row and writing N: a kernel layout (float32 scales and
// biases) or panels, and a bias of [N] or none.
void check_layer(const BlockLayer& layer, int64_t K, int64_t N, const char* name) {
  const std::string what = name;
  require(layer.N == N, what + " must have " + std::to_string(N) + " outputs");
  if (layer.bits == 0) {
    check_panels(layer.w, static_cast<int>(K), layer.N);
  } else {
    check_quantized_operands(layer.w, layer.scales, &layer.biases, layer.group_size, layer.bits);
    require(layer.w.ndim() == 2 && static_cast<int64_t>(layer.w.shape(1)) * 32 / layer.bits == K &&
                layer.w.shape(0) == N,
            what + " must be [" + std::to_string(N) + ", " + std::to_string(K) + "]");
    require(layer.scales.dtype() == mx::float32 && layer.biases.dtype() == mx::float32,
            what + "'s scales and biases must be float32");
  }
  require(layer.bias.dtype() == mx::float32 &&
              (layer.bias.size() == 0 || (layer.bias.ndim() == 1 && layer.bias.shape(0) == N)),
          what + "'s bias must be float32 [N] or empty");
}

void append(std::vector<mx::array>& inputs, const BlockLayer& layer) {
  inputs.insert(inputs.end(), {layer.w, layer.scales, layer.biases, layer.bias});
}

// out[M, N] = x[M, K] @ W.T (+ bias), the layer's four arrays at in[first] and its
// group size, bits and N at layout[0..3).
void run_linear(const float* x, int M, int K, const std::vector<mx::array>& in, size_t first,
                const int* layout, float* out) {
  const auto &w = in[first], &bias = in[first + 3];
  const int group_size = layout[0], bits = layout[1], N = layout[2];
  if (bits == 0) {
    panel_matmul_rows(x, M, w, N, out);
  } else {  // read in place: require_packed (at dispatch) checked they are dense
    quantized_matmul_rows(x, K, 1, M, K, w.data<uint32_t>(), in[first + 1].data<float>(),
                          in[first + 2].data<float>(), N, group_size, bits, out);
  }
  if (bias.size() > 0) {  // as the parts' add: y + bias, broadcast over the rows
    std::vector<float> bias_copy;
    const float* b = row_major_data(bias, bias_copy);
    for (int64_t m = 0; m < M; ++m) {
      for (int n = 0; n < N; ++n) {
        out[m * N + n] += b[n];
      }
    }
  }
}

// out = x + out, out first RMS-normed by post_norm when it is not empty.
void add_residual(const float* x, float* out, int M, int K, const mx::array& post_norm,
                  float eps) {
  if (post_norm.size() > 0) {
    std::vector<float> weight_copy;
    rms_norm_rows(out, row_major_data(post_norm, weight_copy), out, M, K, eps);
  }
  const int64_t size = static_cast<int64_t>(M) * K;
  for (int64_t i = 0; i < size; ++i) {
    out[i] = x[i] + out[i];
  }
}

void check_post_norm(const mx::array& post_norm, int K) {
  require(post_norm.dtype() == mx::float32 &&
              (post_norm.size() == 0 || (post_norm.ndim() == 1 && post_norm.shape(0) == K)),
          "post_norm must be float32 [K] or empty");
}

// The quantized layers' w, scales and biases are read in place. Checked when the op is
// queued, on the caller's thread: an exception in the queued work would end the process.
void require_packed(const std::vector<mx::array>& inputs, const int* layouts, size_t num_layers) {
  for (size_t layer = 0; layer < num_layers; ++layer) {
    if (layouts[3 * layer + 1] == 0) {
      continue;  // panels: StoredWeight copies a strided one
    }
    for (size_t i = 2 + 4 * layer; i < 5 + 4 * layer; ++i) {
      if (!inputs[i].flags().row_contiguous) {
        throw std::runtime_error("cadence residual blocks: quantized weights must be row-contiguous");
      }
    }
  }
}

mx::Stream cpu_stream() {
  return mx::to_stream(mx::StreamOrDevice{}, mx::Device::cpu);
}

}  // namespace

mx::array residual_mlp(const mx::array& x, const mx::array& norm_weight, float eps,
                       const BlockLayer& gate_up, const BlockLayer& down,
                       Activation activation, const mx::array& post_norm) {
  require(x.dtype() == mx::float32 && x.ndim() >= 1, "x must be float32 [..., K]");
  const int K = x.shape(-1);
  require(norm_weight.dtype() == mx::float32 && norm_weight.ndim() == 1 &&
              norm_weight.shape(0) == K,
          "norm_weight must be float32 [K]");
  require(gate_up.N % 2 == 0, "gate_up must have an even number of outputs");
  const int I = gate_up.N / 2;
  check_layer(gate_up, K, 2 * static_cast<int64_t>(I), "gate_up");
  check_layer(down, I, K, "down");
  check_post_norm(post_norm, K);
  std::vector<mx::array> inputs{x, norm_weight};
  append(inputs, gate_up);
  append(inputs, down);
  inputs.push_back(post_norm);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<ResidualMlp>(cpu_stream(), eps, gate_up, down, activation),
                   std::move(inputs));
}

void ResidualMlp::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  require_packed(inputs, layouts_, 2);
  run_on_stream(stream(), inputs, out, [eps = eps_, l = std::vector<int>(layouts_, layouts_ + 6),
                                        activation = activation_](std::vector<mx::array>& in,
                                                                  mx::array& out) {
    block_calls.fetch_add(1, std::memory_order_relaxed);
    const int K = in[0].shape(-1), M = leading_rows(in[0]);
    const int I = l[2] / 2;
    std::vector<float> x_copy, weight_copy;
    const float* x = row_major_data(in[0], x_copy);
    thread_local std::vector<float> normed, gate_up, act;  // the stream's one thread
    float* normed_x = scratch(normed, static_cast<size_t>(M) * K);
    float* gate_up_x = scratch(gate_up, static_cast<size_t>(M) * 2 * I);
    float* act_x = scratch(act, static_cast<size_t>(M) * I);
    rms_norm_rows(x, row_major_data(in[1], weight_copy), normed_x, M, K, eps);
    run_linear(normed_x, M, K, in, 2, &l[0], gate_up_x);
    gated_activation_rows(gate_up_x, act_x, M, I, activation);
    run_linear(act_x, M, I, in, 6, &l[3], out.data<float>());
    add_residual(x, out.data<float>(), M, K, in[10], eps);
  });
}

std::vector<mx::array> residual_attention(
    const mx::array& x, const mx::array& norm_weight, float eps, const BlockLayer& qkv,
    const BlockLayer& o, const mx::array& keys, const mx::array& values,
    const mx::array& tables, const mx::array& token_row, const mx::array& token_pos,
    const mx::array& inv_freqs, int num_heads, int num_kv_heads, int block_size, int window,
    float scale, float rope_scale, const mx::array& q_norm, const mx::array& k_norm,
    float qk_eps, const mx::array& post_norm, bool pools_in_place) {
  require(x.dtype() == mx::float32 && x.ndim() >= 1, "x must be float32 [..., K]");
  const int K = x.shape(-1);
  require(norm_weight.dtype() == mx::float32 && norm_weight.ndim() == 1 &&
              norm_weight.shape(0) == K,
          "norm_weight must be float32 [K]");
  require(num_heads > 0 && keys.ndim() == 2, "num_heads must be positive, the pools 2-D");
  const int D = keys.shape(1), N = leading_rows(x);
  require_pools_and_tables(keys, values, tables, token_row, token_pos, N, num_heads,
                           num_kv_heads, D, block_size, window);
  require(inv_freqs.ndim() == 1 && inv_freqs.dtype() == mx::float32 &&
              2 * inv_freqs.shape(0) <= D && inv_freqs.shape(0) <= 512,
          "inv_freqs must be float32 [dims / 2], dims <= D and at most 1024");
  check_layer(qkv, K, static_cast<int64_t>(num_heads + 2 * num_kv_heads) * D, "qkv");
  check_layer(o, static_cast<int64_t>(num_heads) * D, K, "o");
  const bool has_qk_norm = q_norm.size() > 0 || k_norm.size() > 0;
  for (const auto* norm : {&q_norm, &k_norm}) {
    require(norm->dtype() == mx::float32 &&
                (has_qk_norm ? norm->ndim() == 1 && norm->shape(0) == D : norm->size() == 0),
            "q_norm and k_norm must both be float32 [D], or both empty");
  }
  check_post_norm(post_norm, K);
  std::vector<mx::array> inputs{x, norm_weight};
  append(inputs, qkv);
  append(inputs, o);
  inputs.insert(inputs.end(), {keys, values, tables, token_row, token_pos, inv_freqs, q_norm,
                               k_norm, post_norm});
  return mx::array::make_arrays(
      {x.shape(), keys.shape(), values.shape()}, {mx::float32, mx::float32, mx::float32},
      std::make_shared<ResidualAttention>(cpu_stream(), eps, qkv, o, num_heads, num_kv_heads,
                                          block_size, window, scale, rope_scale, qk_eps,
                                          pools_in_place),
      std::move(inputs));
}

void ResidualAttention::eval_cpu(const std::vector<mx::array>& inputs,
                                 std::vector<mx::array>& outputs) {
  constexpr size_t kKeys = 10;  // inputs: x, norm, 4 of qkv, 4 of o, then the pools
  require_packed(inputs, layouts_, 2);
  run_writing_pools(stream(), inputs, outputs, kKeys, pools_in_place_,
                    [eps = eps_, l = std::vector<int>(layouts_, layouts_ + 6),
                     h = std::vector<int>(heads_, heads_ + 4), scale = scale_,
                     rope_scale = rope_scale_, qk_eps = qk_eps_](std::vector<mx::array>& in,
                                                                 std::vector<mx::array>& out) {
    block_calls.fetch_add(1, std::memory_order_relaxed);
    const int H = h[0], kv = h[1];
    const int K = in[0].shape(-1), M = leading_rows(in[0]);
    const auto &keys = in[kKeys], &tables = in[kKeys + 2];
    const int D = keys.shape(1);
    std::vector<float> x_copy, weight_copy, freqs_copy;
    std::vector<int32_t> tables_copy, row_copy, pos_copy;
    const float* x = row_major_data(in[0], x_copy);
    thread_local std::vector<float> normed, qkv, attended;  // the stream's one thread
    float* normed_x = scratch(normed, static_cast<size_t>(M) * K);
    float* qkv_x = scratch(qkv, static_cast<size_t>(M) * (H + 2 * kv) * D);
    float* attended_x = scratch(attended, static_cast<size_t>(M) * H * D);
    rms_norm_rows(x, row_major_data(in[1], weight_copy), normed_x, M, K, eps);
    run_linear(normed_x, M, K, in, 2, &l[0], qkv_x);
    if (in[kKeys + 6].size() > 0) {  // each token's H query, then Hkv key heads, normed in place
      std::vector<float> q_norm_copy, k_norm_copy;
      const float* q_norm = row_major_data(in[kKeys + 6], q_norm_copy);
      const float* k_norm = row_major_data(in[kKeys + 7], k_norm_copy);
      for (int64_t n = 0; n < M; ++n) {
        float* heads = qkv_x + n * (H + 2 * kv) * D;
        rms_norm_rows(heads, q_norm, heads, H, D, qk_eps);
        rms_norm_rows(heads + static_cast<int64_t>(H) * D, k_norm, heads + static_cast<int64_t>(H) * D,
                      kv, D, qk_eps);
      }
    }
    const AttentionStep step{row_major_data(tables, tables_copy), tables.shape(0),
                             tables.shape(1), row_major_data(in[kKeys + 3], row_copy),
                             row_major_data(in[kKeys + 4], pos_copy), M, out[1].data<float>(),
                             out[2].data<float>(), keys.shape(0) / kv, kv, D, h[2], h[3], scale};
    attend_rotary(step, H, qkv_x, row_major_data(in[kKeys + 5], freqs_copy),
                  in[kKeys + 5].shape(0), rope_scale, attended_x);
    run_linear(attended_x, M, H * D, in, 6, &l[3], out[0].data<float>());
    add_residual(x, out[0].data<float>(), M, K, in[kKeys + 8], eps);
  });
}

void ResidualMlp::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's residual blocks run on the CPU only");
}

void ResidualAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("cadence's residual blocks run on the CPU only");
}

bool ResidualMlp::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ResidualMlp&>(other);
  return eps_ == o.eps_ && std::equal(layouts_, layouts_ + 6, o.layouts_) &&
      activation_ == o.activation_;
}

bool ResidualAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ResidualAttention&>(other);
  return eps_ == o.eps_ && qk_eps_ == o.qk_eps_ && pools_in_place_ == o.pools_in_place_ &&
      std::equal(layouts_, layouts_ + 6, o.layouts_) &&
      std::equal(heads_, heads_ + 4, o.heads_) && scale_ == o.scale_ &&
      rope_scale_ == o.rope_scale_;
}

uint64_t num_block_calls() {
  return block_calls.load();
}

}  // namespace cadence_cpu
