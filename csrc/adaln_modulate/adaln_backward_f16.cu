// The backward kernels of adaln_modulate (LayerNorm) for x of type __half, instantiated from
// norm_modulate_backward.cuh.
#include "norm_modulate_backward.cuh"

namespace adaln {

template void run_backward<Norm::Layer, __half>(BwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
