// Backward kernels of the residual norm-site ops (templates on the norm and r's dtype Tr; instantiated
// in residual_adaln_backward_<dtype>.cu and residual_rms_norm_backward_<dtype>.cu).
//
// Per element (r_hat = (r - mean) * rstd, RMSNorm: mean = 0 and no bias; s1 = 1 + a per-token scale,
// else 1; cf = w * (1 + scale_b) for a per-sample or shared scale, else w; g = dout * s1 * cf):
//   dr_norm  = rstd * (g - mean_D(g) - r_hat * mean_D(g * r_hat))      (RMSNorm: without mean_D(g))
//   dr_total = dr_norm + dr  (fp32; dr absent: dr_norm);   dx = dr_total in dx's dtype
//   dy = gate * dr_total in y's dtype;   dgate = y * dr_total (per element for a per-token gate)
//   per-token scale: dscale = dout * (r_hat * w + b);  per-token shift: dshift = dout (per element)
// and per column, summed over a tile's rows into the [kResPlanes, tiles, B, D] workspace:
//   P0 = sum dout * s1 * r_hat,  P1 = sum dout * s1,  P2 = sum dout,  P3 = sum y * dr_total,
// from which the final reduction (res_reduce_kernel) forms, per sample b (f_b = 1 + scale_b for a
// per-sample or shared scale, else 1):
//   dscale_b = w * P0 + b * P1,  dshift_b = P1 (per-token scale: P2),  dgate_b = P3,
//   dweight = sum_b f_b * P0,  dbias = sum_b f_b * P1.
// No atomics: every sum has a fixed order, so two runs give bit-identical gradients.
//
// One pass (rows up to kResOnePassChunks chunks a thread): a block owns a tile of consecutive rows of
// one sample (one wave of blocks, as the norm -> modulate backward); a row stays in registers across
// its block reduction (the two row sums need all of D), and the column partials accumulate in
// registers, written once per block. dr and y are issued before the reduction at one chunk a thread,
// after it at more (fewer registers held across the barrier); a per-token gate row after it. dout,
// dr, y, dx and dy are read and written as IO says (TypedRows<Tr> when all have r's dtype, else
// AnyRows). STG (typed, aligned rows, sm_80+): r, dout, dr, y and a per-token gate of r's dtype come
// through the per-thread staging ring (RowStage; res_bwd_staged), a.stages rows ahead, and dr, y and
// the gate are read from it after the reduction at any chunk count; else each row is loaded when its
// turn comes (a per-token gate of another dtype too).
// Segmented layout (SEG, the staged one-pass kernel with per-sample rows; ResBwdArgs::seg, Segments):
// a pack as one sequence, the gate and modulation rows per segment. With ids that never decrease, a
// tile is cut where the segment changes and each part's partials go to their own workspace piece
// (piece_of); res_reduce_kernel sums each segment's pieces. With ids in any other order (flagged on
// the device) the row kernel saves its row sums and res_seg_col_kernel sums each segment's rows in
// row order, recomputing dr_total from them.
// Two kernels (wider rows, or BwdArgs-style forced by Tuning::two_kernel): the row kernel computes dx
// and the per-element gradients and saves the two row sums; res_bwd_col_kernel then recomputes
// dr_total per element from dout, r, dr, y and the saved sums for the partials.
#pragma once

#include "residual_norm_modulate/residual_forward.cuh"

