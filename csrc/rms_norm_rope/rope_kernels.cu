// The rms_norm_rope kernels (rope.cuh has the math). A block is blockDim.y rows of blockDim.x threads
// each (rope_shape); a thread owns C groups of VEC consecutive features of its row (groups tid, tid +
// threads, ...), kept in registers across the row's reduction; VEC is even, so a group holds whole
// (even, odd) pairs of one head. Several groups a thread and several rows a block keep more bytes in
// flight a SM than a block of one row. The rotation tables are read through the read-only path, issued
// with x's loads, not after the row's reduction (a round trip to L2 a group after it held the v2
// kernels to a third of speed-of-light); the weight, which stays in L1, through the ordinary one.
// Forward: each block its blockDim.y rows. Backward: a full wave of blocks going over the rows
// blockDim.y at a time, each thread-row's dweight partial in shared memory (not registers, so that a
// thread may take several groups), one partial a block.
#include "rms_norm_rope/rope.cuh"

namespace adaln {
namespace {

constexpr int kRopeRows = 8;       // most rows a block
constexpr int kRopeThreads = 512;  // most threads a row (and a block)
constexpr int kRopeFwdThreads = 160;  // the forward's cap on threads a row where none is set (rope_shape)

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

// Row `row` of x viewed as [B, N, D] as (b, n): 32-bit division where the rows allow (B * N < 2^31).
__device__ __forceinline__ void row_bn(const RopeArgs& a, int64_t row, int64_t& b, int64_t& n) {
  if (a.B == 1) {
    b = 0, n = row;
  } else if (a.B * a.N <= INT32_MAX) {
    const unsigned r = static_cast<unsigned>(row), N = static_cast<unsigned>(a.N);
    const unsigned q = r / N;
    b = q, n = r - q * N;
  } else {
    b = row / a.N, n = row - b * a.N;
  }
}

// Where a thread's sets of angles start in a row (head h, pair i of the group at column (k * threads +
// tid) * VEC), found once a thread: the same for every row.
template <int VEC, int kSets>
struct AngleStart {
  int h[kSets], i[kSets];
  __device__ __forceinline__ AngleStart(const RopeArgs& a, int threads, int tid) {
#pragma unroll
    for (int k = 0; k < kSets; ++k) {
      const int col = (k * threads + tid) * VEC;
      h[k] = col / a.Dh, i[k] = (col - h[k] * a.Dh) >> 1;
    }
  }
};

// Element i of a table row (row: the table's element (b, n, 0, 0)) as fp32, through the read-only path.
// (One 16-bit load for both 16-bit dtypes, then the conversion: fewer registers than a load a dtype.)
__device__ __forceinline__ float table_at(DType t, const void* row, int i) {
  if (t == DType::F32) return __ldg(static_cast<const float*>(row) + i);
  const unsigned short u = __ldg(static_cast<const unsigned short*>(row) + i);
  return t == DType::BF16 ? __bfloat162float(__ushort_as_bfloat16(u)) : __half2float(__ushort_as_half(u));
}

// The cos and sin of the pairs of a thread's groups in one row: kSets sets of VEC / 2 pairs, set k
// for the group at column (k * threads + tid) * VEC. With kShared, one set serves every group: the
// tables are broadcast over the heads (sh = 0) and the groups of a thread lie whole heads apart
// (threads * VEC a multiple of Dh, D a multiple of VEC), so each group has the same pair indices.
// Read through the read-only path (__ldg), which lets the compiler issue them early: before the row's
// reduction and ahead of earlier groups' stores.
template <int VEC, int kSets>
struct RowAngles {
  float c[kSets][VEC / 2], s[kSets][VEC / 2];
  __device__ __forceinline__ RowAngles(const RopeArgs& a, int64_t b, int64_t n, int threads, int tid,
                                       const AngleStart<VEC, kSets>& st) {
    const void* cr = elem_ptr(a.cos.p, a.cos.t, b * a.cos.sb + n * a.cos.sn);
    const void* sr = elem_ptr(a.sin.p, a.sin.t, b * a.sin.sb + n * a.sin.sn);
    const int pairs = a.Dh >> 1;
#pragma unroll
    for (int k = 0; k < kSets; ++k) {
      const int col = (k * threads + tid) * VEC;
      int h = st.h[k], i = st.i[k];  // (a group may cross into the next head)
#pragma unroll
      for (int q = 0; q < VEC / 2; ++q) {
        if (i == pairs) i = 0, ++h;
        // (0 past D, where the unaligned path's last group ends, so that y and g are 0 there)
        const bool in = col + 2 * q < a.D;
        c[k][q] = in ? table_at(a.cos.t, cr, h * a.cos.sh + i * a.cos.si) : 0.f;
        s[k][q] = in ? table_at(a.sin.t, sr, h * a.sin.sh + i * a.sin.si) : 0.f;
        ++i;
      }
    }
  }
};

// The weight's VEC values from column col (1 where there is none). (Through the ordinary path: it stays
// in L1, and read-only loads let the compiler hoist every group's weights ahead, past 64 registers.)
template <int VEC>
__device__ __forceinline__ void weight_at(const RopeArgs& a, int col, float (&w)[VEC]) {
  if (a.weight && col < a.D) {  // (vector loads of whole 16-byte words only: a 16-bit weight beside fp32 x by element)
    load_any_f<VEC>(a.weight, a.wt, col, a.D, a.aligned && VEC * dtype_bytes(a.wt) % 16 == 0, w);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f;
  }
}

template <typename Tx, int VEC, int C, bool kShared>
__global__ void __launch_bounds__(kRopeThreads, 2) rope_forward_kernel(RopeArgs a) {
  constexpr int kSets = kShared ? 1 : C;
  __shared__ float red[2 * kRopeRows * 32];
  const int tid = threadIdx.x, threads = blockDim.x, D = a.D;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < a.B * a.N;  // (a row past the end still takes part in the block's reduction)
  const int64_t r0 = valid ? row : 0;
  int64_t b, n;
  row_bn(a, r0, b, n);
  Raw<Tx, VEC> xr[C];
  load_chunks<Tx, VEC, C>(static_cast<const Tx*>(a.x) + r0 * D, valid ? D : 0, threads, tid, a.aligned, xr);
  const RowAngles<VEC, kSets> r(a, b, n, threads, tid, AngleStart<VEC, kSets>(a, threads, tid));
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
    weight_at<VEC>(a, col, w);
    const int k = kShared ? 0 : c;
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      const float cs = r.c[k][j / 2], sn = r.s[k][j / 2];
      const float n1 = to_f<Tx>(xr[c].v[j]) * rstd * w[j], n2 = to_f<Tx>(xr[c].v[j + 1]) * rstd * w[j + 1];
      out[j] = n1 * cs - n2 * sn;  // (zeros past D: the tables read 0 there)
      out[j + 1] = n1 * sn + n2 * cs;
    }
    store_any<VEC>(yrow, a.yt, col, D, a.aligned, out);
  }
}

