#include "attention_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

#include "attention_kernels.h"
#include "cpu_dispatch.h"
#include "isa.h"
#include "norm_rope_ops.h"
#include "row_pool.h"

namespace cadence_cpu {

namespace {

std::atomic<uint64_t> attention_calls{0};
std::atomic<uint64_t> pool_copies{0};
std::atomic<uint64_t> gated_calls{0};

// A chunk of work should be worth waking a sleeping worker (~10-20 us).
constexpr int64_t kMinFlopsPerChunk = 1 << 18;

struct Kernels {
  AttentionItems attention;
  SiluMulRange silu_mul;
  SiluMulRange gelu_tanh_mul;
  int lanes;  // query heads a prefill tile holds
};

const Kernels& kernels() {
  static const Kernels chosen = [] {
    switch (best_isa()) {
#if defined(CADENCE_HAS_X86_KERNELS)
      case Isa::avx512:
        return Kernels{avx512::paged_attention_items, avx512::silu_mul_range, avx512::gelu_tanh_mul_range,
                       avx512::attention_lanes()};
      case Isa::avx2:
        return Kernels{avx2::paged_attention_items, avx2::silu_mul_range, avx2::gelu_tanh_mul_range,
                       avx2::attention_lanes()};
#endif
      default:
        return Kernels{baseline::paged_attention_items, baseline::silu_mul_range, baseline::gelu_tanh_mul_range,
                       baseline::attention_lanes()};
    }
  }();
  return chosen;
}

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("cadence CPU kernels: " + what);
  }
}

mx::Stream cpu_stream() {
  return mx::to_stream(mx::StreamOrDevice{}, mx::Device::cpu);
}

// True if every block a token reads is a real pool block: a bad table must give NaN
// (which fails the rows that read it, see runtime/engine.py), never a wild read.
bool tables_are_sound(const PagedAttentionJob& job, int N, int R, int num_blocks) {
  std::vector<int> last_pos(R, -1);
  for (int n = 0; n < N; ++n) {
    const int row = job.token_row[n], pos = job.token_pos[n];
    if (row < 0 || row >= R || pos < 0 || pos / job.block_size >= job.table_width) {
      return false;
    }
    last_pos[row] = std::max(last_pos[row], pos);
  }
  for (int row = 0; row < R; ++row) {
    const int32_t* table = job.tables + static_cast<int64_t>(row) * job.table_width;
    for (int b = 0; b <= last_pos[row] / job.block_size && last_pos[row] >= 0; ++b) {
      if (table[b] < 0 || table[b] >= num_blocks) {
        return false;
      }
    }
  }
  return true;
}

struct AttentionTask {
  PagedAttentionJob job;
  AttentionItems items;
};

// Tiles of the step's tokens: a run of tokens of one row at consecutive positions
// (a prefill chunk) is cut in tiles of lanes / G tokens; any other token is its own.
void build_tiles(const PagedAttentionJob& job, int N, int lanes, std::vector<int32_t>& first,
                 std::vector<int32_t>& count) {
  const int G = job.H / job.Hkv;
  const int per_tile = job.D <= kMaxTileHeadDim ? lanes / G : 0;
  first.clear();
  count.clear();
  for (int n = 0; n < N;) {
    int run = 1;
    while (n + run < N && job.token_row[n + run] == job.token_row[n] &&
           job.token_pos[n + run] == job.token_pos[n] + run) {
      ++run;
    }
    const int step = per_tile >= 2 && run * G >= lanes ? per_tile : 1;
    for (int t = 0; t < run; t += step) {
      first.push_back(n + t);
      count.push_back(std::min(step, run - t));
    }
    n += run;
  }
}

}  // namespace