namespace adaln {

// dr_total of one element: the same rounding steps in both kernels (no FMA contraction), so the two
// designs' dx and partials see the same value.
__device__ __forceinline__ float res_dr_total(float g, float xh, float rstd, float mg, float mgx, float dr) {
  return __fadd_rn(__fmul_rn(rstd, __fsub_rn(__fsub_rn(g, mg), __fmul_rn(xh, mgx))), dr);
}

// The row tensors of the backward's staging ring, in slot order (room for all four in every slot).
enum ResBwdStaged : int { kStR = 0, kStDout = 1, kStDr = 2, kStY = 3, kStCount = 4 };
// How a staged row kernel instance takes the per-token gate and scale (its template argument G): Any,
// whatever the call has (a per-sample, shared or per-token gate, or none, decided at run time; per-token
// rows loaded at use); Staged, the per-token gate and scale rows of res_bwd_extra_rows through a ring of
// their own; None, a plain residual (no gate, no y, no per-token scale), with that code compiled out: the
// plain one-chunk kernel took 104 registers with it (the run-time per-token load path) against 70 for
// the Staged instance (ptxas sm_90).
enum class ResBwdGate : int { Any, Staged, None };
// The per-token rows a slot of the Staged instances' own ring takes (after the row tensors' slots): 1,
// a per-token gate's; 2, with a per-token scale and no column sums, the gate's (room kept where the call
// has no gate) and the scale's; 0, none staged: a per-token gate or scale not of r's dtype (tr), or a
// per-token scale with column sums. Rows not staged are loaded at use (the Any instances): the gate
// after the row's reduction, the scale before it.
__host__ __device__ inline int res_bwd_extra_rows(const ResBwdArgs& a, DType tr) {
  const bool gpt = a.gate.per_token(), spt = a.scale.per_token();
  if ((gpt && a.gate.t != tr) || (spt && (a.scale.t != tr || a.columns()))) return 0;
  return spt ? 2 : gpt ? 1 : 0;
}
// Whether a staged row kernel takes the None instance: no gate, no per-token scale.
__host__ __device__ inline bool res_bwd_gate_none(const ResBwdArgs& a) {
  return a.gate.ptr == nullptr && !a.scale.per_token();
}
// Whether the row kernel can stage a's rows (typed, aligned rows; the staged instances of
// res_bwd_row_kernel_for): the one-pass kernel with column sums, or, without any, where the per-token
// rows are all staged or there are none.
__host__ __device__ inline bool res_bwd_stageable(const ResBwdArgs& a, DType tr, int chunks) {
  if (a.columns()) return !a.two_kernel;
  return chunks <= kResOnePassChunks && (res_bwd_extra_rows(a, tr) > 0 || res_bwd_gate_none(a));
}
// The rows a slot of the staging ring takes: the four row tensors (room for dr and y kept where a call
// has none: a plain residual's backward read 1-3 points of speed-of-light slower with 3-row slots,
// benchmarks/KERNEL_NOTES.md), and the staged per-token rows.
__host__ __device__ inline int res_bwd_staged(const ResBwdArgs& a, DType tr) {
  return kStCount + res_bwd_extra_rows(a, tr);
}

// The row kernels' body (res_bwd_row_kernel, and res_bwd_wide_kernel below, which differ only in their
// launch bound).
template <Norm N, typename Tr, int C, typename IO, bool SPT, bool ACC, bool P3, bool STG, bool SEG, ResBwdGate G>
__device__ __forceinline__ void res_bwd_rows(const ResBwdArgs& a) {
  constexpr bool GST = G == ResBwdGate::Staged, NOG = G == ResBwdGate::None;
  static_assert(!SEG || (STG && !SPT && ACC), "the segmented layout takes the staged one-pass kernel, per-sample rows");
  static_assert(G == ResBwdGate::Any || (STG && !SEG && !P3 && !(SPT && ACC)),
                "the Staged and None instances are staged kernels without a dgate plane (a per-token scale: without column sums)");
  constexpr bool RMS = N == Norm::RMS;
  constexpr int NS = RMS ? 1 : 2;  // row sums: [sum g,] sum g * r_hat
  constexpr int VEC = kResVec;
  constexpr bool kEarly = C == 1 && !STG;  // dr and y loaded before the row's reduction (else after it)
  using RawIO = typename IO::template RawT<VEC>;
  __shared__ float red[2 * 2 * 32];
  int parity = 0;
  const int64_t b = blockIdx.x / a.tiles, tile = blockIdx.x % a.tiles;
  const int64_t n0 = tile * a.rows_per_tile;
  const int64_t n1 = min(a.N, n0 + a.rows_per_tile);
  if (n0 >= n1) return;
  const int D = a.D, T = blockDim.x, tid = threadIdx.x;
  const bool al = a.aligned;
  const bool has_gate = !NOG && a.gate.ptr != nullptr;
  const bool gpt = has_gate && a.gate.sn != 0;  // per-token gate
  const bool p2 = SPT && a.dshift_rows != nullptr;
  const Tr* __restrict__ rp = static_cast<const Tr*>(a.r);

  // per-column coefficients in shared memory: cf (w * (1 + scale_b), or w with a per-token scale or
  // none), the bias (a per-token scale's dscale) and a per-sample or shared gate
  extern __shared__ float4 coef_smem[];
  const int arr = C * (VEC / 4) * T;
  const CoefRow<VEC> coef{coef_smem}, bias_row{coef_smem + arr}, gate_row{coef_smem + 2 * arr};
  float p0[C][VEC], p1[C][VEC], p2s[C][VEC], p3[C][VEC];
  // Chunk c of cf and the gate row for modulation row m (sample b, or the segment)
  auto coef_chunk = [&](int c, int64_t m) {
    const int col = (c * T + tid) * VEC;
    float w[VEC], s[VEC], g[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f, s[j] = 0.f, g[j] = 0.f;
    if (col < D) {
      if (a.weight) load_f<float, VEC>(a.weight, col, D, al, w);
      if (!SPT && a.scale.ptr) load_any_f<VEC>(mod_row(a.scale, m, 0), a.scale.t, col, D, al, s);
      if (has_gate && !gpt) load_any_f<VEC>(mod_row(a.gate, m, 0), a.gate.t, col, D, al, g);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] *= 1.f + s[j];
    coef.store(c, w);
    gate_row.store(c, g);
  };
  // chunk c's partials into a workspace piece (norm_modulate.cuh: Pieces), then zeros
  const int64_t plane = a.pieces * D;
  auto flush = [&](int c, int64_t piece) {
    const int col = (c * T + tid) * VEC;
    if (col >= D) return;
    float* ws = a.ws + piece * static_cast<int64_t>(D);
    store_f<float, VEC>(ws, col, D, al, p0[c]);
    store_f<float, VEC>(ws + plane, col, D, al, p1[c]);
    if (p2) store_f<float, VEC>(ws + 2 * plane, col, D, al, p2s[c]);
    if constexpr (P3) store_f<float, VEC>(ws + 3 * plane, col, D, al, p3[c]);
  };
  // Segmented layout (SEG): a tile's rows are cut where the segment changes, each part's partials
  // flushed to piece tile + segment (ids in order; otherwise res_seg_col_kernel sums the segments
  // from the row sums saved below) and the coefficients recomputed, each thread its own columns
  const bool parts = !SEG || ids_sorted(a.seg);
  int64_t seg_cur = SEG ? seg_of(a.seg, n0) : b, seg_next = seg_cur;  // (the next row's, read a row ahead)
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int col = (c * T + tid) * VEC;
    float bb[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      bb[j] = 0.f;
      p0[c][j] = p1[c][j] = p2s[c][j] = p3[c][j] = 0.f;
    }
    if (col < D && a.bias) load_f<float, VEC>(a.bias, col, D, al, bb);
    bias_row.store(c, bb);
    coef_chunk(c, seg_cur);
  }

  // the staging ring (STG) after the coefficient rows: rows n0 .. n0 + S - 2 issued up front
  const int S = STG ? a.stages : 1;
  const RowStage<Tr, kStCount, C> stage{reinterpret_cast<uint4*>(coef_smem + 3 * arr), T, tid};
  // GST: the per-token gate's and (SPT) scale's rows, of r's dtype (res_bwd_extra_rows), in a ring of S
  // slots after the row tensors' S slots (instances of their own: the others keep their registers). A
  // gate there is per-token: without column sums a call has no other; with them, GST has no other.
  constexpr int kSlotWords = kStCount * C * RowStage<Tr, kStCount, C>::kWords;  // (a thread's 16-byte words a slot)
  const RowStage<Tr, SPT ? 2 : 1, C> ex_stage{reinterpret_cast<uint4*>(coef_smem + 3 * arr) + S * kSlotWords * T, T, tid};
  auto stage_row = [&](int64_t n, int slot) {
    const int64_t o = (b * a.N + n) * static_cast<int64_t>(D);
    stage.copy(slot, kStR, rp + o, D);
    stage.copy(slot, kStDout, static_cast<const Tr*>(a.dout) + o, D);
    if (a.dr) stage.copy(slot, kStDr, static_cast<const Tr*>(a.dr) + o, D);
    if (has_gate) stage.copy(slot, kStY, static_cast<const Tr*>(a.y) + o, D);
    if constexpr (GST) {
      if (has_gate) ex_stage.copy(slot, 0, static_cast<const Tr*>(mod_row(a.gate, b, n)), D);
      if constexpr (SPT) ex_stage.copy(slot, 1, static_cast<const Tr*>(mod_row(a.scale, b, n)), D);
    }
  };
  if constexpr (STG) {
    for (int i = 0; i < S - 1; ++i) {
      if (n0 + i < n1) stage_row(n0 + i, i);
      cp_async_commit();
    }
  }
  int slot = 0;  // row n's slot (STG)

  const float inv_d = 1.f / static_cast<float>(D);
  for (int64_t n = n0; n < n1; ++n) {
    if constexpr (SEG) {  // at the top of the row, where few registers are live
      const int64_t m = seg_next;
      if (n + 1 < n1) seg_next = seg_of(a.seg, n + 1);
      if (m != seg_cur) {  // the previous segment's part of the tile is complete
#pragma unroll
        for (int c = 0; c < C; ++c) {
          if (parts) flush(c, piece_of(tile, seg_cur, a.B, true));
#pragma unroll
          for (int j = 0; j < VEC; ++j) p0[c][j] = p1[c][j] = p3[c][j] = 0.f;
          coef_chunk(c, m);
        }
        seg_cur = m;
      }
    }
    const int64_t row = b * a.N + n;
    const int64_t off = row * static_cast<int64_t>(D);
    const float mean = RMS ? 0.f : a.mean[row], rstd = a.rstd[row];
    // this row, raw: r, dout, a per-token scale row (SPT); with kEarly also dr and y
    Raw<Tr, VEC> cr[C];
    RawIO cdo[C], cdr[C], cy[C];
    AnyRaw<VEC> cs[SPT && !GST ? C : 1];  // (GST: a per-token scale is read from its slot where used)
    if constexpr (STG) {
      // row n + S - 1 into the slot row n - 1 left (this thread read it in the previous iteration)
      if (n + S - 1 < n1) stage_row(n + S - 1, slot == 0 ? S - 1 : slot - 1);
      cp_async_commit();
      cp_async_wait(S - 1);
      stage.read(slot, kStR, cr);
      stage.read(slot, kStDout, cdo);
    } else {
      load_chunks(rp + off, D, T, tid, al, cr);
      IO::template load<VEC, C>(IO::at(a.dout, a.dot, off), a.dot, D, T, tid, al, cdo);
    }
    if constexpr (SPT && !GST) load_chunks_any<VEC, C>(mod_row(a.scale, b, n), a.scale.t, D, T, tid, al, cs);
    auto load_late = [&]() {  // what only the second half of the row needs
      if constexpr (STG) {
        if (a.dr) stage.read(slot, kStDr, cdr);
        if (has_gate) stage.read(slot, kStY, cy);
      } else {
        if (a.dr) IO::template load<VEC, C>(IO::at(a.dr, a.drt, off), a.drt, D, T, tid, al, cdr);
        if (has_gate) IO::template load<VEC, C>(IO::at(a.y, a.yt, off), a.yt, D, T, tid, al, cy);
      }
    };
    if constexpr (kEarly) load_late();
    // s1 = 1 + the per-token scale of element j of chunk c (SPT), else 1
    auto scale1 = [&](int c, float (&s1)[VEC]) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) s1[j] = 1.f;
      if constexpr (SPT && GST) {
        Raw<Tr, VEC> sraw;
        ex_stage.read_chunk(slot, 1, c, sraw);
#pragma unroll
        for (int j = 0; j < VEC; ++j) s1[j] = to_f<Tr>(sraw.v[j]) + 1.f;
      } else if constexpr (SPT) {
        any_to_f<VEC>(cs[c], a.scale.t, s1);
#pragma unroll
        for (int j = 0; j < VEC; ++j) s1[j] += 1.f;
      }
    };

