// Backward kernels instantiated for x of type __nv_bfloat16 (see adaln_backward.cuh).
#include "adaln_backward.cuh"

namespace adaln {

void run_backward_bf16(BwdArgs& a, bool launch, cudaStream_t stream) {
  BwdForX<__nv_bfloat16>::dispatch(a, RunOp{a, launch, stream});
}

}  // namespace adaln
