// Forward kernel of the fused norm -> modulate ops (templates, on the norm type N: instantiated in
// csrc/adaln_modulate/adaln_forward.cu and csrc/rms_norm_modulate/rms_norm_forward.cu): one launch
// reads x once and writes y in the output dtype plus fp32 rstd (and, for LayerNorm, mean) per row.
//
// Grid: B * tiles blocks, one wave (blocks per SM from the occupancy calculator; more than one only
// when B exceeds it), then the short blocks below; a block owns
// rows of one sample, so a per-sample modulation row is read once per block and folded with the
// LayerNorm affine into two per-column coefficients, kept in shared memory:
//     y = x_hat * alpha + beta,   alpha = w * (1 + scale),   beta = b * (1 + scale) + shift.
// The i-th block of a sample takes its rows i, i + tiles, i + 2 tiles, ..., so at any time the wave
// reads a window of neighbouring rows, as a copy kernel does (a tile of consecutive rows per block
// measured 1-6 points of SoL slower: KERNEL_NOTES v14). The wave takes FwdArgs::main_rows of
// each sample, and short blocks of tail_rows consecutive rows, launched after it, take the rest as
// SMs free up (KERNEL_NOTES v20).
// A block of T threads covers one row at a time; thread t owns the 16-byte groups t, t + T, ...
// (C of them), so the row stays in registers and the next row's x is loaded while the current
// row is reduced. LayerNorm statistics are two-pass in fp32 (mean, then the mean of squared
// deviations of the values already in registers): no cancellation, no second read of x. (A
// one-barrier variant merging per-thread statistics with Chan's update measured 1.5-2x slower:
// KERNEL_NOTES.md, v3.) RMSNorm has one reduction, the mean of squares, and so one barrier a row;
// the ring's slot is released after it.
//
// Segmented layout (FwdArgs::seg: a pack, B = 1): the rows' segments are read with the rows, and a
// thread recomputes its coefficients where the segment changes. The wave's blocks take tiles of
// consecutive rows (Segments::consecutive, set for every segmented call), so that with non-decreasing
// ids a block crosses one or two segment boundaries instead of every one (measured faster than the
// interleaved order at 1, 12 and 42 segments: benchmarks/KERNEL_NOTES.md).
//
// RING (sm_90; aligned rows): rows come through a ring of a.stages slots in shared memory instead
// of the register prefetch, filled by bulk copies that thread 0 issues a.stages rows ahead; the
// copy engine keeps a.stages - 1 rows per block in flight without registers (Little's law asks for
// ~26 KB per SM: KERNEL_NOTES.md, v6). With per-token modulation (PT) a slot also holds the row's
// scale and/or shift rows (mod_rows), counted on the same mbarrier. A slot is refilled right after
// the first block reduction of its row, when every thread holds the row (and its modulation) in
// registers; with the bulk store of y (a.store == 1, below) it holds the row's y until the copy
// engine has stored it, and is refilled two rows later (rows fetched a.stages - 2 ahead). Same
// arithmetic and rounding either way.
#pragma once

#include <type_traits>

#include "norm_modulate.cuh"

