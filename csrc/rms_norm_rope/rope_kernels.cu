// The rms_norm_rope kernels (rope.cuh has the math). A block is blockDim.y rows of blockDim.x threads
// each (rope_shape); a thread owns C groups of VEC consecutive features of its row (groups tid, tid +
// threads, ...), kept in registers across the row's reduction; VEC is even, so a group holds whole
// (even, odd) pairs of one head. Few threads a row, many groups each, and several rows a block keep
// more bytes in flight a SM than a block of one row (a row of D = 1,536 bf16 is one warp's, 6 groups a
// lane). Forward: each block its blockDim.y rows. Backward: a full wave of blocks going over the rows
// blockDim.y at a time, each thread-row's dweight partial in registers (so the backward takes fewer
// groups a thread: one of 16-bit x, C * VEC = 8, where the row allows; at most 64 registers, two blocks
// of kRopeThreads a SM).
#include "rms_norm_rope/rope.cuh"

namespace adaln {
namespace {

constexpr int kRopeRows = 8;       // most rows a block
constexpr int kRopeThreads = 512;  // most threads a row (and a block)

// The sum of v over the blockDim.x threads of each row of the block; every thread gets its row's.
// One warp a row: shuffles alone. Else each warp's partial through `red` (2 * kRopeRows * 32 floats,
// `parity` alternating its halves, as block_sum) and one __syncthreads, which every thread of the
// block must reach.
__device__ __forceinline__ float row_sum(float v, float* red, int& parity) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float* buf = red + (parity * kRopeRows + threadIdx.y) * 32;
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = lane < nwarps ? buf[lane] : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  parity ^= 1;
  return v;
}

// The cos and sin of the VEC / 2 pairs of the group at column col (even) of row (b, n): the head and
// pair index found once for the group, then stepped (a group may cross into the next head).
template <int VEC>
struct RopeAngles {
  float c[VEC / 2], s[VEC / 2];
  __device__ __forceinline__ RopeAngles(const RopeArgs& a, int64_t b, int64_t n, int col) {
    const float* cr = a.cos.p + b * a.cos.sb + n * a.cos.sn;
    const float* sr = a.sin.p + b * a.sin.sb + n * a.sin.sn;
    int h = col / a.Dh, i = (col - h * a.Dh) >> 1;
    const int pairs = a.Dh >> 1;
#pragma unroll
    for (int k = 0; k < VEC / 2; ++k) {
      if (i == pairs) i = 0, ++h;
      // (past D, where the unaligned path's last group ends: never read)
      const bool in = col + 2 * k < a.D;
      c[k] = in ? cr[h * a.cos.sh + i * a.cos.si] : 0.f;
      s[k] = in ? sr[h * a.sin.sh + i * a.sin.si] : 0.f;
      ++i;
    }
  }
};

template <typename Tx, int VEC, int C>
__global__ void __launch_bounds__(kRopeThreads) rope_forward_kernel(RopeArgs a) {
  __shared__ float red[2 * kRopeRows * 32];
  const int tid = threadIdx.x, threads = blockDim.x, D = a.D;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < a.B * a.N;  // (a row past the end still takes part in the block's reduction)
  const int64_t b = row / a.N, n = row - b * a.N;
  Raw<Tx, VEC> xr[C];
  load_chunks<Tx, VEC, C>(static_cast<const Tx*>(a.x) + (valid ? row : 0) * D, valid ? D : 0, threads, tid,
                          a.aligned, xr);
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float v = to_f<Tx>(xr[c].v[j]);
      ss += v * v;
    }
  int parity = 0;
  ss = row_sum(ss, red, parity);
  if (!valid) return;
  const float rstd = rsqrtf(ss / D + a.eps);
  if (tid == 0) a.rstd[row] = rstd;
  void* yrow = elem_ptr(a.y, a.yt, row * D);
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int col = (c * threads + tid) * VEC;
    if (col >= D) continue;
    float w[VEC], out[VEC];
    if (a.weight) {
      load_f<float, VEC>(a.weight, col, D, a.aligned, w);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[j] = 1.f;
    }
    const RopeAngles<VEC> r(a, b, n, col);
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      const float cs = r.c[j / 2], sn = r.s[j / 2];
      const float n1 = to_f<Tx>(xr[c].v[j]) * rstd * w[j], n2 = to_f<Tx>(xr[c].v[j + 1]) * rstd * w[j + 1];
      out[j] = n1 * cs - n2 * sn;  // (zeros past D: the tables read 0 there)
      out[j + 1] = n1 * sn + n2 * cs;
    }
    store_any<VEC>(yrow, a.yt, col, D, a.aligned, out);
  }
}

