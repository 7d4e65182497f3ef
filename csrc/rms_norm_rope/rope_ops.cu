// rms_norm_rope's CUDA bodies in torch terms (declared in norm_modulate_ops.h): the op's arguments,
// already validated by its Python CUDA path (adaptiveload/ops/rms_norm_rope/op.py), as [B, N, D] rows
// and strided rotation tables, the tables and the weight read in their own dtype (fp32, bf16 or fp16: no
// copy a call); outputs allocated; the kernels (rope_kernels.cu) launched on the current stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include "norm_modulate_ops.h"
#include "rms_norm_rope/rope.cuh"

namespace adaln {
namespace {

using at::Tensor;
using c10::optional;

// Table t (cos or sin, broadcast to [*x.shape[:-1], heads, Dh / 2]) as the kernels read it for x viewed
// as [B, N, D]: in its dtype, with its own strides where its row dims collapse to [B, N] (every layout
// the models make), else a copy of that shape, kept alive in `keep`.
RopeTable rope_table(const Tensor& t, const Tensor& x, int64_t B, int64_t N, int64_t heads, Tensor& keep) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(heads);
  shape.push_back(x.size(-1) / heads / 2);
  keep = t.expand(shape).reshape({B, N, heads, shape.back()});
  const int64_t span = (heads - 1) * keep.stride(2) + (shape.back() - 1) * keep.stride(3);
  if (span > INT32_MAX) keep = keep.contiguous();  // (in-row offsets past 32 bits: a copy of one row each)
  RopeTable r;
  r.p = keep.data_ptr();
  r.t = to_dtype(keep, "a rotation table");
  r.sb = keep.stride(0), r.sn = keep.stride(1);
  r.sh = static_cast<int>(keep.stride(2)), r.si = static_cast<int>(keep.stride(3));
  return r;
}

// The common part of both bodies: x as [B, N, D], the weight, the tables. `kept` holds what the
// launch reads that was made here.
struct RopeInputs {
  Tensor x3, w, cos, sin;
};

RopeArgs rope_args(const Tensor& x, const optional<Tensor>& weight, const Tensor& cos, const Tensor& sin,
                   int64_t heads, RopeInputs& kept) {
  const int64_t B = x.dim() >= 2 ? x.size(0) : 1, D = x.size(-1);
  TORCH_CHECK(heads > 0 && D % heads == 0 && (D / heads) % 2 == 0, "rms_norm_rope kernels: x's last dim ",
              num(D), " must split into ", num(heads), " heads of an even head dim");
  kept.x3 = x.contiguous().view({B, -1, D});
  check_x(kept.x3, "x");
  RopeArgs a;
  a.B = B, a.N = kept.x3.size(1), a.D = static_cast<int>(D), a.Dh = static_cast<int>(D / heads);
  a.x = kept.x3.data_ptr(), a.xt = to_dtype(kept.x3, "x");
  if (weight.has_value()) {
    kept.w = weight->contiguous();
    a.weight = kept.w.data_ptr();
    a.wt = to_dtype(kept.w, "weight");
  }
  a.cos = rope_table(cos, x, a.B, a.N, heads, kept.cos);
  a.sin = rope_table(sin, x, a.B, a.N, heads, kept.sin);
  a.aligned = D % rope_vec(a.xt) == 0 && aligned16(a.x) && (!a.weight || aligned16(a.weight));
  a.max_threads = tuning().max_threads;
  return a;
}

}  // namespace

Tensors2 rms_norm_rope_forward(const Tensor& x, const optional<Tensor>& weight, const Tensor& cos, const Tensor& sin,
                               int64_t heads, double eps, at::ScalarType out_dtype) {
  c10::cuda::CUDAGuard guard(x.device());
  RopeInputs kept;
  RopeArgs a = rope_args(x, weight, cos, sin, heads, kept);
  a.eps = static_cast<float>(eps);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  const at::IntArrayRef rows(shape);
  const Tensor rstd = at::empty(rows, x.options().dtype(at::kFloat));
  shape.push_back(heads);
  shape.push_back(a.Dh);
  const Tensor y = at::empty(shape, x.options().dtype(out_dtype));
  a.y = y.data_ptr(), a.yt = to_dtype(y, "y");
  a.rstd = rstd.data_ptr<float>();
  // (16-byte vectors of y need 8 elements of a 16-bit y: element by element after fp32 x's groups of 4)
  a.aligned = a.aligned && aligned16(a.y) && (a.xt != DType::F32 || a.yt == DType::F32);
  launch_rope_forward(a, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, rstd};
}

Tensors2 rms_norm_rope_backward(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight, const Tensor& cos,
                                const Tensor& sin, const Tensor& rstd, bool weight_grad) {
  c10::cuda::CUDAGuard guard(x.device());
  RopeInputs kept;
  RopeArgs a = rope_args(x, weight, cos, sin, dy.size(-2), kept);
  const Tensor dy3 = dy.contiguous().view({a.B, a.N, a.D});
  const Tensor rstd_rows = stat_rows(rstd);
  a.dy = dy3.data_ptr(), a.dyt = to_dtype(dy3, "dy");
  a.rstd = rstd_rows.data_ptr<float>();
  const Tensor dx = at::empty(x.sizes(), x.options());
  a.dx = dx.data_ptr(), a.dxt = to_dtype(dx, "dx");
  a.aligned = a.aligned && aligned16(a.dy) && aligned16(a.dx) && (a.xt != DType::F32 || a.dyt == DType::F32);
  const auto f32 = x.options().dtype(at::kFloat);
  const Tensor dweight = weight.has_value() && weight_grad ? at::empty({a.D}, weight->options()) : Tensor();
  if (dweight.defined()) a.dweight = dweight.data_ptr();  // (before the plan: it sizes the shared memory)
  rope_backward_plan(a);
  Tensor totals;
  if (dweight.defined() && a.partials > 1) {
    totals = at::empty({static_cast<int64_t>(a.partials) * a.D}, f32);
    a.totals = totals.data_ptr<float>();
  }
  launch_rope_backward(a, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, dweight.defined() ? dweight : or_empty(Tensor(), x)};
}

}  // namespace adaln
