#include "attention_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/ops.h"

#include "attention_kernels.h"
#include "cpu_dispatch.h"
#include "isa.h"
#include "row_pool.h"

namespace cadence_cpu {

namespace {

std::atomic<uint64_t> attention_calls{0};

// A chunk of work should be worth waking a sleeping worker (~10-20 us).
constexpr int64_t kMinFlopsPerChunk = 1 << 18;

struct Kernels {
  AttentionItems attention;
  SiluMulRange silu_mul;
  int lanes;  // query heads a prefill tile holds
};

const Kernels& kernels() {
  static const Kernels chosen = [] {
    switch (best_isa()) {
#if defined(CADENCE_HAS_X86_KERNELS)
      case Isa::avx512:
        return Kernels{avx512::paged_attention_items, avx512::silu_mul_range,
                       avx512::attention_lanes()};
      case Isa::avx2:
        return Kernels{avx2::paged_attention_items, avx2::silu_mul_range,
                       avx2::attention_lanes()};
#endif
      default:
        return Kernels{baseline::paged_attention_items, baseline::silu_mul_range,
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

void fill_nan(mx::array& out) {
  std::fill_n(out.data<float>(), out.size(), std::numeric_limits<float>::quiet_NaN());
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

mx::array paged_attention(
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& tables,
    const mx::array& token_row,
    const mx::array& token_pos,
    int num_kv_heads,
    int block_size,
    int window,
    float scale) {
  require(q.ndim() == 3 && q.dtype() == mx::float32, "q must be [N, H, D] float32");
  const int N = q.shape(0), H = q.shape(1), D = q.shape(2);
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
  auto s = cpu_stream();
  return mx::array(
      q.shape(),
      mx::float32,
      std::make_shared<PagedAttention>(s, num_kv_heads, block_size, window, scale),
      {q, keys, values, tables, token_row, token_pos});
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  run_on_stream(stream(), inputs, out, [kv = num_kv_heads_, bs = block_size_, window = window_,
                                        scale = scale_](std::vector<mx::array>& in, mx::array& out) {
    attention_calls.fetch_add(1, std::memory_order_relaxed);
    const auto &q = in[0], &keys = in[1], &values = in[2], &tables = in[3];
    const int N = q.shape(0), H = q.shape(1), D = q.shape(2), R = tables.shape(0);
    const int num_slots = keys.shape(0) / kv;
    std::vector<float> q_copy, keys_copy, values_copy;  // stay empty: the pools are dense
    std::vector<int32_t> tables_copy, row_copy, pos_copy;
    AttentionTask task{
        PagedAttentionJob{row_major_data(q, q_copy), row_major_data(keys, keys_copy),
                          row_major_data(values, values_copy), row_major_data(tables, tables_copy),
                          row_major_data(in[4], row_copy), row_major_data(in[5], pos_copy),
                          nullptr, nullptr, out.data<float>(), H, kv, D, num_slots, bs,
                          tables.shape(1), window, scale},
        kernels().attention};
    if (N == 0) {
      return;
    }
    if (!tables_are_sound(task.job, N, R, num_slots / bs)) {
      fill_nan(out);
      return;
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
  });
}

mx::array silu_mul(const mx::array& gate, const mx::array& up) {
  require(gate.dtype() == mx::float32 && up.dtype() == mx::float32 && gate.shape() == up.shape(),
          "gate and up must be float32 of one shape");
  auto s = cpu_stream();
  return mx::array(gate.shape(), mx::float32, std::make_shared<SiluMul>(s), {gate, up});
}

namespace {
constexpr int64_t kSiluUnit = 1024;  // elements per unit of work handed to the pool
struct SiluTask {
  SiluMulJob job;
  int64_t size;
};
}  // namespace

void SiluMul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  run_on_stream(stream(), inputs, out, [](std::vector<mx::array>& in, mx::array& out) {
    std::vector<float> gate_copy, up_copy;
    const SiluTask task{SiluMulJob{row_major_data(in[0], gate_copy), row_major_data(in[1], up_copy),
                                   out.data<float>()},
                        static_cast<int64_t>(out.size())};
    const int units = static_cast<int>((task.size + kSiluUnit - 1) / kSiluUnit);
    row_pool()->run(
        [](const void* context, int begin, int end) {
          const auto& t = *static_cast<const SiluTask*>(context);
          kernels().silu_mul(t.job, begin * kSiluUnit, std::min(t.size, end * kSiluUnit));
        },
        &task, units, 64);
  });
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's paged attention kernel runs on the CPU only");
}

void SiluMul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("cadence's SwiGLU kernel runs on the CPU only");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return num_kv_heads_ == o.num_kv_heads_ && block_size_ == o.block_size_ &&
      window_ == o.window_ && scale_ == o.scale_;
}

uint64_t num_attention_calls() {
  return attention_calls.load();
}

}  // namespace cadence_cpu