// The pool `in` as the output `out`: its own buffer when nothing else holds it (a
// step's write then costs its new rows, not the pool), else a new one that the
// step fills with a copy first (returns true).
bool take_pool(const mx::array& in, mx::array& out, bool in_place) {
  if ((in_place || in.is_donatable()) && in.flags().row_contiguous) {
    out.copy_shared_buffer(in);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  pool_copies.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The operands both builders share: pools of whole blocks of D-wide heads, tables,
// and each of the N tokens' table row and position.
void require_pools_and_tables(const mx::array& keys, const mx::array& values,
                              const mx::array& tables, const mx::array& token_row,
                              const mx::array& token_pos, int N, int H, int num_kv_heads, int D,
                              int block_size, int window) {
  require(num_kv_heads > 0 && H % num_kv_heads == 0, "H must be a multiple of num_kv_heads");
  require(H / num_kv_heads <= kMaxQueriesPerKv, "at most 64 query heads per KV head");
  require(block_size > 0 && window >= 0, "block_size must be positive, window not negative");
  for (const auto* pool : {&keys, &values}) {
    require(pool->ndim() == 2 && pool->dtype() == mx::float32 && pool->shape(1) == D,
            "the pools must be [Hkv * slots, D] float32");
    require(pool->shape(0) == keys.shape(0) && pool->shape(0) % num_kv_heads == 0 &&
                (pool->shape(0) / num_kv_heads) % block_size == 0,
            "the pools must hold whole blocks of every KV head");
  }
  require(tables.ndim() == 2 && tables.dtype() == mx::int32, "tables must be [R, W] int32");
  for (const auto* index : {&token_row, &token_pos}) {
    require(index->ndim() == 1 && index->shape(0) == N && index->dtype() == mx::int32,
            "token_row and token_pos must be [N] int32");
  }
}

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
    bool pools_in_place,
    float softcap,
    const std::optional<mx::array>& sinks) {
  require(q.ndim() == 3 && q.dtype() == mx::float32, "q must be [N, H, D] float32");
  require(softcap >= 0.0f && std::isfinite(softcap), "softcap must be a finite number >= 0");
  const int N = q.shape(0), H = q.shape(1), D = q.shape(2);
  require(!sinks || (sinks->ndim() == 1 && sinks->shape(0) == H && sinks->dtype() == mx::float32),
          "sinks must be [H] float32");
  require_pools_and_tables(keys, values, tables, token_row, token_pos, N, H, num_kv_heads, D,
                           block_size, window);
  const mx::Shape new_kv{N, num_kv_heads, D};
  require(k.shape() == new_kv && v.shape() == new_kv && k.dtype() == mx::float32 &&
              v.dtype() == mx::float32,
          "k and v must be [N, Hkv, D] float32");
  auto s = cpu_stream();
  return mx::array::make_arrays(
      {q.shape(), keys.shape(), values.shape()},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<PagedAttention>(s, num_kv_heads, block_size, window, scale, pools_in_place,
                                       0, 1.0f, softcap),
      sinks ? std::vector<mx::array>{q, keys, values, tables, token_row, token_pos, k, v, *sinks}
            : std::vector<mx::array>{q, keys, values, tables, token_row, token_pos, k, v});
}

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
    bool pools_in_place) {
  require(num_heads > 0, "num_heads must be positive");
  require(keys.ndim() == 2, "the pools must be [Hkv * slots, D] float32");
  const int N = token_row.ndim() == 1 ? token_row.shape(0) : -1, D = keys.shape(1);
  require_pools_and_tables(keys, values, tables, token_row, token_pos, N, num_heads, num_kv_heads,
                           D, block_size, window);
  const int64_t width = static_cast<int64_t>(num_heads + 2 * num_kv_heads) * D;
  require(qkv.dtype() == mx::float32 && qkv.ndim() >= 1 && qkv.shape(-1) == width &&
              qkv.size() == static_cast<size_t>(N) * width,
          "qkv must be float32 [..., (H + 2 Hkv) * D] holding N tokens");
  require(inv_freqs.ndim() == 1 && inv_freqs.dtype() == mx::float32 &&
              2 * inv_freqs.shape(0) <= D && inv_freqs.shape(0) <= 512,
          "inv_freqs must be float32 [dims / 2], dims <= D and at most 1024");
  mx::Shape out_shape = qkv.shape();
  out_shape.back() = num_heads * D;
  auto s = cpu_stream();
  return mx::array::make_arrays(
      {std::move(out_shape), keys.shape(), values.shape()},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<PagedAttention>(s, num_kv_heads, block_size, window, scale, pools_in_place,
                                       num_heads, rope_scale),
      {qkv, keys, values, tables, token_row, token_pos, inv_freqs});
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  run_writing_pools(stream(), inputs, outputs, 1, pools_in_place_,
                    [kv = num_kv_heads_, bs = block_size_, window = window_, scale = scale_,
                     rotary_heads = num_heads_, rope_scale = rope_scale_, softcap = softcap_](
                        std::vector<mx::array>& in, std::vector<mx::array>& out) {
    const auto& tables = in[3];
    const bool rotary = rotary_heads > 0;
    const int D = in[1].shape(1);
    const int H = rotary ? rotary_heads : in[0].shape(1);
    std::vector<float> q_copy, k_copy, v_copy, freqs_copy, sinks_copy;
    std::vector<int32_t> tables_copy, row_copy, pos_copy;
    const float* sinks = !rotary && in.size() > 8 ? row_major_data(in[8], sinks_copy) : nullptr;
    const AttentionStep step{row_major_data(tables, tables_copy), tables.shape(0), tables.shape(1),
                             row_major_data(in[4], row_copy), row_major_data(in[5], pos_copy),
                             in[4].shape(0), out[1].data<float>(), out[2].data<float>(),
                             in[1].shape(0) / kv, kv, D, bs, window, scale, softcap, sinks};
    if (rotary) {
      attend_rotary(step, H, row_major_data(in[0], q_copy), row_major_data(in[6], freqs_copy),
                    in[6].shape(0), rope_scale, out[0].data<float>());
    } else {
      const int64_t kv_stride = static_cast<int64_t>(kv) * D;
      attend(step, H, row_major_data(in[0], q_copy), row_major_data(in[6], k_copy), kv_stride,
             row_major_data(in[7], v_copy), kv_stride, out[0].data<float>());
    }
  });
}

