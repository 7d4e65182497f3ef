// Host-side launch helpers shared by every kernel of the norm -> modulate ops: block shapes, the
// device's properties (cached), the shared-memory ring's slot count (declared in norm_modulate.cuh).
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "norm_modulate.cuh"

namespace adaln {

RowShape row_shape(int D, DType xt, int max_threads) { return row_shape_vec(D, xt == DType::F32 ? 4 : 8, max_threads); }

RowShape row_shape_vec(int D, int vec, int max_threads) {
  const int groups = (D + vec - 1) / vec;
  const int cap = max_threads <= 0 ? kMaxThreads : (max_threads < 32 ? 32 : (max_threads > kMaxThreads ? kMaxThreads : max_threads));
  int chunks = 1;
  while ((groups + chunks - 1) / chunks > cap && chunks < kMaxChunks) chunks *= 2;
  const int per = (groups + chunks - 1) / chunks;
  return {(per + 31) / 32 * 32, chunks};
}

RowShape ring_row_shape(int D, DType xt, int max_threads, int ring_chunks) {
  if (max_threads <= 0) {
    for (int cap : {128, 256}) {
      const RowShape s = row_shape(D, xt, cap);
      if (s.chunks <= ring_chunks) return s;
    }
  }
  return row_shape(D, xt, max_threads);
}

int max_features(DType) { return kMaxFeatures; }

namespace {
__global__ void __launch_bounds__(256) reduce_totals_kernel(const float* __restrict__ totals, int groups, int D,
                                                            float* dweight, float* dbias) {
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float dw = 0.f, db = 0.f;
  for (int g = 0; g < groups; ++g) {
    dw += totals[2 * g * static_cast<int64_t>(D) + d];
    if (dbias) db += totals[(2 * g + 1) * static_cast<int64_t>(D) + d];  // (a plane only dbias fills)
  }
  if (dweight) dweight[d] = dw;
  if (dbias) dbias[d] = db;
}
}  // namespace

void launch_reduce_totals(const float* totals, int groups, int D, float* dweight, float* dbias, cudaStream_t stream) {
  if (groups <= 1 || (dweight == nullptr && dbias == nullptr)) return;
  reduce_totals_kernel<<<(D + 255) / 256, 256, 0, stream>>>(totals, groups, D, dweight, dbias);
}

const DeviceProps& device_props() {
  constexpr int kMaxDevices = 64;
  static DeviceProps props[kMaxDevices];
  static std::once_flag queried[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    (void)cudaGetLastError();
    dev = 0;
  }
  std::call_once(queried[dev], [dev] {
    DeviceProps& p = props[dev];
    if (cudaDeviceGetAttribute(&p.sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&p.major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&p.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      p = DeviceProps{};  // one SM, no ring: every launch still runs
    }
    if (p.sms < 1) p.sms = 1;
  });
  return props[dev];
}

int blocks_per_sm(const void* kernel, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t, int>, int> cache;
  int dev = 0;
  cudaGetDevice(&dev);
  const auto key = std::make_tuple(kernel, threads, smem, dev);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  if (smem > 47 * 1024) {
    // the opt-in is one ceiling per kernel: raise it to the device's limit, not to this shape's
    // size, or a later launch of a larger cached shape (same kernel, more threads) would fail
    cudaFuncAttributes attr{};
    cudaFuncGetAttributes(&attr, kernel);
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         device_props().smem_optin - static_cast<int>(attr.sharedSizeBytes));
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess || per_sm < 1) {
    (void)cudaGetLastError();
    per_sm = 1;
  }
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = per_sm;
  return per_sm;
}

int stages_keeping_occupancy(const void* kernel, int threads, size_t fixed_bytes, size_t slot_bytes, int stages) {
  if (stages <= 2) return stages;
  const int most = blocks_per_sm(kernel, threads, fixed_bytes + 2 * slot_bytes);
  while (stages > 2 && blocks_per_sm(kernel, threads, fixed_bytes + stages * slot_bytes) < most) --stages;
  return stages;
}

namespace {

// The PTX version `kernel` was compiled for (90: sm_90, with the bulk copies), or 0; queried once per
// kernel and device.
int ptx_version(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  int dev = 0;
  cudaGetDevice(&dev);
  const auto key = std::make_pair(kernel, dev);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attr{};
  int version = 0;
  if (cudaFuncGetAttributes(&attr, kernel) == cudaSuccess) version = attr.ptxVersion;
  else (void)cudaGetLastError();
  cache[key] = version;
  return version;
}

}  // namespace

int ring_stages(int requested, bool eligible, size_t fixed_bytes, size_t slot_bytes, size_t auto_bytes,
                const void* ring_kernel, int min_arch) {
  if (requested == 0 || !eligible) return 0;
  const DeviceProps& dev = device_props();
  const int major = dev.major, optin = dev.smem_optin;
  // the device and the code both min_arch+: a build for an older target (e.g.
  // TORCH_CUDA_ARCH_LIST=8.0+PTX, JIT-compiled here) has no bulk copies in it
  if (major < min_arch / 10 || optin <= 1024 || ptx_version(ring_kernel) < min_arch) return 0;
  const size_t room = static_cast<size_t>(optin) - 1024;  // static shared memory: reductions, barriers
  int stages = requested > 0 ? requested : static_cast<int>(auto_bytes / slot_bytes);
  stages = stages < 2 ? 2 : (stages > kMaxStages ? kMaxStages : stages);
  while (stages >= 2 && fixed_bytes + stages * slot_bytes > room) --stages;
  return stages >= 2 ? stages : 0;
}

}  // namespace adaln
