// Fused norm -> adaptive modulation, for every norm type of the op family (Norm below): kernel
// arguments, launcher declarations and the device helpers (vector loads, row reductions, the
// shared-memory row rings, the deterministic column reduction's layout) shared by the forward and
// backward kernels of every op.
//
//   y = (x_hat * w + b) * (1 + scale) + shift                                   (one row = D features)
//   LayerNorm (adaln_modulate):      x_hat = (x - mean) * rstd,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
//   RMSNorm (rms_norm_modulate):     x_hat = x * rstd,           rstd = 1 / sqrt(mean(x^2) + eps), no b
//
// x is viewed as [B, N, D] (row-major, contiguous); a modulation tensor is addressed as
//   ptr + batch * sb + token * sn + d        (element strides; sb = 0 when its batch is 1 or it is
// shared, sn = 0 when it is per-sample or shared), so a strided .chunk() view needs no copy. The
// segmented layout (packs; Segments) views x as [1, T, D] and reads row n's modulation from row
// ids[n] of an [n_segments, D] tensor.
// This header holds no torch types: the .cu files that include it compile fast and in parallel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace adaln {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };
// The norm the kernels compute, a template parameter of every kernel (the LayerNorm code is the same
// instructions as before RMSNorm was added): Layer, or RMS (no mean: neither its reduction in the
// forward nor the mean_D(g) term of dx; no per-row mean saved; no bias).
enum class Norm : int { Layer = 0, RMS = 1 };

// A block has at most kMaxThreads threads (so each may use up to 128 registers: the row and the
// next row's prefetch stay in registers) and each thread owns at most kMaxChunks 16-byte groups of
// a row. Rows up to kMaxFeatures wide take the kernels (their per-column coefficients, 4 or 8 bytes
// per feature, fit in shared memory); wider rows use the reference path.
constexpr int kMaxChunks = 8;
constexpr int kMaxThreads = 512;
constexpr int kMaxFeatures = 16384;
// The forward's shared-memory row ring (sm_90 bulk copies) holds at most kMaxStages slots (a slot:
// an x row, plus its per-token modulation rows when there are any).
constexpr int kMaxStages = 8;

// The segmented layout (packs): x is one sequence (B = 1) of samples of different lengths, and row n
// takes the modulation row ids[n] of [count, D] tensors (ModView::sb: the stride between those rows).
// start [count + 2] (the backward's; nullptr in the forward): with ids that never decrease the first
// row of each segment, then T; last, 0 when the ids never decrease, else 1 (segment_starts_kernel in
// norm_modulate.cu writes it).
struct Segments {
  const void* ids = nullptr;  // int32 or int64 [T]; nullptr: the [B, N, D] layout
  bool ids64 = false;
  // Forward only: the wave's blocks take tiles of consecutive rows instead of the interleaved rows
  // (packs, set in segment_ids_view: with non-decreasing ids a block then crosses one or two segment
  // boundaries, not every one).
  bool consecutive = false;
  const int64_t* start = nullptr;
  int64_t count = 0;
  __host__ __device__ bool on() const { return ids != nullptr; }
};

struct ModView {
  const void* ptr = nullptr;  // nullptr: absent (shift only)
  int64_t sb = 0;             // batch stride in elements (0: one row for every sample)
  int64_t sn = 0;             // token stride in elements (0: the same row for every token)
  // The tensor's dtype, read by the residual kernels (each modulation in its own dtype); the
  // norm -> modulate kernels take scale's and shift's from FwdArgs::mt / BwdArgs::mt instead.
  DType t = DType::F32;
  // Present, with a row per token.
  __host__ __device__ bool per_token() const { return ptr != nullptr && sn != 0; }
};

