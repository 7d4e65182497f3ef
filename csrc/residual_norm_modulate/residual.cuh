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
// The backward's one-chunk kernel for rows just wider than kMaxThreads chunks of kResVec
// (res_bwd_wide_kernel): up to this many threads a block (D <= 5120).
constexpr int kResWideThreads = 640;
// Planes of the backward's column workspace [kResPlanes, tiles, B, D]:
//   P0 = sum dout * s1 * r_hat,  P1 = sum dout * s1  (s1 = 1 + per-token scale, else 1),
//   P2 = sum dout (per-token scale with a reduced shift),  P3 = sum y * dr_total (reduced gate).
constexpr int kResPlanes = 4;

// ---------------------------------------------------------------------------------------------
// Per-thread row staging (cp.async, sm_80+). Each thread copies the 16-byte groups of a row that it
// will itself read into its own part of a shared-memory ring, `stages` rows ahead of the row it
// computes, one commit group a row. No barrier guards the data: a thread reads only what it copied,
// and cp.async.wait_group orders its own copies; the ring keeps stages x (the row tensors) in flight
// without holding registers, where the register prefetch holds one row. A row past the block's last
// commits an empty group, so the row being computed is always `stages - 1` groups back. Aligned rows
// only (each group wholly inside D or wholly past it); a group past D is zero-filled (src-size 0),
// as the register loads read zeros there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ADALN_CP_ASYNC 1
#endif

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#ifdef ADALN_CP_ASYNC
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef ADALN_CP_ASYNC
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// This thread: wait until at most `pending` (0..kMaxStages - 1) of its commit groups are in flight.
__device__ __forceinline__ void cp_async_wait(int pending) {
#ifdef ADALN_CP_ASYNC
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
#endif
}

// A block's staging ring: S slots x NT row tensors x C groups of kResVec elements of T (kWords
// 16-byte words each) a thread, laid out so that the threads of a warp touch consecutive words.
// NT == 0: the tensor count is `tensors`, set at run time.
template <typename T, int NT, int C>
struct RowStage {
  static constexpr int kWords = kResVec * sizeof(T) / 16;
  uint4* base;
  int threads, tid;
  int tensors = NT;
  __device__ __forceinline__ uint4* at(int slot, int t, int c, int w) const {
    return base + (((slot * (NT > 0 ? NT : tensors) + t) * C + c) * kWords + w) * threads + tid;
  }
  // Issue the copies of this thread's groups of `row` (tensor t, D elements) into `slot`.
  __device__ __forceinline__ void copy(int slot, int t, const T* row, int D) const {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * threads + tid) * kResVec;
      const bool in = col < D;
      const char* src = reinterpret_cast<const char*>(in ? row + col : row);
#pragma unroll
      for (int w = 0; w < kWords; ++w) cp_async16(at(slot, t, c, w), src + 16 * w, in);
    }
  }
  // This thread's groups of tensor t in `slot` (its copies waited for).
  __device__ __forceinline__ void read(int slot, int t, Raw<T, kResVec> (&dst)[C]) const {
#pragma unroll
    for (int c = 0; c < C; ++c) read_chunk(slot, t, c, dst[c]);
  }
  // Its group c of tensor t in `slot` only.
  __device__ __forceinline__ void read_chunk(int slot, int t, int c, Raw<T, kResVec>& dst) const {
#pragma unroll
    for (int w = 0; w < kWords; ++w) reinterpret_cast<uint4*>(&dst)[w] = *at(slot, t, c, w);
  }
};
// The bytes of one slot of a RowStage of `tensors` row tensors, `chunks` groups a thread, `threads`
// threads, elements of `elem_bytes`.
inline size_t res_stage_slot_bytes(int tensors, int chunks, int threads, size_t elem_bytes) {
  return static_cast<size_t>(tensors) * chunks * kResVec * elem_bytes * threads;
}
// Automatic staging of the backward, and of the forward's per-token rows and segmented layout: slots for
// about this many bytes of rows a block (the forward with per-sample or shared rows: kResFwdStages).
constexpr size_t kResStageBytes = 48 * 1024;

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
  // Slots of the x / y staging ring (RowStage): -1 automatic (Tuning::fwd_stages), 0 the register
  // prefetch, 2..kMaxStages; the launcher resolves it (0 where staging cannot run).
  int stages = -1;
  Segments seg;  // the segmented layout (per-sample or shared gate / scale / shift only), or off
};