namespace adaln {

template <Norm N, typename Tx, typename Tm, typename To, int C, bool PT, bool RING, bool SEG = false>
__global__ void __launch_bounds__(kMaxThreads) fwd_kernel(const FwdArgs a, int64_t tiles) {
  static_assert(!SEG || (RING && !PT), "the segmented layout takes the ring kernel with per-sample rows");
  constexpr bool RMS = N == Norm::RMS;
  constexpr int VEC = 16 / sizeof(Tx);
  __shared__ float red[2 * 1 * 32];
  __shared__ __align__(8) uint64_t full[RING ? kMaxStages : 1];
  int parity = 0;
  // The block's rows: the k-th (0 <= k < count) is row first + k * step of sample b: rows t,
  // t + tiles, t + 2 tiles, ... of the sample's first main_rows, so that at any time the blocks of a
  // wave read neighbouring rows; after the wave's B * tiles blocks, short blocks of tail_rows
  // consecutive rows take the rest.
  const int64_t wave = a.B * tiles;
  const bool tail = blockIdx.x >= wave;
  const int64_t j = tail ? blockIdx.x - wave : blockIdx.x, per = tail ? a.tail_blocks : tiles;
  const int64_t b = j / per, t = j % per;
  int64_t first = tail ? a.main_rows + t * a.tail_rows : t;
  int64_t step = tail ? 1 : tiles;
  int64_t count = tail ? min(static_cast<int64_t>(a.tail_rows), a.N - first)
                       : (t < a.main_rows ? (a.main_rows - 1 - t) / tiles + 1 : 0);
  if constexpr (SEG) {  // a pack: the wave's blocks take consecutive rows (Segments::consecutive)
    if (!tail && a.seg.consecutive) {
      const int64_t rows = (a.main_rows + tiles - 1) / tiles;
      first = t * rows;
      step = 1;
      count = min(rows, a.main_rows - first);
    }
  }
  if (count <= 0) return;  // whole block: no barrier is skipped by part of it
  const int D = a.D, T = blockDim.x, tid = threadIdx.x;
  const bool al = a.aligned;
  const Tx* __restrict__ x = static_cast<const Tx*>(a.x);
  To* __restrict__ y = static_cast<To*>(a.y);
  const Tm* __restrict__ sc = static_cast<const Tm*>(a.scale.ptr) + b * a.scale.sb;
  const Tm* __restrict__ sh = a.shift.ptr ? static_cast<const Tm*>(a.shift.ptr) + b * a.shift.sb : nullptr;
  // Per-row modulation loads (PT only), see mod_rows.
  const ModRows mr = mod_rows(a);
  const bool s_row = PT && mr.scale;
  const bool h_row = PT && mr.shift;

  extern __shared__ float4 coef_smem[];
  const CoefRow<VEC> alpha{coef_smem}, beta{coef_smem + C * (VEC / 4) * T};
  const int S = a.stages;
  const uint32_t row_bytes = static_cast<uint32_t>(D) * sizeof(Tx);
  const uint32_t mod_bytes = static_cast<uint32_t>(D) * sizeof(Tm);
  const size_t x_stride = ring_stride(D, sizeof(Tx)), m_stride = ring_stride(D, sizeof(Tm));
  // slot layout: x row | scale row (s_row) | shift row (h_row)
  const size_t stride = x_stride + (PT ? mr.count() : 0) * m_stride;
  const size_t h_off = x_stride + (s_row ? m_stride : 0);
  char* ring = reinterpret_cast<char*>(coef_smem + 2 * C * (VEC / 4) * T);
  auto row = [&](int64_t k) { return first + k * step; };
  auto x_row = [&](int64_t n) { return x + (b * a.N + n) * static_cast<int64_t>(D); };
  auto fetch = [&](int slot, int64_t k) {  // thread 0: the k-th row (and its modulation rows) into a ring slot
    const int64_t n = row(k);
    char* dst = ring + slot * stride;
    async_proxy_fence();
    mbar_expect(&full[slot], row_bytes + (s_row ? mod_bytes : 0u) + (h_row ? mod_bytes : 0u));
    bulk_copy(dst, x_row(n), row_bytes, &full[slot]);
    if (s_row) bulk_copy(dst + x_stride, sc + n * a.scale.sn, mod_bytes, &full[slot]);
    if (h_row) bulk_copy(dst + h_off, sh + n * a.shift.sn, mod_bytes, &full[slot]);
  };
  RingCursor cur{full, S};
  if constexpr (RING) cur.start(0, count, fetch);
  // Bulk store of y (FwdArgs::store): the k-th row's y is written into its own slot, over x,
  // each thread at the columns it read, then fenced for the async proxy by each writer; after the
  // next row's first barrier thread 0 has the copy engine store it, and refills the slot of the row
  // before (whose store has then left shared memory), so rows are fetched S - 2 ahead. Needs y of
  // x's element size (the slot holds a row of x) and S >= 3.
  constexpr bool kBulkY = RING && !PT && sizeof(To) == sizeof(Tx);
  const bool bulk_y = kBulkY && a.store == 1 && S >= 3;
  auto y_row = [&](int64_t k) { return y + (b * a.N + row(k)) * static_cast<int64_t>(D); };
  auto slot_back = [&](int back) { return cur.slot - back < 0 ? cur.slot - back + S : cur.slot - back; };
  // Chunk c of the coefficients of modulation row m (0, or the segment: sc and sh already point at
  // sample b's row), computed into w (alpha) and bb (beta).
  auto coef_chunk = [&](int c, int64_t m, float (&w)[VEC], float (&bb)[VEC]) {
    const int col = (c * T + tid) * VEC;
    float s[VEC], h[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f, bb[j] = 0.f, s[j] = 0.f, h[j] = 0.f;
    if (col < D) {
      if (a.weight) load_f<float, VEC>(a.weight, col, D, al, w);
      if (a.bias) load_f<float, VEC>(a.bias, col, D, al, bb);
      if (!s_row) load_f<Tm, VEC>(sc + m * a.scale.sb, col, D, al, s);
      if (sh && !h_row) load_f<Tm, VEC>(sh + m * a.shift.sb, col, D, al, h);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      w[j] = w[j] * (1.f + s[j]);
      bb[j] = bb[j] * (1.f + s[j]) + h[j];
    }
  };
  // Segmented layout (SEG): the coefficients of the current row's segment; where the segment
  // changes each thread recomputes its own columns (no barrier: no thread reads another's), at the
  // top of the row, where few registers are live; the next row's segment is read a row ahead.
  int64_t seg_cur = SEG ? seg_of(a.seg, row(0)) : 0, seg_next = seg_cur;
#pragma unroll
  for (int c = 0; c < C; ++c) {  // (with the ring: while the first rows land)
    float w[VEC], bb[VEC];
    coef_chunk(c, seg_cur, w, bb);
    alpha.store(c, w);
    beta.store(c, bb);
  }

  const float inv_d = 1.f / static_cast<float>(D);
  Raw<Tx, VEC> nx[C];  // register path: the next row, loaded while this one is reduced
  // (from a pointer stepped by the row order's stride: recomputing x_row(row(k + 1)) each row cost
  // 14 registers at 1 chunk, 7 -> 5 blocks an SM at D = 1536; never stepped past the sample's rows)
  const Tx* x_next = x_row(first);
  const int64_t x_step = step * static_cast<int64_t>(D);
  if constexpr (!RING) load_chunks(x_next, D, T, tid, al, nx);

  for (int64_t k = 0; k < count; ++k) {
    const int64_t n = row(k);
    if constexpr (SEG) {
      const int64_t m = seg_next;
      if (k + 1 < count) seg_next = seg_of(a.seg, row(k + 1));
      if (m != seg_cur) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
          float w[VEC], bb[VEC];
          coef_chunk(c, m, w, bb);
          alpha.store(c, w);
          beta.store(c, bb);
        }
        seg_cur = m;
      }
    }
    Raw<Tx, VEC> rx[C];
    char* const slot_k = ring + cur.slot * stride;  // (RING) this row's slot
    if constexpr (RING) {
      cur.wait();
      load_chunks(reinterpret_cast<const Tx*>(slot_k), D, T, tid, true, rx);
    } else {
#pragma unroll
      for (int c = 0; c < C; ++c) rx[c] = nx[c];
      x_next = k + 1 < count ? x_next + x_step : x_next;
      if (k + 1 < count) load_chunks(x_next, D, T, tid, al, nx);
    }
    float xv[C][VEC];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) xv[c][j] = to_f<Tx>(rx[c].v[j]);

