// The ops' CUDA bodies in torch terms (norm_modulate.cu; the residual ops' in
// residual_norm_modulate/residual_ops.cu), for the dispatcher registrations (norm_modulate_dispatch.cu)
// and the bindings; and the torch-side helpers those files share. Inputs as the public ops receive
// them, already checked.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "norm_modulate.cuh"

namespace adaln {

// {y, mean (undefined for RMSNorm), rstd} in x's shape: the CUDA body of either op's forward. With
// segment_ids (int [T]): the segmented layout, scale and shift [segments, D]; {} where its kernel
// cannot run (the caller's composite then serves the call).
std::vector<at::Tensor> op_forward(Norm norm, const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                   const c10::optional<at::Tensor>& bias, const at::Tensor& scale,
                                   const c10::optional<at::Tensor>& shift, double eps, at::ScalarType out_dtype,
                                   const c10::optional<at::Tensor>& segment_ids = c10::nullopt);

// {dx, dweight, dbias, dscale, dshift} in the inputs' shapes and dtypes (undefined for an absent input:
// or_empty makes the schemas' [0] tensor where a caller returns one): the CUDA body of either op's
// backward (mean: none for RMSNorm); dx_addend (x's shape and dtype) is added to dx before it is rounded
std::vector<at::Tensor> op_backward(Norm norm, const at::Tensor& dy, const at::Tensor& x,
                                    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                    const at::Tensor& scale, const c10::optional<at::Tensor>& shift,
                                    const c10::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                    const c10::optional<at::Tensor>& segment_ids = c10::nullopt,
                                    const c10::optional<at::Tensor>& dx_addend = c10::nullopt);

// {r, out, mean (undefined for RMSNorm), rstd} in x's shape: the CUDA body of either residual op's
// forward (r in r_dtype, out in out_dtype, the statistics fp32). With segment_ids (int [T]): the
// segmented layout, gate / scale / shift [segments, D]; {} where its kernel cannot run (the caller's
// composite then serves the call).
std::vector<at::Tensor> residual_op_forward(Norm norm, const at::Tensor& x, const at::Tensor& y,
                                            const c10::optional<at::Tensor>& gate,
                                            const c10::optional<at::Tensor>& weight,
                                            const c10::optional<at::Tensor>& bias,
                                            const c10::optional<at::Tensor>& scale,
                                            const c10::optional<at::Tensor>& shift, double eps,
                                            at::ScalarType r_dtype, at::ScalarType out_dtype,
                                            const c10::optional<at::Tensor>& segment_ids = c10::nullopt);

// {dx, dy, dgate, dweight, dbias, dscale, dshift} in the inputs' shapes and dtypes (dx in x_dtype;
// undefined for an absent input, and dy and dgate without a gate): the CUDA body of either
// residual op's backward (mean: none for RMSNorm); segment_ids as in the forward ({} where not taken)
std::vector<at::Tensor> residual_op_backward(Norm norm, const at::Tensor& dout, const c10::optional<at::Tensor>& dr,
                                             const at::Tensor& r, const c10::optional<at::Tensor>& y,
                                             const c10::optional<at::Tensor>& gate,
                                             const c10::optional<at::Tensor>& weight,
                                             const c10::optional<at::Tensor>& bias,
                                             const c10::optional<at::Tensor>& scale,
                                             const c10::optional<at::Tensor>& shift,
                                             const c10::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                             at::ScalarType x_dtype,
                                             const c10::optional<at::Tensor>& segment_ids = c10::nullopt);

// The eight ops' CUDA bodies in their schemas' shapes (adaptiveload/ops/<op>/op.py; an absent input's
// gradient as the [0] tensor the schemas return): what the bindings and the dispatcher kernels
// (norm_modulate_dispatch.cu, after their fast checks) call. Inputs validated by the caller.
using Tensors2 = std::tuple<at::Tensor, at::Tensor>;
using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensors5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensors6 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensors7 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// y, mean, rstd
Tensors3 adaln_forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                       const c10::optional<at::Tensor>& bias, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& shift, double eps, at::ScalarType out_dtype);
// dx, dweight, dbias, dscale, dshift
Tensors5 adaln_backward(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                        const c10::optional<at::Tensor>& bias, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& shift, const at::Tensor& mean, const at::Tensor& rstd,
                        const c10::optional<at::Tensor>& dx_addend);
