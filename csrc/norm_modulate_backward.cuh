// Backward kernels of the fused norm -> modulate ops (templates, on the norm type N; instantiated
// per op and x dtype in csrc/<op>/<op>_backward_{f32,bf16,f16}.cu so that they compile in parallel).
//
// Gradients (x_hat = (x - mean) * rstd, RMSNorm: mean = 0 and no b; g = dy * (1 + scale) * w):
//   dx      = rstd * (g - mean_D(g) - x_hat * mean_D(g * x_hat))       (RMSNorm: without mean_D(g))
//             [+ dx_addend, read in fp32 and added before dx is rounded to x's dtype: the per-sample
//             ring kernel; the host adds it after the other kernels]
//   dshift  = sum of dy,                  dscale = sum of dy * (x_hat * w + b)   (broadcast dims)
//   dweight = sum of dy * (1 + scale) * x_hat,   dbias = sum of dy * (1 + scale)  (all rows)
//
// One pass (default): a block owns a tile of whole rows of one sample (one wave of blocks), computes
// dx row by row (the two row sums need all of D, so a row stays in registers) and accumulates fp32
// per-column partial sums in registers, written once per block to a [3, tiles, B, D] workspace; a
// second, small kernel reduces the workspace down the tiles, each thread owning one feature d, so a
// warp reads 32 consecutive floats. When scale is per-sample or shared it is constant inside a
// tile, so two partials are enough for all four gradients:
//   P0 = sum dy * x_hat,  P1 = sum dy  ->  dscale_b = w * P0 + b * P1,  dshift_b = P1,
//                                           dweight = sum_b (1 + scale_b) * P0,  dbias = sum_b (1 + scale_b) * P1.
// When scale is per-token, its gradient is per element (written directly), and
//   P0 = sum dy * (1 + s) * x_hat,  P1 = sum dy * (1 + s),  P2 = sum dy  (for a per-sample shift).
// No atomics: every sum has a fixed order, so two runs give bit-identical gradients.
//
// RING (sm_90; aligned rows): the x and dy rows, and a per-token scale's row, come through a ring of
// a.stages slots in shared memory filled by bulk copies a.stages rows ahead (as the forward's RING),
// instead of the one-row register prefetch; a slot is refilled after the row's block reduction.
//
// Segmented layout (SEG, the ring kernel only; BwdArgs::seg, Segments): a pack as one sequence. With ids that
// never decrease, a tile is cut where the segment changes and each part's P0, P1 go to their own
// workspace piece (piece_of); the final reduction sums each segment's pieces. With ids in any other
// order (flagged on the device by the id kernel) the row kernel writes dx only and seg_col_kernel
// sums each segment's rows in row order.
//
// Two kernels (the reference design, forced by BwdArgs::two_kernel; also taken for per-sample/shared
// rows too wide for the ring, see kBwdRingElems): the row kernel computes dx only, and a column
// kernel over (d_tile, row tile, sample) re-reads x and dy for the partials: 5 x-sized tensors move
// instead of 3.
#pragma once

#include "norm_modulate.cuh"