    Raw<Tm, VEC> sr[C], hr[C];
    if constexpr (PT) {  // issued before the reductions so their latency overlaps them (and, with
                         // the ring, read before the slot is refilled)
      const Tm* srow = RING ? reinterpret_cast<const Tm*>(ring + cur.slot * stride + x_stride) : sc + n * a.scale.sn;
      const Tm* hrow = RING ? reinterpret_cast<const Tm*>(ring + cur.slot * stride + h_off) : sh + n * a.shift.sn;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int col = (c * T + tid) * VEC;
        if (col < D) {
          if (s_row) sr[c] = load_raw<Tm, VEC>(srow, col, D, RING || al);
          if (h_row) hr[c] = load_raw<Tm, VEC>(hrow, col, D, RING || al);
        }
      }
    }

    // After the row's first barrier (every thread holds the row and its modulation in registers,
    // and has written the previous row's y): the ring's bookkeeping.
    auto after_first_barrier = [&]() {
      if constexpr (RING) {
        if (bulk_y) {  // every thread has written the previous row's y into its slot (before the barrier)
          if (tid == 0) {
            if (k >= 1) {
              bulk_store(y_row(k - 1), ring + slot_back(1) * stride, row_bytes);
              bulk_commit();
            }
            if (k >= 2 && k - 2 + S < count) {
              bulk_wait_read<1>();  // the (k - 2)-th row's y has left its slot
              fetch(slot_back(2), k - 2 + S);
            }
          }
          cur.advance();
        } else {
          cur.release(k, count, fetch);  // every thread has read the slot
        }
      }
    };
    float mean = 0.f;  // (RMSNorm: none)
    if constexpr (!RMS) {
      float sum[1] = {0.f};
#pragma unroll
      for (int c = 0; c < C; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum[0] += xv[c][j];  // out-of-range elements are zero
      block_sum<1>(sum, red, parity);
      after_first_barrier();
      mean = sum[0] * inv_d;
    }

    float sq[1] = {0.f};
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      if constexpr (RING || RMS) {  // aligned rows (D % VEC == 0): a group is wholly in the row or past its
                                    // end; RMSNorm: out-of-range elements are zero
        if (RMS || col < D) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) sq[0] += (xv[c][j] - mean) * (xv[c][j] - mean);
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float dlt = (col + j < D) ? xv[c][j] - mean : 0.f;
          sq[0] += dlt * dlt;
        }
      }
    }
    block_sum<1>(sq, red, parity);
    if constexpr (RMS) after_first_barrier();
    const float rstd = rsqrtf(sq[0] * inv_d + a.eps);

    To* yrow = y + (b * a.N + n) * static_cast<int64_t>(D);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      if (col >= D) continue;
      float out[VEC], av[VEC], bv[VEC];
      alpha.load(c, av);
      beta.load(c, bv);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float al_ = av[j], be_ = bv[j];
        if constexpr (PT) {
          if (s_row) {
            const float s1 = 1.f + to_f<Tm>(sr[c].v[j]);
            al_ *= s1;
            be_ *= s1;
          }
          if (h_row) be_ += to_f<Tm>(hr[c].v[j]);
        }
        out[j] = (xv[c][j] - mean) * rstd * al_ + be_;
      }
      if (kBulkY && bulk_y) store_f<To, VEC>(reinterpret_cast<To*>(slot_k), col, D, true, out);
      else store_f<To, VEC>(yrow, col, D, al, out);
    }
    if (bulk_y) async_proxy_fence();  // each writer: its y visible to the copy engine (after the next barrier)
    if (tid == 0) {
      if constexpr (!RMS) a.mean[b * a.N + n] = mean;
      a.rstd[b * a.N + n] = rstd;
    }
  }
  if (bulk_y) {  // the last row's y, once every thread has written it; shared memory outlives the reads
    __syncthreads();
    if (tid == 0) {
      bulk_store(y_row(count - 1), ring + slot_back(1) * stride, row_bytes);
      bulk_commit();
      bulk_wait_read<0>();
    }
  }
}