struct FwdArgs {
  const void* x = nullptr;  // [B, N, D], dtype xt
  void* y = nullptr;        // [B, N, D], dtype ot
  float* mean = nullptr;    // [B * N]; nullptr for Norm::RMS
  float* rstd = nullptr;    // [B * N]
  Norm norm = Norm::Layer;
  const float* weight = nullptr;  // [D] or nullptr
  const float* bias = nullptr;    // [D] or nullptr
  ModView scale, shift;           // dtype mt
  int64_t B = 0, N = 0;
  int D = 0;
  float eps = 0.f;
  DType xt = DType::F32, mt = DType::F32, ot = DType::F32;
  bool aligned = false;  // every row start and modulation row is 16-byte aligned and D % VEC == 0
  // The launcher's choices below are automatic (from the shape and the device) unless a benchmark or
  // test forces one (csrc/norm_modulate.cu: Tuning, set by adaptiveload/ops/_tuning.py).
  // Threads-per-block cap (fewer threads, more chunks); 0: automatic (ring_row_shape).
  int max_threads = 0;
  // Rows of the forward's shared-memory ring: 0 = register prefetch (one row ahead), -1 = chosen by
  // the launcher, 2..kMaxStages = that many (the launcher falls back to 0 where the ring cannot run).
  int stages = 0;
  // How the ring forward writes y: 1 = into the row's ring slot, stored by the copy engine (a bulk
  // store; per-sample or shared modulation, y of x's element size, >= 3 slots), 0 = each thread its
  // own 16-byte groups, -1 = chosen by the launcher (kBulkStoreRowBytes). Same bits either way.
  int store = -1;
  // A block takes rows t, t + tiles, ... of its sample (interleaved, so the blocks of the wave sweep x
  // together): the wave takes main_rows rows a sample (a whole number per block), then tail_blocks
  // short blocks a sample take tail_rows consecutive rows each, launched after the wave so that the
  // SMs that finish their share first take them. tail_pct: the share of the rows left to them (-1 =
  // chosen by the launcher, 0 = none); main_rows and tail_blocks are set by the launcher.
  int tail_pct = -1;
  int tail_rows = 8;
  int64_t main_rows = 0, tail_blocks = 0;
  Segments seg;  // the segmented layout (per-sample or shared modulation only), or off
};

struct BwdArgs {
  const void* dy = nullptr;  // [B, N, D], dtype dyt
  const void* x = nullptr;   // [B, N, D], dtype xt
  const float* mean = nullptr;  // nullptr for Norm::RMS
  const float* rstd = nullptr;
  const float* weight = nullptr;
  const float* bias = nullptr;
  ModView scale, shift;  // dtype mt
  Norm norm = Norm::Layer;
  void* dx = nullptr;    // [B, N, D], dtype xt
  // [B, N, D], dtype xt, contiguous and aligned, or none: added to dx by the per-sample ring kernel
  // (the gradient that reaches x by another path, which the backend's post-grad pass hands the op
  // instead of an add after it); set by the host before backward_plan (the row widens the ring's
  // slots) and cleared where the plan takes no ring, so only that kernel reads it
  const void* dx_addend = nullptr;
  // Per-token modulation: its gradient is per element ([B, N, D], dtype mt), written directly.
  void* dscale_el = nullptr;  // non-null iff scale is per-token
  void* dshift_el = nullptr;  // non-null iff shift is per-token
  // Workspace of fp32 per-column partial sums: 3 planes of [tiles, B, D].
  float* ws = nullptr;
  // Outputs of the final column reduction: per-sample-row sums [B, D] in rows_t, and [D] fp32 totals.
  void* dscale_rows = nullptr;  // non-null iff scale is reduced (per-sample or shared)
  void* dshift_rows = nullptr;  // non-null iff shift is present and reduced
  float* dweight = nullptr;      // non-null iff weight is given
  float* dbias = nullptr;        // non-null iff bias is given
  int64_t B = 0, N = 0;
  int D = 0;
  int64_t tiles = 0;          // row tiles per sample and rows per tile, set by backward_plan
  int64_t rows_per_tile = 0;
  DType xt = DType::F32, mt = DType::F32, dyt = DType::F32;
  bool aligned = false;
  bool two_kernel = false;  // reference design: dx kernel + column kernel re-reading x and dy
  int max_threads = 0;  // as FwdArgs::max_threads
  int stages = 0;  // rows (x and dy) of the row kernel's shared-memory ring, as FwdArgs::stages
  int threads = 0, chunks = 0;  // the row kernel's block: threads, 16-byte chunks a thread (backward_plan)
  Segments seg;  // the segmented layout (the one-pass ring kernel only), or off
  int64_t pieces = 0;  // workspace rows a plane (column_pieces), set by the host after backward_plan
  float* totals = nullptr;  // the reduction groups' dweight / dbias partials [groups, 2, D] (totals_floats), or none
  // The dtype of dscale_rows / dshift_rows: the modulation's where those rows are its gradient
  // (per-sample or per-segment), so that each sum is rounded once and no cast kernel follows; fp32
  // where a modulation shared over the batch is summed over it afterwards.
  DType rows_t = DType::F32;
};

