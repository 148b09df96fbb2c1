// See norm_rope_kernels.h. Compiled with -ffp-contract=off (CMakeLists.txt): the RoPE
// angles must round as mlx's do, where only the explicit fma() calls fuse.
#include <math.h>
#include <stdint.h>

#include "norm_rope_kernels.h"

#ifndef CADENCE_ISA
#error "compile with -DCADENCE_ISA=<namespace>"
#endif

namespace cadence_cpu {
namespace CADENCE_ISA {
namespace {

// sin and cos as mlx computes them on the CPU (mlx/backend/cpu/simd/math.h, after
// Cephes): reduce by multiples of pi/4 in three fma steps, then one polynomial each.
// Step for step, so a rotation here is bit for bit the one of mlx's rope fallback.
// Past 2^23 the reduction is not exact and mlx, as here, calls libm.
inline void sin_cos(float angle, float& sine, float& cosine) {
  if (fabsf(angle) > 8388608.0f) {
    sine = sinf(angle);
    cosine = cosf(angle);
    return;
  }
  bool sine_negative = angle < 0;
  float x = fabsf(angle);
  const uint32_t octant = (static_cast<uint32_t>(x * 1.27323954473516f) + 1) & ~1u;
  const float y = static_cast<float>(octant);
  const bool swap = (octant & 2) != 0;  // which polynomial is sin and which is cos
  x = fmaf(y, -0.78515625f, x);
  x = fmaf(y, -2.4187564849853515625e-4f, x);
  x = fmaf(y, -3.77489497744594108e-8f, x);
  sine_negative ^= (octant & 4) != 0;
  const bool cosine_positive = ((octant - 2) & 4) != 0;
  const float z = x * x;
  float y1 = fmaf(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
  float y2 = fmaf(z, -1.9515295891e-4f, 8.3321608736e-3f);
  y1 = fmaf(y1, z, 4.166664568298827e-2f);
  y2 = fmaf(y2, z, -1.6666654611e-1f);
  y1 = y1 * z;
  y2 = y2 * z;
  y1 = y1 * z;
  y2 = fmaf(x, y2, x);
  y1 = fmaf(z, -0.5f, y1);
  y1 = y1 + 1.0f;
  const float s = swap ? y1 : y2, c = swap ? y2 : y1;
  sine = sine_negative ? -s : s;
  cosine = cosine_positive ? c : -c;
}

constexpr int kMaxHalf = 512;  // head dims up to 1024 rotate from the stack

}  // namespace

void rms_norm_rows(const NormJob& job, int begin, int end) {
  const int D = job.D;
  for (int64_t r = begin; r < end; ++r) {
    const float* x = job.x + r * D;
    float* out = job.out + r * D;
    // 16 running sums, vectorized by the compiler; one chain would wait on each add.
    float sums[16] = {};
    int k = 0;
    for (; k + 16 <= D; k += 16) {
      for (int l = 0; l < 16; ++l) {
        sums[l] += x[k + l] * x[k + l];
      }
    }
    for (int l = 1; l < 16; ++l) {
      sums[0] += sums[l];
    }
    float sum = sums[0];
    for (; k < D; ++k) {
      sum += x[k] * x[k];
    }
    // As mlx's fallback: the mean in float32, 1 / sqrt of it plus eps, x times that, times w.
    const float inv_rms = 1.0f / sqrtf(sum * (1.0f / static_cast<float>(D)) + job.eps);
    for (k = 0; k < D; ++k) {
      out[k] = (x[k] * inv_rms) * job.weight[k];
    }
  }
}

namespace {
// One token's H heads [H, D] from x into out, rotated by the token's angles.
void rotate_heads(const float* x, float* out, int H, int D, int half, const float* cosines,
                  const float* sines) {
  for (int h = 0; h < H; ++h, x += D, out += D) {
    for (int i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      out[i] = x1 * cosines[i] - x2 * sines[i];
      out[i + half] = x1 * sines[i] + x2 * cosines[i];
    }
    for (int i = 2 * half; i < D; ++i) {
      out[i] = x[i];
    }
  }
}
}  // namespace

void rope_tokens(const RopeJob& job, int begin, int end) {
  const int H = job.H, D = job.D, half = job.half;
  float cosines[kMaxHalf], sines[kMaxHalf];
  for (int64_t n = begin; n < end; ++n) {
    // As mlx's fallback: the position scaled in float32, times each inverse frequency.
    const float position = static_cast<float>(job.positions[n]) * job.scale;
    for (int i = 0; i < half; ++i) {
      sin_cos(position * job.inv_freqs[i], sines[i], cosines[i]);
    }
    rotate_heads(job.x + n * job.x_stride, job.out + n * H * D, H, D, half, cosines, sines);
    if (job.H2 > 0) {
      rotate_heads(job.x2 + n * job.x_stride, job.out2 + n * job.H2 * D, job.H2, D, half,
                   cosines, sines);
    }
  }
}

}  // namespace CADENCE_ISA
}  // namespace cadence_cpu