    float sums[NS] = {};
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      float cf[VEC], dof[VEC], s1[VEC];
      coef.load(c, cf);
      IO::template to_f<VEC>(cdo[c], a.dot, dof);  // zero past D, so it masks every sum
      scale1(c, s1);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xh = (to_f<Tr>(cr[c].v[j]) - mean) * rstd;
        // __fmul_rn: the g recomputed after the barrier is bit-identical (see norm_modulate_backward.cuh)
        const float g = __fmul_rn(__fmul_rn(dof[j], s1[j]), cf[j]);
        if constexpr (!RMS) sums[0] += g;
        sums[NS - 1] += g * xh;
        if constexpr (ACC) {
          p0[c][j] += dof[j] * s1[j] * xh;
          p1[c][j] += dof[j] * s1[j];
          if (p2) p2s[c][j] += dof[j];
        }
      }
      // per-element gradients of per-token modulation need no row sum: stored before the barrier
      if (col < D) {
        if constexpr (SPT) {  // dscale = dout * (r_hat * w + b)  (cf = w here)
          float bb[VEC], ds[VEC];
          bias_row.load(c, bb);
#pragma unroll
          for (int j = 0; j < VEC; ++j) ds[j] = dof[j] * ((to_f<Tr>(cr[c].v[j]) - mean) * rstd * cf[j] + bb[j]);
          store_any<VEC>(elem_ptr(a.dscale_el, a.dscale_t, off), a.dscale_t, col, D, al, ds);
        }
        if (a.dshift_el) store_any<VEC>(elem_ptr(a.dshift_el, a.dshift_t, off), a.dshift_t, col, D, al, dof);
      }
    }
    block_sum<NS>(sums, red, parity);
    const float mg = RMS ? 0.f : sums[0] * inv_d, mgx = sums[NS - 1] * inv_d;
    if (a.rowsums && tid == 0) a.rowsums[2 * row] = mg, a.rowsums[2 * row + 1] = mgx;  // (two kernels)
    if constexpr (!kEarly) load_late();

