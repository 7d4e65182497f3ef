// The residual norm-site kernels (residual_adaln_modulate, residual_rms_norm_modulate): kernel
// arguments and launcher declarations. The gated residual update in front of a norm -> modulate site,
// in one pass forward and one pass backward:
//
//   r   = x + gate * y        in fp32 (x + y without a gate), rounded once to r's dtype Tr
//   out = norm(r) * (1 + scale) + shift                          (norm(r) without modulation)
//   backward: dr_total = dr + d(out)/d(r) . dout (fp32);  dx = dr_total;  dy = gate * dr_total;
//             dgate = sum of y * dr_total over gate's broadcast dims; the norm's and modulation's
//             gradients as the norm -> modulate kernels give them.
//
// Tensors are viewed as [B, N, D] (contiguous rows); gate, scale and shift are ModViews (per-sample,
// per-token or shared rows addressed by strides, each in its own dtype ModView::t). The kernels are
// templated on the norm and on r's dtype Tr (one .cu per Tr: residual_{forward,backward}_<dtype>.cu);
// every other tensor's dtype is read at run time (float32, bfloat16 or float16: norm_modulate.cuh's
// AnyRaw loads). A thread loads kResVec = 8 elements of each tensor at a time, whatever its dtype.
// This header holds no torch types.
#pragma once

#include "norm_modulate.cuh"

namespace adaln {

constexpr int kResVec = 8;
// Chunks of kResVec elements a thread: 4 x 8 x 512 threads covers kMaxFeatures.
constexpr int kResMaxChunks = 4;
// The forward prefetches the next row's x and y into registers up to this many chunks a thread
// (wider rows: loaded when their turn comes; ptxas sm_90, see residual_forward.cuh).
constexpr int kResPrefetchChunks = 2;
// The backward keeps its column partial sums in registers (one pass) up to this many chunks a
// thread; wider rows (D > 8192) take two kernels: dx, then the column sums recomputing dr_total.
constexpr int kResOnePassChunks = 2;
// Planes of the backward's column workspace [kResPlanes, tiles, B, D]:
//   P0 = sum dout * s1 * r_hat,  P1 = sum dout * s1  (s1 = 1 + per-token scale, else 1),
//   P2 = sum dout (per-token scale with a reduced shift),  P3 = sum y * dr_total (reduced gate).
constexpr int kResPlanes = 4;

struct ResFwdArgs {
  const void* x = nullptr;  // [B, N, D], dtype xt
  const void* y = nullptr;  // [B, N, D], dtype yt
  void* r = nullptr;        // [B, N, D], dtype Tr (the kernel's)
  void* out = nullptr;      // [B, N, D], dtype ot
  float* mean = nullptr;    // [B * N]; nullptr for Norm::RMS
  float* rstd = nullptr;    // [B * N]
  const float* weight = nullptr;  // [D] or nullptr
  const float* bias = nullptr;    // [D] or nullptr
  ModView gate, scale, shift;     // ptr nullptr: absent (no gate: x + y; no scale: a plain norm)
  Norm norm = Norm::Layer;
  int64_t B = 0, N = 0;
  int D = 0;
  float eps = 0.f;
  DType xt = DType::F32, yt = DType::F32, ot = DType::F32;
  bool aligned = false;  // every row start and modulation row 16-byte aligned and D % kResVec == 0
  int max_threads = 0;   // threads-per-block cap (Tuning); 0: automatic
};

struct ResBwdArgs {
  const void* dout = nullptr;  // [B, N, D], dtype dot
  const void* dr = nullptr;    // [B, N, D], dtype drt; nullptr: no gradient arrives at r
  const void* r = nullptr;     // [B, N, D], dtype Tr
  const void* y = nullptr;     // [B, N, D], dtype yt; with a gate only
  const float* mean = nullptr;  // nullptr for Norm::RMS
  const float* rstd = nullptr;
  const float* weight = nullptr;
  const float* bias = nullptr;
  ModView gate, scale, shift;
  Norm norm = Norm::Layer;
  void* dx = nullptr;  // [B, N, D], dtype dxt
  void* dy = nullptr;  // [B, N, D], dtype yt; with a gate only
  // Per-token gate / scale / shift: their gradients per element ([B, N, D], written directly), each in
  // its own dtype (float32 where the caller sums them over a broadcast batch afterwards).
  void* dgate_el = nullptr;
  void* dscale_el = nullptr;
  void* dshift_el = nullptr;
  DType dgate_t = DType::F32, dscale_t = DType::F32, dshift_t = DType::F32;
  // Column sums (fp32): per-sample rows [B, D] of a per-sample or shared gate / scale / shift, and
  // the dweight / dbias totals [D]; nullptr where not wanted. None wanted: no workspace, no reduction.
  float* dgate_rows = nullptr;
  float* dscale_rows = nullptr;
  float* dshift_rows = nullptr;
  float* dweight = nullptr;
  float* dbias = nullptr;
  float* ws = nullptr;       // [kResPlanes, tiles, B, D] fp32 partial sums
  float* rowsums = nullptr;  // [B * N, 2] fp32: mean_D(g), mean_D(g * r_hat) a row (two kernels only)
  int64_t B = 0, N = 0;
  int D = 0;
  DType dot = DType::F32, drt = DType::F32, yt = DType::F32, dxt = DType::F32;
  bool aligned = false;
  bool two_kernel = false;  // the row kernel computes dx only; a column kernel recomputes the partials
  int max_threads = 0;
  // Set by res_backward's plan: row tiles a sample, rows a tile, the row kernel's block shape.
  int64_t tiles = 0, rows_per_tile = 0;
  int threads = 0, chunks = 0;

  bool columns() const { return dgate_rows || dscale_rows || dshift_rows || dweight || dbias; }
};

// The DType of a kernel element type.
template <typename T>
constexpr DType dtype_of() {
  return std::is_same<T, float>::value ? DType::F32 : std::is_same<T, __half>::value ? DType::F16 : DType::BF16;
}

// Threads a block and chunks of kResVec a thread for a row of D (at most kResMaxChunks chunks).
RowShape res_row_shape(int D, int max_threads);
// The launchers, by norm and r's dtype Tr (float, __nv_bfloat16, __half): instantiated in
// residual_forward_<dtype>.cu / residual_backward_<dtype>.cu. res_backward with launch == false
// plans only (sets a.two_kernel where the row is too wide for one pass, a.tiles, a.rows_per_tile,
// a.threads, a.chunks), so that the caller sizes the workspace; then launch == true runs it.
template <Norm N, typename Tr>
void res_forward(const ResFwdArgs& a, cudaStream_t stream);
template <Norm N, typename Tr>
void res_backward(ResBwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
