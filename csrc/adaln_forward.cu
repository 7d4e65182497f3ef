// Forward kernel of the fused LayerNorm -> modulate op: one launch reads x once and writes y in
// the output dtype plus fp32 mean and rstd per row.
//
// Grid: B * tiles blocks, one wave (blocks per SM from the occupancy calculator); a block owns a
// tile of consecutive rows of one sample, so a per-sample modulation row is read once per block
// and folded with the LayerNorm affine into two per-column coefficients, kept in shared memory:
//     y = x_hat * alpha + beta,   alpha = w * (1 + scale),   beta = b * (1 + scale) + shift.
// A block of T threads covers one row at a time; thread t owns the 16-byte groups t, t + T, ...
// (C of them), so the row stays in registers and the next row's x is loaded while the current
// row is reduced. Statistics are two-pass in fp32 (mean, then the mean of squared deviations of
// the values already in registers): no cancellation, no second read of x. (A one-barrier variant
// merging per-thread statistics with Chan's update measured 1.5-2x slower: KERNEL_NOTES.md, v3.)
#include "adaln_modulate.cuh"

namespace adaln {

template <typename Tx, typename Tm, typename To, int C, bool PT>
__global__ void __launch_bounds__(kMaxThreads) fwd_kernel(const FwdArgs a, int64_t tiles, int64_t rows_per_tile) {
  constexpr int VEC = 16 / sizeof(Tx);
  __shared__ float red[2 * 1 * 32];
  int parity = 0;
  const int64_t b = blockIdx.x / tiles;
  const int64_t n0 = (blockIdx.x % tiles) * rows_per_tile;
  const int64_t n1 = min(a.N, n0 + rows_per_tile);
  if (n0 >= n1) return;  // whole block: no barrier is skipped by part of it
  const int D = a.D, T = blockDim.x, tid = threadIdx.x;
  const bool al = a.aligned;
  const Tx* __restrict__ x = static_cast<const Tx*>(a.x);
  To* __restrict__ y = static_cast<To*>(a.y);
  const Tm* __restrict__ sc = static_cast<const Tm*>(a.scale.ptr) + b * a.scale.sb;
  const Tm* __restrict__ sh = a.shift.ptr ? static_cast<const Tm*>(a.shift.ptr) + b * a.shift.sb : nullptr;
  // Per-row modulation loads (PT only): scale when it is per-token; shift when it is per-token,
  // or when scale is (then shift cannot be folded into beta before the multiplication).
  const bool s_row = PT && a.scale.sn != 0;
  const bool h_row = PT && sh != nullptr && (a.shift.sn != 0 || s_row);

  extern __shared__ float4 coef_smem[];
  const CoefRow<VEC> alpha{coef_smem}, beta{coef_smem + C * (VEC / 4) * T};
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int col = (c * T + tid) * VEC;
    float w[VEC], bb[VEC], s[VEC], h[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f, bb[j] = 0.f, s[j] = 0.f, h[j] = 0.f;
    if (col < D) {
      if (a.weight) load_f<float, VEC>(a.weight, col, D, al, w);
      if (a.bias) load_f<float, VEC>(a.bias, col, D, al, bb);
      if (!s_row) load_f<Tm, VEC>(sc, col, D, al, s);
      if (sh && !h_row) load_f<Tm, VEC>(sh, col, D, al, h);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      w[j] = w[j] * (1.f + s[j]);
      bb[j] = bb[j] * (1.f + s[j]) + h[j];
    }
    alpha.store(c, w);
    beta.store(c, bb);
  }

  const float inv_d = 1.f / static_cast<float>(D);
  Raw<Tx, VEC> nx[C];
  auto load_row = [&](int64_t n, Raw<Tx, VEC>(&dst)[C]) {
    const Tx* row = x + (b * a.N + n) * static_cast<int64_t>(D);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      if (col < D) {
        dst[c] = load_raw<Tx, VEC>(row, col, D, al);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) dst[c].v[j] = from_f<Tx>(0.f);
      }
    }
  };
  load_row(n0, nx);

  for (int64_t n = n0; n < n1; ++n) {
    float xv[C][VEC];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) xv[c][j] = to_f<Tx>(nx[c].v[j]);
    if (n + 1 < n1) load_row(n + 1, nx);  // in flight while this row is reduced

    Raw<Tm, VEC> sr[C], hr[C];
    if constexpr (PT) {  // issued before the reductions so their latency overlaps them
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int col = (c * T + tid) * VEC;
        if (col < D) {
          if (s_row) sr[c] = load_raw<Tm, VEC>(sc + n * a.scale.sn, col, D, al);
          if (h_row) hr[c] = load_raw<Tm, VEC>(sh + n * a.shift.sn, col, D, al);
        }
      }
    }

    float sum[1] = {0.f};
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum[0] += xv[c][j];  // out-of-range elements are zero
    block_sum<1>(sum, red, parity);
    const float mean = sum[0] * inv_d;

    float sq[1] = {0.f};
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float dlt = (col + j < D) ? xv[c][j] - mean : 0.f;
        sq[0] += dlt * dlt;
      }
    }
    block_sum<1>(sq, red, parity);
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
      store_f<To, VEC>(yrow, col, D, al, out);
    }
    if (tid == 0) {
      a.mean[b * a.N + n] = mean;
      a.rstd[b * a.N + n] = rstd;
    }
  }
}

