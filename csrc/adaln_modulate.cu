// Python bindings of the fused LayerNorm -> modulate kernels: validate every input at the boundary
// (one TORCH_CHECK per constraint, naming the tensor and what was expected), allocate the outputs
// and launch on the current stream. Called from adaptiveload/ops/adaln_modulate.py, which owns the
// op's registrations (the public op's CUDA kernel is registered there, once).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include "adaln_modulate.cuh"

namespace adaln {

void backward_plan(BwdArgs& a) {
  switch (a.xt) {
    case DType::F32: run_backward_f32(a, false, nullptr); break;
    case DType::BF16: run_backward_bf16(a, false, nullptr); break;
    default: run_backward_f16(a, false, nullptr); break;
  }
}

void launch_backward(const BwdArgs& a, cudaStream_t stream) {
  BwdArgs args = a;
  switch (a.xt) {
    case DType::F32: run_backward_f32(args, true, stream); break;
    case DType::BF16: run_backward_bf16(args, true, stream); break;
    default: run_backward_f16(args, true, stream); break;
  }
}

namespace {

using at::Tensor;
using c10::optional;

DType to_dtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default: TORCH_CHECK(false, "adaln_modulate: ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return DType::F32;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// x: [B, N, D] contiguous on CUDA.
void check_x(const Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), "adaln_modulate: ", name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 3, "adaln_modulate: ", name, " must be viewed as [B, N, D], got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "adaln_modulate: ", name, " must be contiguous, got strides ", x.strides());
  TORCH_CHECK(x.size(0) > 0 && x.size(1) > 0 && x.size(2) > 0, "adaln_modulate: ", name,
              " must not be empty, got shape ", x.sizes());
}

void check_same_device(const Tensor& t, const Tensor& x, const char* name) {
  TORCH_CHECK(t.device() == x.device(), "adaln_modulate: ", name, " is on ", t.device(), " but x is on ", x.device());
}

// weight/bias: fp32 contiguous [D].
const float* affine_ptr(const optional<Tensor>& t, const Tensor& x, const char* name) {
  if (!t.has_value()) return nullptr;
  const Tensor& v = *t;
  check_same_device(v, x, name);
  TORCH_CHECK(v.scalar_type() == at::kFloat, "adaln_modulate: ", name, " must be float32 here, got ", v.scalar_type());
  TORCH_CHECK(v.dim() == 1 && v.size(0) == x.size(2) && v.is_contiguous(), "adaln_modulate: ", name,
              " must be a contiguous [", x.size(2), "] tensor, got shape ", v.sizes(), " strides ", v.strides());
  return v.data_ptr<float>();
}

// Modulation: [Bm, Nm, D] with Bm in {1, B}, Nm in {1, N}, unit stride along D.
ModView mod_view(const Tensor& m, const Tensor& x, const char* name) {
  check_same_device(m, x, name);
  TORCH_CHECK(m.dim() == 3, "adaln_modulate: ", name, " must be viewed as [B or 1, N or 1, D], got shape ", m.sizes());
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  TORCH_CHECK(m.size(2) == D, "adaln_modulate: ", name, " has ", m.size(2), " features, x has ", D, " (shape ",
              m.sizes(), ")");
  TORCH_CHECK(m.size(0) == 1 || m.size(0) == B, "adaln_modulate: ", name, " batch must be 1 or ", B, ", got shape ",
              m.sizes());
  TORCH_CHECK(m.size(1) == 1 || m.size(1) == N, "adaln_modulate: ", name, " tokens must be 1 or ", N,
              ", got shape ", m.sizes());
  TORCH_CHECK(m.stride(2) == 1 || D == 1, "adaln_modulate: ", name, " must have unit stride along D, got strides ",
              m.strides());
  ModView v;
  v.ptr = m.data_ptr();
  v.sb = m.size(0) == 1 ? 0 : m.stride(0);
  v.sn = m.size(1) == 1 ? 0 : m.stride(1);
  return v;
}

bool mod_aligned(const ModView& v, int64_t esize) {
  return v.ptr == nullptr || (aligned16(v.ptr) && (v.sb * esize) % 16 == 0 && (v.sn * esize) % 16 == 0);
}

void check_mod_dtype(const Tensor& m, const Tensor& x, const char* name) {
  TORCH_CHECK(m.scalar_type() == x.scalar_type() || m.scalar_type() == at::kFloat, "adaln_modulate: ", name,
              " must be float32 or x's dtype ", x.scalar_type(), ", got ", m.scalar_type());
}

std::vector<Tensor> forward(const Tensor& x, const optional<Tensor>& weight, const optional<Tensor>& bias,
                            const Tensor& scale, const optional<Tensor>& shift, double eps, bool out_fp32,
                            int64_t max_threads, int64_t stages) {
  check_x(x, "x");
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  FwdArgs a;
  a.xt = to_dtype(x, "x");
  TORCH_CHECK(D <= max_features(a.xt), "adaln_modulate: D = ", D, " exceeds the kernel's ", max_features(a.xt),
              " features for ", x.scalar_type());
  check_mod_dtype(scale, x, "scale");
  a.mt = to_dtype(scale, "scale");
  if (shift.has_value())
    TORCH_CHECK(shift->scalar_type() == scale.scalar_type(), "adaln_modulate: shift dtype ", shift->scalar_type(),
                " must equal scale dtype ", scale.scalar_type());
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({B, N, D}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  auto mean = at::empty({B, N}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({B, N}, x.options().dtype(at::kFloat));
  a.ot = out_fp32 ? DType::F32 : a.xt;
  a.x = x.data_ptr();
  a.y = out.data_ptr();
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.weight = affine_ptr(weight, x, "weight");
  a.bias = affine_ptr(bias, x, "bias");
  a.scale = mod_view(scale, x, "scale");
  if (shift.has_value()) a.shift = mod_view(*shift, x, "shift");
  a.B = B;
  a.N = N;
  a.D = static_cast<int>(D);
  a.eps = static_cast<float>(eps);
  a.max_threads = static_cast<int>(max_threads);
  a.stages = static_cast<int>(stages);
  const int64_t vec = a.xt == DType::F32 ? 4 : 8;
  a.aligned = D % vec == 0 && aligned16(a.x) && aligned16(a.y) && (!a.weight || aligned16(a.weight)) &&
              (!a.bias || aligned16(a.bias)) && mod_aligned(a.scale, scale.element_size()) &&
              mod_aligned(a.shift, scale.element_size());
  launch_forward(a, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, mean, rstd};
}

// Returns [dx, dscale, dshift, dweight, dbias]:
//   dscale: [B, N, D] in scale's dtype when scale is per-token (Nm == N > 1), else fp32 [B, D]
//           per-sample sums (the caller sums over B for a shared scale);
//   dshift: likewise, or empty without shift; dweight, dbias: fp32 [D], or empty when absent.
std::vector<Tensor> backward(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight,
                             const optional<Tensor>& bias, const Tensor& scale, const optional<Tensor>& shift,
                             const Tensor& mean, const Tensor& rstd, bool two_kernel, int64_t max_threads,
                             int64_t stages) {
  check_x(x, "x");
  check_x(dy, "dy");
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  TORCH_CHECK(dy.sizes() == x.sizes(), "adaln_modulate_backward: dy shape ", dy.sizes(), " must equal x shape ",
              x.sizes());
  check_same_device(dy, x, "dy");
  BwdArgs a;
  a.xt = to_dtype(x, "x");
  TORCH_CHECK(D <= max_features(a.xt), "adaln_modulate: D = ", D, " exceeds the kernel's ", max_features(a.xt),
              " features for ", x.scalar_type());
  a.dyt = to_dtype(dy, "dy");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type() || dy.scalar_type() == at::kFloat,
              "adaln_modulate_backward: dy must be float32 or x's dtype ", x.scalar_type(), ", got ",
              dy.scalar_type());
  check_mod_dtype(scale, x, "scale");
  a.mt = to_dtype(scale, "scale");
  if (shift.has_value())
    TORCH_CHECK(shift->scalar_type() == scale.scalar_type(), "adaln_modulate: shift dtype ", shift->scalar_type(),
                " must equal scale dtype ", scale.scalar_type());
  for (const Tensor* s : {&mean, &rstd}) {
    const char* name = s == &mean ? "mean" : "rstd";
    check_same_device(*s, x, name);
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == B * N,
                "adaln_modulate_backward: ", name, " must be contiguous float32 with ", B * N,
                " elements (one per row), got shape ", s->sizes(), " dtype ", s->scalar_type());
  }
  c10::cuda::CUDAGuard guard(x.device());
  a.dy = dy.data_ptr();
  a.x = x.data_ptr();
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.weight = affine_ptr(weight, x, "weight");
  a.bias = affine_ptr(bias, x, "bias");
  a.scale = mod_view(scale, x, "scale");
  if (shift.has_value()) a.shift = mod_view(*shift, x, "shift");
  a.B = B;
  a.N = N;
  a.D = static_cast<int>(D);
  a.two_kernel = two_kernel;
  a.max_threads = static_cast<int>(max_threads);
  a.stages = static_cast<int>(stages);

  auto f32 = x.options().dtype(at::kFloat);
  auto dx = at::empty_like(x);
  a.dx = dx.data_ptr();
  const bool scale_pt = a.scale.sn != 0;
  const bool shift_pt = shift.has_value() && a.shift.sn != 0;
  Tensor dscale = scale_pt ? at::empty({B, N, D}, scale.options()) : at::empty({B, D}, f32);
  Tensor dshift = !shift.has_value() ? at::empty({0}, f32)
                  : shift_pt         ? at::empty({B, N, D}, shift->options())
                                     : at::empty({B, D}, f32);
  Tensor dweight = weight.has_value() ? at::empty({D}, f32) : at::empty({0}, f32);
  Tensor dbias = bias.has_value() ? at::empty({D}, f32) : at::empty({0}, f32);
  if (scale_pt) a.dscale_el = dscale.data_ptr();
  else a.dscale_rows = dscale.data_ptr<float>();
  if (shift_pt) a.dshift_el = dshift.data_ptr();
  else if (shift.has_value()) a.dshift_rows = dshift.data_ptr<float>();
  if (weight.has_value()) a.dweight = dweight.data_ptr<float>();
  if (bias.has_value()) a.dbias = dbias.data_ptr<float>();

  const int64_t vec = a.xt == DType::F32 ? 4 : 8;
  a.aligned = D % vec == 0 && aligned16(a.x) && aligned16(a.dy) && aligned16(a.dx) &&
              (!a.weight || aligned16(a.weight)) && (!a.bias || aligned16(a.bias)) &&
              mod_aligned(a.scale, scale.element_size()) && mod_aligned(a.shift, scale.element_size()) &&
              (!a.dscale_el || aligned16(a.dscale_el)) && (!a.dshift_el || aligned16(a.dshift_el));
  backward_plan(a);  // after the alignment: the ring (a.stages) needs aligned rows
  auto ws = at::empty({3, a.tiles, B, D}, f32);
  a.ws = ws.data_ptr<float>();
  a.aligned = a.aligned && aligned16(a.ws);
  launch_backward(a, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, dscale, dshift, dweight, dbias};
}

}  // namespace
}  // namespace adaln

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused LayerNorm -> adaptive modulation CUDA kernels (adaptiveload)";
  m.def("forward", &adaln::forward,
        "y, mean, rstd = forward(x[B,N,D], weight?, bias?, scale, shift?, eps, out_fp32, max_threads, stages)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("scale"), py::arg("shift"), py::arg("eps"),
        py::arg("out_fp32"), py::arg("max_threads") = 0, py::arg("stages") = 0);
  m.def("backward", &adaln::backward,
        "dx, dscale, dshift, dweight, dbias = backward(dy, x, weight?, bias?, scale, shift?, mean, rstd, two_kernel, "
        "max_threads, stages)",
        py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("scale"), py::arg("shift"),
        py::arg("mean"), py::arg("rstd"), py::arg("two_kernel") = false,
        py::arg("max_threads") = 0, py::arg("stages") = 0);
  m.def("max_features", [](const std::string& dtype) {
    return adaln::max_features(dtype == "float32" ? adaln::DType::F32 : adaln::DType::BF16);
  }, "largest D the kernels take for x of this dtype ('float32', 'bfloat16', 'float16')");
}
