// The ops' CUDA and AutogradCUDA kernels, registered with the dispatcher from C++ when this module is
// loaded (the first CUDA call of an op builds and loads it, through the op's Python CUDA path, which
// serves that call): from then on a call of torch.ops.adaptiveload.* on CUDA tensors, eager or from a
// compiled graph, runs no Python. Before the load, the ops' CompositeExplicitAutograd kernels route
// CUDA tensors to that Python path, and their Autograd kernels (Python) serve the first call.
//
// The CUDA kernels here take the inputs that the Python validation accepts and the kernels handle
// (fast_* below: sizes, dtypes and devices compared, nothing allocated); every other call goes to the
// op's Python CUDA path (set_fallbacks), whose validation raises the ValueError naming the tensor and
// whose reference serves float64, rows wider than kMaxFeatures, empty x, mixed modulation dtypes and
// the gradients of the rotation tables.
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>

#include "norm_modulate_ops.h"

namespace adaln {
namespace {

using at::Tensor;
using c10::optional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---------------------------------------------------------------------------------------------
// Inputs the kernels take (a subset of those the Python validation accepts)

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

bool fast_mod(const Tensor& m, const Tensor& x) {
  return m.device() == x.device() && (m.scalar_type() == x.scalar_type() || m.scalar_type() == at::kFloat) &&
         layout_ok(m, x);
}

bool fast_param(const optional<Tensor>& p, const Tensor& x) {
  return !p.has_value() || (p->device() == x.device() && kernel_dtype(p->scalar_type()) && p->dim() == 1 &&
                            p->size(0) == x.size(-1));
}

bool fast_inputs(const Tensor& x, const optional<Tensor>& weight, const optional<Tensor>& bias, const Tensor& scale,
                 const optional<Tensor>& shift) {
  return x.is_cuda() && x.dim() >= 2 && x.numel() > 0 && x.size(-1) <= kMaxFeatures &&
         kernel_dtype(x.scalar_type()) && fast_param(weight, x) && fast_param(bias, x) && fast_mod(scale, x) &&
         (!shift.has_value() || fast_mod(*shift, x));
}

bool fast_forward(const Tensor& x, const optional<Tensor>& weight, const optional<Tensor>& bias, const Tensor& scale,
                  const optional<Tensor>& shift, double eps, at::ScalarType out_dtype) {
  return eps >= 0 && (kernel_dtype(out_dtype) || out_dtype == at::kDouble) &&
         fast_inputs(x, weight, bias, scale, shift);
}

// a saved statistic or dy: on x's device, of the given sizes, a kernel dtype
bool fast_like(const Tensor& t, const Tensor& x, at::IntArrayRef sizes) {
  return t.device() == x.device() && kernel_dtype(t.scalar_type()) && t.sizes() == sizes;
}

bool fast_backward(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight, const optional<Tensor>& bias,
                   const Tensor& scale, const optional<Tensor>& shift, const optional<Tensor>& mean,
                   const Tensor& rstd, const optional<Tensor>& dx_addend) {
  if (!fast_inputs(x, weight, bias, scale, shift) || !fast_like(dy, x, x.sizes())) return false;
  if (dx_addend.has_value() && !(fast_like(*dx_addend, x, x.sizes()) && dx_addend->scalar_type() == x.scalar_type()))
    return false;
  const at::IntArrayRef rows = x.sizes().slice(0, x.dim() - 1);
  return fast_like(rstd, x, rows) && (!mean.has_value() || fast_like(*mean, x, rows));
}

// The residual ops (their kernels read gate, scale and shift each in its own kernel dtype)
bool fast_rows(const Tensor& x) {
  return x.is_cuda() && x.dim() >= 2 && x.numel() > 0 && x.size(-1) <= kMaxFeatures && kernel_dtype(x.scalar_type());
}

bool fast_full(const Tensor& t, const Tensor& x) { return fast_like(t, x, x.sizes()); }

bool fast_any_mod(const optional<Tensor>& m, const Tensor& x) {
  return !m.has_value() || (m->device() == x.device() && kernel_dtype(m->scalar_type()) && layout_ok(*m, x));
}

bool fast_residual_params(const Tensor& x, const optional<Tensor>& gate, const optional<Tensor>& weight,
                          const optional<Tensor>& bias, const optional<Tensor>& scale, const optional<Tensor>& shift) {
  return fast_param(weight, x) && fast_param(bias, x) && fast_any_mod(gate, x) && fast_any_mod(scale, x) &&
         fast_any_mod(shift, x) && (scale.has_value() || !shift.has_value());
}

bool fast_residual_forward(const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                           const optional<Tensor>& weight, const optional<Tensor>& bias, const optional<Tensor>& scale,
                           const optional<Tensor>& shift, double eps, at::ScalarType r_dtype,
                           at::ScalarType out_dtype) {
  return eps >= 0 && kernel_dtype(r_dtype) && kernel_dtype(out_dtype) && fast_rows(x) && fast_full(y, x) &&
         fast_residual_params(x, gate, weight, bias, scale, shift);
}

bool fast_residual_backward(const Tensor& dout, const optional<Tensor>& dr, const Tensor& r,
                            const optional<Tensor>& y, const optional<Tensor>& gate, const optional<Tensor>& weight,
                            const optional<Tensor>& bias, const optional<Tensor>& scale,
                            const optional<Tensor>& shift, const optional<Tensor>& mean, const Tensor& rstd,
                            at::ScalarType x_dtype) {
  if (!kernel_dtype(x_dtype) || !fast_rows(r) || !fast_full(dout, r) || (dr.has_value() && !fast_full(*dr, r)))
    return false;
  if (gate.has_value() && !(y.has_value() && fast_full(*y, r))) return false;
  const at::IntArrayRef rows = r.sizes().slice(0, r.dim() - 1);
  return fast_residual_params(r, gate, weight, bias, scale, shift) && fast_like(rstd, r, rows) &&
         (!mean.has_value() || fast_like(*mean, r, rows));
}

// The q/k RMSNorm -> RoPE op: cos and sin (each read as fp32, of any kernel dtype) must broadcast to
// [*x.shape[:-1], heads, Dh / 2]; the gradients of cos and sin come from the Python path's reference.
bool fast_table(const Tensor& t, const Tensor& x, int64_t heads) {
  const int64_t rows = x.dim() - 1, dims = rows + 2;
  if (t.device() != x.device() || !kernel_dtype(t.scalar_type()) || t.dim() > dims) return false;
  for (int64_t i = 1; i <= t.dim(); ++i) {  // aligned from the right, as broadcasting is
    const int64_t want = i == 1 ? x.size(-1) / heads / 2 : i == 2 ? heads : x.size(dims - i);
    if (t.size(-i) != 1 && t.size(-i) != want) return false;
  }
  return true;
}

bool fast_rope_inputs(const Tensor& x, const optional<Tensor>& weight, const Tensor& cos, const Tensor& sin,
                      int64_t heads) {
  return fast_rows(x) && heads > 0 && x.size(-1) % heads == 0 && (x.size(-1) / heads) % 2 == 0 &&
         fast_param(weight, x) && fast_table(cos, x, heads) && fast_table(sin, x, heads);
}

bool fast_rope_forward(const Tensor& x, const optional<Tensor>& weight, const Tensor& cos, const Tensor& sin,
                       int64_t heads, double eps, at::ScalarType out_dtype) {
  return eps >= 0 && kernel_dtype(out_dtype) && fast_rope_inputs(x, weight, cos, sin, heads);
}

bool fast_rope_backward(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight, const Tensor& cos,
                        const Tensor& sin, const Tensor& rstd, std::array<bool, 4> output_mask) {
  if (output_mask[2] || output_mask[3] || x.dim() < 2 || dy.dim() != x.dim() + 1) return false;
  const at::IntArrayRef rows = x.sizes().slice(0, x.dim() - 1);
  const int64_t heads = dy.size(-2);
  return dy.device() == x.device() && kernel_dtype(dy.scalar_type()) && dy.sizes().slice(0, x.dim() - 1) == rows &&
         heads * dy.size(-1) == x.size(-1) && fast_rope_inputs(x, weight, cos, sin, heads) &&
         fast_like(rstd, x, rows);
}

// ---------------------------------------------------------------------------------------------
// The Python CUDA paths (adaptiveload/ops/<op>/op.py), for the calls the fast checks turn away

enum Op : int {
  kAdaln = 0,
  kAdalnBackward,
  kRms,
  kRmsBackward,
  kResAdaln,
  kResAdalnBackward,
  kResRms,
  kResRmsBackward,
  kRope,
  kRopeBackward,
  kOps
};

std::array<PyObject*, kOps>& fallbacks() {
  static std::array<PyObject*, kOps> fns{};  // new references, kept for the life of the process
  return fns;
}

template <typename Result, typename... Args>
Result python_path(Op op, const Args&... args) {
  py::gil_scoped_acquire gil;
  PyObject* fn = fallbacks()[op];
  TORCH_CHECK(fn != nullptr, "adaptiveload: the ops' Python CUDA paths are not registered (set_fallbacks)");
  return py::reinterpret_borrow<py::object>(fn)(args...).template cast<Result>();
}

// ---------------------------------------------------------------------------------------------
// CUDA kernels of the ten ops (their schemas: adaptiveload/ops/<op>/op.py)

Tensors3 adaln_cuda(const Tensor& x, const optional<Tensor>& weight, const optional<Tensor>& bias,
                    const Tensor& scale, const optional<Tensor>& shift, double eps, at::ScalarType out_dtype) {
  if (!fast_forward(x, weight, bias, scale, shift, eps, out_dtype))
    return python_path<Tensors3>(kAdaln, x, weight, bias, scale, shift, eps, out_dtype);
  return adaln_forward(x, weight, bias, scale, shift, eps, out_dtype);
}

Tensors5 adaln_backward_cuda(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight,
                             const optional<Tensor>& bias, const Tensor& scale, const optional<Tensor>& shift,
                             const Tensor& mean, const Tensor& rstd, const optional<Tensor>& dx_addend) {
  if (!fast_backward(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend))
    return python_path<Tensors5>(kAdalnBackward, dy, x, weight, bias, scale, shift, mean, rstd, dx_addend);
  return adaln_backward(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend);
}

Tensors2 rms_cuda(const Tensor& x, const optional<Tensor>& weight, const Tensor& scale, const optional<Tensor>& shift,
                  double eps, at::ScalarType out_dtype) {
  if (!fast_forward(x, weight, c10::nullopt, scale, shift, eps, out_dtype))
    return python_path<Tensors2>(kRms, x, weight, scale, shift, eps, out_dtype);
  return rms_forward(x, weight, scale, shift, eps, out_dtype);
}

Tensors4 rms_backward_cuda(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight, const Tensor& scale,
                           const optional<Tensor>& shift, const Tensor& rstd, const optional<Tensor>& dx_addend) {
  if (!fast_backward(dy, x, weight, c10::nullopt, scale, shift, c10::nullopt, rstd, dx_addend))
    return python_path<Tensors4>(kRmsBackward, dy, x, weight, scale, shift, rstd, dx_addend);
  return rms_backward(dy, x, weight, scale, shift, rstd, dx_addend);
}

Tensors4 residual_adaln_cuda(const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                             const optional<Tensor>& weight, const optional<Tensor>& bias,
                             const optional<Tensor>& scale, const optional<Tensor>& shift, double eps,
                             at::ScalarType r_dtype, at::ScalarType out_dtype) {
  if (!fast_residual_forward(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype))
    return python_path<Tensors4>(kResAdaln, x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype);
  return residual_adaln_forward(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype);
}

Tensors7 residual_adaln_backward_cuda(const Tensor& dout, const optional<Tensor>& dr, const Tensor& r,
                                      const optional<Tensor>& y, const optional<Tensor>& gate,
                                      const optional<Tensor>& weight, const optional<Tensor>& bias,
                                      const optional<Tensor>& scale, const optional<Tensor>& shift,
                                      const Tensor& mean, const Tensor& rstd, at::ScalarType x_dtype) {
  if (!fast_residual_backward(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype))
    return python_path<Tensors7>(kResAdalnBackward, dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd,
                                 x_dtype);
  return residual_adaln_backward(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype);
}

Tensors3 residual_rms_cuda(const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                           const optional<Tensor>& weight, const optional<Tensor>& scale,
                           const optional<Tensor>& shift, double eps, at::ScalarType r_dtype,
                           at::ScalarType out_dtype) {
  if (!fast_residual_forward(x, y, gate, weight, c10::nullopt, scale, shift, eps, r_dtype, out_dtype))
    return python_path<Tensors3>(kResRms, x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype);
  return residual_rms_forward(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype);
}

Tensors6 residual_rms_backward_cuda(const Tensor& dout, const optional<Tensor>& dr, const Tensor& r,
                                    const optional<Tensor>& y, const optional<Tensor>& gate,
                                    const optional<Tensor>& weight, const optional<Tensor>& scale,
                                    const optional<Tensor>& shift, const Tensor& rstd, at::ScalarType x_dtype) {
  if (!fast_residual_backward(dout, dr, r, y, gate, weight, c10::nullopt, scale, shift, c10::nullopt, rstd, x_dtype))
    return python_path<Tensors6>(kResRmsBackward, dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype);
  return residual_rms_backward(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype);
}

Tensors2 rope_cuda(const Tensor& x, const optional<Tensor>& weight, const Tensor& cos, const Tensor& sin,
                   int64_t heads, double eps, at::ScalarType out_dtype) {
  if (!fast_rope_forward(x, weight, cos, sin, heads, eps, out_dtype))
    return python_path<Tensors2>(kRope, x, weight, cos, sin, heads, eps, out_dtype);
  return rms_norm_rope_forward(x, weight, cos, sin, heads, eps, out_dtype);
}

Tensors4 rope_backward_cuda(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight, const Tensor& cos,
                            const Tensor& sin, const Tensor& rstd, std::array<bool, 4> output_mask) {
  if (!fast_rope_backward(dy, x, weight, cos, sin, rstd, output_mask))
    return python_path<Tensors4>(kRopeBackward, dy, x, weight, cos, sin, rstd, output_mask);
  auto [dx, dweight] = rms_norm_rope_backward(dy, x, weight, cos, sin, rstd, output_mask[1]);
  return {dx, dweight, or_empty(Tensor(), x), or_empty(Tensor(), x)};
}

// ---------------------------------------------------------------------------------------------
// AutogradCUDA kernels: what common.differentiable registers in Python (the Autograd alias key, which
// keeps serving CPU), in C++ for CUDA tensors. The forward saves its tensor inputs and statistics,
// never the normalised tensor; the backward op has no derivative.

template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using AdalnSig = Tensors3(const Tensor&, const optional<Tensor>&, const optional<Tensor>&, const Tensor&,
                          const optional<Tensor>&, double, at::ScalarType);
using AdalnBwdSig = Tensors5(const Tensor&, const Tensor&, const optional<Tensor>&, const optional<Tensor>&,
                             const Tensor&, const optional<Tensor>&, const Tensor&, const Tensor&,
                             const optional<Tensor>&);
using RmsSig = Tensors2(const Tensor&, const optional<Tensor>&, const Tensor&, const optional<Tensor>&, double,
                        at::ScalarType);
using RmsBwdSig = Tensors4(const Tensor&, const Tensor&, const optional<Tensor>&, const Tensor&,
                           const optional<Tensor>&, const Tensor&, const optional<Tensor>&);

using ResAdalnSig = Tensors4(const Tensor&, const Tensor&, const optional<Tensor>&, const optional<Tensor>&,
                             const optional<Tensor>&, const optional<Tensor>&, const optional<Tensor>&, double,
                             at::ScalarType, at::ScalarType);
using ResAdalnBwdSig = Tensors7(const Tensor&, const optional<Tensor>&, const Tensor&, const optional<Tensor>&,
                                const optional<Tensor>&, const optional<Tensor>&, const optional<Tensor>&,
                                const optional<Tensor>&, const optional<Tensor>&, const Tensor&, const Tensor&,
                                at::ScalarType);
using ResRmsSig = Tensors3(const Tensor&, const Tensor&, const optional<Tensor>&, const optional<Tensor>&,
                           const optional<Tensor>&, const optional<Tensor>&, double, at::ScalarType, at::ScalarType);
using ResRmsBwdSig = Tensors6(const Tensor&, const optional<Tensor>&, const Tensor&, const optional<Tensor>&,
                              const optional<Tensor>&, const optional<Tensor>&, const optional<Tensor>&,
                              const optional<Tensor>&, const Tensor&, at::ScalarType);

using RopeSig = Tensors2(const Tensor&, const optional<Tensor>&, const Tensor&, const Tensor&, int64_t, double,
                         at::ScalarType);
using RopeBwdSig = Tensors4(const Tensor&, const Tensor&, const optional<Tensor>&, const Tensor&, const Tensor&,
                            const Tensor&, std::array<bool, 4>);

const c10::TypedOperatorHandle<AdalnSig>& adaln_op() {
  static const auto op = typed_op<AdalnSig>("adaptiveload::adaln_modulate");
  return op;
}
const c10::TypedOperatorHandle<AdalnBwdSig>& adaln_backward_op() {
  static const auto op = typed_op<AdalnBwdSig>("adaptiveload::adaln_modulate_backward");
  return op;
}
const c10::TypedOperatorHandle<RmsSig>& rms_op() {
  static const auto op = typed_op<RmsSig>("adaptiveload::rms_norm_modulate");
  return op;
}
const c10::TypedOperatorHandle<RmsBwdSig>& rms_backward_op() {
  static const auto op = typed_op<RmsBwdSig>("adaptiveload::rms_norm_modulate_backward");
  return op;
}

const c10::TypedOperatorHandle<ResAdalnSig>& residual_adaln_op() {
  static const auto op = typed_op<ResAdalnSig>("adaptiveload::residual_adaln_modulate");
  return op;
}
const c10::TypedOperatorHandle<ResAdalnBwdSig>& residual_adaln_backward_op() {
  static const auto op = typed_op<ResAdalnBwdSig>("adaptiveload::residual_adaln_modulate_backward");
  return op;
}
const c10::TypedOperatorHandle<ResRmsSig>& residual_rms_op() {
  static const auto op = typed_op<ResRmsSig>("adaptiveload::residual_rms_norm_modulate");
  return op;
}
const c10::TypedOperatorHandle<ResRmsBwdSig>& residual_rms_backward_op() {
  static const auto op = typed_op<ResRmsBwdSig>("adaptiveload::residual_rms_norm_modulate_backward");
  return op;
}

const c10::TypedOperatorHandle<RopeSig>& rope_op() {
  static const auto op = typed_op<RopeSig>("adaptiveload::rms_norm_rope");
  return op;
}
const c10::TypedOperatorHandle<RopeBwdSig>& rope_backward_op() {
  static const auto op = typed_op<RopeBwdSig>("adaptiveload::rms_norm_rope_backward");
  return op;
}

optional<Tensor> saved(const Tensor& t) { return t.defined() ? optional<Tensor>(t) : c10::nullopt; }
Tensor unless_absent(const Tensor& g, const Tensor& input) { return input.defined() ? g : Tensor(); }

template <typename... Ts>
bool needs_grad(const Ts&... ts) {
  if (!at::GradMode::is_enabled()) return false;
  auto req = [](const auto& t) {
    if constexpr (std::is_same_v<std::decay_t<decltype(t)>, Tensor>) return t.requires_grad();
    else return t.has_value() && t->requires_grad();
  };
  return (req(ts) || ...);
}

struct AdalnFunction : public torch::autograd::Function<AdalnFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional<Tensor>& weight,
                               const optional<Tensor>& bias, const Tensor& scale, const optional<Tensor>& shift,
                               double eps, at::ScalarType out_dtype) {
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(y, mean, rstd) = adaln_op().call(x, weight, bias, scale, shift, eps, out_dtype);
    }
    ctx->save_for_backward({x, weight.value_or(Tensor()), bias.value_or(Tensor()), scale,
                            shift.value_or(Tensor()), mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto g = adaln_backward_op().call(grads[0], s[0], saved(s[1]), saved(s[2]), s[3], saved(s[4]), s[5], s[6],
                                      c10::nullopt);
    return {std::get<0>(g), unless_absent(std::get<1>(g), s[1]), unless_absent(std::get<2>(g), s[2]),
            std::get<3>(g), unless_absent(std::get<4>(g), s[4]), Tensor(), Tensor()};
  }
};

struct RmsFunction : public torch::autograd::Function<RmsFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional<Tensor>& weight,
                               const Tensor& scale, const optional<Tensor>& shift, double eps,
                               at::ScalarType out_dtype) {
    Tensor y, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(y, rstd) = rms_op().call(x, weight, scale, shift, eps, out_dtype);
    }
    ctx->save_for_backward({x, weight.value_or(Tensor()), scale, shift.value_or(Tensor()), rstd});
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto g = rms_backward_op().call(grads[0], s[0], saved(s[1]), s[2], saved(s[3]), s[4], c10::nullopt);
    return {std::get<0>(g), unless_absent(std::get<1>(g), s[1]), std::get<2>(g),
            unless_absent(std::get<3>(g), s[3]), Tensor(), Tensor()};
  }
};

