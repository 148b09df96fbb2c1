// The Python module `kernels._cpu_ext` (loaded by kernels/cpu_extension.py).
#include <string>
#include <optional>
#include <tuple>
#include <variant>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/ops.h"
#include "mlx/version.h"

#include "attention_ops.h"
#include "block_ops.h"
#include "dense_ops.h"
#include "expert_ops.h"
#include "huge_pages.h"
#include "isa.h"
#include "norm_rope_ops.h"
#include "row_pool.h"
#include "quant_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

#define CADENCE_STR2(x) #x
#define CADENCE_STR(x) CADENCE_STR2(x)

NB_MODULE(_cpu_ext, m) {
  m.doc() = "cadence's CPU primitives for mlx: quantized matmuls, paged attention, SwiGLU, RMSNorm, RoPE";
  // The mlx this was compiled against; the loader refuses a different runtime mlx.
  m.attr("built_for_mlx") = CADENCE_STR(MLX_VERSION_MAJOR) "." CADENCE_STR(
      MLX_VERSION_MINOR) "." CADENCE_STR(MLX_VERSION_PATCH);
  m.def("matmul", &cadence_cpu::matmul, "x"_a, "w"_a, "scales"_a, "biases"_a.none(),
        "group_size"_a, "bits"_a,
        "x[M, K] @ dequantize(w).T -> [M, N] float32 (mlx affine layout, 4 or 8 bits; "
        "biases None: mxfp4, scales float32 2^(e - 127)).");
  m.def("expert_matmul", &cadence_cpu::expert_matmul, "x"_a, "experts"_a, "w"_a, "scales"_a,
        "biases"_a.none(), "group_size"_a, "bits"_a,
        "x[R, K], experts[R, k] -> [R, k, N] float32: each row times each of its experts' "
        "quantized weights (w [E, N, K * bits / 32], mlx affine layout).");
  m.def("dense_expert_matmul", &cadence_cpu::dense_expert_matmul, "x"_a, "experts"_a, "w"_a,
        "x[R, K], experts[R, k] -> [R, k, N] float32 for float weights w [E, N, K].");
  m.def("num_expert_calls", &cadence_cpu::num_expert_calls,
        "Expert matmuls evaluated on the CPU, ever.");
  m.def("copy_to_huge_pages", &cadence_cpu::copy_to_huge_pages, "a"_a,
        "A copy of a on a fresh mapping advised for 2 MB pages (Linux), or a itself when it "
        "is under 2 MB or the platform has none.");
  m.def("huge_page_bytes", &cadence_cpu::huge_page_bytes, "a"_a,
        "Bytes of the mapping holding a's data on 2 MB pages now (/proc/self/smaps), 0 if unknown.");
  m.def("paged_attention_write", &cadence_cpu::paged_attention_write, "q"_a, "k"_a, "v"_a,
        "keys"_a, "values"_a, "tables"_a, "token_row"_a, "token_pos"_a, "num_kv_heads"_a,
        "block_size"_a, "window"_a, "scale"_a, "pools_in_place"_a = false, "softcap"_a = 0.0f,
        "sinks"_a = nb::none(),
        "Write k, v [N, Hkv, D] into the pools, then attend: [out, keys, values]. "
        "pools_in_place: write into the pools' buffers even while something holds them "
        "(for pools only these ops use). softcap > 0: each score s becomes "
        "softcap * tanh(s / softcap) (Gemma 2). sinks [H] float32: each query head's "
        "logit in its softmax's sum, with no value (gpt-oss).");
  m.def("paged_attention_rotary", &cadence_cpu::paged_attention_rotary, "qkv"_a, "keys"_a,
        "values"_a, "tables"_a, "token_row"_a, "token_pos"_a, "inv_freqs"_a, "num_heads"_a,
        "num_kv_heads"_a, "block_size"_a, "window"_a, "scale"_a, "rope_scale"_a,
        "pools_in_place"_a = false,
        "Rotate q and k of a stacked qkv [..., (H + 2 Hkv) * D], write k, v into the pools, "
        "then attend: [out [..., H * D], keys, values].");
  // Each activation twice: act(gate) * up, and over the two halves of each row of gate_up.
  for (const auto& [name, activation, what] :
       {std::tuple{"silu_mul", cadence_cpu::Activation::silu, "silu(gate) * up, float32"},
        std::tuple{"gelu_tanh_mul", cadence_cpu::Activation::gelu_tanh,
                   "gelu_tanh(gate) * up (nn.gelu_approx), float32"}}) {
    m.def(name, [activation](const mx::array& gate, const mx::array& up) {
      return cadence_cpu::gated_activation(gate, up, activation);
    }, "gate"_a, "up"_a, what);
    m.def((std::string(name) + "_halves").c_str(), [activation](const mx::array& gate_up) {
      return cadence_cpu::gated_activation_halves(gate_up, activation);
    }, "gate_up"_a, (std::string(what) + ", gate and up the halves of each row of gate_up").c_str());
  }
  m.def("rms_norm", &cadence_cpu::rms_norm, "x"_a, "weight"_a, "eps"_a,
        "x * rsqrt(mean(x^2, -1) + eps) * weight, float32 (kernels/norm_rope.py).");
  m.def("rope", &cadence_cpu::rope, "x"_a, "positions"_a, "inv_freqs"_a, "scale"_a,
        "Rotary embedding of x [N, H, D] at per-token positions [N] (kernels/norm_rope.py).");
  m.def("num_pool_copies", &cadence_cpu::num_pool_copies,
        "How many pools paged_attention_write copied because something else held them.");
  m.def("num_rms_norm_calls", &cadence_cpu::num_rms_norm_calls);
  m.def("num_gated_calls", &cadence_cpu::num_gated_calls,
        "How many times the gated activation kernel (SwiGLU, GELU-tanh) has run.");
  m.def("num_rope_calls", &cadence_cpu::num_rope_calls);
  m.def("num_attention_calls", &cadence_cpu::num_attention_calls,
        "How many times the paged attention kernel has run.");
  m.def("attention_isa", [] { return std::string(cadence_cpu::isa_name(cadence_cpu::best_isa())); },
        "The instruction set the attention and SwiGLU kernels use.");
  m.def("dense_matmul", &cadence_cpu::dense_matmul, "x"_a, "w"_a,
        "x[M, K] @ w[N, K].T -> [M, N] float32, the weight read in place (few rows).");
  m.def("panel_matmul", &cadence_cpu::panel_matmul, "x"_a, "w_panels"_a, "N"_a,
        "x[..., K] @ W.T -> [..., N] float32 for W packed as [ceil(N / 32), K, 32] panels.");
  m.def("pack_panels", &cadence_cpu::pack_panels, "w"_a,
        "w [N, K] -> [ceil(N / 32), K, 32] panels, same dtype, the missing columns zero.");
  m.def("num_panel_calls", &cadence_cpu::num_panel_calls,
        "How many times the panel matmul kernel has run.");
  m.def("num_dense_calls", &cadence_cpu::num_dense_calls,
        "How many times the dense matmul kernel has run.");
  m.def("num_kernel_calls", &cadence_cpu::num_kernel_calls,
        "How many times the kernels have run, for tests that must see them run.");
  // A block's layer: quantized, (w, scales, biases, bias, group_size, bits), or packed
  // in panels, (w_panels, bias, N); bias may be empty.
  using Quantized = std::tuple<mx::array, mx::array, mx::array, mx::array, int, int>;
  using Panels = std::tuple<mx::array, mx::array, int>;
  using Layer = std::variant<Quantized, Panels>;
  auto layer = [](const Layer& held) {
    if (const auto* t = std::get_if<Quantized>(&held)) {
      const auto& w = std::get<0>(*t);
      return cadence_cpu::BlockLayer{w, std::get<1>(*t), std::get<2>(*t), std::get<3>(*t),
                                     std::get<4>(*t), std::get<5>(*t), w.ndim() ? w.shape(0) : 0};
    }
    const auto& [w_panels, bias, N] = std::get<Panels>(held);
    const mx::array unused(0.0f);
    return cadence_cpu::BlockLayer{w_panels, unused, unused, bias, 0, 0, N};
  };
  auto activation_named = [](const std::string& name) {
    if (name != "silu" && name != "gelu_tanh") {
      throw std::invalid_argument("activation must be silu or gelu_tanh");
    }
    return name == "silu" ? cadence_cpu::Activation::silu : cadence_cpu::Activation::gelu_tanh;
  };
  // An optional [K] weight; empty for none. An array built with its (no) data, not an op
  // such as mx::zeros: each op is one more for mlx to run, two a layer a step.
  auto empty = [] { return mx::array(std::initializer_list<float>{}); };
  auto weight_or_none = [empty](const std::optional<mx::array>& w) { return w ? *w : empty(); };
  m.def("residual_mlp", [layer, activation_named, weight_or_none](
                            const mx::array& x, const mx::array& norm_weight, float eps,
                            const Layer& gate_up, const Layer& down, const std::string& activation,
                            const std::optional<mx::array>& post_norm) {
    return cadence_cpu::residual_mlp(x, norm_weight, eps, layer(gate_up), layer(down),
                                     activation_named(activation), weight_or_none(post_norm));
  }, "x"_a, "norm_weight"_a, "eps"_a, "gate_up"_a, "down"_a, "activation"_a,
        "post_norm"_a = nb::none(),
        "x + down(act(gate and up halves of gate_up(rms_norm(x)))), one op (few rows); "
        "post_norm [K] norms the block's output before the add.");
  m.def("residual_attention", [layer, empty, weight_or_none](const mx::array& x, const mx::array& norm_weight, float eps,
                                      const Layer& qkv, const Layer& o, const mx::array& keys,
                                      const mx::array& values, const mx::array& tables,
                                      const mx::array& token_row, const mx::array& token_pos,
                                      const mx::array& inv_freqs, int num_heads, int num_kv_heads,
                                      int block_size, int window, float scale, float rope_scale,
                                      const std::optional<std::tuple<mx::array, mx::array, float>>& qk_norm,
                                      const std::optional<mx::array>& post_norm,
                                      bool pools_in_place) {
    const mx::array none = empty();
    return cadence_cpu::residual_attention(
        x, norm_weight, eps, layer(qkv), layer(o), keys, values, tables, token_row, token_pos,
        inv_freqs, num_heads, num_kv_heads, block_size, window, scale, rope_scale,
        qk_norm ? std::get<0>(*qk_norm) : none, qk_norm ? std::get<1>(*qk_norm) : none,
        qk_norm ? std::get<2>(*qk_norm) : 0.0f, weight_or_none(post_norm), pools_in_place);
  }, "x"_a, "norm_weight"_a, "eps"_a, "qkv"_a, "o"_a, "keys"_a, "values"_a, "tables"_a,
        "token_row"_a, "token_pos"_a, "inv_freqs"_a, "num_heads"_a, "num_kv_heads"_a,
        "block_size"_a, "window"_a, "scale"_a, "rope_scale"_a, "qk_norm"_a = nb::none(),
        "post_norm"_a = nb::none(), "pools_in_place"_a = false,
        "x + o(paged_attention_rotary(qkv(rms_norm(x)))): [out, keys, values], one op; "
        "qk_norm = (q_norm [D], k_norm [D], eps) norms each q and k head before RoPE, "
        "post_norm [K] the block's output before the add.");
  m.def("num_block_calls", &cadence_cpu::num_block_calls,
        "How many times a residual block (residual_mlp, residual_attention) has run.");
  m.def("isa", &cadence_cpu::isa, "The instruction set the kernels use.");
  m.def("num_threads", &cadence_cpu::num_threads);
  m.def("set_num_threads", &cadence_cpu::set_threads, "num_threads"_a);
  m.def("spin_microseconds", &cadence_cpu::spin_microseconds,
        "How long an idle kernel thread watches for work before it sleeps (CADENCE_CPU_SPIN_US).");
}
