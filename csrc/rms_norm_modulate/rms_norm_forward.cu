// The forward kernels of rms_norm_modulate (RMSNorm), instantiated from norm_modulate_forward.cuh.
#include "norm_modulate_forward.cuh"

namespace adaln {

template bool launch_forward_norm<Norm::RMS>(const FwdArgs& a, cudaStream_t stream);

}  // namespace adaln