// Threads per block and 16-byte chunks per thread for a row of D elements of x's dtype.
struct RowShape {
  int threads;
  int chunks;
};
// The fewest chunks a thread with at most `max_threads` threads (0: kMaxThreads) a row.
RowShape row_shape(int D, DType xt, int max_threads);
// The same for a thread loading `vec` elements at a time (row_shape: 16 bytes of xt).
RowShape row_shape_vec(int D, int vec, int max_threads);
// The shape of a ring kernel that takes at most `ring_chunks` chunks a thread. Automatic
// (max_threads == 0): the first of 128 and 256 threads a row whose chunk count fits, else
// row_shape(D, xt, 0). Fewer threads a row (more chunks each) measured faster on the H200 rings
// (bf16, N = 65536, B = 2): forward D = 3072 85% of SoL at 96 threads x 4 chunks, 80% at 384 x 1;
// backward D = 1536 86% at 96 x 2, 79% at 192 x 1 (benchmarks/KERNEL_NOTES.md, v7).
RowShape ring_row_shape(int D, DType xt, int max_threads, int ring_chunks);
// f(std::integral_constant<int, C>{}) for a chunk count known at run time (1, 2, 4 or 8; kMax when
// more, so that a kernel family instantiated up to kMax chunks only compiles those)
template <int kMax = kMaxChunks, typename F>
void with_chunk_count(int chunks, const F& f) {
  static_assert(kMax == 1 || kMax == 2 || kMax == 4 || kMax == 8, "chunk counts are powers of two up to 8");
  if (chunks <= 1 || kMax == 1) f(std::integral_constant<int, 1>{});
  else if (chunks == 2 || kMax == 2) f(std::integral_constant<int, (kMax < 2 ? 1 : 2)>{});
  else if (chunks == 4 || kMax == 4) f(std::integral_constant<int, (kMax < 4 ? 2 : 4)>{});
  else f(std::integral_constant<int, kMax>{});
}
// The most ring slots, from `stages` down to 2, that leave `kernel` as many blocks a SM as two slots
// do (`fixed_bytes` of shared memory beside the slots of `slot_bytes`): where registers cap the blocks
// a SM, slots past that point only take blocks away. `stages` itself where it is 2 or less.
int stages_keeping_occupancy(const void* kernel, int threads, size_t fixed_bytes, size_t slot_bytes, int stages);
// Blocks of `kernel` (threads a block, smem bytes of dynamic shared memory) resident on one SM, from
// the occupancy calculator (1 where it fails). Raises the kernel's dynamic shared memory ceiling to
// the device's limit first where smem needs the opt-in (above 48 KB). Cached per (kernel, threads,
// smem, device): the query costs microseconds.
int blocks_per_sm(const void* kernel, int threads, size_t smem);
// Ring slots of `ring_kernel` for `requested` (FwdArgs::stages: -1 automatic, 0 none,
// 2..kMaxStages), or 0 where the ring cannot run: not `eligible` (unaligned rows), a GPU or a build
// before `min_arch` (90: the bulk copies of the norm -> modulate rings; 80: the residual kernels'
// cp.async staging), or too little shared memory for two slots of `slot_bytes` beside `fixed_bytes`.
// Automatic: slots for ~`auto_bytes` of rows per block.
int ring_stages(int requested, bool eligible, size_t fixed_bytes, size_t slot_bytes, size_t auto_bytes,
                const void* ring_kernel, int min_arch = 90);
int max_features(DType xt);

// by a.norm; false (nothing launched) only for the segmented layout where its kernel cannot run
bool launch_forward(const FwdArgs& a, cudaStream_t stream);
// What the launchers' choices read of the current device, queried once per device.
struct DeviceProps {
  int sms = 1;         // streaming multiprocessors
  int major = 0;       // compute capability major (9: sm_90, the ring's bulk copies)
  int smem_optin = 0;  // shared memory a block may opt in to, bytes
};
const DeviceProps& device_props();
// Sets a.tiles and a.rows_per_tile (one wave of blocks; sizes the [3, tiles, B, D] workspace).
void backward_plan(BwdArgs& a);
void launch_backward(const BwdArgs& a, cudaStream_t stream);  // by a.norm
// The entry points of each norm and x dtype: defined in norm_modulate_forward.cuh and
// norm_modulate_backward.cuh, explicitly instantiated in csrc/<op>/<op>_forward.cu and
// <op>_backward_{f32,bf16,f16}.cu, so that they compile in parallel.
// run_backward: launch == false only plans (sets a.tiles, a.rows_per_tile, ...).
template <Norm N>
bool launch_forward_norm(const FwdArgs& a, cudaStream_t stream);
template <Norm N, typename Tx>
void run_backward(BwdArgs& a, bool launch, cudaStream_t stream);


