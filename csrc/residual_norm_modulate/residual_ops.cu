// The residual norm-site ops' CUDA bodies in torch terms (declared in norm_modulate_ops.h): their
// arguments as the public ops receive them, already checked (the dispatcher kernels' fast checks in
// norm_modulate_dispatch.cu, or the Python CUDA path's validation), turned into [B, N, D] row views,
// the outputs allocated, the kernels (residual_forward.cuh, residual_backward.cuh) launched on the
// current stream. Gate, scale and shift are read in place in their own dtypes (a .chunk() view is not
// copied); r's dtype picks the kernels' row type.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include "norm_modulate_ops.h"
#include "residual_norm_modulate/residual.cuh"

namespace adaln {

RowShape res_row_shape(int D, int max_threads) {
  const RowShape rs = row_shape_vec(D, kResVec, max_threads);
  if (rs.chunks <= kResMaxChunks) return rs;
  // a cap too low for kResMaxChunks chunks: more threads instead (D <= kMaxFeatures: at most 512)
  const int per = ((D + kResVec - 1) / kResVec + kResMaxChunks - 1) / kResMaxChunks;
  return {(per + 31) / 32 * 32, kResMaxChunks};
}

RowShape res_bwd_wide_shape(int D, int max_threads) {
  const int groups = (D + kResVec - 1) / kResVec;
  if (max_threads > 0 || groups <= kMaxThreads || groups > kResWideThreads) return {0, 0};
  return {(groups + 31) / 32 * 32, 1};
}

namespace {

using at::Tensor;
using c10::optional;

// f(tag) with tag::type the kernels' row type for r of dtype `dtype`.
template <typename F>
void with_row_type(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat: f(F32Tag{}); break;
    case at::kBFloat16: f(BF16Tag{}); break;
    case at::kHalf: f(F16Tag{}); break;
    default: TORCH_CHECK(false, "residual kernels: r must be float32, bfloat16 or float16, got ", dtype);
  }
}

// Modulation m (gate, scale or shift; absent: a null view) as the kernels read it for x viewed as
// [B, N, D], in its own dtype (mod_rows: in place, or a copy kept alive in `rows` until the launch).
ModView typed_rows(const optional<Tensor>& m, const Tensor& x, const char* name, Tensor& rows) {
  return m.has_value() ? mod_rows(*m, x, m->scalar_type(), name, rows) : ModView{};
}

// The segmented layout's modulation m [segments, D] (absent: a null view), read in place in its own
// dtype (a copy only where D is not unit-stride), kept alive in `rows`.
ModView segment_typed_rows(const optional<Tensor>& m, const Tensor& x3, const char* name, Tensor& rows) {
  if (!m.has_value()) return ModView{};
  rows = m->size(1) == 1 || m->stride(1) == 1 ? *m : m->contiguous();
  ModView v = seg_view(rows, x3, name);
  v.t = to_dtype(rows, name);
  return v;
}

// The rows of the first given modulation tensor: the segment count (the caller checked one is given).
int64_t segment_count(const optional<Tensor>& gate, const optional<Tensor>& scale, const optional<Tensor>& shift) {
  for (const optional<Tensor>* m : {&gate, &scale, &shift})
    if (m->has_value()) return (*m)->size(0);
  TORCH_CHECK(false, "residual kernels: the segmented layout needs a gate, scale or shift");
  return 0;
}

// What the launch reads of gate, scale and shift (and segment_ids), kept alive until it.
struct KeptRows {
  Tensor gate, scale, shift, ids;
};

// Gate, scale and shift of either residual op's arguments (ResFwdArgs, ResBwdArgs) as the kernels
// read them for the row tensor `like` ([B, ..., D]; like3: it viewed as [B, N, D]); with segment_ids,
// the segmented layout's [segments, D] rows and the ids.
template <typename Args>
KeptRows set_modulation(Args& a, const optional<Tensor>& gate, const optional<Tensor>& scale,
                        const optional<Tensor>& shift, const Tensor& like, const Tensor& like3,
                        const optional<Tensor>& segment_ids) {
  KeptRows k;
  if (segment_ids.has_value()) {
    a.gate = segment_typed_rows(gate, like3, "gate", k.gate);
    a.scale = segment_typed_rows(scale, like3, "scale", k.scale);
    a.shift = segment_typed_rows(shift, like3, "shift", k.shift);
    k.ids = segment_ids->contiguous();
    const int64_t count = segment_count(gate, scale, shift);
    for (const auto& [m, name] : {std::pair{&gate, "gate"}, std::pair{&scale, "scale"}, std::pair{&shift, "shift"}})
      TORCH_CHECK(!m->has_value() || (*m)->size(0) == count, "residual kernels: segmented ", name, " of shape ",
                  dims((*m)->sizes()), " must have one row per segment, ", num(count));
    a.seg = segment_ids_view(k.ids, like3, count);
  } else {
    a.gate = typed_rows(gate, like, "gate", k.gate);
    a.scale = typed_rows(scale, like, "scale", k.scale);
    a.shift = typed_rows(shift, like, "shift", k.shift);
  }
  return k;
}


const float* ptr_or_null(const optional<Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

}  // namespace

std::vector<Tensor> residual_op_forward(Norm norm, const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                                        const optional<Tensor>& weight, const optional<Tensor>& bias,
                                        const optional<Tensor>& scale, const optional<Tensor>& shift, double eps,
                                        at::ScalarType r_dtype, at::ScalarType out_dtype,
                                        const optional<Tensor>& segment_ids) {
  const Tuning t = tuning();
  c10::cuda::CUDAGuard guard(x.device());
  const bool segmented = segment_ids.has_value();
  const int64_t B = segmented ? 1 : x.size(0), D = x.size(-1);
  const Tensor x3 = x.contiguous().view({B, -1, D}), y3 = y.contiguous().view({B, -1, D});
  check_x(x3, "x");
  check_x(y3, "y");
  const int64_t N = x3.size(1);
  ResFwdArgs a;
  a.norm = norm;
  a.B = B, a.N = N, a.D = static_cast<int>(D);
  a.eps = static_cast<float>(eps);
  a.max_threads = t.max_threads;
  a.stages = t.fwd_stages;
  a.x = x3.data_ptr(), a.xt = to_dtype(x3, "x");
  a.y = y3.data_ptr(), a.yt = to_dtype(y3, "y");
  const KeptRows mods = set_modulation(a, gate, scale, shift, x, x3, segment_ids);
  if (segmented) segment_starts(mods.ids, a.seg.count, nullptr);  // (the ids' check)
  const optional<Tensor> w = affine_f32(weight), bi = affine_f32(bias);
  a.weight = ptr_or_null(w), a.bias = ptr_or_null(bi);
  const auto f32 = x.options().dtype(at::kFloat);
  const at::IntArrayRef rows = x.sizes().slice(0, x.dim() - 1);
  Tensor r = at::empty(x.sizes(), x.options().dtype(r_dtype));
  Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  Tensor mean = norm == Norm::RMS ? Tensor() : at::empty(rows, f32);
  Tensor rstd = at::empty(rows, f32);
  a.r = r.data_ptr(), a.out = out.data_ptr(), a.ot = to_dtype(out, "out");
  a.mean = mean.defined() ? mean.data_ptr<float>() : nullptr;
  a.rstd = rstd.data_ptr<float>();
  a.aligned = D % kResVec == 0 && aligned16(a.x) && aligned16(a.y) && aligned16(a.r) && aligned16(a.out) &&
              (!a.weight || aligned16(a.weight)) && (!a.bias || aligned16(a.bias)) &&
              mod_aligned(a.gate) && mod_aligned(a.scale) && mod_aligned(a.shift);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  bool ran = false;
  with_row_type(r_dtype, [&](auto tag) {
    using Tr = typename decltype(tag)::type;
    ran = norm == Norm::RMS ? res_forward<Norm::RMS, Tr>(a, stream) : res_forward<Norm::Layer, Tr>(a, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!ran) return {};  // (the segmented layout where its kernel cannot run: the caller's composite)
  return {r, out, mean, rstd};
}

std::vector<Tensor> residual_op_backward(Norm norm, const Tensor& dout, const optional<Tensor>& dr, const Tensor& r,
                                         const optional<Tensor>& y, const optional<Tensor>& gate,
                                         const optional<Tensor>& weight, const optional<Tensor>& bias,
                                         const optional<Tensor>& scale, const optional<Tensor>& shift,
                                         const optional<Tensor>& mean, const Tensor& rstd, at::ScalarType x_dtype,
                                         const optional<Tensor>& segment_ids) {
  const Tuning t = tuning();
  c10::cuda::CUDAGuard guard(r.device());
  const bool segmented = segment_ids.has_value();
  const int64_t B = segmented ? 1 : r.size(0), D = r.size(-1);
  const Tensor r3 = r.contiguous().view({B, -1, D});
  check_x(r3, "r");
  const int64_t N = r3.size(1);
  const Tensor dout3 = dout.contiguous().view({B, N, D});
  const Tensor dr3 = dr.has_value() ? dr->contiguous().view({B, N, D}) : Tensor();
  const Tensor y3 = gate.has_value() ? y->contiguous().view({B, N, D}) : Tensor();
  ResBwdArgs a;
  a.norm = norm;
  a.B = B, a.N = N, a.D = static_cast<int>(D);
  a.max_threads = t.max_threads;
  a.stages = t.bwd_stages;
  a.two_kernel = t.two_kernel;
  a.r = r3.data_ptr();
  a.dout = dout3.data_ptr(), a.dot = to_dtype(dout3, "dout");
  if (dr3.defined()) a.dr = dr3.data_ptr(), a.drt = to_dtype(dr3, "dr");
  if (y3.defined()) a.y = y3.data_ptr(), a.yt = to_dtype(y3, "y");
  const KeptRows mods = set_modulation(a, gate, scale, shift, r, r3, segment_ids);
  const optional<Tensor> w = affine_f32(weight), bi = affine_f32(bias);
  a.weight = ptr_or_null(w), a.bias = ptr_or_null(bi);
  const Tensor mean_rows = mean.has_value() ? stat_rows(*mean) : Tensor(), rstd_rows = stat_rows(rstd);
  a.mean = mean_rows.defined() ? mean_rows.data_ptr<float>() : nullptr;
  a.rstd = rstd_rows.data_ptr<float>();

  // outputs: per-token modulation's gradients per element, the others' per-sample column sums (mod_out)
  const auto f32 = r.options().dtype(at::kFloat);
  const Tensor dx = at::empty(r.sizes(), r.options().dtype(x_dtype));
  const Tensor dy = y3.defined() ? at::empty(r.sizes(), y3.options()) : Tensor();
  // (segmented: r is one sequence, its gradient rows are per segment and never summed)
  auto summed = [&](const Tensor& m) { return !segmented && summed_over_batch(m, r); };
  // The kernels' output for modulation m: per element (per-token) or per-sample (per-segment) column
  // sums, in m's dtype and allocated in m's shape where that is its gradient as written (`final`); a
  // modulation shared over a batch > 1: fp32 [B, N, D] or [B, D], summed over the batch afterwards
  // (mod_grad).
  auto mod_out = [&](const optional<Tensor>& m, const ModView& v, void*& el, DType& el_t, void*& rows,
                     DType& rows_t, bool& final) {
    if (!m.has_value()) return Tensor();
    final = !summed(*m);
    Tensor g = final ? at::empty(m->sizes(), r.options().dtype(m->scalar_type()))
               : v.sn != 0 ? at::empty({B, N, D}, f32) : at::empty({B, D}, f32);
    (v.sn != 0 ? el : rows) = g.data_ptr();
    (v.sn != 0 ? el_t : rows_t) = to_dtype(g, "gradient");
    return g;
  };
  bool gate_final = false, scale_final = false, shift_final = false;
  const Tensor dgate = mod_out(gate, a.gate, a.dgate_el, a.dgate_t, a.dgate_rows, a.dgate_rows_t, gate_final);
  const Tensor dscale = mod_out(scale, a.scale, a.dscale_el, a.dscale_t, a.dscale_rows, a.dscale_rows_t, scale_final);
  const Tensor dshift = mod_out(shift, a.shift, a.dshift_el, a.dshift_t, a.dshift_rows, a.dshift_rows_t, shift_final);
  const Tensor dweight = weight.has_value() ? at::empty({D}, f32) : Tensor();
  const Tensor dbias = bias.has_value() ? at::empty({D}, f32) : Tensor();
  if (dweight.defined()) a.dweight = dweight.data_ptr<float>();
  if (dbias.defined()) a.dbias = dbias.data_ptr<float>();
  a.dx = dx.data_ptr(), a.dxt = to_dtype(dx, "dx");
  if (dy.defined()) a.dy = dy.data_ptr();
  auto al = [](const void* p) { return p == nullptr || aligned16(p); };
  a.aligned = D % kResVec == 0 && al(a.r) && al(a.dout) && al(a.dr) && al(a.y) && al(a.dx) && al(a.dy) &&
              al(a.dgate_el) && al(a.dscale_el) && al(a.dshift_el) && al(a.weight) && al(a.bias) &&
              mod_aligned(a.gate) && mod_aligned(a.scale) && mod_aligned(a.shift);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(r.get_device()).stream();
  Tensor ws, rowsums, starts;
  bool taken = true;
  with_row_type(r.scalar_type(), [&](auto tag) {
    using Tr = typename decltype(tag)::type;
    auto run = [&](bool launch) {
      if (norm == Norm::RMS) res_backward<Norm::RMS, Tr>(a, launch, stream);
      else res_backward<Norm::Layer, Tr>(a, launch, stream);
    };
    run(false);  // plan: the design, tiles and block shape, which size the workspace
    if (segmented && a.stages == 0) {  // (the segmented layout's kernel cannot run: the caller's composite)
      taken = false;
      return;
    }
    if (a.columns()) {
      a.pieces = segmented ? a.tiles + a.seg.count : a.tiles * B;  // (norm_modulate.cuh: Pieces)
      // the planes, then the reduction groups' totals partials (norm_modulate.cuh: reduce_groups)
      const int64_t totals = totals_floats(a);
      ws = at::empty({kResPlanes * a.pieces * D + totals}, f32);
      a.ws = ws.data_ptr<float>();
      if (totals > 0) a.totals = a.ws + kResPlanes * a.pieces * D;
      a.aligned = a.aligned && aligned16(a.ws);
      if (a.two_kernel || segmented) {
        rowsums = at::empty({B * N * 2}, f32);
        a.rowsums = rowsums.data_ptr<float>();
      }
    }
    if (segmented) starts = segment_start_rows(mods.ids, a.seg);
    run(true);
  });
  if (!taken) return {};
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // (an absent input's gradient: undefined)
  auto grad_of = [&](const optional<Tensor>& m, const Tensor& g, bool final) {
    return !m.has_value() || final ? g : mod_grad(g, *m, r);
  };
  return {dx, dy, grad_of(gate, dgate, gate_final), affine_grad(dweight, weight), affine_grad(dbias, bias),
          grad_of(scale, dscale, scale_final), grad_of(shift, dshift, shift_final)};
}

Tensors4 residual_adaln_forward(const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                                const optional<Tensor>& weight, const optional<Tensor>& bias,
                                const optional<Tensor>& scale, const optional<Tensor>& shift, double eps,
                                at::ScalarType r_dtype, at::ScalarType out_dtype) {
  auto o = residual_op_forward(Norm::Layer, x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype);
  return {o[0], o[1], o[2], o[3]};
}

Tensors7 residual_adaln_backward(const Tensor& dout, const optional<Tensor>& dr, const Tensor& r,
                                 const optional<Tensor>& y, const optional<Tensor>& gate,
                                 const optional<Tensor>& weight, const optional<Tensor>& bias,
                                 const optional<Tensor>& scale, const optional<Tensor>& shift, const Tensor& mean,
                                 const Tensor& rstd, at::ScalarType x_dtype) {
  auto g = residual_op_backward(Norm::Layer, dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype);
  return {g[0], or_empty(g[1], r), or_empty(g[2], r), or_empty(g[3], r), or_empty(g[4], r), or_empty(g[5], r),
          or_empty(g[6], r)};
}

Tensors3 residual_rms_forward(const Tensor& x, const Tensor& y, const optional<Tensor>& gate,
                              const optional<Tensor>& weight, const optional<Tensor>& scale,
                              const optional<Tensor>& shift, double eps, at::ScalarType r_dtype,
                              at::ScalarType out_dtype) {
  auto o = residual_op_forward(Norm::RMS, x, y, gate, weight, c10::nullopt, scale, shift, eps, r_dtype, out_dtype);
  return {o[0], o[1], o[3]};
}

Tensors6 residual_rms_backward(const Tensor& dout, const optional<Tensor>& dr, const Tensor& r,
                               const optional<Tensor>& y, const optional<Tensor>& gate,
                               const optional<Tensor>& weight, const optional<Tensor>& scale,
                               const optional<Tensor>& shift, const Tensor& rstd, at::ScalarType x_dtype) {
  auto g = residual_op_backward(Norm::RMS, dout, dr, r, y, gate, weight, c10::nullopt, scale, shift, c10::nullopt,
                                rstd, x_dtype);
  return {g[0], or_empty(g[1], r), or_empty(g[2], r), or_empty(g[3], r), or_empty(g[5], r), or_empty(g[6], r)};
}

}  // namespace adaln