// One group of VEC features of a row at column col (zeros past D): g = dn * w, x_hat and p = dn * x_hat
// (the row's dweight terms), dn the rotation transposed of dy by the group's angles c, s.
template <typename Tx, typename DyRows, int VEC>
__device__ __forceinline__ void rope_grads(const RopeArgs& a, const Raw<Tx, VEC>& x,
                                           const typename DyRows::template RawT<VEC>& dy, const float (&c)[VEC / 2],
                                           const float (&s)[VEC / 2], float rstd, int col, float (&g)[VEC],
                                           float (&h)[VEC], float (&p)[VEC]) {
  float d[VEC], w[VEC];
  DyRows::template to_f<VEC>(dy, a.dyt, d);
  weight_at<VEC>(a, col, w);
#pragma unroll
  for (int j = 0; j < VEC; j += 2) {
    const float cs = c[j / 2], sn = s[j / 2];  // (0 past D, so g = 0 there)
    const float dn1 = d[j] * cs + d[j + 1] * sn, dn2 = d[j + 1] * cs - d[j] * sn;
    h[j] = to_f<Tx>(x.v[j]) * rstd, h[j + 1] = to_f<Tx>(x.v[j + 1]) * rstd;
    p[j] = dn1 * h[j], p[j + 1] = dn2 * h[j + 1];
    g[j] = dn1 * w[j], g[j + 1] = dn2 * w[j + 1];
  }
}

