// Custom mlx primitives for attention and SwiGLU on the CPU (see kernels/native_ops.py).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include "cpu_dispatch.h"

namespace cadence_cpu {

namespace mx = mlx::core;

// Paged attention of q [N, H, D] over head-major pools [Hkv * slots, D], after writing
// k, v [N, Hkv, D] (each token's new K/V) into the pools at the token's slot; token n
// attends its table row token_row[n] up to position token_pos[n] (see
// attention_kernels.h). Returns {out, keys', values'}, the pools' buffers donated when
// nothing else holds them (as mlx's own scatter does), copied otherwise. One op per
// layer in place of a transpose, a reshape and a scatter for each of K and V.
std::vector<mx::array> paged_attention_write(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& tables,
    const mx::array& token_row,
    const mx::array& token_pos,
    int num_kv_heads,
    int block_size,
    int window,
    float scale,
    bool pools_in_place = false,
    float softcap = 0.0f,  // > 0: scores soft-capped, softcap * tanh(score / softcap)
    const std::optional<mx::array>& sinks = std::nullopt);  // [H] float32: see PagedAttentionJob

// The same from a stacked q/k/v projection: qkv [..., (H + 2 Hkv) * D] (N tokens; per
// token H query heads, then Hkv key and Hkv value heads). q and k are rotated first
// (rope's half-split layout, angle (token_pos * rope_scale) * inv_freqs[i], as
// norm_rope_ops.h), the angles computed once for both. out is [..., H * D]. One op in
// place of the reshape, three slices and two RoPEs that would feed the other.
std::vector<mx::array> paged_attention_rotary(
    const mx::array& qkv,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& tables,
    const mx::array& token_row,
    const mx::array& token_pos,
    const mx::array& inv_freqs,
    int num_heads,
    int num_kv_heads,
    int block_size,
    int window,
    float scale,
    float rope_scale,
    bool pools_in_place = false);

// One layer's paged attention over a ragged step, as the primitive's work, for ops
// that run it inside their own (block_ops.cpp). Call from the stream's thread.
struct AttentionStep {
  const int32_t* tables;  // [R, table_width]
  int R, table_width;
  const int32_t* token_row;  // [N]
  const int32_t* token_pos;  // [N]
  int N;
  float* keys;  // [Hkv * num_slots, D]: the pools, written in place
  float* values;
  int num_slots, Hkv, D, block_size, window;
  float scale;
  float softcap = 0.0f;  // see PagedAttentionJob
  const float* sinks = nullptr;  // [H] or null: see PagedAttentionJob
};
// Writes each token's k, v (token n's Hkv heads at k + n * k_stride, v alike) into the
// pools, then q [N, H, D] attends -> out [N, H, D]; a table that points outside the pool
// gives NaN and writes nothing.
void attend(const AttentionStep& step, int H, const float* q, const float* k, int64_t k_stride,
            const float* v, int64_t v_stride, float* out);
// The same from a dense stacked qkv [N, (H + 2 Hkv) * D], q and k rotated first by
// `half` inverse frequencies (paged_attention_rotary).
void attend_rotary(const AttentionStep& step, int H, const float* qkv, const float* inv_freqs,
                   int half, float rope_scale, float* out);
// Throws std::invalid_argument unless the pools hold whole blocks of Hkv heads of D
// float32 values and tables, token_row, token_pos fit N tokens of H query heads.
void require_pools_and_tables(const mx::array& keys, const mx::array& values,
                              const mx::array& tables, const mx::array& token_row,
                              const mx::array& token_pos, int N, int H, int num_kv_heads, int D,
                              int block_size, int window);
// The pool `in` as the output `out`: its buffer when nothing else holds it, else a new
// one (returns true: the caller copies the pool into it before writing).
//
// With `in_place` its buffer whoever holds it, for pools only these ops read and write
// (PagedKV's, see kernels/paged_attention.py). mlx keeps a multi-output op's output
// buffers referenced until the op has run, and decides here, when a step is queued:
// a step queued while the one before it still runs (a small model's decode step is
// too few ops for mlx to hold the caller back) found every pool still held, and copied
// all of them each layer (Gemma's bench model at 1 row: 28 instead of 85 tok/s). Ops
// on one stream run in order, so a write queued behind the earlier readers of a pool
// happens after they read it.
bool take_pool(const mx::array& in, mx::array& out, bool in_place);

// The shell of an eval_cpu whose outputs are {out, keys', values'}, the pools at
// inputs[pools] and inputs[pools + 1]: out allocated, the pools taken over (take_pool),
// then `body(in, out)` queued on the stream's thread, after a pool that could not be
// taken over is copied into its output.
template <class Body>  // Body: void(std::vector<mx::array>& in, std::vector<mx::array>& out)
void run_writing_pools(mx::Stream stream, const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs, size_t pools, bool in_place, Body body) {
  // Each output of a multi-output primitive holds its own copy of the inputs, so the
  // old pools would count three holders and never be donated (every step copied them
  // whole: 7 tok/s instead of 54). The outputs other than the one being evaluated,
  // whose inputs are `inputs`, let go of theirs now; mlx detaches them all once this
  // returns anyway.
  for (auto& output : outputs) {
    if (&output.inputs() != &inputs) {
      output.inputs().clear();
    }
  }
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  const bool copies[2] = {take_pool(inputs[pools], outputs[1], in_place),
                          take_pool(inputs[pools + 1], outputs[2], in_place)};
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in, out;
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& a : outputs) {
    encoder.set_output_array(a);
    out.push_back(mx::array::unsafe_weak_copy(a));
  }
  encoder.dispatch([in = std::move(in), out = std::move(out), copies = std::vector<bool>(copies, copies + 2),
                    pools, body = std::move(body)]() mutable {
    for (size_t i = 0; i < 2; ++i) {
      if (copies[i]) {
        std::vector<float> dense;
        const auto& pool = in[pools + i];
        std::copy_n(row_major_data(pool, dense), pool.size(), out[1 + i].data<float>());
      }
    }
    body(in, out);
  });
}