// Split N rows per sample into tiles so that B * tiles blocks fill the GPU once (blocks per SM from
// the occupancy calculator): every block then streams many rows, and the per-block costs (loading
// the modulation row, writing column partials) are paid once per SM slot rather than per row.
// Tiles of consecutive rows (`interleaved` false) have rows_per_tile rows each, the last one fewer.
// Interleaved rows (the forward's t, t + tiles, ...) take B * floor(slots / B) of the wave's block
// slots (every one when B divides them; B blocks, one a sample, when B exceeds them), so that each
// SM gets the same number of blocks and, to a row, the same number of rows (tiles of consecutive rows
// left part of the SMs a block short: 1041 blocks of 63 rows for 1056 slots at N = 65536).
template <typename Kernel>
void one_wave(Kernel kernel, int threads, size_t smem, int64_t B, int64_t N, bool interleaved, int64_t& tiles,
              int64_t& rows_per_tile) {
  const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(kernel), threads, smem);
  const int64_t target = static_cast<int64_t>(device_props().sms) * per_sm;
  tiles = interleaved ? target / B : (target + B - 1) / B;  // (interleaved: one wave while B <= target)
  tiles = tiles < 1 ? 1 : (tiles > N ? N : tiles);
  rows_per_tile = (N + tiles - 1) / tiles;
  if (!interleaved) tiles = (N + rows_per_tile - 1) / rows_per_tile;  // no empty tiles
}

// ---------------------------------------------------------------------------------------------
// Device helpers

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// VEC consecutive elements of T, kept in their storage type (half the registers of floats for
// 16-bit types). VEC * sizeof(T) is a multiple of 16 bytes for every type used here.
template <typename T, int VEC>
struct alignas(16) Raw {
  T v[VEC];
};

// Load VEC elements starting at column `col` of row pointer p: one or two 16-byte loads when the
// row is aligned (then the whole group is in bounds), else element by element with a bounds
// check (out-of-range elements read as zero).
template <typename T, int VEC>
__device__ __forceinline__ Raw<T, VEC> load_raw(const T* __restrict__ p, int col, int D, bool aligned) {
  Raw<T, VEC> r;
  if (aligned) {
    constexpr int kWords = VEC * sizeof(T) / 16;
    const uint4* src = reinterpret_cast<const uint4*>(p + col);
    uint4* dst = reinterpret_cast<uint4*>(&r);
#pragma unroll
    for (int i = 0; i < kWords; ++i) dst[i] = src[i];
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) r.v[j] = (col + j < D) ? p[col + j] : from_f<T>(0.f);
  }
  return r;
}

