// The backward kernels of the residual norm-site ops (LayerNorm and RMSNorm) for r of type __nv_bfloat16,
// instantiated from residual_backward.cuh.
#include "residual_norm_modulate/residual_backward.cuh"

namespace adaln {

template void res_backward<Norm::Layer, __nv_bfloat16>(ResBwdArgs& a, bool launch, cudaStream_t stream);
template void res_backward<Norm::RMS, __nv_bfloat16>(ResBwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
