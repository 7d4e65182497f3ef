// Forward kernel of the residual norm-site ops (template on the norm and r's dtype Tr; instantiated in
// residual_forward_<dtype>.cu): one launch reads x, y (and gate, modulation) once and writes r, out
// and the per-row statistics.
//
// Grid: B * tiles blocks, one wave (blocks per SM from the occupancy calculator); block i of a
// sample takes rows i, i + tiles, i + 2 tiles, ... (the interleaved order of the norm -> modulate
// forward, without its short blocks after the wave); in a pack (Segments::consecutive), a tile of
// consecutive rows, so that a block crosses one or two segment boundaries instead of every one. A
// per-sample or shared gate, scale and shift are read once per block into per-column coefficients in
// shared memory:
//     alpha = w * (1 + scale),  beta = b * (1 + scale) + shift,  g = gate (1 without a gate);
// per-token rows are read with their row (through the staging ring where it runs and they have r's
// dtype: res_fwd_staged_rows). Per row:
//     r = round_Tr(x + g * y)          (fp32 multiply, then add: no FMA, as eager and Inductor round)
//     mean, rstd of r as rounded (two block sums, fp32; RMSNorm: one, the mean of squares)
//     out = (r - mean) * rstd * alpha + beta   (a per-token scale multiplies alpha and beta, a per-token
//                                               shift adds to beta; then rounded once to out's dtype)
// A block of T threads covers a row; thread t owns the groups of 8 elements t, t + T, ... (C of them):
// r stays in registers in fp32 between the reductions. x and y come through the per-thread staging
// ring (STG: typed, aligned rows, sm_80+; RowStage), a.stages rows ahead; else the next row's x and
// y are loaded raw into registers while this row is reduced (up to kResPrefetchChunks chunks). x, y
// and out are read and written as IO says: TypedRows<Tr> when all three have r's dtype (raw rows in
// Tr), else AnyRows (each in its own dtype, twice the registers for a 16-bit raw row).
#pragma once

#include <map>
#include <mutex>
#include <tuple>

#include "residual_norm_modulate/residual.cuh"

