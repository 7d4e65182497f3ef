// The backward kernels of rms_norm_modulate (RMSNorm) for x of type float, instantiated from
// norm_modulate_backward.cuh.
#include "norm_modulate_backward.cuh"

namespace adaln {

template void run_backward<Norm::RMS, float>(BwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