// DyRows: TypedRows<Tx> where dy has x's dtype (half the registers of AnyRows for 16-bit dy), else
// AnyRows. dn (and g = dn * w) is formed twice, before and after the row's reduction, from the raw x
// and dy kept in registers, instead of keeping it: fewer registers, more blocks a SM.
template <typename Tx, typename DyRows, int VEC, int C>
__global__ void __launch_bounds__(kRopeThreads, 2) rope_backward_kernel(RopeArgs a) {
  __shared__ float red[2 * kRopeRows * 32];
  const int tid = threadIdx.x, threads = blockDim.x, D = a.D;
  const int64_t rows = a.B * a.N, step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  float dw[C][VEC];
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[c][j] = 0.f;
  int parity = 0;
  // (the same trip count for every thread of the block: the rows past the end take part in row_sum)
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const int64_t r0 = valid ? row : 0, b = r0 / a.N, n = r0 - b * a.N;
    const int Dv = valid ? D : 0;  // (loads of an invalid row: zeros)
    const float rstd = valid ? a.rstd[row] : 0.f;
    Raw<Tx, VEC> xr[C];
    load_chunks<Tx, VEC, C>(static_cast<const Tx*>(a.x) + r0 * D, Dv, threads, tid, a.aligned, xr);
    typename DyRows::template RawT<VEC> dyr[C];
    DyRows::template load<VEC, C>(DyRows::at(a.dy, a.dyt, r0 * D), a.dyt, Dv, threads, tid, a.aligned, dyr);
    // g = dn * w and x_hat of the pairs of chunk c (zeros past D); with `sum`, dn * x_hat added to dw
    auto grads = [&](int c, float (&g)[VEC], float (&h)[VEC], bool sum) {
      const int col = (c * threads + tid) * VEC;
      float d[VEC], w[VEC];
      DyRows::template to_f<VEC>(dyr[c], a.dyt, d);
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[j] = 1.f;
      if (a.weight && col < D) load_f<float, VEC>(a.weight, col, D, a.aligned, w);
      const RopeAngles<VEC> r(a, b, n, col);
#pragma unroll
      for (int j = 0; j < VEC; j += 2) {
        const float cs = r.c[j / 2], sn = r.s[j / 2];  // (0 past D, so g = 0 there)
        const float dn1 = d[j] * cs + d[j + 1] * sn, dn2 = d[j + 1] * cs - d[j] * sn;
        h[j] = to_f<Tx>(xr[c].v[j]) * rstd, h[j + 1] = to_f<Tx>(xr[c].v[j + 1]) * rstd;
        if (sum) dw[c][j] += dn1 * h[j], dw[c][j + 1] += dn2 * h[j + 1];
        g[j] = dn1 * w[j], g[j + 1] = dn2 * w[j + 1];
      }
    };
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      float g[VEC], h[VEC];
      grads(c, g, h, true);
#pragma unroll
      for (int j = 0; j < VEC; ++j) dot += g[j] * h[j];
    }
    const float m = row_sum(dot, red, parity) / D;
    if (!valid) continue;
    void* dxrow = elem_ptr(a.dx, a.dxt, row * D);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * threads + tid) * VEC;
      if (col >= D) continue;
      float g[VEC], h[VEC];
      grads(c, g, h, false);
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[j] = rstd * (g[j] - h[j] * m);
      store_any<VEC>(dxrow, a.dxt, col, D, a.aligned, g);
    }
  }
  if (!a.dweight) return;
  // this thread-row's partial (or, for a single one, the total) of dweight: plane 0 of its [2, D] slot
  const int64_t part = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  float* dst = gridDim.x * blockDim.y == 1 ? a.dweight : a.totals + 2 * part * D;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int col = (c * threads + tid) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (col + j < D) dst[col + j] = dw[c][j];
  }
}

