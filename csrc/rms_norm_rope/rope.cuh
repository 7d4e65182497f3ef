// The q/k RMSNorm -> RoPE op (adaptiveload::rms_norm_rope): kernel arguments and launchers. One row is
// a token's projection of D = heads * Dh features:
//
//   x_hat = x * rstd,  rstd = 1 / sqrt(mean_D(x^2) + eps),  n = x_hat * w
//   y[h, 2i] = n[h, 2i] * cos - n[h, 2i + 1] * sin,   y[h, 2i + 1] = n[h, 2i] * sin + n[h, 2i + 1] * cos
//
// with cos, sin = table[b, t, h, i] (i < Dh / 2) read through element strides (0 where a table is
// broadcast: diffusers' Wan tables are [1, S, 1, Dh / 2] views with stride 2 along i), the tables and the
// weight each in its own dtype (fp32, bf16 or fp16), dweight written in the weight's. Backward, the
// rotation transposed: dn[2i] = dy[2i] * cos + dy[2i + 1] * sin, dn[2i + 1] = dy[2i + 1] * cos - dy[2i] * sin;
// g = dn * w; dx = rstd * (g - x_hat * mean_D(g * x_hat)); dweight = sum over rows of dn * x_hat,
// summed deterministically (each thread-row of the backward's grid into its own row in shared memory,
// those in order into the block's partial, then the partials in a fixed order by a second kernel).
// Statistics and arithmetic in fp32; x, y, dy and dx each in its own dtype. (reference:
// adaptiveload/ops/rms_norm_rope/reference.py)
// This header holds no torch types.
#pragma once

#include "norm_modulate.cuh"

namespace adaln {

// A rotation table (cos or sin) as the kernels read it for x viewed as [B, N, D]: element (b, n, h, i)
// at p[b * sb + n * sn + h * sh + i * si] (the in-row strides sh, si 32-bit), of dtype t.
struct RopeTable {
  const void* p = nullptr;
  DType t = DType::F32;
  int64_t sb = 0, sn = 0;
  int sh = 0, si = 0;
};

struct RopeArgs {
  int64_t B = 0, N = 0;
  int D = 0, Dh = 0;  // row width, head dim (even)
  float eps = 0.f;
  const void* x = nullptr;
  DType xt = DType::F32;
  const void* weight = nullptr;  // [D] of dtype wt, or null
  DType wt = DType::F32;
  RopeTable cos, sin;
  float* rstd = nullptr;  // [B * N]: written by the forward, read by the backward
  bool aligned = false;   // D a multiple of the vector width and every row pointer 16-byte aligned
  int max_threads = 0;    // threads-a-row cap (rope_shape; 0: automatic), set_tuning's for benchmarks
  // forward
  void* y = nullptr;
  DType yt = DType::F32;
  // backward
  const void* dy = nullptr;
  DType dyt = DType::F32;
  void* dx = nullptr;
  DType dxt = DType::F32;
  void* dweight = nullptr;  // [D] of the weight's dtype wt, or null (no weight, or its gradient not wanted)
  float* totals = nullptr;   // the backward blocks' dweight partials, [partials, D] (where partials > 1)
  int blocks = 0;            // backward grid (rope_backward_plan)
  int partials = 0;          // dweight partials of that grid: one a block (rope_backward_plan)
};

// A launch's shape: threads a row (a multiple of 32), rows a block, groups of VEC a thread.
struct RopeShape {
  int threads, rows, chunks;
};

// Vector width of x's dtype (16 bytes).
inline int rope_vec(DType xt) { return xt == DType::F32 ? 4 : 8; }
// Forward: each block its rows. Launch on `stream`.
void launch_rope_forward(const RopeArgs& a, cudaStream_t stream);
// The backward's grid (a.blocks: resident blocks, a full wave, no more than the rows need) and its
// dweight partials (a.partials, one a block: a.totals holds [a.partials, D] floats where more than one).
// Set a.dweight first: the blocks' shared memory (a row of partials a thread-row) depends on it.
void rope_backward_plan(RopeArgs& a);
// Backward: a.blocks blocks over the rows; then the dweight partials summed in a fixed order.
void launch_rope_backward(const RopeArgs& a, cudaStream_t stream);

}  // namespace adaln