namespace adaln {

// Row n of sample b of modulation m: its element pointer (a per-sample row ignores n, a shared one b).
__device__ __forceinline__ const void* mod_row(const ModView& m, int64_t b, int64_t n) {
  return elem_ptr(m.ptr, m.t, b * m.sb + n * m.sn);
}

// The forward's body (the kernels below): block blockIdx.x's rows of `a`.
template <Norm N, typename Tr, int C, bool PT, typename IO, bool STG, bool SEG>
__device__ __forceinline__ void res_fwd_rows(const ResFwdArgs& a, int64_t tiles) {
  static_assert(!SEG || (STG && !PT), "the segmented layout takes the staged kernel with per-sample rows");
  constexpr bool RMS = N == Norm::RMS;
  constexpr int VEC = kResVec;
  constexpr bool kPrefetch = C <= kResPrefetchChunks && !STG;
  __shared__ float red[2 * 1 * 32];
  int parity = 0;
  const int64_t b = blockIdx.x / tiles, t = blockIdx.x % tiles;
  if (t >= a.N) return;  // whole block: no barrier is skipped by part of it
  // the block's k-th row is first + k * step: interleaved, or (a pack, Segments::consecutive) a tile
  // of consecutive rows
  int64_t first = t, step = tiles, count = (a.N - 1 - t) / tiles + 1;
  if constexpr (SEG) {
    if (a.seg.consecutive) {
      const int64_t rows = (a.N + tiles - 1) / tiles;
      first = t * rows;
      step = 1;
      count = min(rows, a.N - first);
      if (count <= 0) return;
    }
  }
  const int D = a.D, T = blockDim.x, tid = threadIdx.x;
  const bool al = a.aligned;
  // per-token rows, read with each row (PT only): a shift row also when scale is per-token, since the
  // shift cannot then be folded into beta
  const bool g_row = PT && a.gate.per_token();
  const bool s_row = PT && a.scale.per_token();
  const bool h_row = PT && a.shift.ptr && (a.shift.sn != 0 || s_row);

  extern __shared__ float4 coef_smem[];
  const int arr = C * (VEC / 4) * T;
  const CoefRow<VEC> alpha{coef_smem}, beta{coef_smem + arr}, gco{coef_smem + 2 * arr};
  // Chunk c of the coefficients of modulation row m (sample b, or the segment), into the rows above.
  auto coef_chunk = [&](int c, int64_t m) {
    const int col = (c * T + tid) * VEC;
    float w[VEC], bb[VEC], s[VEC], h[VEC], g[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f, bb[j] = 0.f, s[j] = 0.f, h[j] = 0.f, g[j] = 1.f;
    if (col < D) {
      if (a.weight) load_f<float, VEC>(a.weight, col, D, al, w);
      if (a.bias) load_f<float, VEC>(a.bias, col, D, al, bb);
      if (a.scale.ptr && !s_row) load_any_f<VEC>(mod_row(a.scale, m, 0), a.scale.t, col, D, al, s);
      if (a.shift.ptr && !h_row) load_any_f<VEC>(mod_row(a.shift, m, 0), a.shift.t, col, D, al, h);
      if (a.gate.ptr && !g_row) load_any_f<VEC>(mod_row(a.gate, m, 0), a.gate.t, col, D, al, g);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      w[j] = w[j] * (1.f + s[j]);
      bb[j] = bb[j] * (1.f + s[j]) + h[j];
    }
    alpha.store(c, w);
    beta.store(c, bb);
    gco.store(c, g);
  };
  // Segmented layout (SEG; B = 1): the current row's segment; where it changes each thread
  // recomputes its own columns (no barrier), at the top of the row; the next row's is read a row ahead
  int64_t seg_cur = SEG ? seg_of(a.seg, first) : b, seg_next = seg_cur;
#pragma unroll
  for (int c = 0; c < C; ++c) coef_chunk(c, seg_cur);

  const float inv_d = 1.f / static_cast<float>(D);
  using RawIO = typename IO::template RawT<VEC>;
  RawIO nx[C], ny[C];  // the next row's x and y, raw (kPrefetch)
  auto load_xy = [&](int64_t n, RawIO(&xs)[C], RawIO(&ys)[C]) {
    const int64_t off = (b * a.N + n) * static_cast<int64_t>(D);
    IO::template load<VEC, C>(IO::at(a.x, a.xt, off), a.xt, D, T, tid, al, xs);
    IO::template load<VEC, C>(IO::at(a.y, a.yt, off), a.yt, D, T, tid, al, ys);
  };
  if constexpr (kPrefetch) load_xy(first, nx, ny);
  // the staging ring (STG) after the coefficient rows: x in tensor 0, y in 1 of each slot, then (PT)
  // the per-token rows of r's dtype (res_fwd_staged_rows: gate, scale, shift in this order)
  const ResFwdStagedRows st = PT && STG ? res_fwd_staged_rows(a, dtype_of<Tr>()) : ResFwdStagedRows{};
  const int gi = 2, si = gi + st.gate, hi = si + st.scale;
  const RowStage<Tr, PT ? 0 : 2, C> stage{reinterpret_cast<uint4*>(coef_smem + 3 * arr), T, tid, 2 + st.count()};
  const int S = STG ? a.stages : 1;
  auto stage_row = [&](int64_t k, int slot) {  // the block's k-th row
    const int64_t n = first + k * step, o = (b * a.N + n) * static_cast<int64_t>(D);
    stage.copy(slot, 0, static_cast<const Tr*>(a.x) + o, D);
    stage.copy(slot, 1, static_cast<const Tr*>(a.y) + o, D);
    if constexpr (PT) {
      if (st.gate) stage.copy(slot, gi, static_cast<const Tr*>(mod_row(a.gate, b, n)), D);
      if (st.scale) stage.copy(slot, si, static_cast<const Tr*>(mod_row(a.scale, b, n)), D);
      if (st.shift) stage.copy(slot, hi, static_cast<const Tr*>(mod_row(a.shift, b, n)), D);
    }
  };
  // Group c of a per-token row: from ring tensor i of slot `cur` where staged, else loaded at use.
  auto mod_chunk = [&](bool staged, int i, int cur, const ModView& m, int64_t n, int c, int col, float(&v)[VEC]) {
    if constexpr (PT && STG) {
      if (staged) {
        Raw<Tr, VEC> raw;
        stage.read_chunk(cur, i, c, raw);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = to_f<Tr>(raw.v[j]);
        return;
      }
    }
    load_any_f<VEC>(mod_row(m, b, n), m.t, col, D, al, v);
  };
  if constexpr (STG) {
    for (int i = 0; i < S - 1; ++i) {
      if (i < count) stage_row(i, i);
      cp_async_commit();
    }
  }
  int slot = 0;  // the k-th row's slot (STG)

  for (int64_t k = 0; k < count; ++k) {
    const int64_t n = first + k * step;
    const int64_t off = (b * a.N + n) * static_cast<int64_t>(D);
    if constexpr (SEG) {
      const int64_t m = seg_next;
      if (k + 1 < count) seg_next = seg_of(a.seg, n + step);
      if (m != seg_cur) {
#pragma unroll
        for (int c = 0; c < C; ++c) coef_chunk(c, m);
        seg_cur = m;
      }
    }
    RawIO cx[C], cy[C];
    const int cur = slot;  // the k-th row's slot (STG), read after the slot index moves on
    if constexpr (STG) {
      // row k + S - 1 into the slot row k - 1 left (this thread read it in the previous iteration)
      if (k + S - 1 < count) stage_row(k + S - 1, slot == 0 ? S - 1 : slot - 1);
      cp_async_commit();
      cp_async_wait(S - 1);
      stage.read(slot, 0, cx);
      stage.read(slot, 1, cy);
      slot = slot + 1 == S ? 0 : slot + 1;
    } else if constexpr (kPrefetch) {
#pragma unroll
      for (int c = 0; c < C; ++c) cx[c] = nx[c], cy[c] = ny[c];
      if (k + 1 < count) load_xy(n + step, nx, ny);  // in flight while this row is reduced
    } else {
      load_xy(n, cx, cy);
    }

    // r = x + g * y in fp32, rounded once to Tr; the norm reads r as rounded (zeros past D)
    float rv[C][VEC];
    Tr* rrow = static_cast<Tr*>(a.r) + off;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      float xf[VEC], yf[VEC], gf[VEC];
      IO::template to_f<VEC>(cx[c], a.xt, xf);
      IO::template to_f<VEC>(cy[c], a.yt, yf);
      gco.load(c, gf);
      if (g_row && col < D) mod_chunk(st.gate, gi, cur, a.gate, n, c, col, gf);
#pragma unroll
      for (int j = 0; j < VEC; ++j) rv[c][j] = to_f<Tr>(from_f<Tr>(__fadd_rn(xf[j], __fmul_rn(gf[j], yf[j]))));
      if (col < D) store_f<Tr, VEC>(rrow, col, D, al, rv[c]);
    }

    float mean = 0.f;  // (RMSNorm: none)
    if constexpr (!RMS) {
      float sum[1] = {0.f};
#pragma unroll
      for (int c = 0; c < C; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum[0] += rv[c][j];  // zero past D
      block_sum<1>(sum, red, parity);
      mean = sum[0] * inv_d;
    }
    float sq[1] = {0.f};
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float dlt = (RMS || col + j < D) ? rv[c][j] - mean : 0.f;  // (RMSNorm: zero past D)
        sq[0] += dlt * dlt;
      }
    }
    block_sum<1>(sq, red, parity);
    const float rstd = rsqrtf(sq[0] * inv_d + a.eps);

    void* orow = IO::at(a.out, a.ot, off);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      if (col >= D) continue;
      float av[VEC], bv[VEC], sv[VEC], hv[VEC], o[VEC];
      alpha.load(c, av);
      beta.load(c, bv);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sv[j] = 0.f, hv[j] = 0.f;
      if (s_row) mod_chunk(st.scale, si, cur, a.scale, n, c, col, sv);
      if (h_row) mod_chunk(st.shift, hi, cur, a.shift, n, c, col, hv);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float al_ = av[j], be_ = bv[j];
        if (s_row) {
          const float s1 = 1.f + sv[j];
          al_ *= s1;
          be_ *= s1;
        }
        if (h_row) be_ += hv[j];
        o[j] = (rv[c][j] - mean) * rstd * al_ + be_;
      }
      IO::template store<VEC>(orow, a.ot, col, D, al, o);
    }
    if (tid == 0) {
      if constexpr (!RMS) a.mean[b * a.N + n] = mean;
      a.rstd[b * a.N + n] = rstd;
    }
  }
}