// y, rstd
Tensors2 rms_forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& shift, double eps, at::ScalarType out_dtype);
// dx, dweight, dscale, dshift
Tensors4 rms_backward(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                      const at::Tensor& scale, const c10::optional<at::Tensor>& shift, const at::Tensor& rstd,
                      const c10::optional<at::Tensor>& dx_addend);
// r, out, mean, rstd
Tensors4 residual_adaln_forward(const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& gate,
                                const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& shift,
                                double eps, at::ScalarType r_dtype, at::ScalarType out_dtype);
// dx, dy, dgate, dweight, dbias, dscale, dshift
Tensors7 residual_adaln_backward(const at::Tensor& dout, const c10::optional<at::Tensor>& dr, const at::Tensor& r,
                                 const c10::optional<at::Tensor>& y, const c10::optional<at::Tensor>& gate,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                 const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& shift,
                                 const at::Tensor& mean, const at::Tensor& rstd, at::ScalarType x_dtype);
// r, out, rstd
Tensors3 residual_rms_forward(const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& gate,
                              const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& scale,
                              const c10::optional<at::Tensor>& shift, double eps, at::ScalarType r_dtype,
                              at::ScalarType out_dtype);
// dx, dy, dgate, dweight, dscale, dshift
Tensors6 residual_rms_backward(const at::Tensor& dout, const c10::optional<at::Tensor>& dr, const at::Tensor& r,
                               const c10::optional<at::Tensor>& y, const c10::optional<at::Tensor>& gate,
                               const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& scale,
                               const c10::optional<at::Tensor>& shift, const at::Tensor& rstd,
                               at::ScalarType x_dtype);

// y [*x.shape[:-1], heads, Dh], rstd: the q/k RMSNorm -> RoPE op (csrc/rms_norm_rope/rope_ops.cu)
Tensors2 rms_norm_rope_forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t heads, double eps, at::ScalarType out_dtype);
// dx, dweight (an empty [0] tensor without a weight or with weight_grad false)
Tensors2 rms_norm_rope_backward(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& rstd,
                                bool weight_grad);

// Kernel choices a benchmark or test may force (adaptiveload/ops/_tuning.py: override); each
// default is "the launcher's choice", from the shape, the dtypes, the layout and the device, which
// is what every call makes unless an override is set. Process-wide.
struct Tuning {
  int max_threads = 0;      // FwdArgs / BwdArgs::max_threads: 0 automatic, else 32..kMaxThreads
  int fwd_stages = -1;      // FwdArgs::stages: -1 automatic, 0 the register path, 2..kMaxStages
  int bwd_stages = -1;      // BwdArgs::stages, likewise
  int store = -1;           // FwdArgs::store: -1 automatic, 0 threads, 1 bulk
  int tail_pct = -1;        // FwdArgs::tail_pct: -1 automatic, 0..50
  int tail_rows = 8;        // FwdArgs::tail_rows: 1..65536
  bool two_kernel = false;  // BwdArgs::two_kernel: true forces the two-kernel backward everywhere
};
// The choices in force: the defaults, without a lock, unless an override is set.
Tuning tuning();

