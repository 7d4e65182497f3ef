// The backward kernels of adaln_modulate (LayerNorm) for x of type float, instantiated from
// norm_modulate_backward.cuh.
#include "norm_modulate_backward.cuh"

namespace adaln {

template void run_backward<Norm::Layer, float>(BwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
