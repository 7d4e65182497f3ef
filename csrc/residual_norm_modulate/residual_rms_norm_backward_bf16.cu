// The backward kernels of the residual norm-site op with an RMSNorm for r of type __nv_bfloat16, instantiated from
// residual_backward.cuh (one file a norm and dtype: the build compiles them in parallel).
#include "residual_norm_modulate/residual_backward.cuh"

namespace adaln {

template void res_backward<Norm::RMS, __nv_bfloat16>(ResBwdArgs& a, bool launch, cudaStream_t stream);

}  // namespace adaln