// The per-token modulation rows the staged forward copies through its ring after x and y (ring
// tensors 2, 3, ... in this order): those in r's dtype `tr`; a per-token row of another dtype, and a
// per-sample shift beside a per-token scale, are loaded at use.
struct ResFwdStagedRows {
  bool gate = false, scale = false, shift = false;
  __host__ __device__ int count() const { return int{gate} + int{scale} + int{shift}; }
};
__host__ __device__ inline ResFwdStagedRows res_fwd_staged_rows(const ResFwdArgs& a, DType tr) {
  auto per_token = [&](const ModView& m) { return m.per_token() && m.t == tr; };
  ResFwdStagedRows st;
  st.gate = per_token(a.gate);
  st.scale = per_token(a.scale);
  st.shift = per_token(a.shift);
  return st;
}

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
  // Column sums: per-sample rows [B, D] of a per-sample or shared gate / scale / shift (in dgate_rows_t
  // etc., below), and the dweight / dbias totals [D] (fp32); nullptr where not wanted. None wanted: no
  // workspace, no reduction.
  void* dgate_rows = nullptr;
  void* dscale_rows = nullptr;
  void* dshift_rows = nullptr;
  float* dweight = nullptr;
  float* dbias = nullptr;
  float* ws = nullptr;       // [kResPlanes, pieces, D] fp32 partial sums (norm_modulate.cuh: Pieces)
  // [B * N, 2] fp32: mean_D(g), mean_D(g * r_hat) a row (two kernels, and the segmented layout, whose
  // column kernel reads them when the ids are out of order)
  float* rowsums = nullptr;
  int64_t B = 0, N = 0;
  int D = 0;
  DType dot = DType::F32, drt = DType::F32, yt = DType::F32, dxt = DType::F32;
  bool aligned = false;
  bool two_kernel = false;  // the row kernel computes dx only; a column kernel recomputes the partials
  int max_threads = 0;
  // Slots of the one-pass row kernel's staging ring of r, dout, dr and y (RowStage): -1 automatic
  // (Tuning::bwd_stages), 0 none (loads at use), 2..kMaxStages; resolved by res_backward's plan.
  int stages = -1;
  // Set by res_backward's plan: row tiles a sample, rows a tile, the row kernel's block shape.
  int64_t tiles = 0, rows_per_tile = 0;
  int threads = 0, chunks = 0;
  // The segmented layout (the one-pass staged kernel with per-sample rows only), or off; the
  // workspace's pieces a plane (tiles * B, or tiles + segments), set by the caller after the plan.
  Segments seg;
  int64_t pieces = 0;
  float* totals = nullptr;  // the reduction groups' dweight / dbias partials [groups, 2, D] (totals_floats), or none
  // The rows' dtypes: each modulation's own where its rows are its gradient (per-sample or
  // per-segment), so that each sum is rounded once and no cast kernel follows; fp32 where a modulation
  // shared over the batch is summed over it afterwards.
  DType dgate_rows_t = DType::F32, dscale_rows_t = DType::F32, dshift_rows_t = DType::F32;

  bool columns() const { return dgate_rows || dscale_rows || dshift_rows || dweight || dbias; }
};

// The DType of a kernel element type.
template <typename T>
constexpr DType dtype_of() {
  return std::is_same<T, float>::value ? DType::F32 : std::is_same<T, __half>::value ? DType::F16 : DType::BF16;
}

// Threads a block and chunks of kResVec a thread for a row of D (at most kResMaxChunks chunks).
RowShape res_row_shape(int D, int max_threads);
// The backward's wide one-chunk shape for D of more than kMaxThreads and at most kResWideThreads groups of
// kResVec, with no thread cap (max_threads <= 0); else {0, 0}.
RowShape res_bwd_wide_shape(int D, int max_threads);
// The launchers, by norm and r's dtype Tr (float, __nv_bfloat16, __half): instantiated in
// residual_forward_<dtype>.cu / residual_{adaln,rms_norm}_backward_<dtype>.cu. res_forward returns false (nothing
// launched) only for the segmented layout where its kernel cannot run. res_backward with
// launch == false plans only (sets a.two_kernel where the row is too wide for one pass, a.tiles,
// a.rows_per_tile, a.threads, a.chunks, a.stages: 0 for the segmented layout where its kernel cannot
// run), so that the caller sizes the workspace; then launch == true runs it.
template <Norm N, typename Tr>
bool res_forward(const ResFwdArgs& a, cudaStream_t stream);
template <Norm N, typename Tr>
void res_backward(ResBwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
