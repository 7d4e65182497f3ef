// Backward kernels instantiated for x of type float (see adaln_backward.cuh).
#include "adaln_backward.cuh"

namespace adaln {

void run_backward_f32(BwdArgs& a, bool launch, cudaStream_t stream) {
  BwdForX<float>::dispatch(a, RunOp{a, launch, stream});
}

}  // namespace adaln
