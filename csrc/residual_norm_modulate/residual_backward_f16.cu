// The backward kernels of the residual norm-site ops (LayerNorm and RMSNorm) for r of type __half,
// instantiated from residual_backward.cuh.
#include "residual_norm_modulate/residual_backward.cuh"

namespace adaln {

template void res_backward<Norm::Layer, __half>(ResBwdArgs& a, bool launch, cudaStream_t stream);
template void res_backward<Norm::RMS, __half>(ResBwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