// Chunks a thread up to which the forward takes the ring: ptxas sm_90 shows no spills up to 4 with
// per-sample or shared modulation, and up to 2 with per-token rows (at 4: 128 registers, spills).
constexpr int kRingChunks = 4;
constexpr int kRingChunksPerToken = 2;
// Automatic forward ring: slots for ~32 KB of rows per block. 64 KB (the backward's) measured worse on the
// H200 wherever it gave more than 4 slots: per-token D = 1536 (7 slots) 73% of SoL against 88% with 2.
constexpr size_t kFwdRingBytes = 32 * 1024;
// Automatic store of y (FwdArgs::store = -1): the bulk store from the ring slot for rows of up to
// 6 KB, with 4 slots unless FwdArgs::stages asks otherwise. Measured on the H200 (bf16, per-sample,
// N = 65536, B = 1 / 2; KERNEL_NOTES v18, v19): D = 1536 84 / 88% of SoL against 81 / 85–86% storing
// from the threads, D = 3072 90 / 87–91% against 88–89 / 87–90%; at D = 5120 (10 KB rows) 81–83%
// against 87–90%.
constexpr size_t kBulkStoreRowBytes = 6 * 1024;
constexpr int kBulkStoreStages = 4;
// Automatic share of the rows left to short blocks of 8 rows after the wave (FwdArgs::tail_pct = -1):
// 10% for rows of up to 4 KB, 5% for wider ones. Measured on the H200 (bf16, per-sample, N = 65536,
// B = 1 / 2, against no short blocks; KERNEL_NOTES v20): D = 1536 86 / 91% of SoL against 84 / 88–89%
// (10%), D = 5120 90 / 91–92% against 88 / 89% (5%); D = 3072 89–90 / 92–93% against 90–91 / 93% (5%;
// 10% gave 86 / 89%).
constexpr size_t kFwdTailRowBytes = 4 * 1024;
constexpr int64_t kMaxGridX = 2147483647;  // blocks a 1-D grid may have
constexpr int kFwdTailPctNarrow = 10, kFwdTailPctWide = 5;
// No short blocks where the wave gives each block fewer rows a sample than this (small row counts):
// measured on the H200 (bf16 RMSNorm, D = 2048; `kernel_stages.py small`) the short blocks made the
// forward slower there: (8, 384) 0.022 ms against 0.016 ms without them, (1, 6144) 0.027 against 0.023.
constexpr int64_t kFwdTailMinRowsPerBlock = 16;

