// The ops' CUDA bodies in torch terms (norm_modulate.cu), for the dispatcher registrations
// (norm_modulate_dispatch.cu). Inputs as the public ops receive them, already checked.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "norm_modulate.cuh"

namespace adaln {

// {y, mean (undefined for RMSNorm), rstd} in x's shape: the CUDA body of either op's forward
std::vector<at::Tensor> op_forward(Norm norm, const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                   const c10::optional<at::Tensor>& bias, const at::Tensor& scale,
                                   const c10::optional<at::Tensor>& shift, double eps, at::ScalarType out_dtype);

// {dx, dweight, dbias, dscale, dshift} in the inputs' shapes and dtypes (an empty tensor for an absent
// input): the CUDA body of either op's backward (mean: none for RMSNorm)
std::vector<at::Tensor> op_backward(Norm norm, const at::Tensor& dy, const at::Tensor& x,
                                    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                    const at::Tensor& scale, const c10::optional<at::Tensor>& shift,
                                    const c10::optional<at::Tensor>& mean, const at::Tensor& rstd);

// Hands the dispatcher kernels the ops' Python CUDA paths ({op name: callable}), which serve the calls
// the kernels do not take; called once, when the module is loaded.
void register_dispatch(pybind11::dict paths);

}  // namespace adaln