#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      if (col >= D) continue;
      float cf[VEC], dof[VEC], s1[VEC], drf[VEC], tot[VEC];
      coef.load(c, cf);
      IO::template to_f<VEC>(cdo[c], a.dot, dof);
      scale1(c, s1);
#pragma unroll
      for (int j = 0; j < VEC; ++j) drf[j] = 0.f;
      if (a.dr) IO::template to_f<VEC>(cdr[c], a.drt, drf);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xh = (to_f<Tr>(cr[c].v[j]) - mean) * rstd;
        const float g = __fmul_rn(__fmul_rn(dof[j], s1[j]), cf[j]);
        tot[j] = res_dr_total(g, xh, rstd, mg, mgx, drf[j]);
      }
      IO::template store<VEC>(IO::at(a.dx, a.dxt, off), a.dxt, col, D, al, tot);
      if (has_gate) {
        float gv[VEC], yf[VEC], o[VEC];
        if constexpr (GST) {
          Raw<Tr, VEC> graw;
          ex_stage.read_chunk(slot, 0, c, graw);
#pragma unroll
          for (int j = 0; j < VEC; ++j) gv[j] = to_f<Tr>(graw.v[j]);
        } else if (gpt) {
          load_any_f<VEC>(mod_row(a.gate, b, n), a.gate.t, col, D, al, gv);
        } else {
          gate_row.load(c, gv);
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = __fmul_rn(gv[j], tot[j]);
        IO::template store<VEC>(IO::at(a.dy, a.yt, off), a.yt, col, D, al, o);
        IO::template to_f<VEC>(cy[c], a.yt, yf);  // (zero past D)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          o[j] = __fmul_rn(yf[j], tot[j]);
          if constexpr (P3) p3[c][j] += o[j];
        }
        if (gpt) store_any<VEC>(elem_ptr(a.dgate_el, a.dgate_t, off), a.dgate_t, col, D, al, o);
      }
    }
    if constexpr (STG) slot = slot + 1 == S ? 0 : slot + 1;
  }

  if constexpr (ACC) {
    if (parts) {
      const int64_t piece = piece_of(tile, seg_cur, a.B, SEG);  // (seg_cur: b outside the segmented layout)
#pragma unroll
      for (int c = 0; c < C; ++c) flush(c, piece);
    }
  }
}