// The forward ring kernel's automatic block shape: ring_row_shape's, but for 16-bit x two chunks a thread
// on up to 256 threads where ring_row_shape gives more (D = 2056-4096). Measured on one H200 (bf16,
// N = 65536, forced max_threads; benchmarks/results/segmented_h200_shape_sweep.txt): at D = 3072 two
// chunks of 192 threads read 90.4% of speed-of-light with per-sample rows and 83.1% in the segmented
// layout, against 88.6% / 79.7% with four chunks of 96.
inline RowShape fwd_ring_shape(int D, DType xt, int max_threads, int ring_chunks) {
  const RowShape shape = ring_row_shape(D, xt, max_threads, ring_chunks);
  if (max_threads > 0 || xt == DType::F32 || shape.chunks <= 2) return shape;
  const RowShape two = row_shape(D, xt, 256);
  return two.chunks <= 2 ? two : shape;
}

// Whether it launched: false only for the segmented layout where the ring cannot run.
template <Norm N, typename Tx, typename Tm, typename To>
bool fwd_typed(const FwdArgs& a0, cudaStream_t stream) {
  const bool pt = a0.scale.sn != 0 || (a0.shift.ptr && a0.shift.sn != 0);
  const size_t slot = ring_stride(a0.D, sizeof(Tx)) + (pt ? mod_rows(a0).count() : 0) * ring_stride(a0.D, sizeof(Tm));
  // y through the ring slot (per-sample or shared modulation, y of x's element size; the kernel
  // also needs 3 or more slots)
  const bool bulk = !pt && sizeof(To) == sizeof(Tx) &&
                    (a0.store == 1 || (a0.store < 0 && static_cast<size_t>(a0.D) * sizeof(Tx) <= kBulkStoreRowBytes));
  auto go = [&](auto kernel, RowShape rs, int stages) {
    FwdArgs a = a0;
    a.stages = stages;
    a.store = bulk ? 1 : 0;
    const size_t smem = coef_smem_bytes(2, rs.chunks, rs.threads, a.xt) + stages * slot;
    int64_t tiles, rows_per_tile;  // (the interleaved order needs only the tile count)
    one_wave(kernel, rs.threads, smem, a.B, a.N, /*interleaved=*/true, tiles, rows_per_tile);
    const int pct = a.tail_pct >= 0 ? a.tail_pct
                    : (static_cast<size_t>(a.D) * sizeof(Tx) <= kFwdTailRowBytes ? kFwdTailPctNarrow : kFwdTailPctWide);
    const int64_t per_block = a.N * (100 - pct) / 100 / tiles;  // the wave's rows a block
    a.main_rows = a.N;
    a.tail_blocks = 0;
    if (pct > 0 && a.tail_rows > 0 && per_block >= (a0.tail_pct >= 0 ? 2 : kFwdTailMinRowsPerBlock)) {
      a.main_rows = per_block * tiles;
      a.tail_blocks = (a.N - a.main_rows + a.tail_rows - 1) / a.tail_rows;
      if (a.B * (tiles + a.tail_blocks) > kMaxGridX) a.main_rows = a.N, a.tail_blocks = 0;  // (gridDim.x)
    }
    kernel<<<static_cast<unsigned>(a.B * (tiles + a.tail_blocks)), rs.threads, smem, stream>>>(a, tiles);
  };
  // the ring where it compiles without spills (its own, narrower block shape), else the register prefetch
  const int ring_chunks = pt ? kRingChunksPerToken : kRingChunks;
  const RowShape ring = fwd_ring_shape(a0.D, a0.xt, a0.max_threads, ring_chunks);
  bool ran = false;
  auto try_ring = [&](auto kernel, int chunks) {  // ran: the ring could run, and was launched
    const size_t coef = coef_smem_bytes(2, chunks, ring.threads, a0.xt);
    const int requested = bulk && a0.stages < 0 ? kBulkStoreStages : a0.stages;
    const int stages = ring_stages(requested, a0.aligned, coef, slot, kFwdRingBytes,
                                   reinterpret_cast<const void*>(kernel));
    if (stages > 0) go(kernel, ring, stages);
    ran = stages > 0;
  };
  if (a0.seg.on()) {  // the segmented layout: the ring kernel only (else not taken)
    if (pt || ring.chunks > kRingChunks) return false;
    with_chunk_count<kRingChunks>(ring.chunks, [&](auto chunks) {
      constexpr int kC = decltype(chunks)::value;
      try_ring(fwd_kernel<N, Tx, Tm, To, kC, false, true, true>, kC);
    });
    return ran;
  }
  if (ring.chunks <= ring_chunks) {
    with_chunk_count(ring.chunks, [&](auto chunks) {
      constexpr int kC = decltype(chunks)::value;
      if constexpr (kC <= kRingChunksPerToken) {
        if (pt) try_ring(fwd_kernel<N, Tx, Tm, To, kC, true, true>, kC);
      }
      if constexpr (kC <= kRingChunks) {
        if (!pt) try_ring(fwd_kernel<N, Tx, Tm, To, kC, false, true>, kC);
      }
    });
  }
  if (ran) return true;
  const RowShape rs = row_shape(a0.D, a0.xt, a0.max_threads);
  with_chunk_count(rs.chunks, [&](auto chunks) {
    constexpr int kC = decltype(chunks)::value;
    if (pt) go(fwd_kernel<N, Tx, Tm, To, kC, true, false>, rs, 0);
    else go(fwd_kernel<N, Tx, Tm, To, kC, false, false>, rs, 0);
  });
  return true;
}

template <Norm N, typename Tx>
bool fwd_x(const FwdArgs& a, cudaStream_t stream) {
  const bool m32 = a.mt == DType::F32, o32 = a.ot == DType::F32;
  if (m32 && o32) return fwd_typed<N, Tx, float, float>(a, stream);
  if (m32) return fwd_typed<N, Tx, float, Tx>(a, stream);
  if (o32) return fwd_typed<N, Tx, Tx, float>(a, stream);
  return fwd_typed<N, Tx, Tx, Tx>(a, stream);
}

template <Norm N>
bool launch_forward_norm(const FwdArgs& a, cudaStream_t stream) {
  switch (a.xt) {
    case DType::F32: return fwd_typed<N, float, float, float>(a, stream);
    case DType::BF16: return fwd_x<N, __nv_bfloat16>(a, stream);
    default: return fwd_x<N, __half>(a, stream);
  }
}

}  // namespace adaln