void attend_rotary(const AttentionStep& step, int H, const float* qkv, const float* inv_freqs,
                   int half, float rope_scale, float* out) {
  // q and k rotated into [N, H, D] and [N, Hkv, D]; v read in place.
  const int N = step.N, D = step.D, kv = step.Hkv;
  const int64_t qkv_stride = static_cast<int64_t>(H + 2 * kv) * D;
  thread_local std::vector<float> rotated;  // the stream's one thread
  float* q_rot = scratch(rotated, static_cast<size_t>(N) * (H + kv) * D);
  float* k_rot = q_rot + static_cast<int64_t>(N) * H * D;
  rope_tokens(RopeJob{qkv, step.token_pos, inv_freqs, q_rot, H, D, half, rope_scale, qkv_stride,
                      qkv + H * D, k_rot, kv},
              N);
  attend(step, H, q_rot, k_rot, static_cast<int64_t>(kv) * D,
         qkv + static_cast<int64_t>(H + kv) * D, qkv_stride, out);
}

void attend(const AttentionStep& step, int H, const float* q, const float* k, int64_t k_stride,
            const float* v, int64_t v_stride, float* out) {
  attention_calls.fetch_add(1, std::memory_order_relaxed);
  const int N = step.N, D = step.D, kv = step.Hkv, bs = step.block_size;
  const int window = step.window;
  AttentionTask task{
      PagedAttentionJob{q, step.keys, step.values, step.tables, step.token_row, step.token_pos,
                        nullptr, nullptr, out, H, kv, D, step.num_slots, bs, step.table_width,
                        window, step.scale, step.softcap, step.sinks},
      kernels().attention};
  if (N == 0) {
    return;
  }
  if (!tables_are_sound(task.job, N, step.R, step.num_slots / bs)) {
    std::fill_n(out, static_cast<int64_t>(N) * H * D, std::numeric_limits<float>::quiet_NaN());
    return;  // and nothing written: the pools stay as they were
  }
  {  // each token's K/V into its slot, head-major: row h * num_slots + slot
    const auto& job = task.job;
    for (int n = 0; n < N; ++n) {
      const int pos = job.token_pos[n];
      const int64_t block =
          job.tables[static_cast<int64_t>(job.token_row[n]) * job.table_width + pos / bs];
      const int64_t slot = block * bs + pos % bs;
      for (int h = 0; h < kv; ++h) {
        const int64_t dst = (h * static_cast<int64_t>(step.num_slots) + slot) * D;
        std::copy_n(k + n * k_stride + h * D, D, step.keys + dst);
        std::copy_n(v + n * v_stride + h * D, D, step.values + dst);
      }
    }
  }
  thread_local std::vector<int32_t> tile_first, tile_count;  // the stream's one thread
  build_tiles(task.job, N, kernels().lanes, tile_first, tile_count);
  task.job.tile_first = tile_first.data();
  task.job.tile_count = tile_count.data();
  int64_t flops = 0;  // ~ keys seen x query heads x D, to size the chunks
  for (int n = 0; n < N; ++n) {
    const int pos = task.job.token_pos[n];
    flops += window > 0 ? std::min(pos + 1, window) : pos + 1;
  }
  flops = std::max<int64_t>(1, flops * H * D);
  const int items = static_cast<int>(tile_first.size()) * kv;
  const int min_items =
      static_cast<int>(std::clamp<int64_t>(kMinFlopsPerChunk * items / flops, 1, items));
  row_pool()->run(
      [](const void* context, int begin, int end) {
        const auto& t = *static_cast<const AttentionTask*>(context);
        t.items(t.job, begin, end);
      },
      &task, items, min_items);
}

