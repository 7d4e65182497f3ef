// Backward kernels instantiated for x of type __half (see adaln_backward.cuh).
#include "adaln_backward.cuh"

namespace adaln {

void run_backward_f16(BwdArgs& a, bool launch, cudaStream_t stream) {
  BwdForX<__half>::dispatch(a, RunOp{a, launch, stream});
}

}  // namespace adaln
