// The backward kernels of adaln_modulate (LayerNorm) for x of type __nv_bfloat16, instantiated from
// norm_modulate_backward.cuh.
#include "norm_modulate_backward.cuh"

namespace adaln {

template void run_backward<Norm::Layer, __nv_bfloat16>(BwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