// Threads a row, rows a block and groups a thread for rows of D features: up to max_groups groups of
// VEC a thread, a warp a row where that covers it, else as few warps as take the row (more groups
// where kRopeThreads would not: D <= kMaxFeatures needs at most 8 of fp32); rows up to 256 threads a
// block (kRopeRows at most).
RopeShape rope_shape(int D, int vec, int max_groups) {
  const int groups = (D + vec - 1) / vec;
  int chunks = 1;
  while (chunks < max_groups && (groups + chunks - 1) / chunks > 32) chunks *= 2;
  while ((groups + chunks - 1) / chunks > kRopeThreads) chunks *= 2;
  const int threads = ((groups + chunks - 1) / chunks + 31) / 32 * 32;
  const int rows = threads >= 256 ? 1 : (256 / threads < kRopeRows ? 256 / threads : kRopeRows);
  return {threads, rows, chunks};
}

// f(kernel, shape) for the dtypes and the row's shape.
template <bool kBackward, typename F>
void with_rope_kernel(const RopeArgs& a, const F& f) {
  const auto body = [&](auto tag) {
    using Tx = typename std::decay_t<decltype(tag)>::type;
    constexpr int VEC = 16 / sizeof(Tx);
    // the backward's dweight partial: C * VEC registers a thread
    const RopeShape rs = rope_shape(a.D, VEC, kBackward ? 8 / VEC : 8);
    with_chunk_count<8>(rs.chunks, [&](auto chunk_count) {
      constexpr int C = decltype(chunk_count)::value;
      if constexpr (!kBackward) f(rope_forward_kernel<Tx, VEC, C>, rs);
      else if constexpr (C * VEC <= 32) {  // (8 but for the widest rows: rope_shape)
        if (a.dyt == a.xt) f(rope_backward_kernel<Tx, TypedRows<Tx>, VEC, C>, rs);
        else f(rope_backward_kernel<Tx, AnyRows, VEC, C>, rs);
      }
    });
  };
  switch (a.xt) {
    case DType::BF16: body(BF16Tag{}); break;
    case DType::F16: body(F16Tag{}); break;
    default: body(F32Tag{}); break;
  }
}

}  // namespace

void launch_rope_forward(const RopeArgs& a, cudaStream_t stream) {
  with_rope_kernel<false>(a, [&](auto kernel, RopeShape rs) {
    const int64_t blocks = (a.B * a.N + rs.rows - 1) / rs.rows;
    kernel<<<static_cast<unsigned>(blocks), dim3(rs.threads, rs.rows), 0, stream>>>(a);
  });
}

int rope_backward_blocks(const RopeArgs& a) {
  int blocks = 1, rows = 1;
  with_rope_kernel<true>(a, [&](auto kernel, RopeShape rs) {
    blocks = blocks_per_sm(reinterpret_cast<const void*>(kernel), rs.threads * rs.rows, 0) * device_props().sms;
    rows = rs.rows;
  });
  const int64_t needed = (a.B * a.N + rows - 1) / rows;
  return static_cast<int>(needed < blocks ? needed : blocks);
}

int rope_backward_partials(const RopeArgs& a) {
  int rows = 1;
  with_rope_kernel<true>(a, [&](auto, RopeShape rs) { rows = rs.rows; });
  return a.blocks * rows;
}

void launch_rope_backward(const RopeArgs& a, cudaStream_t stream) {
  int partials = a.blocks;
  with_rope_kernel<true>(a, [&](auto kernel, RopeShape rs) {
    kernel<<<a.blocks, dim3(rs.threads, rs.rows), 0, stream>>>(a);
    partials *= rs.rows;
  });
  launch_reduce_totals(a.totals, partials, a.D, a.dweight, nullptr, stream);
}

}  // namespace adaln