template <Norm N, typename Tr, int C, typename IO, bool SPT, bool ACC, bool P3, bool STG = false, bool SEG = false,
          ResBwdGate G = ResBwdGate::Any>
__global__ void __launch_bounds__(kMaxThreads) res_bwd_row_kernel(const ResBwdArgs a) {
  res_bwd_rows<N, Tr, C, IO, SPT, ACC, P3, STG, SEG, G>(a);
}

// Rows of kMaxThreads * kResVec < D <= kResWideThreads * kResVec elements (D = 5120 in 16-bit or fp32):
// one chunk a thread on up to kResWideThreads threads instead of two chunks on kMaxThreads or fewer
// (res_bwd_wide_shape), for the staged one-pass kernel with typed per-sample rows. Two chunks keep 2 x
// 8 elements of each row tensor and of each partial-sum plane a thread: 128 registers (the cap of
// kMaxThreads) with spills, one 320-thread block (10 warps) a SM; one chunk on 640 threads is 20
// warps, its registers capped by this launch bound at 65536 / 640 (ptxas, sm_90: benchmarks/KERNEL_NOTES.md).
template <Norm N, typename Tr, bool P3, ResBwdGate G = ResBwdGate::Any>
__global__ void __launch_bounds__(kResWideThreads) res_bwd_wide_kernel(const ResBwdArgs a) {
  res_bwd_rows<N, Tr, 1, TypedRows<Tr>, false, true, P3, true, false, G>(a);
}