// Helpers of the CUDA bodies (norm_modulate.cu), shared with the residual ops' (TORCH_CHECKs there
// guard what the callers have already checked).
// Integers and shapes for TORCH_CHECK messages, formatted by std::to_string, never by a stream: on a
// host whose g++ links libstdc++ into the extension statically (the H200 machine's: the built module
// needs no libstdc++.so), writing a number to a std::ostream -- c10::str, so any TORCH_CHECK message
// with an integer or a shape -- ends the process with a segmentation fault, as in a minimal extension
// that only formats an int; text and devices pass through. (Static libstdc++ in a shared object and
// the locale's number facets: ggml-org/llama.cpp#22434, crosstool-ng/crosstool-ng#2478.)
template <typename T>
std::string num(T v) {
  static_assert(std::is_integral<T>::value, "num() formats integers");
  return std::to_string(static_cast<long long>(v));
}
std::string dims(at::IntArrayRef s);  // "[2, 3]"
DType to_dtype(at::ScalarType dtype, const char* name);
DType to_dtype(const at::Tensor& t, const char* name);
bool aligned16(const void* p);
// x: [B, N, D] contiguous on CUDA, not empty.
void check_x(const at::Tensor& x, const char* name);
// The segmented layout (x viewed as [1, T, D]): modulation m [segments, D], unit stride along D, as a
// view of rows seg[n] (its dtype left to the caller); the ids [T] (int32 / int64, contiguous) as the
// kernels' Segments of `count` segments; segment_starts checks the ids on the device (each in
// [0, segments), else the kernel stops with a message) and, given `start`, fills the backward's
// start array; segment_start_rows allocates that array, fills it and sets s.start (the tensor must
// outlive the launch).
ModView seg_view(const at::Tensor& m, const at::Tensor& x, const char* name);
Segments segment_ids_view(const at::Tensor& ids, const at::Tensor& x, int64_t count);
void segment_starts(const at::Tensor& ids, int64_t segments, int64_t* start);
at::Tensor segment_start_rows(const at::Tensor& ids, Segments& s);
// Every row of v (of its dtype v.t) 16-byte aligned; true for an absent one.
bool mod_aligned(const ModView& v);
// The size of modulation t at x's dim i, t broadcast against x (right-aligned): 1 where t has none.
int64_t bcast_size(const at::Tensor& t, const at::Tensor& x, int64_t i);
// A modulation with a token dim other than 1 (per-token).
bool per_token(const at::Tensor& t, const at::Tensor& x);
// Whether the kernels' gradient rows of modulation t (one per sample of x's batch) are summed over
// that batch afterwards: t is shared by a batch of more than one sample.
bool summed_over_batch(const at::Tensor& t, const at::Tensor& x);
// Modulation t as the kernels read it for x ([B, ..., D]) viewed as [B, N, D], in dtype dt (v.t): in
// place, through t's own pointer and strides, where t is of dtype dt, D is unit-stride and its token
// dims collapse to one stride (every layout the models make, .chunk() views included; no tensor is
// made); else from a converted or copied [B or 1, N or 1, D] tensor, kept alive in `keep` until the launch.
// Raises where t is not on x's device or not one of the layouts (layout_ok).
ModView mod_rows(const at::Tensor& t, const at::Tensor& x, at::ScalarType dt, const char* name, at::Tensor& keep);
// Whether modulation t broadcasts over x as per-sample, per-token or shared (modulation_layout in
// adaptiveload/ops/common.py).
bool layout_ok(const at::Tensor& t, const at::Tensor& x);
// A norm's affine parameter as contiguous fp32 (itself when it is already).
c10::optional<at::Tensor> affine_f32(const c10::optional<at::Tensor>& t);
// The kernels' fp32 gradient g of affine parameter p in p's dtype (g itself when p is fp32 or absent).
at::Tensor affine_grad(const at::Tensor& g, const c10::optional<at::Tensor>& p);
// A saved per-row statistic as contiguous fp32 (itself when it is already).
at::Tensor stat_rows(const at::Tensor& s);
// A kernel gradient of modulation t ([B, N, D] per element or [B, D] per-sample sums), summed over
// the dims where t broadcasts, in t's shape and dtype.
at::Tensor mod_grad(at::Tensor g, const at::Tensor& t, const at::Tensor& x);
// g, or a fresh empty [0] tensor on x's device where g is undefined (the gradient of an absent input,
// as the schemas return it; outputs of an op must not alias one another).
at::Tensor or_empty(const at::Tensor& g, const at::Tensor& x);

// Hands the dispatcher kernels the ops' Python CUDA paths ({op name: callable}), which serve the calls
// the kernels do not take; called once, when the module is loaded.
void register_dispatch(pybind11::dict paths);

}  // namespace adaln