// dw[col + j] += p[j]: a thread-row's dweight partial in shared memory (16-byte accesses where aligned).
template <int VEC>
__device__ __forceinline__ void add_partial(float* dw, int col, int D, bool aligned, const float (&p)[VEC]) {
  if (aligned) {
    float4* q = reinterpret_cast<float4*>(dw + col);
#pragma unroll
    for (int v = 0; v < VEC / 4; ++v) {
      float4 t = q[v];
      t.x += p[4 * v], t.y += p[4 * v + 1], t.z += p[4 * v + 2], t.w += p[4 * v + 3];
      q[v] = t;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (col + j < D) dw[col + j] += p[j];
  }
}

// DyRows: TypedRows<Tx> where dy has x's dtype (half the registers of AnyRows for 16-bit dy), else
// AnyRows. A full wave of blocks goes over the rows, blockDim.y at a time. Each thread-row adds its
// rows' dn * x_hat into its own row of dweight partials in shared memory (dynamic, blockDim.y * D
// floats where a dweight is wanted), at the columns its thread owns, so no two threads touch one
// element and the sums need no atomics; the block then adds its rows' partials in order into its row of
// a.totals. With several groups a thread, dn (and g = dn * w) is formed twice, before and after the
// row's reduction, from the raw x and dy kept in registers, instead of keeping it: fewer registers.
// With one group a thread g and x_hat are kept (64 registers, no spill), so nothing is formed twice.
template <typename Tx, typename DyRows, int VEC, int C, bool kShared>
__global__ void __launch_bounds__(kRopeThreads, 2) rope_backward_kernel(RopeArgs a) {
  constexpr int kSets = kShared ? 1 : C;
  constexpr bool kKeep = C == 1;  // one group a thread: g and h kept, not formed again after the reduction
  extern __shared__ float4 dw_smem[];
  __shared__ float red[2 * kRopeRows * 32];
  const int tid = threadIdx.x, threads = blockDim.x, D = a.D;
  const int64_t rows = a.B * a.N, step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  float* const dw_all = reinterpret_cast<float*>(dw_smem);
  float* const dw = a.dweight ? dw_all + threadIdx.y * D : nullptr;
  if (dw) {
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int col = (c * threads + tid) * VEC + j;
        if (col < D) dw[col] = 0.f;
      }
  }
  const AngleStart<VEC, kSets> start(a, threads, tid);
  int parity = 0;
  // (the same trip count for every thread of the block: the rows past the end take part in row_sum)
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const int64_t r0 = valid ? row : 0;
    const int Dv = valid ? D : 0;  // (loads of an invalid row: zeros)
    const float rstd = valid ? a.rstd[row] : 0.f;
    Raw<Tx, VEC> xr[C];
    load_chunks<Tx, VEC, C>(static_cast<const Tx*>(a.x) + r0 * D, Dv, threads, tid, a.aligned, xr);
    typename DyRows::template RawT<VEC> dyr[C];
    DyRows::template load<VEC, C>(DyRows::at(a.dy, a.dyt, r0 * D), a.dyt, Dv, threads, tid, a.aligned, dyr);
    int64_t b, n;
    row_bn(a, r0, b, n);
    const RowAngles<VEC, kSets> r(a, b, n, threads, tid, start);
    float dot = 0.f;
    float gk[VEC], hk[VEC];  // (kKeep: the one group's g and h, kept across the reduction)
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * threads + tid) * VEC, k = kShared ? 0 : c;
      float g[VEC], h[VEC], p[VEC];
      rope_grads<Tx, DyRows, VEC>(a, xr[c], dyr[c], r.c[k], r.s[k], rstd, col, g, h, p);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        dot += g[j] * h[j];
        if constexpr (kKeep) gk[j] = g[j], hk[j] = h[j];
      }
      if (dw && col < D) add_partial<VEC>(dw, col, D, a.aligned, p);
    }
    const float m = row_sum(dot, red, parity) / D;
    if (!valid) continue;
    void* dxrow = elem_ptr(a.dx, a.dxt, row * D);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = (c * threads + tid) * VEC;
      if (col >= D) continue;
      float g[VEC], h[VEC], p[VEC];
      if constexpr (kKeep) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[j] = gk[j], h[j] = hk[j];
      } else {
        rope_grads<Tx, DyRows, VEC>(a, xr[c], dyr[c], r.c[kShared ? 0 : c], r.s[kShared ? 0 : c], rstd, col, g, h, p);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[j] = rstd * (g[j] - h[j] * m);
      store_any<VEC>(dxrow, a.dxt, col, D, a.aligned, g);
    }
  }
  if (!dw) return;
  // the block's partial: its thread-rows' rows added in order (with a single block, dweight itself, in
  // the weight's dtype)
  __syncthreads();
  for (int d = threadIdx.y * threads + tid; d < D; d += threads * blockDim.y) {
    float t = 0.f;
    for (int y = 0; y < static_cast<int>(blockDim.y); ++y) t += dw_all[y * D + d];
    if (gridDim.x == 1) store1(a.dweight, a.wt, d, t);
    else a.totals[static_cast<int64_t>(blockIdx.x) * D + d] = t;
  }
}