namespace adaln {

// The backward's ring takes rows of up to 16 elements a thread (2 chunks of 16-bit x, 4 of fp32):
// ptxas sm_90 shows no spills there; at 32 (4 chunks of 16-bit x) the ring variant fell to 32 registers
// and 2.4 KB of spills. Beyond it, the one-pass register kernel's column partials (3 floats an
// element) spill too (6% of SoL at bf16 D = 12288 / 16384 on the H200), so wider per-sample/shared
// rows always take the two-kernel design: a dx kernel with the partials compiled out, then a column
// kernel re-reading x and dy.
constexpr int kBwdRingElems = 16;
template <typename Tx>
constexpr int bwd_ring_chunks() { return kBwdRingElems / (16 / static_cast<int>(sizeof(Tx))); }
// Per-token scale (its row rides the slot beside x and dy; the kernel also keeps a third partial
// and the bias row): up to kBwdRingElemsPerToken elements a thread (see KERNEL_NOTES v8).
constexpr int kBwdRingElemsPerToken = 16;
// RMSNorm's ring kernels with per-token scale at 2 chunks of 16-bit x spill (ptxas sm_90: 16-84 bytes
// at 128 registers, bf16 84; the LayerNorm ones do not), so RMSNorm takes 1 chunk there: on the H200
// (bf16, N = 65536, per-token scale and shift) 1 chunk measured 88 / 79 / 86% of SoL at D = 2048 /
// 3072 / 4096 against 67% at 2 chunks (benchmarks/KERNEL_NOTES.md, rms_norm_modulate).
template <Norm N, typename Tx>
constexpr int bwd_ring_chunks_per_token() {
  return N == Norm::RMS && sizeof(Tx) == 2 ? 1 : kBwdRingElemsPerToken / (16 / static_cast<int>(sizeof(Tx)));
}

template <Norm N, typename Tx, typename Tm, typename Tdy, int C, bool SPT, bool RING, bool SEG = false>
__global__ void __launch_bounds__(kMaxThreads) bwd_row_kernel(const BwdArgs a) {
  static_assert(!SEG || (RING && !SPT), "the segmented layout takes the ring kernel with per-sample rows");
  constexpr bool RMS = N == Norm::RMS;
  constexpr int NS = RMS ? 1 : 2;  // row sums: [sum g,] sum g * x_hat
  const int64_t rows_per_tile = a.rows_per_tile;
  constexpr int VEC = 16 / sizeof(Tx);
  __shared__ float red[2 * 2 * 32];
  __shared__ __align__(8) uint64_t full[RING ? kMaxStages : 1];
  int parity = 0;
  const int64_t tiles = a.tiles;
  const int64_t b = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int64_t n0 = tile * rows_per_tile;
  const int64_t n1 = min(a.N, n0 + rows_per_tile);
  if (n0 >= n1) return;
  const int D = a.D, T = blockDim.x, tid = threadIdx.x;
  // rows wider than the one-pass limit always take the two-kernel design (see kBwdRingElems): their
  // column partials are compiled out, so the dx-only kernel keeps its rows in registers
  constexpr bool kOnePass = SPT || C <= bwd_ring_chunks<Tx>();
  // (segmented layout with ids out of order: dx only, seg_col_kernel sums the segments)
  const bool al = a.aligned, accum = kOnePass && !a.two_kernel && (!SEG || ids_sorted(a.seg));
  const Tx* __restrict__ x = static_cast<const Tx*>(a.x);
  const Tdy* __restrict__ dy = static_cast<const Tdy*>(a.dy);
  Tx* __restrict__ dx = static_cast<Tx*>(a.dx);
  // dx_addend: the per-sample ring kernel only (BwdArgs::dx_addend), not the segmented one; its row
  // rides the ring slot (a load from global memory ahead of the block reduction stalled every row:
  // 58 -> 101 µs a call at Wan's 12 x 1,560 x 1,536); in the other kernels it took registers they
  // hold across the reduction (ptxas sm_90: spills where there were none, e.g. the per-token ring
  // kernel at 2 chunks of bf16), and the host adds it after them
  constexpr bool kAddend = RING && !SPT && !SEG;
  const Tx* __restrict__ dx_add = kAddend ? static_cast<const Tx*>(a.dx_addend) : nullptr;
  const Tm* __restrict__ sc = static_cast<const Tm*>(a.scale.ptr) + b * a.scale.sb;
  Tm* __restrict__ dsc_el = static_cast<Tm*>(a.dscale_el);
  Tm* __restrict__ dsh_el = static_cast<Tm*>(a.dshift_el);

  // coef = w * (1 + scale_b) (per-sample scale) or w (per-token scale: (1 + s) comes per row),
  // in shared memory; the column partial sums stay in registers
  extern __shared__ float4 coef_smem[];
  const CoefRow<VEC> coef{coef_smem}, bias_row{coef_smem + C * (VEC / 4) * blockDim.x};  // bias: SPT only
  // the ring (RING): slot = [x row | dy row | per-token scale row (SPT) | dx_addend row (kAddend)], each
  // rounded up to 128 bytes
  const int S = a.stages;
  const size_t x_bytes = ring_stride(D, sizeof(Tx)), s_off = x_bytes + ring_stride(D, sizeof(Tdy));
  const size_t a_off = s_off + (SPT ? ring_stride(D, sizeof(Tm)) : 0);
  const size_t stride = a_off + (dx_add ? x_bytes : 0);
  char* ring = reinterpret_cast<char*>(coef_smem + (SPT ? 2 : 1) * C * (VEC / 4) * T);
  auto fetch = [&](int slot, int64_t n) {  // thread 0: x, dy (and the scale row) of row n into a ring slot
    const int64_t off = (b * a.N + n) * static_cast<int64_t>(D);
    char* dst = ring + slot * stride;
    async_proxy_fence();
    mbar_expect(&full[slot], static_cast<uint32_t>(D * (sizeof(Tx) + sizeof(Tdy) + (SPT ? sizeof(Tm) : 0) +
                                                        (dx_add ? sizeof(Tx) : 0))));
    bulk_copy(dst, x + off, static_cast<uint32_t>(D * sizeof(Tx)), &full[slot]);
    bulk_copy(dst + x_bytes, dy + off, static_cast<uint32_t>(D * sizeof(Tdy)), &full[slot]);
    if constexpr (SPT) bulk_copy(dst + s_off, sc + n * a.scale.sn, static_cast<uint32_t>(D * sizeof(Tm)), &full[slot]);
    if (dx_add) bulk_copy(dst + a_off, dx_add + off, static_cast<uint32_t>(D * sizeof(Tx)), &full[slot]);
  };
  RingCursor cur{full, S};
  if constexpr (RING) cur.start(n0, n1, fetch);
  float p0[C][VEC], p1[C][VEC], p2[C][VEC];
  // Chunk c of coef for modulation row m (0, or the segment: sc already points at sample b's row)
  auto coef_chunk = [&](int c, int64_t m, float (&w)[VEC]) {
    const int col = (c * T + tid) * VEC;
    float s[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f, s[j] = 0.f;
    if (col < D) {
      if (a.weight) load_f<float, VEC>(a.weight, col, D, al, w);
      if (!SPT) load_f<Tm, VEC>(sc + m * a.scale.sb, col, D, al, s);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] *= 1.f + s[j];
  };
  // The workspace (kernel doc): plane by plane, this block's partials of sample b or of a segment
  const int64_t plane = a.pieces * D;
  const bool w0 = !SPT || a.weight, w1 = !SPT || a.bias, w2 = SPT && a.dshift_rows;
  auto flush = [&](int c, int64_t piece) {  // chunk c's partials into the piece
    const int col = (c * T + tid) * VEC;
    if (col >= D) return;
    float* ws = a.ws + piece * static_cast<int64_t>(D);
    if (w0) store_f<float, VEC>(ws, col, D, al, p0[c]);
    if (w1) store_f<float, VEC>(ws + plane, col, D, al, p1[c]);
    if (w2) store_f<float, VEC>(ws + 2 * plane, col, D, al, p2[c]);
  };
  // Segmented layout (SEG): the tile's rows are cut where the segment
  // changes, each part's partials flushed to its own piece and the coefficients recomputed (each
  // thread its own columns: no barrier)
  int64_t seg_cur = SEG ? seg_of(a.seg, n0) : 0, seg_next = seg_cur;  // (the next row's, read a row ahead)
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int col = (c * T + tid) * VEC;
    float w[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) p0[c][j] = p1[c][j] = p2[c][j] = 0.f;
    coef_chunk(c, seg_cur, w);
    coef.store(c, w);
    if (SPT) {
      float bb[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) bb[j] = 0.f;
      if (col < D && a.bias) load_f<float, VEC>(a.bias, col, D, al, bb);
      bias_row.store(c, bb);
    }
  }

  const float inv_d = 1.f / static_cast<float>(D);
  Raw<Tx, VEC> nx[C];
  Raw<Tdy, VEC> ndy[C];
  Raw<Tm, VEC> ns[C];
  float nmean = 0.f, nrstd = 0.f;
  auto load_row = [&](int64_t n) {  // the row's statistics, and (without the ring) the row itself
    if constexpr (!RMS) nmean = a.mean[b * a.N + n];
    nrstd = a.rstd[b * a.N + n];
    if constexpr (RING) return;
    const int64_t off = (b * a.N + n) * static_cast<int64_t>(D);
    load_chunks(x + off, D, T, tid, al, nx);
    load_chunks(dy + off, D, T, tid, al, ndy);
    if constexpr (SPT) load_chunks(sc + n * a.scale.sn, D, T, tid, al, ns);
  };
  load_row(n0);

  for (int64_t n = n0; n < n1; ++n) {
    if constexpr (SEG) {  // at the top of the row, where few registers are live
      const int64_t m = seg_next;
      if (n + 1 < n1) seg_next = seg_of(a.seg, n + 1);
      if (m != seg_cur) {  // the previous segment's part of the tile is complete
#pragma unroll
        for (int c = 0; c < C; ++c) {
          float w[VEC];
          if (accum) flush(c, piece_of(tile, seg_cur, a.B, true));
#pragma unroll
          for (int j = 0; j < VEC; ++j) p0[c][j] = p1[c][j] = 0.f;
          coef_chunk(c, m, w);
          coef.store(c, w);
        }
        seg_cur = m;
      }
    }
    // The current row stays in its storage type (half the registers of fp32 for 16-bit types);
    // x_hat and g are recomputed from it after the barrier instead of being held across it.
    const float mean = nmean, rstd = nrstd;
    Raw<Tx, VEC> cx[C];
    Raw<Tdy, VEC> cdy[C];
    Raw<Tm, VEC> cs[C];
    Raw<Tx, VEC> cadd[kAddend ? C : 1];  // dx's addend (zeros without one), kept across the block reduction
    if constexpr (RING) {
      cur.wait();
      load_chunks(reinterpret_cast<const Tx*>(ring + cur.slot * stride), D, T, tid, true, cx);
      load_chunks(reinterpret_cast<const Tdy*>(ring + cur.slot * stride + x_bytes), D, T, tid, true, cdy);
      if constexpr (SPT) load_chunks(reinterpret_cast<const Tm*>(ring + cur.slot * stride + s_off), D, T, tid, true, cs);
      if constexpr (kAddend) {
        if (dx_add) load_chunks(reinterpret_cast<const Tx*>(ring + cur.slot * stride + a_off), D, T, tid, true, cadd);
        else {
#pragma unroll
          for (int c = 0; c < C; ++c)
#pragma unroll
            for (int j = 0; j < VEC; ++j) cadd[c].v[j] = from_f<Tx>(0.f);
        }
      }
    } else {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        cx[c] = nx[c];
        cdy[c] = ndy[c];
        if (SPT) cs[c] = ns[c];
      }
    }
    if (n + 1 < n1) load_row(n + 1);  // in flight while this row is reduced

    const int64_t off = (b * a.N + n) * static_cast<int64_t>(D);
    float sums[NS] = {};
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      float cf[VEC], bb[VEC], ds_el[VEC], dyv[VEC];
      coef.load(c, cf);
      if (SPT) bias_row.load(c, bb);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xh = (to_f<Tx>(cx[c].v[j]) - mean) * rstd;
        const float dy_ = to_f<Tdy>(cdy[c].v[j]);  // zero outside the row, so it masks every sum
        const float s1 = SPT ? 1.f + to_f<Tm>(cs[c].v[j]) : 1.f;
        // __fmul_rn: no FMA contraction, so the g recomputed after the barrier is bit-identical
        // (g - mean(g) is then exactly 0 where it should be, e.g. D = 1, where rstd = eps^-1/2)
        const float g = __fmul_rn(__fmul_rn(dy_, s1), cf[j]);
        if constexpr (!RMS) sums[0] += g;
        sums[NS - 1] += g * xh;
        if (accum) {
          if (!SPT) {
            p0[c][j] += dy_ * xh;
            p1[c][j] += dy_;
          } else {
            p0[c][j] += dy_ * s1 * xh;
            p1[c][j] += dy_ * s1;
            p2[c][j] += dy_;
          }
        }
        // per-token scale: d scale = dy * (x_hat * w + b), per element (cf = w here)
        ds_el[j] = SPT ? dy_ * (xh * cf[j] + bb[j]) : 0.f;
        dyv[j] = dy_;
      }
      // Per-element gradients of per-token modulation need no row sum: stored before the barrier.
      if (col < D) {
        if (SPT) store_f<Tm, VEC>(dsc_el + off, col, D, al, ds_el);
        if (dsh_el) store_f<Tm, VEC>(dsh_el + off, col, D, al, dyv);  // per-token shift: dy itself
      }
    }
    block_sum<NS>(sums, red, parity);
    if constexpr (RING) cur.release(n, n1, fetch);  // every thread holds the row in registers
    const float mg = RMS ? 0.f : sums[0] * inv_d, mgx = sums[NS - 1] * inv_d;

