// The forward kernels of adaln_modulate (LayerNorm), instantiated from norm_modulate_forward.cuh.
#include "norm_modulate_forward.cuh"

namespace adaln {

template bool launch_forward_norm<Norm::Layer>(const FwdArgs& a, cudaStream_t stream);

}  // namespace adaln