template <typename T, int VEC>
__device__ __forceinline__ void load_f(const T* __restrict__ p, int col, int D, bool aligned, float (&out)[VEC]) {
  Raw<T, VEC> r = load_raw<T, VEC>(p, col, D, aligned);
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_f<T>(r.v[j]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_f(T* __restrict__ p, int col, int D, bool aligned, const float (&in)[VEC]) {
  Raw<T, VEC> r;
#pragma unroll
  for (int j = 0; j < VEC; ++j) r.v[j] = from_f<T>(in[j]);
  if (aligned) {
    constexpr int kWords = VEC * sizeof(T) / 16;
    uint4* dst = reinterpret_cast<uint4*>(p + col);
    const uint4* src = reinterpret_cast<const uint4*>(&r);
#pragma unroll
    for (int i = 0; i < kWords; ++i) dst[i] = src[i];
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (col + j < D) p[col + j] = r.v[j];
  }
}

// Thread `tid`'s C 16-byte groups of a row of D elements (groups tid, tid + threads, ...), zeros
// past D.
template <typename T, int VEC, int C>
__device__ __forceinline__ void load_chunks(const T* __restrict__ row, int D, int threads, int tid, bool aligned,
                                            Raw<T, VEC> (&dst)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int col = (c * threads + tid) * VEC;
    if (col < D) {
      dst[c] = load_raw<T, VEC>(row, col, D, aligned);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dst[c].v[j] = from_f<T>(0.f);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Hopper bulk copies (sm_90+): one thread has the copy engine move a whole row from global to
// shared memory (cp.async.bulk), its completion counted in bytes on an mbarrier that every thread
// then waits on. Sizes must be multiples of 16 and both addresses 16-byte aligned (the aligned
// path). Below sm_90 they compile to a trap; the launcher never picks them there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ADALN_BULK 1
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: an mbarrier per ring slot expecting one arrival, made visible to the async proxy.
__device__ __forceinline__ void mbar_init(uint64_t* bars, int count) {
#ifdef ADALN_BULK
  for (int i = 0; i < count; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + i)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Orders this thread's generic-proxy accesses of shared memory with the copy engine's (async-proxy)
// ones: thread 0 before refilling a buffer the block has read (after the barrier that follows the
// reads), and each writer of a buffer the copy engine will store (before the barrier).
__device__ __forceinline__ void async_proxy_fence() {
#ifdef ADALN_BULK
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// One thread: the one arrival on `bar`, which then completes when `bytes` more have landed.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
#ifdef ADALN_BULK
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}

// One thread: copy `bytes` from `src` (global) to `dst` (shared), counted on `bar` as they land.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifdef ADALN_BULK
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
#else
  __trap();
#endif
}

// One thread: the copy engine writes `bytes` from shared memory to global memory (a bulk store),
// as one more operation of this thread's current bulk group; commit_group closes the group.
// The shared memory written by the block's threads must be made visible to the copy engine first:
// async_proxy_fence() by each writing thread after its writes, then a block barrier.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
#ifdef ADALN_BULK
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void bulk_commit() {
#ifdef ADALN_BULK
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}
// The issuing thread: wait until at most N of its committed bulk groups still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#ifdef ADALN_BULK
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#endif
}

// Every thread: wait until the phase of `bar` with this parity has completed (its bytes landed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef ADALN_BULK
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
}

// Slot bookkeeping of a shared-memory row ring, for the forward and the backward row kernels:
// `full` holds one mbarrier per slot; the k-th of a block's rows, k in [k0, k1), sits in slot
// (k - k0) % S, and its use of that slot has parity ((k - k0) / S) & 1. `fetch(slot, k)` (thread 0)
// issues the bulk copies of the k-th row into a slot; the kernels map k to a row of x (a tile of
// consecutive rows, or every tiles-th row with the interleaved order).
struct RingCursor {
  uint64_t* full;
  int S;
  int slot = 0;
  uint32_t phase = 0;
  // Every thread: the barriers initialised, then thread 0 fetches the first S rows.
  template <typename Fetch>
  __device__ __forceinline__ void start(int64_t n0, int64_t n1, const Fetch& fetch) {
    if (threadIdx.x == 0) mbar_init(full, S);
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 0; i < S && n0 + i < n1; ++i) fetch(i, n0 + i);
    }
  }
  // Every thread: wait until the current row has landed in its slot.
  __device__ __forceinline__ void wait() const { mbar_wait(&full[slot], phase); }
  // Every thread, after a block barrier that follows the last read of the k-th row's slot (n = k
  // here): thread 0 refills the slot with the (k + S)-th row; then on to the next slot.
  template <typename Fetch>
  __device__ __forceinline__ void release(int64_t n, int64_t n1, const Fetch& fetch) {
    if (threadIdx.x == 0 && n + S < n1) fetch(slot, n + S);
    advance();
  }
  // Every thread: on to the next slot without refilling this one (the forward's bulk store of y
  // refills a slot two rows later, once the copy engine has read y out of it).
  __device__ __forceinline__ void advance() {
    if (++slot == S) slot = 0, phase ^= 1;
  }
};

// Bytes between ring slots: a row rounded up to 128 bytes.
__host__ __device__ inline size_t ring_stride(int D, int elem_bytes) {
  return (static_cast<size_t>(D) * elem_bytes + 127) / 128 * 128;
}

// Per-token modulation rows the forward reads for each x row: scale when it is per-token; shift
// when it is per-token, or when scale is (then shift cannot be folded into the per-column beta).
struct ModRows {
  bool scale, shift;
  __host__ __device__ int count() const { return static_cast<int>(scale) + static_cast<int>(shift); }
};
__host__ __device__ inline ModRows mod_rows(const FwdArgs& a) {
  const bool s = a.scale.sn != 0;
  return {s, a.shift.ptr != nullptr && (a.shift.sn != 0 || s)};
}

// Sum NV values over the whole block; every thread gets the totals. Deterministic: a fixed
// butterfly inside each warp, then lane w of every warp reads warp w's partial and the same
// butterfly again. `red` holds 2 * NV * 32 floats; `parity` alternates its halves so one
// __syncthreads per call suffices (a half is rewritten only two calls later, after every thread
// has passed the barrier of the call in between).
template <int NV>
__device__ __forceinline__ void block_sum(float (&v)[NV], float* red, int& parity) {
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float* buf = red + parity * NV * 32;
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) buf[k * 32 + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    float s = lane < nwarps ? buf[k * 32 + lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    v[k] = s;
  }
  parity ^= 1;
}

