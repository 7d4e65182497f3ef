// Host-side launch helpers shared by every kernel of the norm -> modulate ops: block shapes, the
// device's SM count, the shared-memory ring's slot count (declared in norm_modulate.cuh).
#include "norm_modulate.cuh"

namespace adaln {

RowShape row_shape(int D, DType xt, int max_threads) {
  const int vec = xt == DType::F32 ? 4 : 8;
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

int ring_stages(int requested, bool eligible, size_t fixed_bytes, size_t slot_bytes, size_t auto_bytes,
                const void* ring_kernel) {
  if (requested == 0 || !eligible) return 0;
  int dev = 0, major = 0, optin = 0;
  cudaFuncAttributes attr{};
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      cudaFuncGetAttributes(&attr, ring_kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  // the device and the code both sm_90+: a build for an older target (e.g. TORCH_CUDA_ARCH_LIST=8.0+PTX,
  // JIT-compiled here) has no bulk copies in it
  if (major < 9 || attr.ptxVersion < 90 || optin <= 1024) return 0;
  const size_t room = static_cast<size_t>(optin) - 1024;  // static shared memory: reductions, barriers
  int stages = requested > 0 ? requested : static_cast<int>(auto_bytes / slot_bytes);
  stages = stages < 2 ? 2 : (stages > kMaxStages ? kMaxStages : stages);
  while (stages >= 2 && fixed_bytes + stages * slot_bytes > room) --stages;
  return stages >= 2 ? stages : 0;
}

}  // namespace adaln