// The forward with a shared-memory row ring (sm_90; per-sample or shared modulation; aligned rows).
// Each block keeps a ring of S = a.stages row buffers filled by bulk copies that thread 0 issues
// S rows ahead, so S - 1 rows per block are in flight without holding registers: v4's register
// prefetch holds one, and Little's law asks for ~26 KB per SM (KERNEL_NOTES.md). A slot is refilled
// right after the first block reduction of its row, when every thread has copied the row into
// registers. Same coefficients, statistics and rounding as fwd_kernel.
template <typename Tx, typename Tm, typename To, int C>
__global__ void __launch_bounds__(kMaxThreads) fwd_ring_kernel(const FwdArgs a, int64_t tiles, int64_t rows_per_tile) {
  constexpr int VEC = 16 / sizeof(Tx);
  __shared__ float red[2 * 1 * 32];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  int parity = 0;
  const int64_t b = blockIdx.x / tiles;
  const int64_t n0 = (blockIdx.x % tiles) * rows_per_tile;
  const int64_t n1 = min(a.N, n0 + rows_per_tile);
  if (n0 >= n1) return;  // whole block: no barrier is skipped by part of it
  const int D = a.D, T = blockDim.x, tid = threadIdx.x, S = a.stages;
  const uint32_t row_bytes = static_cast<uint32_t>(D) * sizeof(Tx);
  const size_t stride = ring_stride(D, sizeof(Tx));
  const Tx* __restrict__ x = static_cast<const Tx*>(a.x) + b * a.N * static_cast<int64_t>(D);
  To* __restrict__ y = static_cast<To*>(a.y);
  const Tm* __restrict__ sc = static_cast<const Tm*>(a.scale.ptr) + b * a.scale.sb;
  const Tm* __restrict__ sh = a.shift.ptr ? static_cast<const Tm*>(a.shift.ptr) + b * a.shift.sb : nullptr;

  extern __shared__ float4 coef_smem[];
  const CoefRow<VEC> alpha{coef_smem}, beta{coef_smem + C * (VEC / 4) * T};
  char* ring = reinterpret_cast<char*>(coef_smem + 2 * C * (VEC / 4) * T);
  if (tid == 0) mbar_init(full, S);
  __syncthreads();
  if (tid == 0) {
    for (int i = 0; i < S && n0 + i < n1; ++i)
      bulk_load(ring + i * stride, x + (n0 + i) * static_cast<int64_t>(D), row_bytes, &full[i]);
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {  // while the first rows land
    const int col = (c * T + tid) * VEC;
    float w[VEC], bb[VEC], s[VEC], h[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f, bb[j] = 0.f, s[j] = 0.f, h[j] = 0.f;
    if (col < D) {
      if (a.weight) load_f<float, VEC>(a.weight, col, D, true, w);
      if (a.bias) load_f<float, VEC>(a.bias, col, D, true, bb);
      load_f<Tm, VEC>(sc, col, D, true, s);
      if (sh) load_f<Tm, VEC>(sh, col, D, true, h);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      w[j] = w[j] * (1.f + s[j]);
      bb[j] = bb[j] * (1.f + s[j]) + h[j];
    }
    alpha.store(c, w);
    beta.store(c, bb);
  }

  const float inv_d = 1.f / static_cast<float>(D);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t it = n - n0;
    const int slot = static_cast<int>(it % S);
    mbar_wait(&full[slot], static_cast<uint32_t>((it / S) & 1));
    const Tx* row = reinterpret_cast<const Tx*>(ring + slot * stride);
    float xv[C][VEC];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
      if (col < D) {
        const Raw<Tx, VEC> r = load_raw<Tx, VEC>(row, col, D, true);
#pragma unroll
        for (int j = 0; j < VEC; ++j) xv[c][j] = to_f<Tx>(r.v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) xv[c][j] = 0.f;
      }
    }

    float sum[1] = {0.f};
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum[0] += xv[c][j];
    block_sum<1>(sum, red, parity);  // every thread has read the slot: refill it
    if (tid == 0 && n + S < n1) bulk_load(ring + slot * stride, x + (n + S) * static_cast<int64_t>(D), row_bytes, &full[slot]);
    const float mean = sum[0] * inv_d;

    float sq[1] = {0.f};
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * T + tid) * VEC;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float dlt = (col + j < D) ? xv[c][j] - mean : 0.f;
        sq[0] += dlt * dlt;
      }
    }
    block_sum<1>(sq, red, parity);
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
      for (int j = 0; j < VEC; ++j) out[j] = (xv[c][j] - mean) * rstd * av[j] + bv[j];
      store_f<To, VEC>(yrow, col, D, true, out);
    }
    if (tid == 0) {
      a.mean[b * a.N + n] = mean;
      a.rstd[b * a.N + n] = rstd;
    }
  }
}