// The q/k RMSNorm -> RoPE op: saves x, weight, cos, sin and rstd; the backward op's output_mask says
// which of (x, weight, cos, sin) need a gradient (what autograd asks for, as the Python kernel reads
// ctx.needs_input_grad), so dweight is skipped when only dx is wanted.
struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional<Tensor>& weight,
                               const Tensor& cos, const Tensor& sin, int64_t heads, double eps,
                               at::ScalarType out_dtype) {
    Tensor y, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(y, rstd) = rope_op().call(x, weight, cos, sin, heads, eps, out_dtype);
    }
    ctx->save_for_backward({x, weight.value_or(Tensor()), cos, sin, rstd});
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    // (autograd's edges count the tensor inputs given: x, weight when present, cos, sin)
    const size_t w = s[1].defined() ? 1 : 0;
    const std::array<bool, 4> mask = {ctx->needs_input_grad(0), w && ctx->needs_input_grad(1),
                                      ctx->needs_input_grad(1 + w), ctx->needs_input_grad(2 + w)};
    auto g = rope_backward_op().call(grads[0], s[0], saved(s[1]), s[2], s[3], s[4], mask);
    return {std::get<0>(g), mask[1] ? std::get<1>(g) : Tensor(), mask[2] ? std::get<2>(g) : Tensor(),
            mask[3] ? std::get<3>(g) : Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// The residual ops (Python: residual_norm_modulate/op.py, _differentiable): the forward saves r (an
// output), y only with a gate, the gate, norm and modulation tensors and the statistics, never the
// normalised tensor; the backward hands the backward op out's gradient (zeros when only r is used) and
// r's (undefined when r has no other use). Without a gate the backward op's dx is also y's (cast to
// y's dtype where it differs). One Function for both norms: the RMSNorm op passes no bias (no grad).
template <Norm NT>
struct ResidualFunction : public torch::autograd::Function<ResidualFunction<NT>> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                               const optional<Tensor>& weight, const optional<Tensor>& bias,
                               const optional<Tensor>& scale, const optional<Tensor>& shift, double eps,
                               at::ScalarType r_dtype, at::ScalarType out_dtype) {
    variable_list out;  // r, out, then the statistics (LayerNorm: mean, rstd; RMSNorm: rstd)
    {
      at::AutoDispatchBelowADInplaceOrView below;
      if constexpr (NT == Norm::Layer) {
        auto o = residual_adaln_op().call(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype);
        out = {std::get<0>(o), std::get<1>(o), std::get<2>(o), std::get<3>(o)};
      } else {
        auto o = residual_rms_op().call(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype);
        out = {std::get<0>(o), std::get<1>(o), std::get<2>(o)};
      }
    }
    const Tensor stat1 = NT == Norm::Layer ? out[3] : Tensor();
    ctx->save_for_backward({out[0], gate.has_value() ? y : Tensor(), gate.value_or(Tensor()),
                            weight.value_or(Tensor()), bias.value_or(Tensor()), scale.value_or(Tensor()),
                            shift.value_or(Tensor()), out[2], stat1});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["y_dtype"] = static_cast<int64_t>(y.scalar_type());
    if constexpr (NT == Norm::Layer) ctx->mark_non_differentiable({out[2], out[3]});
    else ctx->mark_non_differentiable({out[2]});
    ctx->set_materialize_grads(false);  // r's gradient stays undefined when r has no other use
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const Tensor& r = s[0];
    const optional<Tensor> dr = grads[0].defined() ? optional<Tensor>(grads[0]) : c10::nullopt;
    const Tensor dout = grads[1].defined() ? grads[1] : at::zeros_like(r);  // only r is used
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto y_dtype = static_cast<at::ScalarType>(ctx->saved_data["y_dtype"].toInt());
    Tensor dx, dy, dgate, dweight, dbias, dscale, dshift;
    if constexpr (NT == Norm::Layer) {
      std::tie(dx, dy, dgate, dweight, dbias, dscale, dshift) = residual_adaln_backward_op().call(
          dout, dr, r, saved(s[1]), saved(s[2]), saved(s[3]), saved(s[4]), saved(s[5]), saved(s[6]), s[7], s[8],
          x_dtype);
    } else {
      std::tie(dx, dy, dgate, dweight, dscale, dshift) = residual_rms_backward_op().call(
          dout, dr, r, saved(s[1]), saved(s[2]), saved(s[3]), saved(s[5]), saved(s[6]), s[7], x_dtype);
    }
    if (!s[2].defined()) dy = y_dtype == x_dtype ? dx : dx.to(y_dtype);  // x + y: dr_total for both
    return {dx,
            dy,
            unless_absent(dgate, s[2]),
            unless_absent(dweight, s[3]),
            unless_absent(dbias, s[4]),
            unless_absent(dscale, s[5]),
            unless_absent(dshift, s[6]),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

// The backward ops: a call that would need their derivative (create_graph with inputs that require
// grad) records a node whose backward raises, as in Python.
template <typename Result, typename Sig>
struct FirstDerivativeOnly : public torch::autograd::Function<FirstDerivativeOnly<Result, Sig>> {
  template <typename... Args>
  static variable_list forward(AutogradContext* ctx, const c10::TypedOperatorHandle<Sig>* op, const Args&... args) {
    at::AutoDispatchBelowADInplaceOrView below;
    Result r = op->call(args...);
    return std::apply([](const auto&... t) { return variable_list{t...}; }, r);
  }
  static variable_list backward(AutogradContext* ctx, variable_list) {
    TORCH_CHECK(false, "adaptiveload: the norm-modulate backward ops have no derivative (first derivatives only, "
                       "no double backward)");
    return {};
  }
};

Tensors3 adaln_autograd(const Tensor& x, const optional<Tensor>& weight, const optional<Tensor>& bias,
                    const Tensor& scale, const optional<Tensor>& shift, double eps, at::ScalarType out_dtype) {
  if (!needs_grad(x, weight, bias, scale, shift)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return adaln_op().call(x, weight, bias, scale, shift, eps, out_dtype);
  }
  auto out = AdalnFunction::apply(x, weight, bias, scale, shift, eps, out_dtype);
  return {out[0], out[1], out[2]};
}

Tensors2 rms_autograd(const Tensor& x, const optional<Tensor>& weight, const Tensor& scale,
                  const optional<Tensor>& shift, double eps, at::ScalarType out_dtype) {
  if (!needs_grad(x, weight, scale, shift)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return rms_op().call(x, weight, scale, shift, eps, out_dtype);
  }
  auto out = RmsFunction::apply(x, weight, scale, shift, eps, out_dtype);
  return {out[0], out[1]};
}

Tensors5 adaln_backward_autograd(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight,
                             const optional<Tensor>& bias, const Tensor& scale, const optional<Tensor>& shift,
                             const Tensor& mean, const Tensor& rstd, const optional<Tensor>& dx_addend) {
  if (!needs_grad(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return adaln_backward_op().call(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend);
  }
  auto g = FirstDerivativeOnly<Tensors5, AdalnBwdSig>::apply(&adaln_backward_op(), dy, x, weight, bias, scale, shift,
                                                         mean, rstd, dx_addend);
  return {g[0], g[1], g[2], g[3], g[4]};
}

Tensors4 rms_backward_autograd(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight, const Tensor& scale,
                           const optional<Tensor>& shift, const Tensor& rstd, const optional<Tensor>& dx_addend) {
  if (!needs_grad(dy, x, weight, scale, shift, rstd, dx_addend)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return rms_backward_op().call(dy, x, weight, scale, shift, rstd, dx_addend);
  }
  auto g = FirstDerivativeOnly<Tensors4, RmsBwdSig>::apply(&rms_backward_op(), dy, x, weight, scale, shift, rstd,
                                                           dx_addend);
  return {g[0], g[1], g[2], g[3]};
}

Tensors4 residual_adaln_autograd(const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                             const optional<Tensor>& weight, const optional<Tensor>& bias,
                             const optional<Tensor>& scale, const optional<Tensor>& shift, double eps,
                             at::ScalarType r_dtype, at::ScalarType out_dtype) {
  if (!needs_grad(x, y, gate, weight, bias, scale, shift)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return residual_adaln_op().call(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype);
  }
  auto out = ResidualFunction<Norm::Layer>::apply(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype);
  return {out[0], out[1], out[2], out[3]};
}

Tensors3 residual_rms_autograd(const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                           const optional<Tensor>& weight, const optional<Tensor>& scale,
                           const optional<Tensor>& shift, double eps, at::ScalarType r_dtype,
                           at::ScalarType out_dtype) {
  if (!needs_grad(x, y, gate, weight, scale, shift)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return residual_rms_op().call(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype);
  }
  const optional<Tensor> no_bias;
  auto out = ResidualFunction<Norm::RMS>::apply(x, y, gate, weight, no_bias, scale, shift, eps, r_dtype, out_dtype);
  return {out[0], out[1], out[2]};
}

Tensors7 residual_adaln_backward_autograd(const Tensor& dout, const optional<Tensor>& dr, const Tensor& r,
                                         const optional<Tensor>& y, const optional<Tensor>& gate,
                                         const optional<Tensor>& weight, const optional<Tensor>& bias,
                                         const optional<Tensor>& scale, const optional<Tensor>& shift,
                                         const Tensor& mean, const Tensor& rstd, at::ScalarType x_dtype) {
  if (!needs_grad(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return residual_adaln_backward_op().call(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype);
  }
  auto g = FirstDerivativeOnly<Tensors7, ResAdalnBwdSig>::apply(&residual_adaln_backward_op(), dout, dr, r, y, gate,
                                                               weight, bias, scale, shift, mean, rstd, x_dtype);
  return {g[0], g[1], g[2], g[3], g[4], g[5], g[6]};
}

Tensors6 residual_rms_backward_autograd(const Tensor& dout, const optional<Tensor>& dr, const Tensor& r,
                                       const optional<Tensor>& y, const optional<Tensor>& gate,
                                       const optional<Tensor>& weight, const optional<Tensor>& scale,
                                       const optional<Tensor>& shift, const Tensor& rstd, at::ScalarType x_dtype) {
  if (!needs_grad(dout, dr, r, y, gate, weight, scale, shift, rstd)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return residual_rms_backward_op().call(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype);
  }
  auto g = FirstDerivativeOnly<Tensors6, ResRmsBwdSig>::apply(&residual_rms_backward_op(), dout, dr, r, y, gate,
                                                             weight, scale, shift, rstd, x_dtype);
  return {g[0], g[1], g[2], g[3], g[4], g[5]};
}

Tensors2 rope_autograd(const Tensor& x, const optional<Tensor>& weight, const Tensor& cos, const Tensor& sin,
                       int64_t heads, double eps, at::ScalarType out_dtype) {
  if (!needs_grad(x, weight, cos, sin)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return rope_op().call(x, weight, cos, sin, heads, eps, out_dtype);
  }
  auto out = RopeFunction::apply(x, weight, cos, sin, heads, eps, out_dtype);
  return {out[0], out[1]};
}

Tensors4 rope_backward_autograd(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight, const Tensor& cos,
                                const Tensor& sin, const Tensor& rstd, std::array<bool, 4> output_mask) {
  if (!needs_grad(dy, x, weight, cos, sin, rstd)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return rope_backward_op().call(dy, x, weight, cos, sin, rstd, output_mask);
  }
  auto g = FirstDerivativeOnly<Tensors4, RopeBwdSig>::apply(&rope_backward_op(), dy, x, weight, cos, sin, rstd,
                                                            output_mask);
  return {g[0], g[1], g[2], g[3]};
}

}  // namespace

void register_dispatch(py::dict paths) {
  static const char* const names[kOps] = {"adaln_modulate",
                                          "adaln_modulate_backward",
                                          "rms_norm_modulate",
                                          "rms_norm_modulate_backward",
                                          "residual_adaln_modulate",
                                          "residual_adaln_modulate_backward",
                                          "residual_rms_norm_modulate",
                                          "residual_rms_norm_modulate_backward",
                                          "rms_norm_rope",
                                          "rms_norm_rope_backward"};
  for (int i = 0; i < kOps; ++i) {
    TORCH_CHECK(paths.contains(names[i]), "register_dispatch: no Python CUDA path for ", names[i]);
    py::object fn = paths[names[i]];
    Py_XDECREF(fallbacks()[i]);
    fallbacks()[i] = fn.inc_ref().ptr();
  }
}

}  // namespace adaln

TORCH_LIBRARY_IMPL(adaptiveload, CUDA, m) {
  m.impl("adaln_modulate", TORCH_FN(adaln::adaln_cuda));
  m.impl("adaln_modulate_backward", TORCH_FN(adaln::adaln_backward_cuda));
  m.impl("rms_norm_modulate", TORCH_FN(adaln::rms_cuda));
  m.impl("rms_norm_modulate_backward", TORCH_FN(adaln::rms_backward_cuda));
  m.impl("residual_adaln_modulate", TORCH_FN(adaln::residual_adaln_cuda));
  m.impl("residual_adaln_modulate_backward", TORCH_FN(adaln::residual_adaln_backward_cuda));
  m.impl("residual_rms_norm_modulate", TORCH_FN(adaln::residual_rms_cuda));
  m.impl("residual_rms_norm_modulate_backward", TORCH_FN(adaln::residual_rms_backward_cuda));
  m.impl("rms_norm_rope", TORCH_FN(adaln::rope_cuda));
  m.impl("rms_norm_rope_backward", TORCH_FN(adaln::rope_backward_cuda));
}

TORCH_LIBRARY_IMPL(adaptiveload, AutogradCUDA, m) {
  m.impl("adaln_modulate", TORCH_FN(adaln::adaln_autograd));
  m.impl("adaln_modulate_backward", TORCH_FN(adaln::adaln_backward_autograd));
  m.impl("rms_norm_modulate", TORCH_FN(adaln::rms_autograd));
  m.impl("rms_norm_modulate_backward", TORCH_FN(adaln::rms_backward_autograd));
  m.impl("residual_adaln_modulate", TORCH_FN(adaln::residual_adaln_autograd));
  m.impl("residual_adaln_modulate_backward", TORCH_FN(adaln::residual_adaln_backward_autograd));
  m.impl("residual_rms_norm_modulate", TORCH_FN(adaln::residual_rms_autograd));
  m.impl("residual_rms_norm_modulate_backward", TORCH_FN(adaln::residual_rms_backward_autograd));
  m.impl("rms_norm_rope", TORCH_FN(adaln::rope_autograd));
  m.impl("rms_norm_rope_backward", TORCH_FN(adaln::rope_backward_autograd));
}