template <Norm N, typename Tr, int C, bool PT, typename IO, bool STG = false, bool SEG = false>
__global__ void __launch_bounds__(kMaxThreads) res_fwd_kernel(const ResFwdArgs a, int64_t tiles) {
  res_fwd_rows<N, Tr, C, PT, IO, STG, SEG>(a, tiles);
}

// The segmented layout at one chunk a thread (rows up to 8 * kMaxThreads elements): the staged kernel with
// per-sample rows, its registers capped at 80, where the segment reload inside the row loop had raised
// them from the per-sample kernel's 63 to 89 (ptxas, sm_90; no spills at 80). At D = 3072 (384 threads
// a block) 89 left one block a SM, 80 fits two as the per-sample kernel does (Nsight Compute: 132
// against 264 blocks, 58% against 77% of DRAM bandwidth; benchmarks/KERNEL_NOTES.md). Its own kernel,
// so that the cap does not touch the other instances' code.
// (__maxnreg__ came with CUDA 12.4; older compilers build the kernel uncapped.)
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define ADALN_SEG1_REGS __maxnreg__(80)
#else
#define ADALN_SEG1_REGS __launch_bounds__(kMaxThreads)
#endif
template <Norm N, typename Tr>
__global__ void ADALN_SEG1_REGS res_fwd_seg1_kernel(const ResFwdArgs a, int64_t tiles) {
  res_fwd_rows<N, Tr, 1, false, TypedRows<Tr>, true, true>(a, tiles);
}

