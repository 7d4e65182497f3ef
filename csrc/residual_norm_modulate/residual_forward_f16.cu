// The forward kernels of the residual norm-site ops (LayerNorm and RMSNorm) for r of type __half,
// instantiated from residual_forward.cuh.
#include "residual_norm_modulate/residual_forward.cuh"

namespace adaln {

template bool res_forward<Norm::Layer, __half>(const ResFwdArgs& a, cudaStream_t stream);
template bool res_forward<Norm::RMS, __half>(const ResFwdArgs& a, cudaStream_t stream);

}  // namespace adaln