RowShape row_shape(int D, DType xt, int max_threads) {
  const int vec = xt == DType::F32 ? 4 : 8;
  const int groups = (D + vec - 1) / vec;
  const int cap = max_threads < 32 ? 32 : (max_threads > kMaxThreads ? kMaxThreads : max_threads);
  int chunks = 1;
  while ((groups + chunks - 1) / chunks > cap && chunks < kMaxChunks) chunks *= 2;
  const int per = (groups + chunks - 1) / chunks;
  return {(per + 31) / 32 * 32, chunks};
}

int max_features(DType) { return kMaxFeatures; }

int num_sms() {
  static int cached[64] = {0};  // per device ordinal; a benign race writes the same value
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    cached[dev] = n > 0 ? n : 1;
  }
  return cached[dev];
}

// Ring slots for a.stages (see FwdArgs::stages), or 0 where the ring cannot run:
// per-token modulation, unaligned rows, a GPU before sm_90, or too little shared memory for two
// slots. Automatic: slots for ~48 KB of rows, 2 to kMaxStages.
static int ring_stages(const FwdArgs& a, bool per_token, size_t coef_bytes) {
  if (a.stages == 0 || per_token || !a.aligned) return 0;
  int dev = 0, major = 0, optin = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (major < 9) return 0;
  const size_t stride = ring_stride(a.D, a.xt == DType::F32 ? 4 : 2);
  const size_t room = static_cast<size_t>(optin) - 1024;  // static shared memory: reduction + barriers
  int stages = a.stages > 0 ? a.stages : static_cast<int>((48 * 1024) / stride);
  stages = stages < 2 ? 2 : (stages > kMaxStages ? kMaxStages : stages);
  while (stages >= 2 && coef_bytes + stages * stride > room) --stages;
  return stages >= 2 ? stages : 0;
}

template <typename Tx, typename Tm, typename To>
void fwd_typed(const FwdArgs& a0, cudaStream_t stream) {
  FwdArgs a = a0;
  const RowShape rs = row_shape(a.D, a.xt, a.max_threads);
  const bool pt = a.scale.sn != 0 || (a.shift.ptr && a.shift.sn != 0);
  const size_t coef = coef_smem_bytes(2, rs.chunks, rs.threads, a.xt);
  a.stages = ring_stages(a, pt, coef);
  const size_t smem = coef + a.stages * ring_stride(a.D, sizeof(Tx));
  auto go = [&](auto kernel) {
    int64_t tiles, rpt;
    one_wave(kernel, rs.threads, smem, a.B, a.N, tiles, rpt);
    kernel<<<static_cast<unsigned>(a.B * tiles), rs.threads, smem, stream>>>(a, tiles, rpt);
  };
  if (a.stages > 0) {
    switch (rs.chunks) {
      case 1: go(fwd_ring_kernel<Tx, Tm, To, 1>); break;
      case 2: go(fwd_ring_kernel<Tx, Tm, To, 2>); break;
      case 4: go(fwd_ring_kernel<Tx, Tm, To, 4>); break;
      default: go(fwd_ring_kernel<Tx, Tm, To, 8>); break;
    }
    return;
  }
  switch (rs.chunks) {
    case 1: pt ? go(fwd_kernel<Tx, Tm, To, 1, true>) : go(fwd_kernel<Tx, Tm, To, 1, false>); break;
    case 2: pt ? go(fwd_kernel<Tx, Tm, To, 2, true>) : go(fwd_kernel<Tx, Tm, To, 2, false>); break;
    case 4: pt ? go(fwd_kernel<Tx, Tm, To, 4, true>) : go(fwd_kernel<Tx, Tm, To, 4, false>); break;
    default: pt ? go(fwd_kernel<Tx, Tm, To, 8, true>) : go(fwd_kernel<Tx, Tm, To, 8, false>); break;
  }
}

template <typename Tx>
void fwd_x(const FwdArgs& a, cudaStream_t stream) {
  const bool m32 = a.mt == DType::F32, o32 = a.ot == DType::F32;
  if (m32 && o32) fwd_typed<Tx, float, float>(a, stream);
  else if (m32) fwd_typed<Tx, float, Tx>(a, stream);
  else if (o32) fwd_typed<Tx, Tx, float>(a, stream);
  else fwd_typed<Tx, Tx, Tx>(a, stream);
}

void launch_forward(const FwdArgs& a, cudaStream_t stream) {
  switch (a.xt) {
    case DType::F32: fwd_typed<float, float, float>(a, stream); break;
    case DType::BF16: fwd_x<__nv_bfloat16>(a, stream); break;
    case DType::F16: fwd_x<__half>(a, stream); break;
  }
}

}  // namespace adaln