// Shared memory of the forward's coefficient rows (alpha, beta, gate) for a block of rs, then `stages`
// slots of its staging ring of `slot_bytes` each.
inline size_t res_fwd_smem(RowShape rs, int stages = 0, size_t slot_bytes = 0) {
  return static_cast<size_t>(3) * rs.chunks * kResVec * rs.threads * sizeof(float) + stages * slot_bytes;
}

// Automatic slots of the forward's staging ring with per-sample or shared rows. Measured on one H200
// (bf16, N = 65536, B = 1; benchmarks/results/residual_h200_fwd_occupancy.md and
// residual_h200_wide_stages.md): Wan's gated site 88.9 / 90.1 / 91.5 / 88.8 / 91.3% of speed-of-light
// at D = 1536 / 2048 / 3072 / 4096 / 5120 with 2 slots, against 84.8 / 85.0 / 87.6 / 87.3 / 91.2%
// with the slots for 48 KB of rows (8 / 6 / 4 / 3 / 2); the plain residual with an affine norm 85.6 /
// 88.0 / 89.6 / 87.8% against 82.3 / 82.2 / 85.7 / 86.0% (D = 1536-4096).
constexpr int kResFwdStages = 2;

// Warps a SM of the staged per-token kernel in shape rs with its automatic slots (staged_rows row
// tensors a slot): the blocks its registers and shared memory allow, times its warps a block.
template <Norm N, typename Tr, int C>
int res_fwd_per_token_warps(RowShape rs, int staged_rows) {
  const void* k = reinterpret_cast<const void*>(res_fwd_kernel<N, Tr, C, true, TypedRows<Tr>, true>);
  const size_t slot = res_stage_slot_bytes(staged_rows, rs.chunks, rs.threads, sizeof(Tr));
  int stages = ring_stages(-1, true, res_fwd_smem(rs), slot, kResStageBytes, k, 80);
  if (stages > 0) stages = stages_keeping_occupancy(k, rs.threads, res_fwd_smem(rs), slot, stages);
  return blocks_per_sm(k, rs.threads, res_fwd_smem(rs, stages, slot)) * (rs.threads / 32);
}

// The automatic shape of the per-token kernel with typed rows (staged_rows row tensors a ring slot):
// two chunks a thread on half the threads where the row has 192 groups of kResVec or more (D >= 1536)
// and that keeps at least as many warps a SM as res_row_shape's one chunk, else res_row_shape's.
// Measured on one H200 (bf16, N = 65536, forced shapes; benchmarks/KERNEL_NOTES.md): a per-token
// gate at D = 1536 / 2048 / 3072 / 4096 read 90 / 92 / 94 / 91% of speed-of-light with two chunks,
// 72 / 82 / 68 / 80% with one; gate, scale and shift per token at D = 4096, where two chunks' larger
// slots leave one 8-warp block a SM against one chunk's 16 warps, 87% against 95% (four chunks at
// D = 5120: 56% against two's 79%).
// Chosen once per (D, staged_rows, device): the occupancy queries behind it take about ten cached
// lookups, each under a lock.
template <Norm N, typename Tr>
RowShape res_fwd_per_token_shape(int D, int staged_rows) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, RowShape> chosen;
  int dev = 0;
  cudaGetDevice(&dev);
  const auto key = std::make_tuple(D, staged_rows, dev);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = chosen.find(key);
    if (it != chosen.end()) return it->second;
  }
  RowShape shape = res_row_shape(D, 0);
  const int groups = (D + kResVec - 1) / kResVec;
  if (shape.chunks == 1 && groups >= 192) {
    const RowShape two = res_row_shape(D, (groups / 2 + 31) / 32 * 32);
    if (two.chunks == 2 && res_fwd_per_token_warps<N, Tr, 2>(two, staged_rows) >=
                               res_fwd_per_token_warps<N, Tr, 1>(shape, staged_rows))
      shape = two;
  }
  std::lock_guard<std::mutex> lock(mu);
  chosen[key] = shape;
  return shape;
}