mx::array gated_activation(const mx::array& gate, const mx::array& up, Activation activation) {
  require(gate.dtype() == mx::float32 && up.dtype() == mx::float32 && gate.shape() == up.shape(),
          "gate and up must be float32 of one shape");
  auto s = cpu_stream();
  return mx::array(gate.shape(), mx::float32, std::make_shared<GatedActivation>(s, activation),
                   {gate, up});
}

mx::array gated_activation_halves(const mx::array& gate_up, Activation activation) {
  require(gate_up.dtype() == mx::float32 && gate_up.ndim() >= 1 && gate_up.shape(-1) % 2 == 0,
          "gate_up must be float32 [..., 2 * I]");
  mx::Shape shape = gate_up.shape();
  shape.back() /= 2;
  auto s = cpu_stream();
  return mx::array(std::move(shape), mx::float32, std::make_shared<GatedActivation>(s, activation),
                   {gate_up});
}

namespace {
constexpr int64_t kGatedUnit = 1024;  // elements per unit of work handed to the pool
struct GatedTask {
  SiluMulJob job;
  int64_t size;
  SiluMulRange range;  // the activation's kernel
};
struct GatedHalvesTask {
  const float* gate_up;  // [rows, 2 * width]
  float* out;  // [rows, width]
  int64_t width;
  SiluMulRange range;
};
}  // namespace

void GatedActivation::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  run_on_stream(stream(), inputs, out, [activation = activation_](std::vector<mx::array>& in,
                                                                  mx::array& out) {
    std::vector<float> gate_copy, up_copy;
    if (in.size() == 1) {  // one input: gate and up are the two halves of each row
      const int64_t width = out.shape(-1);
      const int rows = width == 0 ? 0 : static_cast<int>(out.size() / width);
      gated_activation_rows(row_major_data(in[0], gate_copy), out.data<float>(), rows, width,
                            activation);
      return;
    }
    gated_calls.fetch_add(1, std::memory_order_relaxed);
    const SiluMulRange range =
        activation == Activation::silu ? kernels().silu_mul : kernels().gelu_tanh_mul;
    const GatedTask task{SiluMulJob{row_major_data(in[0], gate_copy), row_major_data(in[1], up_copy),
                                    out.data<float>()},
                         static_cast<int64_t>(out.size()), range};
    const int units = static_cast<int>((task.size + kGatedUnit - 1) / kGatedUnit);
    row_pool()->run(
        [](const void* context, int begin, int end) {
          const auto& t = *static_cast<const GatedTask*>(context);
          t.range(t.job, begin * kGatedUnit, std::min(t.size, end * kGatedUnit));
        },
        &task, units, 64);
  });
}

void gated_activation_rows(const float* gate_up, float* out, int rows, int64_t width,
                           Activation activation) {
  gated_calls.fetch_add(1, std::memory_order_relaxed);
  const SiluMulRange range =
      activation == Activation::silu ? kernels().silu_mul : kernels().gelu_tanh_mul;
  const GatedHalvesTask task{gate_up, out, width, range};
  row_pool()->run(
      [](const void* context, int begin, int end) {
        const auto& t = *static_cast<const GatedHalvesTask*>(context);
        for (int64_t r = begin; r < end; ++r) {
          const float* gate = t.gate_up + r * 2 * t.width;
          t.range(SiluMulJob{gate, gate + t.width, t.out + r * t.width}, 0, t.width);
        }
      },
      &task, rows, static_cast<int>(std::max<int64_t>(1, 64 * kGatedUnit / std::max<int64_t>(1, width))));
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("cadence's paged attention kernel runs on the CPU only");
}

void GatedActivation::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's gated activation kernel runs on the CPU only");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return num_kv_heads_ == o.num_kv_heads_ && block_size_ == o.block_size_ &&
      window_ == o.window_ && scale_ == o.scale_ && pools_in_place_ == o.pools_in_place_ &&
      num_heads_ == o.num_heads_ &&
      rope_scale_ == o.rope_scale_ && softcap_ == o.softcap_;
}

uint64_t num_attention_calls() {
  return attention_calls.load();
}

uint64_t num_pool_copies() {
  return pool_copies.load();
}

uint64_t num_gated_calls() {
  return gated_calls.load();
}

}  // namespace cadence_cpu