// Two-kernel design's column kernel: grid (ceil(D / 32), tiles, B), block (32, 8); thread (tx, ty)
// owns feature d = 32 * blockIdx.x + tx and rows n0 + ty, n0 + ty + 8, ... of its tile, recomputing
// each element's terms from dout, r, (dr, y, a per-token scale) and the row sums the row kernel saved;
// the 8 row groups are then summed in shared memory in a fixed order into the workspace.
template <Norm N, typename Tr>
__global__ void __launch_bounds__(256) res_bwd_col_kernel(const ResBwdArgs a) {
  __shared__ float part[kResPlanes][8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int d = blockIdx.x * 32 + tx;
  const int64_t tile = blockIdx.y, b = blockIdx.z;
  const int64_t n0 = tile * a.rows_per_tile, n1 = min(a.N, n0 + a.rows_per_tile);
  const bool spt = a.scale.per_token();
  const bool p3 = a.dgate_rows != nullptr;
  const Tr* __restrict__ rp = static_cast<const Tr*>(a.r);
  float q[kResPlanes] = {};
  if (d < a.D) {
    const float w = a.weight ? a.weight[d] : 1.f;
    const float cf = (a.scale.ptr && !spt) ? w * (1.f + load1(a.scale.ptr, a.scale.t, b * a.scale.sb + d)) : w;
    for (int64_t n = n0 + ty; n < n1; n += 8) {
      const int64_t row = b * a.N + n, i = row * a.D + d;
      const float mean = N == Norm::RMS ? 0.f : a.mean[row], rstd = a.rstd[row];
      const float xh = (to_f<Tr>(rp[i]) - mean) * rstd;
      const float dof = load1(a.dout, a.dot, i);
      const float s1 = spt ? 1.f + load1(a.scale.ptr, a.scale.t, b * a.scale.sb + n * a.scale.sn + d) : 1.f;
      q[0] += dof * s1 * xh;
      q[1] += dof * s1;
      q[2] += dof;
      if (p3) {
        const float g = __fmul_rn(__fmul_rn(dof, s1), cf);
        const float dr = a.dr ? load1(a.dr, a.drt, i) : 0.f;
        const float tot = res_dr_total(g, xh, rstd, a.rowsums[2 * row], a.rowsums[2 * row + 1], dr);
        q[3] += __fmul_rn(load1(a.y, a.yt, i), tot);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kResPlanes; ++k) part[k][ty][tx] = q[k];
  __syncthreads();
  if (ty == 0 && d < a.D) {
    const int64_t plane = a.pieces * a.D;
    float* ws = a.ws + piece_of(tile, b, a.B, false) * a.D + d;
#pragma unroll
    for (int k = 0; k < kResPlanes; ++k) {
      float s = 0.f;
      for (int i = 0; i < 8; ++i) s += part[k][i][tx];
      ws[k * plane] = s;
    }
  }
}

// The segmented layout's column sums when the ids are out of order (ids_sorted false; otherwise the
// kernel returns at once), as seg_col_kernel in norm_modulate_backward.cuh: one warp a block over all
// rows in order, thread tx owning feature d; each element's P0 = dout * r_hat, P1 = dout and
// P3 = y * dr_total (recomputed from the row sums the row kernel saved) added to its segment's
// accumulators in shared memory, kSegColSegments segments a pass. Leaves segment s's sums in piece s.
template <Norm N, typename Tr>
__global__ void __launch_bounds__(32) res_seg_col_kernel(const ResBwdArgs a) {
  if (ids_sorted(a.seg)) return;
  __shared__ float acc[3][kSegColSegments][32];
  const int tx = threadIdx.x, d = blockIdx.x * 32 + tx;
  const bool p3 = a.dgate_rows != nullptr;
  const Tr* __restrict__ rp = static_cast<const Tr*>(a.r);
  const int64_t plane = a.pieces * a.D, T = a.N;
  const float w = (a.weight && d < a.D) ? a.weight[d] : 1.f;
  for (int64_t s0 = 0; s0 < a.seg.count; s0 += kSegColSegments) {
    for (int i = 0; i < kSegColSegments; ++i) acc[0][i][tx] = acc[1][i][tx] = acc[2][i][tx] = 0.f;
    if (d < a.D) {
      for (int64_t n = 0; n < T; ++n) {
        const int64_t m = seg_of(a.seg, n), s = m - s0;
        if (s < 0 || s >= kSegColSegments) continue;
        const int64_t i = n * a.D + d;
        const float mean = N == Norm::RMS ? 0.f : a.mean[n], rstd = a.rstd[n];
        const float xh = (to_f<Tr>(rp[i]) - mean) * rstd;
        const float dof = load1(a.dout, a.dot, i);
        acc[0][s][tx] += dof * xh;
        acc[1][s][tx] += dof;
        if (p3) {
          const float cf = a.scale.ptr ? w * (1.f + load1(a.scale.ptr, a.scale.t, m * a.scale.sb + d)) : w;
          const float g = __fmul_rn(dof, cf);
          const float dr = a.dr ? load1(a.dr, a.drt, i) : 0.f;
          const float tot = res_dr_total(g, xh, rstd, a.rowsums[2 * n], a.rowsums[2 * n + 1], dr);
          acc[2][s][tx] += __fmul_rn(load1(a.y, a.yt, i), tot);
        }
      }
      for (int64_t s = s0; s < min(a.seg.count, s0 + kSegColSegments); ++s) {
        a.ws[s * a.D + d] = acc[0][s - s0][tx];
        a.ws[plane + s * a.D + d] = acc[1][s - s0][tx];
        if (p3) a.ws[3 * plane + s * a.D + d] = acc[2][s - s0][tx];
      }
    }
  }
}

// Final column reduction: grid (ceil(D / 32), reduce_groups(a)), block (32, 16); per sample of the
// block's group, the tiles of each plane summed in a fixed order (tile_column_sums), then the
// per-sample rows and the dweight / dbias totals (fp32; store_totals) formed as the header says. (A
// template only so that each dtype's file has its own instance.)
template <typename Tr>
__global__ void __launch_bounds__(512) res_reduce_kernel(const ResBwdArgs a) {
  __shared__ float part[kResPlanes][16][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int d = blockIdx.x * 32 + tx;
  const int64_t plane = a.pieces * a.D;
  const bool spt = a.scale.per_token();
  const bool reduced_scale = a.scale.ptr && !spt;
  const bool use[kResPlanes] = {true, true, spt && a.dshift_rows != nullptr, a.dgate_rows != nullptr};
  const float w = (a.weight && d < a.D) ? a.weight[d] : 1.f;
  const float bb = (a.bias && d < a.D) ? a.bias[d] : 0.f;
  float dw = 0.f, db = 0.f;
  const int64_t samples = column_samples(a);
  for (int64_t b = blockIdx.y; b < samples; b += gridDim.y) {  // this group's samples (reduce_groups)
    float s[kResPlanes];
    tile_column_sums<kResPlanes>(a.ws, plane, column_pieces(b, a.tiles, a.B, a.seg, a.rows_per_tile), a.D, d, use,
                                 part, s);
    if (ty == 0 && d < a.D) {
      const float f = reduced_scale ? 1.f + load1(a.scale.ptr, a.scale.t, b * a.scale.sb + d) : 1.f;
      if (a.dscale_rows) store1(a.dscale_rows, a.dscale_rows_t, b * a.D + d, w * s[0] + bb * s[1]);
      if (a.dshift_rows) store1(a.dshift_rows, a.dshift_rows_t, b * a.D + d, spt ? s[2] : s[1]);
      if (a.dgate_rows) store1(a.dgate_rows, a.dgate_rows_t, b * a.D + d, s[3]);
      dw += f * s[0];
      db += f * s[1];
    }
  }
  if (ty == 0 && d < a.D) store_totals(a.totals, a.dweight, a.dbias, a.D, d, dw, db);
}

// Shared memory of the backward row kernel's coefficient rows (cf, bias, gate), then `stages` slots
// of its staging ring of `slot_bytes` each.
inline size_t res_bwd_smem(int threads, int chunks, int stages = 0, size_t slot_bytes = 0) {
  return static_cast<size_t>(3) * chunks * kResVec * threads * sizeof(float) + stages * slot_bytes;
}

// Bytes of one slot of the row kernel's staging ring for a's shape (a.threads, a.chunks).
template <typename Tr>
size_t res_bwd_slot_bytes(const ResBwdArgs& a) {
  return res_stage_slot_bytes(res_bwd_staged(a, dtype_of<Tr>()), a.chunks, a.threads, sizeof(Tr));
}

// Automatic threads-a-block cap of the backward without a gate (res_bwd_gate_none, per-sample rows)
// with 16-bit r: half the row's groups of kResVec (two chunks a thread) where one chunk would take
// 257-512 threads (D = 2056-4096); else 0 (res_row_shape's automatic shape). The gate's None instance
// keeps two chunks in 103-107 registers without spills (ptxas sm_90; the gated ones spill). Measured on
// one H200 (bf16, N = 65536, a plain residual, forced shapes; benchmarks/KERNEL_NOTES.md): LayerNorm
// (affine) 88.3 / 85.7% of speed-of-light at D = 3072 / 4096 with two chunks, 81.7 / 80.8% with one;
// RMSNorm 90.8 / 91.1% against 73.0 / 81.6%.
inline int res_bwd_plain_cap(const ResBwdArgs& a, size_t tr_size) {
  const int groups = (a.D + kResVec - 1) / kResVec;
  if (a.max_threads > 0 || !res_bwd_gate_none(a) || a.seg.on() || tr_size != 2 || groups <= 256 || groups > kMaxThreads)
    return 0;
  return (groups / 2 + 31) / 32 * 32;
}

// Rows of r's dtype for dout, dr, y and dx (the common case): the row kernel reads them raw in Tr.
template <typename Tr>
bool res_bwd_typed(const ResBwdArgs& a) {
  constexpr DType kTr = dtype_of<Tr>();
  return a.dot == kTr && (!a.dr || a.drt == kTr) && (!a.y || a.yt == kTr) && a.dxt == kTr;
}

// f(kernel, staged): the row kernel for a's plan (chunks, one pass or two kernels, a per-token scale,
// the partials it keeps, how it reads the row tensors); staged (typed rows where res_bwd_stageable
// holds) picks its staging-ring instance.
template <Norm N, typename Tr, typename F>
void res_bwd_row_kernel_for(const ResBwdArgs& a, bool staged, const F& f) {
  const bool one_pass = a.columns() && !a.two_kernel;
  const bool spt = a.scale.per_token(), p3 = a.dgate_rows != nullptr;
  const bool gst = staged && res_bwd_extra_rows(a, dtype_of<Tr>()) > 0;  // (per-token rows staged)
  const bool no_gate = res_bwd_gate_none(a);
  constexpr ResBwdGate kStaged = ResBwdGate::Staged, kNone = ResBwdGate::None;
  if (a.threads > kMaxThreads) {  // the wide one-chunk kernel (res_bwd_wide_shape; planned only where it runs)
    if (p3) return f(res_bwd_wide_kernel<N, Tr, true>);
    if (gst) return f(res_bwd_wide_kernel<N, Tr, false, kStaged>);
    if (no_gate) return f(res_bwd_wide_kernel<N, Tr, false, kNone>);
    return f(res_bwd_wide_kernel<N, Tr, false>);
  }
  auto by_io = [&](auto io) {
    using IO = decltype(io);
    constexpr bool kTyped = std::is_same<IO, TypedRows<Tr>>::value;
    with_chunk_count<kResMaxChunks>(a.chunks, [&](auto chunks) {
      constexpr int kC = decltype(chunks)::value;
      if constexpr (kC <= kResOnePassChunks && kTyped) {
        if (one_pass && staged && a.seg.on() && !spt) {  // the segmented layout
          if (p3) return f(res_bwd_row_kernel<N, Tr, kC, IO, false, true, true, true, true>);
          return f(res_bwd_row_kernel<N, Tr, kC, IO, false, true, false, true, true>);
        }
      }
      if constexpr (kC <= kResOnePassChunks) {
        if (one_pass) {
          auto pick = [&](auto stg) {
            constexpr bool kS = decltype(stg)::value;
            if (spt && p3) f(res_bwd_row_kernel<N, Tr, kC, IO, true, true, true, kS>);
            else if (spt) f(res_bwd_row_kernel<N, Tr, kC, IO, true, true, false, kS>);
            else if (p3) f(res_bwd_row_kernel<N, Tr, kC, IO, false, true, true, kS>);
            else if constexpr (kS) {  // (the gate's Staged and None instances: staged only)
              if (gst) f(res_bwd_row_kernel<N, Tr, kC, IO, false, true, false, true, false, kStaged>);
              else if (no_gate) f(res_bwd_row_kernel<N, Tr, kC, IO, false, true, false, true, false, kNone>);
              else f(res_bwd_row_kernel<N, Tr, kC, IO, false, true, false, true>);
            } else {
              f(res_bwd_row_kernel<N, Tr, kC, IO, false, true, false, false>);
            }
          };
          if constexpr (kTyped) {
            if (staged) return pick(std::true_type{});
          }
          return pick(std::false_type{});
        }
      }
      if constexpr (kC <= kResOnePassChunks && kTyped) {  // no column sums: the staged instances
        if (staged && !a.columns()) {
          if (gst && spt) return f(res_bwd_row_kernel<N, Tr, kC, IO, true, false, false, true, false, kStaged>);
          if (gst) return f(res_bwd_row_kernel<N, Tr, kC, IO, false, false, false, true, false, kStaged>);
          if (no_gate) return f(res_bwd_row_kernel<N, Tr, kC, IO, false, false, false, true, false, kNone>);
        }
      }
      if (spt) f(res_bwd_row_kernel<N, Tr, kC, IO, true, false, false>);
      else f(res_bwd_row_kernel<N, Tr, kC, IO, false, false, false>);
    });
  };
  if (res_bwd_typed<Tr>(a)) by_io(TypedRows<Tr>{});
  else by_io(AnyRows{});
}

template <Norm N, typename Tr>
void res_backward(ResBwdArgs& a, bool launch, cudaStream_t stream) {
  if (!launch) {
    const int requested = a.stages;
    // Shape {threads, chunks}: the staging ring's slots for it (typed, aligned rows where res_bwd_stageable
    // holds; a.stages: the request), 0 where it does not stage.
    auto plan_shape = [&](RowShape rs) {
      a.threads = rs.threads;
      a.chunks = rs.chunks;
      a.two_kernel = a.columns() && (a.two_kernel || rs.chunks > kResOnePassChunks);
      const bool eligible = a.aligned && res_bwd_typed<Tr>(a) && res_bwd_stageable(a, dtype_of<Tr>(), rs.chunks);
      int stages = 0;
      if (eligible) {
        const size_t coef = res_bwd_smem(a.threads, a.chunks);
        const size_t slot = res_bwd_slot_bytes<Tr>(a);
        res_bwd_row_kernel_for<N, Tr>(a, true, [&](auto kernel) {
          const void* k = reinterpret_cast<const void*>(kernel);
          stages = ring_stages(requested, true, coef, slot, kResStageBytes, k, 80);
          // without a gate (the None instance, 63-90 registers at one chunk): the most slots that keep
          // the blocks a SM its registers allow. Measured on one H200 (bf16, N = 65536, the plain affine
          // LayerNorm site, forced slots; benchmarks/KERNEL_NOTES.md): 2 slots read 75.4 / 81.7% of
          // speed-of-light at D = 1536 / 2048 against 69.0 / 76.4% with the 4 / 3 slots of 48 KB.
          if (stages > 0 && requested < 0 && res_bwd_gate_none(a)) stages = stages_keeping_occupancy(k, a.threads, coef, slot, stages);
        });
      }
      return stages;
    };
    // the wide one-chunk kernel where it applies (staged, column sums, per-sample rows, no per-token
    // scale), else the shape of res_row_shape
    const RowShape wide = res_bwd_wide_shape(a.D, a.max_threads);
    int stages = 0;
    if (wide.threads > 0 && a.columns() && !a.scale.per_token() && !a.seg.on() && !a.two_kernel) stages = plan_shape(wide);
    const int plain_cap = res_bwd_plain_cap(a, sizeof(Tr));
    if (stages == 0 && plain_cap > 0 && !a.two_kernel) stages = plan_shape(res_row_shape(a.D, plain_cap));
    if (stages == 0) stages = plan_shape(res_row_shape(a.D, a.max_threads));
    const size_t slot = res_bwd_slot_bytes<Tr>(a);
    a.stages = stages;
    if (a.seg.on() && (a.stages == 0 || a.scale.per_token())) {  // the staged kernel or nothing
      a.stages = 0;
      return;
    }
    res_bwd_row_kernel_for<N, Tr>(a, a.stages > 0, [&](auto kernel) {
      one_wave(kernel, a.threads, res_bwd_smem(a.threads, a.chunks, a.stages, slot), a.B, a.N, false, a.tiles,
               a.rows_per_tile);
    });
    return;
  }
  if (!a.aligned) {  // (the workspace, allocated after the plan, unaligned: never from torch)
    a.stages = 0;
    if (a.threads > kMaxThreads) {  // the wide kernel stages its rows: the narrower shape instead (same tiles)
      const RowShape rs = res_row_shape(a.D, a.max_threads);
      a.threads = rs.threads;
      a.chunks = rs.chunks;
    }
  }
  const size_t smem = res_bwd_smem(a.threads, a.chunks, a.stages, res_bwd_slot_bytes<Tr>(a));
  res_bwd_row_kernel_for<N, Tr>(a, a.stages > 0, [&](auto kernel) {
    kernel<<<static_cast<unsigned>(a.B * a.tiles), a.threads, smem, stream>>>(a);
  });
  if (!a.columns()) return;
  if (a.two_kernel) {
    dim3 grid((a.D + 31) / 32, static_cast<unsigned>(a.tiles), static_cast<unsigned>(a.B));
    res_bwd_col_kernel<N, Tr><<<grid, dim3(32, 8), 0, stream>>>(a);
  }
  if (a.seg.on()) res_seg_col_kernel<N, Tr><<<(a.D + 31) / 32, 32, 0, stream>>>(a);
  const int groups = reduce_groups(a);
  res_reduce_kernel<Tr><<<dim3((a.D + 31) / 32, groups), dim3(32, 16), 0, stream>>>(a);
  launch_reduce_totals(a.totals, groups, a.D, a.dweight, a.dbias, stream);
}

}  // namespace adaln