// dweight[d] (of dtype wt, rounded once) = the sum of the backward's partials[p, d] over p in a fixed order: thread (x, y) of a block
// of 32 columns sums p = y, y + kReduceLanes, ... and the kReduceLanes sums are added in y order. No
// atomics: the same bits every run. (Several hundred partials, one a resident block, are more than
// launch_reduce_totals' one thread a column reads quickly: 15 us at D = 1,536 on an H200.)
constexpr int kReduceLanes = 32;
__global__ void __launch_bounds__(32 * kReduceLanes) rope_dweight_kernel(const float* __restrict__ partials, int P,
                                                                         int D, void* dweight, DType wt) {
  __shared__ float sums[kReduceLanes][33];
  const int d = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (d < D) {
#pragma unroll 4
    for (int p = threadIdx.y; p < P; p += kReduceLanes) s += partials[static_cast<int64_t>(p) * D + d];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && d < D) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < kReduceLanes; ++k) t += sums[k][threadIdx.x];
    store1(dweight, wt, d, t);
  }
}

// Threads a row, rows a block and groups a thread for rows of D features: as few groups of VEC a
// thread (1, 2, 3, 4, or 8: fp32 past 8,192 features) as keep the threads a row within the cap, the
// groups spread evenly over the threads (in warps); rows up to 256 threads a block (kRopeRows at most).
// The cap is max_threads where set, else kRopeFwdThreads forward and kRopeThreads backward: measured on
// an H200 (bf16, Wan's q/k at D = 1,536 and 40 heads' 5,120; benchmarks/kernel_stages.py rope), the
// forward is fastest at 2 and 4 groups a thread (96 and 160 threads), the backward at 1 and 2 (192, 320).
RopeShape rope_shape(int D, int vec, int max_threads, bool backward) {
  const int groups = (D + vec - 1) / vec;
  const int cap = max_threads > 0 ? max_threads / 32 * 32 : backward ? kRopeThreads : kRopeFwdThreads;
  int chunks = (groups + cap - 1) / cap;
  if (chunks > 4) chunks = 8;  // (no 5..7)
  const int threads = ((groups + chunks - 1) / chunks + 31) / 32 * 32;
  const int rows = threads >= 256 ? 1 : (256 / threads < kRopeRows ? 256 / threads : kRopeRows);
  return {threads, rows, chunks};
}