template <Norm N, typename Tr>
bool res_forward(const ResFwdArgs& a0, cudaStream_t stream) {
  ResFwdArgs a = a0;
  const bool pt = a.gate.per_token() || a.scale.per_token() || a.shift.per_token();
  // x, y and out of r's dtype (the common case): their rows raw in Tr; else each in its own dtype
  const bool typed = a.xt == dtype_of<Tr>() && a.yt == dtype_of<Tr>() && a.ot == dtype_of<Tr>();
  // x, y and (per-token kernel) the per-token rows of r's dtype
  const int staged_rows = 2 + (pt ? res_fwd_staged_rows(a, dtype_of<Tr>()).count() : 0);
  const RowShape rs = pt && typed && !a.seg.on() && a.max_threads <= 0 ? res_fwd_per_token_shape<N, Tr>(a.D, staged_rows)
                                                                        : res_row_shape(a.D, a.max_threads);
  const size_t slot = res_stage_slot_bytes(staged_rows, rs.chunks, rs.threads, sizeof(Tr));
  auto go = [&](auto kernel) {
    const size_t smem = res_fwd_smem(rs, a.stages, slot);
    int64_t tiles, rows_per_tile;  // (the interleaved order needs only the tile count)
    one_wave(kernel, rs.threads, smem, a.B, a.N, /*interleaved=*/true, tiles, rows_per_tile);
    kernel<<<static_cast<unsigned>(a.B * tiles), rs.threads, smem, stream>>>(a, tiles);
  };
  // the staging ring where the rows are aligned (a.stages: the request, resolved here). Automatic:
  // - per-sample or shared rows: kResFwdStages slots;
  // - per-token rows and the segmented layout: slots for ~kResStageBytes of rows, fewer where more
  //   would take away blocks a SM that the kernel's registers allow (at D = 1536, bf16, 192 threads,
  //   the segmented kernel's 80 registers fit 4 blocks a SM, 8 slots left 3: 75% of speed-of-light
  //   against 83% with 6; benchmarks/results/seg_probe_h200.txt).
  const bool by_occupancy = pt || a.seg.on();
  auto staged = [&](auto kernel) {
    const void* k = reinterpret_cast<const void*>(kernel);
    const int requested = a0.stages < 0 && !by_occupancy ? kResFwdStages : a0.stages;
    a.stages = ring_stages(requested, a.aligned, res_fwd_smem(rs), slot, kResStageBytes, k, 80);
    if (a0.stages < 0 && by_occupancy)
      a.stages = stages_keeping_occupancy(k, rs.threads, res_fwd_smem(rs), slot, a.stages);
    if (a.stages > 0) go(kernel);
    return a.stages > 0;
  };
  bool ran = true;
  with_chunk_count<kResMaxChunks>(rs.chunks, [&](auto chunks) {
    constexpr int kC = decltype(chunks)::value;
    using IO = TypedRows<Tr>;
    if (a.seg.on()) {  // the segmented layout: the staged kernel only (else not taken)
      if constexpr (kC == 1) ran = typed && !pt && staged(res_fwd_seg1_kernel<N, Tr>);
      else ran = typed && !pt && staged(res_fwd_kernel<N, Tr, kC, false, IO, true, true>);
    } else if (typed) {
      if (pt) {
        if (!staged(res_fwd_kernel<N, Tr, kC, true, IO, true>)) go(res_fwd_kernel<N, Tr, kC, true, IO>);
      } else {
        if (!staged(res_fwd_kernel<N, Tr, kC, false, IO, true>)) go(res_fwd_kernel<N, Tr, kC, false, IO>);
      }
    } else {
      a.stages = 0;
      if (pt) go(res_fwd_kernel<N, Tr, kC, true, AnyRows>);
      else go(res_fwd_kernel<N, Tr, kC, false, AnyRows>);
    }
  });
  return ran;
}

}  // namespace adaln