// Per-column fp32 coefficients of the row a thread owns, in shared memory instead of registers (so
// more rows are in flight per SM). Layout [chunk][VEC / 4][threads] of float4: the lanes of a warp
// read consecutive float4s (no bank conflicts). A thread reads back only what it wrote itself, so
// no barrier is needed between the store and the loads.
template <int VEC>
struct CoefRow {
  float4* base;
  __device__ __forceinline__ float4* at(int c, int q) const {
    return base + (c * (VEC / 4) + q) * static_cast<int>(blockDim.x) + threadIdx.x;
  }
  __device__ __forceinline__ void store(int c, const float (&v)[VEC]) const {
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) *at(c, q) = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  }
  __device__ __forceinline__ void load(int c, float (&v)[VEC]) const {
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) {
      const float4 f = *at(c, q);
      v[4 * q] = f.x, v[4 * q + 1] = f.y, v[4 * q + 2] = f.z, v[4 * q + 3] = f.w;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Rows of a dtype known at run time (the residual kernels: x, y, dout, dr and each modulation in its
// own dtype). VEC elements travel as raw words in a Raw<float, VEC> (a 16-bit dtype fills its first
// half), so that a prefetched row stays raw until it is used (converting it right after the load
// would wait for the load); any_to_f converts, store_any rounds once to the dtype.

__host__ __device__ inline int dtype_bytes(DType t) { return t == DType::F32 ? 4 : 2; }

// `p` advanced by `i` elements of dtype t.
__host__ __device__ inline const void* elem_ptr(const void* p, DType t, int64_t i) {
  return static_cast<const char*>(p) + i * dtype_bytes(t);
}
__host__ __device__ inline void* elem_ptr(void* p, DType t, int64_t i) {
  return static_cast<char*>(p) + i * dtype_bytes(t);
}

template <int VEC>
using AnyRaw = Raw<float, VEC>;

// Call f(T{}) with T the C++ element type of t (float, __nv_bfloat16 or __half).
template <typename F>
__device__ __forceinline__ void with_dtype(DType t, const F& f) {
  switch (t) {
    case DType::BF16: f(__nv_bfloat16{}); break;
    case DType::F16: f(__half{}); break;
    default: f(float{}); break;
  }
}

// VEC elements of a row of dtype t from column col (load_raw's bounds and alignment rules).
template <int VEC>
__device__ __forceinline__ AnyRaw<VEC> load_any(const void* __restrict__ p, DType t, int col, int D, bool aligned) {
  AnyRaw<VEC> r;
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    static_assert(sizeof(Raw<T, VEC>) <= sizeof(AnyRaw<VEC>), "raw words must fit");
    *reinterpret_cast<Raw<T, VEC>*>(&r) = load_raw<T, VEC>(static_cast<const T*>(p), col, D, aligned);
  });
  return r;
}

template <int VEC>
__device__ __forceinline__ void any_to_f(const AnyRaw<VEC>& r, DType t, float (&out)[VEC]) {
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    const Raw<T, VEC>& v = *reinterpret_cast<const Raw<T, VEC>*>(&r);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = to_f<T>(v.v[j]);
  });
}

template <int VEC>
__device__ __forceinline__ void load_any_f(const void* __restrict__ p, DType t, int col, int D, bool aligned,
                                           float (&out)[VEC]) {
  any_to_f<VEC>(load_any<VEC>(p, t, col, D, aligned), t, out);
}

template <int VEC>
__device__ __forceinline__ void store_any(void* __restrict__ p, DType t, int col, int D, bool aligned,
                                          const float (&in)[VEC]) {
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    store_f<T, VEC>(static_cast<T*>(p), col, D, aligned, in);
  });
}

// One element of dtype t: v rounded once to it (store1), or it as a float (load1).
__device__ __forceinline__ void store1(void* __restrict__ p, DType t, int64_t i, float v) {
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    static_cast<T*>(p)[i] = from_f<T>(v);
  });
}
__device__ __forceinline__ float load1(const void* __restrict__ p, DType t, int64_t i) {
  float v = 0.f;
  with_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    v = to_f<T>(static_cast<const T*>(p)[i]);
  });
  return v;
}

// Thread `tid`'s C groups of VEC elements of a row of dtype t (as load_chunks), zeros past D.
template <int VEC, int C>
__device__ __forceinline__ void load_chunks_any(const void* __restrict__ row, DType t, int D, int threads, int tid,
                                                bool aligned, AnyRaw<VEC> (&dst)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int col = (c * threads + tid) * VEC;
    if (col < D) {
      dst[c] = load_any<VEC>(row, t, col, D, aligned);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dst[c].v[j] = 0.f;  // zero bits: 0 in every dtype
    }
  }
}