// The gated MLP's activation, act(gate) * up, float32: SwiGLU (silu) or Gemma's
// GELU with the tanh approximation (nn.gelu_approx).
enum class Activation { silu, gelu_tanh };
mx::array gated_activation(const mx::array& gate, const mx::array& up, Activation activation);
// The same with gate and up the halves of each row of gate_up [..., 2 * I] -> [..., I]:
// a stacked gate/up projection's output, with no split or copy between.
mx::array gated_activation_halves(const mx::array& gate_up, Activation activation);

// The halves form's work over dense rows of gate_up [rows, 2 * width] -> out [rows,
// width], on the kernel threads (block_ops.cpp).
void gated_activation_rows(const float* gate_up, float* out, int rows, int64_t width,
                           Activation activation);

uint64_t num_attention_calls();  // evaluations of paged_attention_write on the CPU, ever
uint64_t num_pool_copies();  // pools paged_attention_write had to copy (not donated), ever
uint64_t num_gated_calls();  // evaluations of gated_activation(_halves) on the CPU, ever

// Inputs q, keys, values, tables, token_row, token_pos, k, v[, sinks]; or, rotary (num_heads > 0),
// qkv, keys, values, tables, token_row, token_pos, inv_freqs. Outputs out, keys', values'.
class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, int num_kv_heads, int block_size, int window, float scale,
                 bool pools_in_place, int num_heads = 0, float rope_scale = 1.0f,
                 float softcap = 0.0f)
      : mx::Primitive(stream),
        num_kv_heads_(num_kv_heads),
        block_size_(block_size),
        window_(window),
        scale_(scale),
        pools_in_place_(pools_in_place),
        num_heads_(num_heads),
        rope_scale_(rope_scale),
        softcap_(softcap) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "CadencePagedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int num_kv_heads_, block_size_, window_;
  float scale_;
  bool pools_in_place_;  // see take_pool
  int num_heads_;  // > 0: the rotary form, which reads the query heads' count from here
  float rope_scale_;
  float softcap_;
};

class GatedActivation : public mx::UnaryPrimitive {
 public:
  GatedActivation(mx::Stream stream, Activation activation)
      : mx::UnaryPrimitive(stream), activation_(activation) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CadenceGatedActivation";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return activation_ == static_cast<const GatedActivation&>(other).activation_;
  }

 private:
  Activation activation_;
};

}  // namespace cadence_cpu