// Whether one set of angles serves every group of a thread (RowAngles' kShared) for rows of shape rs.
bool rope_shared_angles(const RopeArgs& a, int vec, const RopeShape& rs) {
  return a.cos.sh == 0 && a.sin.sh == 0 && a.D % vec == 0 && (rs.threads * vec) % a.Dh == 0;
}

// f(std::integral_constant<int, C>{}) for the chunk counts rope_shape gives (1, 2, 3, 4, 8): with_chunk_count
// (norm_modulate.cuh) takes powers of two only, and a 3 there would instantiate every other op's kernels at 3.
template <typename F>
void with_rope_chunks(int chunks, const F& f) {
  switch (chunks) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// f(kernel, shape) for the dtypes, the row's shape and the tables' layout.
template <bool kBackward, typename F>
void with_rope_kernel(const RopeArgs& a, const F& f) {
  const auto body = [&](auto tag) {
    using Tx = typename std::decay_t<decltype(tag)>::type;
    constexpr int VEC = 16 / sizeof(Tx);
    const RopeShape rs = rope_shape(a.D, VEC, a.max_threads, kBackward);
    const bool shared = rope_shared_angles(a, VEC, rs);
    with_rope_chunks(rs.chunks, [&](auto chunk_count) {
      constexpr int C = decltype(chunk_count)::value;
      const auto pick = [&](auto kShared) {
        constexpr bool S = decltype(kShared)::value;
        if constexpr (!kBackward) f(rope_forward_kernel<Tx, VEC, C, S>, rs);
        else if (a.dyt == a.xt) f(rope_backward_kernel<Tx, TypedRows<Tx>, VEC, C, S>, rs);
        else f(rope_backward_kernel<Tx, AnyRows, VEC, C, S>, rs);
      };
      if (shared) pick(std::true_type{});
      else pick(std::false_type{});
    });
  };
  switch (a.xt) {
    case DType::BF16: body(BF16Tag{}); break;
    case DType::F16: body(F16Tag{}); break;
    default: body(F32Tag{}); break;
  }
}

// The backward's dynamic shared memory: a row of dweight partials a thread-row, where one is wanted.
size_t rope_backward_smem(const RopeArgs& a, const RopeShape& rs) {
  return a.dweight ? static_cast<size_t>(rs.rows) * a.D * sizeof(float) : 0;
}

}  // namespace

void launch_rope_forward(const RopeArgs& a, cudaStream_t stream) {
  with_rope_kernel<false>(a, [&](auto kernel, RopeShape rs) {
    const int64_t blocks = (a.B * a.N + rs.rows - 1) / rs.rows;
    kernel<<<static_cast<unsigned>(blocks), dim3(rs.threads, rs.rows), 0, stream>>>(a);
  });
}

void rope_backward_plan(RopeArgs& a) {
  with_rope_kernel<true>(a, [&](auto kernel, RopeShape rs) {
    const int64_t wave = static_cast<int64_t>(blocks_per_sm(reinterpret_cast<const void*>(kernel),
                                                            rs.threads * rs.rows, rope_backward_smem(a, rs))) *
                         device_props().sms;
    const int64_t needed = (a.B * a.N + rs.rows - 1) / rs.rows;
    a.blocks = static_cast<int>(needed < wave ? needed : wave);
  });
  a.partials = a.blocks;
}

void launch_rope_backward(const RopeArgs& a, cudaStream_t stream) {
  with_rope_kernel<true>(a, [&](auto kernel, RopeShape rs) {
    kernel<<<a.blocks, dim3(rs.threads, rs.rows), rope_backward_smem(a, rs), stream>>>(a);
  });
  if (a.dweight && a.partials > 1)
    rope_dweight_kernel<<<(a.D + 31) / 32, dim3(32, kReduceLanes), 0, stream>>>(a.totals, a.partials, a.D, a.dweight,
                                                                             a.wt);
}

}  // namespace adaln