// How a kernel reads and writes a family of row tensors: all of one dtype fixed at compile time
// (TypedRows<T>: raw rows in T, half the registers of AnyRows for 16-bit T), or each of its own dtype
// read at run time (AnyRows). The DType arguments are ignored by TypedRows (the launcher picks it only
// where every such tensor has T's dtype).
template <typename T>
struct TypedRows {
  template <int VEC>
  using RawT = Raw<T, VEC>;
  static __host__ __device__ __forceinline__ const void* at(const void* p, DType, int64_t i) {
    return static_cast<const T*>(p) + i;
  }
  static __host__ __device__ __forceinline__ void* at(void* p, DType, int64_t i) { return static_cast<T*>(p) + i; }
  template <int VEC, int C>
  static __device__ __forceinline__ void load(const void* row, DType, int D, int threads, int tid, bool aligned,
                                              RawT<VEC> (&dst)[C]) {
    load_chunks(static_cast<const T*>(row), D, threads, tid, aligned, dst);
  }
  template <int VEC>
  static __device__ __forceinline__ void to_f(const RawT<VEC>& r, DType, float (&out)[VEC]) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = adaln::to_f<T>(r.v[j]);
  }
  template <int VEC>
  static __device__ __forceinline__ void store(void* row, DType, int col, int D, bool aligned, const float (&in)[VEC]) {
    store_f<T, VEC>(static_cast<T*>(row), col, D, aligned, in);
  }
};

struct AnyRows {
  template <int VEC>
  using RawT = AnyRaw<VEC>;
  static __host__ __device__ __forceinline__ const void* at(const void* p, DType t, int64_t i) {
    return elem_ptr(p, t, i);
  }
  static __host__ __device__ __forceinline__ void* at(void* p, DType t, int64_t i) { return elem_ptr(p, t, i); }
  template <int VEC, int C>
  static __device__ __forceinline__ void load(const void* row, DType t, int D, int threads, int tid, bool aligned,
                                              RawT<VEC> (&dst)[C]) {
    load_chunks_any<VEC, C>(row, t, D, threads, tid, aligned, dst);
  }
  template <int VEC>
  static __device__ __forceinline__ void to_f(const RawT<VEC>& r, DType t, float (&out)[VEC]) {
    any_to_f<VEC>(r, t, out);
  }
  template <int VEC>
  static __device__ __forceinline__ void store(void* row, DType t, int col, int D, bool aligned, const float (&in)[VEC]) {
    store_any<VEC>(row, t, col, D, aligned, in);
  }
};

// The segment of row n.
__device__ __forceinline__ int64_t seg_of(const Segments& s, int64_t n) {
  return s.ids64 ? static_cast<const int64_t*>(s.ids)[n] : static_cast<const int32_t*>(s.ids)[n];
}

// The backward's workspace: [planes, pieces, D] fp32 column partial sums, one piece per (row tile,
// sample) that a block of the row kernel sums. Per-sample layout: tile t of sample b is piece
// t * B + b (pieces = tiles * B). Segmented layout (tiles of consecutive rows of the whole pack, cut
// where the segment changes): the part of tile t in segment s is piece t + s (pieces = tiles +
// segments): with non-decreasing ids, each step to the next part in row order moves to the next
// tile, the next segment or both, so t + s never repeats. Sample b's pieces: first, first + stride,
// ... (count of them).
struct Pieces {
  int64_t first, count, stride;
};
__host__ __device__ inline int64_t piece_of(int64_t tile, int64_t b, int64_t B, bool segmented) {
  return segmented ? tile + b : tile * B + b;
}
// The final column reductions' grid: ceil(D / 32) strips of columns by reduce_groups(a) groups,
// group g summing samples (or segments) g, g + groups, ... one after another; their rows of dscale,
// dshift (and dgate) are independent. One group loops over every sample in one block: at 42 segments
// that is 42 latency-bound rounds, 67-86 us on an H200 against 7-12 us for one (Nsight Compute,
// benchmarks/KERNEL_NOTES.md). With more than one group, the dweight / dbias totals (sums over the
// samples) come from each group's partials, summed in group order by reduce_totals_kernel: a fixed
// order, so still no atomics and the same bits every run.
constexpr int kReduceGroups = 64;
// The rows of per-sample sums a backward's final column reduction forms (BwdArgs, ResBwdArgs): one
// per segment in the segmented layout, else one per sample.
template <typename Args>
__host__ __device__ __forceinline__ int64_t column_samples(const Args& a) {
  return a.seg.on() ? a.seg.count : a.B;
}
template <typename Args>
int reduce_groups(const Args& a) {
  const int64_t samples = column_samples(a);
  return static_cast<int>(samples < 1 ? 1 : samples < kReduceGroups ? samples : kReduceGroups);
}
// Floats of the groups' totals partials ([groups, 2, D]) a backward needs: none with one group or
// neither dweight nor dbias wanted. (Called by the host once `a`'s segments, B, D and gradient
// pointers are set, so that the launch's reduce_groups(a) is the same count.)
template <typename Args>
int64_t totals_floats(const Args& a) {
  const int groups = reduce_groups(a);
  return groups > 1 && (a.dweight || a.dbias) ? static_cast<int64_t>(groups) * 2 * a.D : 0;
}
// The end of a final column reduction, thread of column d (< D) holding its group's totals: written
// as dweight / dbias with one group, else as the group's partials.
__device__ __forceinline__ void store_totals(float* totals, float* dweight, float* dbias, int D, int d, float dw,
                                             float db) {
  if (gridDim.y == 1) {
    if (dweight) dweight[d] = dw;
    if (dbias) dbias[d] = db;
  } else if (dweight || dbias) {
    totals[2 * blockIdx.y * static_cast<int64_t>(D) + d] = dw;
    totals[(2 * blockIdx.y + 1) * static_cast<int64_t>(D) + d] = db;
  }
}
// dweight / dbias from the partials of `groups` groups (store_totals), summed in group order; nothing
// launched with one group or neither total wanted.
void launch_reduce_totals(const float* totals, int groups, int D, float* dweight, float* dbias, cudaStream_t stream);