#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      if (col >= D) continue;
      float cf[VEC], o[VEC];
      coef.load(c, cf);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xh = (to_f<Tx>(cx[c].v[j]) - mean) * rstd;
        const float s1 = SPT ? 1.f + to_f<Tm>(cs[c].v[j]) : 1.f;
        const float g = __fmul_rn(__fmul_rn(to_f<Tdy>(cdy[c].v[j]), s1), cf[j]);
        o[j] = rstd * (g - mg - xh * mgx) + (kAddend ? to_f<Tx>(cadd[kAddend ? c : 0].v[j]) : 0.f);
      }
      store_f<Tx, VEC>(dx + off, col, D, al, o);
    }
  }

  if (!accum) return;
  const int64_t piece = piece_of(tile, SEG ? seg_cur : b, a.B, SEG);
#pragma unroll
  for (int c = 0; c < C; ++c) flush(c, piece);
}

// Reference design's column kernel: grid (ceil(D / 32), tiles, B), block (32, 8); thread (tx, ty)
// owns feature d = 32 * blockIdx.x + tx and rows n0 + ty, n0 + ty + 8, ... of its tile, re-reading
// x and dy; then the 8 row groups are summed in shared memory in a fixed order.
template <Norm N, typename Tx, typename Tm, typename Tdy, bool SPT>
__global__ void __launch_bounds__(256) bwd_col_kernel(const BwdArgs a) {
  const int64_t rows_per_tile = a.rows_per_tile;
  __shared__ float part[3][8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int d = blockIdx.x * 32 + tx;
  const int64_t tile = blockIdx.y, b = blockIdx.z;
  const int64_t n0 = tile * rows_per_tile, n1 = min(a.N, n0 + rows_per_tile);
  const Tx* __restrict__ x = static_cast<const Tx*>(a.x);
  const Tdy* __restrict__ dy = static_cast<const Tdy*>(a.dy);
  const Tm* __restrict__ sc = static_cast<const Tm*>(a.scale.ptr) + b * a.scale.sb;
  float q0 = 0.f, q1 = 0.f, q2 = 0.f;
  if (d < a.D) {
    for (int64_t n = n0 + ty; n < n1; n += 8) {
      const int64_t row = b * a.N + n;
      const float mean = N == Norm::RMS ? 0.f : a.mean[row];
      const float xh = (to_f<Tx>(x[row * a.D + d]) - mean) * a.rstd[row];
      const float g = to_f<Tdy>(dy[row * a.D + d]);
      if (!SPT) {
        q0 += g * xh;
        q1 += g;
      } else {
        const float ds = g * (1.f + to_f<Tm>(sc[n * a.scale.sn + d]));
        q0 += ds * xh;
        q1 += ds;
        q2 += g;
      }
    }
  }
  part[0][ty][tx] = q0;
  part[1][ty][tx] = q1;
  part[2][ty][tx] = q2;
  __syncthreads();
  if (ty == 0 && d < a.D) {
    float r0 = 0.f, r1 = 0.f, r2 = 0.f;
    for (int k = 0; k < 8; ++k) r0 += part[0][k][tx], r1 += part[1][k][tx], r2 += part[2][k][tx];
    const int64_t plane = a.pieces * a.D;
    float* ws = a.ws + piece_of(tile, b, a.B, false) * a.D + d;
    ws[0] = r0;
    ws[plane] = r1;
    ws[2 * plane] = r2;
  }
}

// The segmented layout's column sums when the ids are out of order (ids_sorted false; otherwise the
// kernel returns at once): grid ceil(D / 32), one warp a block, thread tx owning feature
// d = 32 * blockIdx.x + tx; the rows are read in order and each added to its segment's accumulators
// in shared memory (kSegColSegments segments a pass, as many passes as needed), so every sum has a
// fixed order. Leaves P0 = sum dy * x_hat and P1 = sum dy of segment s in piece s of the workspace
// (column_pieces). Slow (one warp streams all rows of 32 features), but only ids that are not a
// pack's take it.
template <Norm N, typename Tx, typename Tdy>
__global__ void __launch_bounds__(32) seg_col_kernel(const BwdArgs a) {
  if (ids_sorted(a.seg)) return;
  __shared__ float acc[2][kSegColSegments][32];
  const int tx = threadIdx.x, d = blockIdx.x * 32 + tx;
  const Tx* __restrict__ x = static_cast<const Tx*>(a.x);
  const Tdy* __restrict__ dy = static_cast<const Tdy*>(a.dy);
  const int64_t plane = a.pieces * a.D, T = a.N;
  for (int64_t s0 = 0; s0 < a.seg.count; s0 += kSegColSegments) {
    for (int i = 0; i < kSegColSegments; ++i) acc[0][i][tx] = acc[1][i][tx] = 0.f;
    if (d < a.D) {
      for (int64_t n = 0; n < T; ++n) {
        const int64_t s = seg_of(a.seg, n) - s0;
        if (s < 0 || s >= kSegColSegments) continue;
        const float mean = N == Norm::RMS ? 0.f : a.mean[n];
        const float xh = (to_f<Tx>(x[n * a.D + d]) - mean) * a.rstd[n];
        const float g = to_f<Tdy>(dy[n * a.D + d]);
        acc[0][s][tx] += g * xh;
        acc[1][s][tx] += g;
      }
      for (int64_t s = s0; s < min(a.seg.count, s0 + kSegColSegments); ++s) {
        a.ws[s * a.D + d] = acc[0][s - s0][tx];
        a.ws[plane + s * a.D + d] = acc[1][s - s0][tx];
      }
    }
  }
}

// Final column reduction: grid (ceil(D / 32), reduce_groups(a)), block (32, 16). Thread
// (tx, ty) owns feature d = 32 * blockIdx.x + tx and sums tiles ty, ty + 16, ... of each sample of
// its group; the 16 partial sums are then added in a fixed order (tile_column_sums). Writes
// per-sample rows of dscale/dshift (in BwdArgs::rows_t) and the dweight/dbias totals (fp32;
// store_totals).
template <typename Tm, bool SPT>
__global__ void __launch_bounds__(512) bwd_reduce_kernel(const BwdArgs a) {
  __shared__ float part[3][16][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int d = blockIdx.x * 32 + tx;
  const int64_t plane = a.pieces * a.D;
  const bool use[3] = {!SPT || a.weight != nullptr, !SPT || a.bias != nullptr, SPT && a.dshift_rows != nullptr};
  const Tm* sc = static_cast<const Tm*>(a.scale.ptr);
  const float w = (a.weight && d < a.D) ? a.weight[d] : 1.f;
  const float bb = (a.bias && d < a.D) ? a.bias[d] : 0.f;
  float dw = 0.f, db = 0.f;
  const int64_t samples = column_samples(a);
  for (int64_t b = blockIdx.y; b < samples; b += gridDim.y) {  // this group's samples (reduce_groups)
    float s[3];
    tile_column_sums<3>(a.ws, plane, column_pieces(b, a.tiles, a.B, a.seg, a.rows_per_tile), a.D, d, use, part, s);
    if (ty == 0 && d < a.D) {
      if (!SPT) {
        const float f = 1.f + to_f<Tm>(sc[b * a.scale.sb + d]);
        store1(a.dscale_rows, a.rows_t, b * a.D + d, w * s[0] + bb * s[1]);
        if (a.dshift_rows) store1(a.dshift_rows, a.rows_t, b * a.D + d, s[1]);
        dw += f * s[0];
        db += f * s[1];
      } else {
        dw += s[0];
        db += s[1];
        if (a.dshift_rows) store1(a.dshift_rows, a.rows_t, b * a.D + d, s[2]);
      }
    }
  }
  if (ty == 0 && d < a.D) store_totals(a.totals, a.dweight, a.dbias, a.D, d, dw, db);
}


constexpr size_t kBwdRingBytes = 64 * 1024;  // automatic backward ring: slots for ~64 KB of rows a block

template <Norm N, typename Tx, typename Tm, typename Tdy, int C, bool SPT>
struct BwdKernels {
  static size_t coef(const BwdArgs& a, int threads) { return coef_smem_bytes(SPT ? 2 : 1, C, threads, a.xt); }
  static size_t slot(const BwdArgs& a) {  // as bwd_row_kernel's ring (dx_addend's row: per-sample scale only)
    return ring_stride(a.D, sizeof(Tx)) + ring_stride(a.D, sizeof(Tdy)) + (SPT ? ring_stride(a.D, sizeof(Tm)) : 0) +
           (!SPT && a.dx_addend ? ring_stride(a.D, sizeof(Tx)) : 0);
  }
  static size_t smem(const BwdArgs& a, int threads) { return coef(a, threads) + a.stages * slot(a); }
  // the ring up to kBwdRingElems a thread (per-token scale: bwd_ring_chunks_per_token)
  static constexpr bool kRing = C <= (SPT ? bwd_ring_chunks_per_token<N, Tx>() : bwd_ring_chunks<Tx>());
  template <typename F>
  static void with_kernel(const BwdArgs& a, const F& f) {  // the ring's row kernel, or the register one
    if constexpr (kRing && !SPT) {
      if (a.seg.on() && a.stages > 0) return f(bwd_row_kernel<N, Tx, Tm, Tdy, C, false, true, true>);
    }
    if constexpr (kRing) {
      if (a.stages > 0) return f(bwd_row_kernel<N, Tx, Tm, Tdy, C, SPT, true>);
    }
    f(bwd_row_kernel<N, Tx, Tm, Tdy, C, SPT, false>);
  }
  // Sets a.stages (the ring's slots, or 0), a.tiles and a.rows_per_tile.
  static void plan(BwdArgs& a, int threads) {
    if constexpr (kRing) {
      const void* ring = reinterpret_cast<const void*>(bwd_row_kernel<N, Tx, Tm, Tdy, C, SPT, true>);
      // automatic: ~64 KB of rows; two slots with per-token scale rows, whose larger slots measured
      // better at 2 than at 64 KB's 3-7 (H200, D = 1536: 86% of SoL against 76%; equal at 3072 / 5120)
      const size_t auto_bytes = SPT ? 2 * slot(a) : kBwdRingBytes;
      const int requested = a.stages;
      a.stages = ring_stages(requested, a.aligned, coef(a, threads), slot(a), auto_bytes, ring);
      if constexpr (!SPT) {
        // the segmented kernel (102 registers at D = 1536, bf16: 6 blocks of 96 threads a SM) keeps the
        // blocks its registers allow: 64 KB's 8 slots left 4, and forced 2 or 3 slots had read 74% of
        // speed-of-light against 70% (one segment; benchmarks/results/seg_probe_h200.txt)
        if (a.seg.on() && requested < 0) {
          const void* seg = reinterpret_cast<const void*>(bwd_row_kernel<N, Tx, Tm, Tdy, C, false, true, true>);
          a.stages = stages_keeping_occupancy(seg, threads, coef(a, threads), slot(a), a.stages);
        }
      }
    } else {
      a.stages = 0;
    }
    with_kernel(a, [&](auto kernel) { one_wave(kernel, threads, smem(a, threads), a.B, a.N, false, a.tiles, a.rows_per_tile); });
  }
  static void launch(const BwdArgs& a, int threads, cudaStream_t stream) {
    with_kernel(a, [&](auto kernel) {
      kernel<<<static_cast<unsigned>(a.B * a.tiles), threads, smem(a, threads), stream>>>(a);
    });
    if (a.two_kernel) {
      dim3 grid((a.D + 31) / 32, static_cast<unsigned>(a.tiles), static_cast<unsigned>(a.B));
      bwd_col_kernel<N, Tx, Tm, Tdy, SPT><<<grid, dim3(32, 8), 0, stream>>>(a);
    }
    if constexpr (!SPT) {
      if (a.seg.on()) seg_col_kernel<N, Tx, Tdy><<<(a.D + 31) / 32, 32, 0, stream>>>(a);
    }
    const int groups = reduce_groups(a);
    bwd_reduce_kernel<Tm, SPT><<<dim3((a.D + 31) / 32, groups), dim3(32, 16), 0, stream>>>(a);
    launch_reduce_totals(a.totals, groups, a.D, a.dweight, a.dbias, stream);
  }
};

// plan (launch == false: sets a.threads, a.chunks, a.stages, a.tiles, a.rows_per_tile) or launch
// the backward: the ring's block shape first, the register path's where the ring cannot run
template <Norm N, typename Tx, typename Tm, typename Tdy, bool SPT>
void bwd_run(BwdArgs& a, bool launch, cudaStream_t stream) {
  if (launch) {
    with_chunk_count(a.chunks, [&](auto c) { BwdKernels<N, Tx, Tm, Tdy, decltype(c)::value, SPT>::launch(a, a.threads, stream); });
    return;
  }
  const int requested = a.stages;
  auto plan = [&](RowShape rs) {
    a.stages = requested;
    a.threads = rs.threads;
    a.chunks = rs.chunks;
    with_chunk_count(rs.chunks, [&](auto c) { BwdKernels<N, Tx, Tm, Tdy, decltype(c)::value, SPT>::plan(a, rs.threads); });
  };
  const RowShape regs = row_shape(a.D, a.xt, a.max_threads);
  const RowShape ring =
      ring_row_shape(a.D, a.xt, a.max_threads, SPT ? bwd_ring_chunks_per_token<N, Tx>() : bwd_ring_chunks<Tx>());
  plan(ring);
  if (a.seg.on()) return;  // the segmented layout: the ring kernel or nothing (a.stages == 0)
  if (a.stages == 0 && (ring.threads != regs.threads || ring.chunks != regs.chunks)) plan(regs);
  if (!SPT && a.chunks > bwd_ring_chunks<Tx>()) a.two_kernel = true;  // see kBwdRingElems
}

// The backward of norm N for x of type Tx: dispatch on (modulation dtype, dy dtype), each x's dtype
// or fp32, and on a per-token scale.
template <Norm N, typename Tx>
void run_backward(BwdArgs& a, bool launch, cudaStream_t stream) {
  const bool m32 = a.mt == DType::F32, d32 = a.dyt == DType::F32, spt = a.scale.sn != 0;
  auto by_spt = [&](auto tm, auto tdy) {
    using Tm = typename decltype(tm)::type;
    using Tdy = typename decltype(tdy)::type;
    if (spt) bwd_run<N, Tx, Tm, Tdy, true>(a, launch, stream);
    else bwd_run<N, Tx, Tm, Tdy, false>(a, launch, stream);
  };
  struct XTag { using type = Tx; };
  if (m32 && d32) by_spt(F32Tag{}, F32Tag{});
  else if (m32) by_spt(F32Tag{}, XTag{});
  else if (d32) by_spt(XTag{}, F32Tag{});
  else by_spt(XTag{}, XTag{});
}

}  // namespace adaln
