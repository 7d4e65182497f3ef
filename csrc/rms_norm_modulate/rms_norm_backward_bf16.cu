// The backward kernels of rms_norm_modulate (RMSNorm) for x of type __nv_bfloat16, instantiated from
// norm_modulate_backward.cuh.
#include "norm_modulate_backward.cuh"

namespace adaln {

template void run_backward<Norm::RMS, __nv_bfloat16>(BwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