// Segments a pass of the segmented column kernels (ids out of order): their accumulators in shared
// memory, 2 or 3 planes x kSegColSegments x 32 floats (the residual's 48 KB, the static limit).
constexpr int kSegColSegments = 128;
// Ids in any other order: the segmented column kernel leaves segment s's sums in piece s.
__device__ __forceinline__ bool ids_sorted(const Segments& s) { return s.start[s.count + 1] == 0; }
__device__ __forceinline__ Pieces column_pieces(int64_t b, int64_t tiles, int64_t B, const Segments& seg,
                                                int64_t rows_per_tile) {
  if (!seg.on()) return {b, tiles, B};
  if (!ids_sorted(seg)) return {b, 1, 1};
  const int64_t r0 = seg.start[b], r1 = seg.start[b + 1];
  if (r0 >= r1) return {0, 0, 1};  // a segment without rows: zeros
  const int64_t t0 = r0 / rows_per_tile, t1 = (r1 - 1) / rows_per_tile;
  return {t0 + b, t1 - t0 + 1, 1};
}

// The final column reduction's sum for one sample (or segment), in a (32, 16) block: thread (tx, ty)
// sums pieces ty, ty + 16, ... of `p` in column d of each plane k that `use` marks (`plane` floats
// apart), then every thread adds the 16 partial sums in a fixed order into s[k] (0 for unmarked
// planes, d >= D and no pieces). Every thread of the block must call it (two barriers; `part` is free
// again when it returns). Deterministic: no atomics.
template <int NP>
__device__ __forceinline__ void tile_column_sums(const float* __restrict__ ws, int64_t plane, Pieces p, int D, int d,
                                                 const bool (&use)[NP], float (&part)[NP][16][33], float (&s)[NP]) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  float q[NP];
#pragma unroll
  for (int k = 0; k < NP; ++k) q[k] = 0.f;
  if (d < D) {
    for (int64_t i = ty; i < p.count; i += 16) {
      const float* w = ws + (p.first + i * p.stride) * D + d;
#pragma unroll
      for (int k = 0; k < NP; ++k)
        if (use[k]) q[k] += w[k * plane];
    }
  }
#pragma unroll
  for (int k = 0; k < NP; ++k) part[k][ty][tx] = q[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < NP; ++k) {
    s[k] = 0.f;
    for (int i = 0; i < 16; ++i) s[k] += part[k][i][tx];
  }
  __syncthreads();
}

// Dynamic shared memory of `arrays` coefficient rows for a block of rs.threads threads.
inline size_t coef_smem_bytes(int arrays, int chunks, int threads, DType xt) {
  const int vec = xt == DType::F32 ? 4 : 8;
  return static_cast<size_t>(arrays) * chunks * vec * threads * sizeof(float);
}

// Call f(tag) with tag's `type` the C++ element type of d.
struct F32Tag { using type = float; };
struct BF16Tag { using type = __nv_bfloat16; };
struct F16Tag { using type = __half; };

}  // namespace adaln
