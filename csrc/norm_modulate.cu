// Python bindings of the fused norm -> modulate kernels (forward / backward: LayerNorm, for
// adaln_modulate; rms_forward / rms_backward: RMSNorm, for rms_norm_modulate; residual_forward /
// residual_backward and residual_rms_*: the residual ops, whose bodies are in
// residual_norm_modulate/residual_ops.cu; segmented_forward / segmented_backward: the segmented
// layout of either norm, for adaptiveload/ops/segmented.py; rope_forward / rope_backward: the q/k
// RMSNorm -> RoPE op, whose bodies are in rms_norm_rope/rope_ops.cu): validate every input
// at the boundary (one TORCH_CHECK per constraint, naming the tensor and what was expected), allocate
// the outputs and launch on the current stream. The ops' dispatcher kernels for CUDA tensors
// (norm_modulate_dispatch.cu) call op_forward / op_backward; the bindings serve the ops' Python CUDA
// paths (adaptiveload/ops/<op>/op.py: the first call, and the calls those kernels hand back). Every kernel
// choice (block shape, ring slots, how y is stored, the short blocks after the wave, the backward's
// design) is the launchers' own, from the shape, dtypes, layout and device; set_tuning forces them
// for benchmarks and tests (adaptiveload/ops/_tuning.py).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <atomic>
#include <mutex>
#include <string>
#include <tuple>

#include "norm_modulate_ops.h"

namespace adaln {

namespace {

template <Norm N>
void run_backward_x(BwdArgs& a, bool launch, cudaStream_t stream) {
  switch (a.xt) {
    case DType::F32: run_backward<N, float>(a, launch, stream); break;
    case DType::BF16: run_backward<N, __nv_bfloat16>(a, launch, stream); break;
    default: run_backward<N, __half>(a, launch, stream); break;
  }
}

void run_backward_norm(BwdArgs& a, bool launch, cudaStream_t stream) {
  if (a.norm == Norm::RMS) run_backward_x<Norm::RMS>(a, launch, stream);
  else run_backward_x<Norm::Layer>(a, launch, stream);
}

}  // namespace

void backward_plan(BwdArgs& a) { run_backward_norm(a, false, nullptr); }

void launch_backward(const BwdArgs& a, cudaStream_t stream) {
  BwdArgs args = a;
  run_backward_norm(args, true, stream);
}

bool launch_forward(const FwdArgs& a, cudaStream_t stream) {
  return a.norm == Norm::RMS ? launch_forward_norm<Norm::RMS>(a, stream) : launch_forward_norm<Norm::Layer>(a, stream);
}

// Torch-side helpers of the CUDA bodies; those declared in norm_modulate_ops.h are shared with the
// residual ops' bodies (residual_norm_modulate/residual_ops.cu).
using at::Tensor;
using c10::optional;

DType to_dtype(at::ScalarType dtype, const char* name) {
  switch (dtype) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default:
      TORCH_CHECK(false, "norm_modulate kernels: ", name, " must be float32, bfloat16 or float16, got ", dtype);
  }
  return DType::F32;
}

DType to_dtype(const Tensor& t, const char* name) { return to_dtype(t.scalar_type(), name); }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::string dims(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// x: [B, N, D] contiguous on CUDA.
void check_x(const Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), "norm_modulate kernels: ", name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 3, "norm_modulate kernels: ", name, " must be viewed as [B, N, D], got shape ",
              dims(x.sizes()));
  TORCH_CHECK(x.is_contiguous(), "norm_modulate kernels: ", name, " must be contiguous, got strides ",
              dims(x.strides()));
  TORCH_CHECK(x.size(0) > 0 && x.size(1) > 0 && x.size(2) > 0, "norm_modulate kernels: ", name,
              " must not be empty, got shape ", dims(x.sizes()));
}

void check_same_device(const Tensor& t, const Tensor& x, const char* name) {
  TORCH_CHECK(t.device() == x.device(), "norm_modulate kernels: ", name, " is on ", t.device(), " but x is on ", x.device());
}

// weight/bias: fp32 contiguous [D].
const float* affine_ptr(const optional<Tensor>& t, const Tensor& x, const char* name) {
  if (!t.has_value()) return nullptr;
  const Tensor& v = *t;
  check_same_device(v, x, name);
  TORCH_CHECK(v.scalar_type() == at::kFloat, "norm_modulate kernels: ", name, " must be float32 here, got ", v.scalar_type());
  TORCH_CHECK(v.dim() == 1 && v.size(0) == x.size(2) && v.is_contiguous(), "norm_modulate kernels: ", name,
              " must be a contiguous [", num(x.size(2)), "] tensor, got shape ", dims(v.sizes()),
              " strides ", dims(v.strides()));
  return v.data_ptr<float>();
}

bool mod_aligned(const ModView& v) {
  const int64_t esize = dtype_bytes(v.t);
  return v.ptr == nullptr || (aligned16(v.ptr) && (v.sb * esize) % 16 == 0 && (v.sn * esize) % 16 == 0);
}

// Segmented modulation: [segments, D] rows, unit stride along D, of x viewed as [1, T, D].
ModView seg_view(const Tensor& m, const Tensor& x, const char* name) {
  check_same_device(m, x, name);
  TORCH_CHECK(m.dim() == 2 && m.size(1) == x.size(2) && (m.stride(1) == 1 || m.size(1) == 1),
              "norm_modulate kernels: segmented ", name, " must be [segments, ", num(x.size(2)),
              "] with unit stride along D, got shape ", dims(m.sizes()), " strides ", dims(m.strides()));
  ModView v;
  v.ptr = m.data_ptr();
  v.sb = m.stride(0);
  return v;
}

// segment_ids: int32 / int64 [T], contiguous, on x's device (x viewed as [1, T, D]), of `count` segments.
Segments segment_ids_view(const Tensor& ids, const Tensor& x, int64_t count) {
  check_same_device(ids, x, "segment_ids");
  TORCH_CHECK(x.size(0) == 1, "norm_modulate kernels: a segmented x must be viewed as [1, T, D], got ",
              dims(x.sizes()));
  TORCH_CHECK((ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong) && ids.dim() == 1 &&
                  ids.size(0) == x.size(1) && ids.is_contiguous(),
              "norm_modulate kernels: segment_ids must be a contiguous int32 or int64 [", num(x.size(1)),
              "], got shape ", dims(ids.sizes()), " dtype ", ids.scalar_type());
  Segments s;
  s.ids = ids.data_ptr();
  s.ids64 = ids.scalar_type() == at::kLong;
  s.count = count;
  s.consecutive = true;  // (the forward; benchmarks/KERNEL_NOTES.md, "tiles of consecutive rows")
  return s;
}

namespace {
// Checks that each segment id lies in [0, segments) and, where `start` is given (BwdArgs::seg_start,
// its last entry zeroed before), writes each segment's first row and T at [segments] for
// non-decreasing ids (row i writes the segments from ids[i - 1] + 1 to ids[i], the last row also
// those after its own, so every entry is written once), and 1 at [segments + 1] where an id is below
// the one before it. An id out of range stops the kernel with a message naming the row (a
// device-side error: reading the ids on the host would make it wait for the device).
template <typename I>
__global__ void segment_starts_kernel(const I* __restrict__ ids, int64_t T, int64_t segments, int64_t* start) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i], prev = i > 0 ? static_cast<int64_t>(ids[i - 1]) : -1;
    if (id < 0 || id >= segments) {
      printf("adaptiveload: segment_ids[%lld] = %lld lies outside [0, %lld) (the rows of scale)\n",
             static_cast<long long>(i), static_cast<long long>(id), static_cast<long long>(segments));
      __trap();
    }
    if (start == nullptr) continue;
    if (id < prev) start[segments + 1] = 1;  // (every writer writes the same value)
    for (int64_t s = prev + 1; s <= id; ++s) start[s] = i;
    if (i == T - 1)
      for (int64_t s = id + 1; s <= segments; ++s) start[s] = T;
  }
}
}  // namespace

// Launches segment_starts_kernel on the current stream (start: nullptr to check only).
void segment_starts(const Tensor& ids, int64_t segments, int64_t* start) {
  const int64_t T = ids.size(0);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((T + threads - 1) / threads, 1024);
  auto stream = c10::cuda::getCurrentCUDAStream(ids.get_device()).stream();
  if (ids.scalar_type() == at::kLong)
    segment_starts_kernel<<<blocks, threads, 0, stream>>>(ids.data_ptr<int64_t>(), T, segments, start);
  else
    segment_starts_kernel<<<blocks, threads, 0, stream>>>(ids.data_ptr<int32_t>(), T, segments, start);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

Tensor segment_start_rows(const Tensor& ids, Segments& s) {
  Tensor starts = at::empty({s.count + 2}, ids.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(starts.data_ptr<int64_t>() + s.count + 1, 0, sizeof(int64_t),
                                 c10::cuda::getCurrentCUDAStream(ids.get_device()).stream()));
  segment_starts(ids, s.count, starts.data_ptr<int64_t>());
  s.start = starts.data_ptr<int64_t>();
  return starts;
}

std::mutex tuning_mutex;
Tuning tuning_set;                    // guarded by tuning_mutex
std::atomic<bool> tuning_on{false};  // tuning_set differs from the defaults

// The choices in force: the defaults, without a lock, unless an override is set.
Tuning tuning() {
  if (!tuning_on.load(std::memory_order_acquire)) return Tuning{};
  std::lock_guard<std::mutex> lock(tuning_mutex);
  return tuning_set;
}

// Sets the override; returns what is wrong with the arguments ("" when they are fine, and then set).
// A return value rather than an exception: the Python layer (_tuning.override) raises the ValueError.
std::string set_tuning(int64_t max_threads, int64_t fwd_stages, int64_t bwd_stages, int64_t store, int64_t tail_pct,
                       int64_t tail_rows, bool two_kernel) {
  static_assert(kMaxThreads == 512 && kMaxStages == 8, "set_tuning's messages name these limits");
  auto bad = [](const char* what, int64_t got) {
    return std::string("set_tuning: ") + what + ", got " + num(got);
  };
  if (max_threads != 0 && (max_threads < 32 || max_threads > kMaxThreads))
    return bad("max_threads must be 0 (automatic) or 32..512", max_threads);
  for (int64_t stages : {fwd_stages, bwd_stages})
    if (stages != -1 && stages != 0 && (stages < 2 || stages > kMaxStages))
      return bad("stages must be -1 (automatic), 0 or 2..8", stages);
  if (store < -1 || store > 1) return bad("store must be -1, 0 or 1", store);
  if (tail_pct < -1 || tail_pct > 50) return bad("tail_pct must be -1 (automatic) or 0..50", tail_pct);
  if (tail_rows < 1 || tail_rows > 65536) return bad("tail_rows must be 1..65536", tail_rows);
  Tuning t;
  t.max_threads = static_cast<int>(max_threads);
  t.fwd_stages = static_cast<int>(fwd_stages);
  t.bwd_stages = static_cast<int>(bwd_stages);
  t.store = static_cast<int>(store);
  t.tail_pct = static_cast<int>(tail_pct);
  t.tail_rows = static_cast<int>(tail_rows);
  t.two_kernel = two_kernel;
  const Tuning d;
  std::lock_guard<std::mutex> lock(tuning_mutex);
  tuning_set = t;
  tuning_on.store(t.max_threads != d.max_threads || t.fwd_stages != d.fwd_stages || t.bwd_stages != d.bwd_stages ||
                      t.store != d.store || t.tail_pct != d.tail_pct || t.tail_rows != d.tail_rows ||
                      t.two_kernel != d.two_kernel,
                  std::memory_order_release);
  return "";
}

// ---------------------------------------------------------------------------------------------
// The ops' CUDA bodies: their arguments as the public ops receive them (validated by the dispatcher
// kernels' fast checks or the Python layer), turned into the kernels' [B, N, D] row views. Done here
// rather than in Python because each tensor call costs host time on every launch; for the same
// reason a call makes no tensor it does not return or launch with: the modulation is read in place
// through its own strides, outputs are allocated in their final shapes and dtypes wherever the
// kernels write them as such, and an absent input's gradient is left undefined (the callers turn it
// into the [0] tensor the schemas return, only where they return one).

// The size of modulation `t` at x's dim i, t broadcast against x (right-aligned): 1 where t has
// no such dim. Sizes only, so the launch path creates no tensor to answer it.
int64_t bcast_size(const Tensor& t, const Tensor& x, int64_t i) {
  TORCH_CHECK(t.dim() >= 1 && t.dim() <= x.dim(), "norm_modulate kernels: a modulation of shape ", dims(t.sizes()),
              " does not broadcast over x of shape ", dims(x.sizes()));
  const int64_t j = i - (x.dim() - t.dim());
  return j < 0 ? 1 : t.size(j);
}

// A modulation with a token dim other than 1 (per-token); 2-D x has no token dims.
bool per_token(const Tensor& t, const Tensor& x) {
  for (int64_t i = 1; i + 1 < x.dim(); ++i)
    if (bcast_size(t, x, i) != 1) return true;
  return false;
}

bool summed_over_batch(const Tensor& t, const Tensor& x) { return x.size(0) > 1 && bcast_size(t, x, 0) == 1; }

// One dtype for scale and shift: theirs when they agree and it is x's or float32, else float32. A
// per-token modulation broadcast over a batch > 1 also goes float32: its per-element gradients are
// summed over the batch afterwards, and should be rounded once, after the sum.
at::ScalarType mod_dtype(const Tensor& x, const Tensor& scale, const optional<Tensor>& shift) {
  const at::ScalarType st = scale.scalar_type();
  if ((shift.has_value() && shift->scalar_type() != st) || (st != x.scalar_type() && st != at::kFloat))
    return at::kFloat;
  for (const Tensor* t : {&scale, shift.has_value() ? &*shift : nullptr}) {
    if (t == nullptr) continue;
    if (summed_over_batch(*t, x) && per_token(*t, x)) return at::kFloat;
  }
  return st;
}

// modulation_layout(t.shape, x.shape) in adaptiveload/ops/common.py: per-sample, per-token or shared
bool layout_ok(const Tensor& t, const Tensor& x) {
  const int64_t xd = x.dim(), td = t.dim();
  if (td == 0 || td > xd || t.size(-1) != x.size(-1)) return false;
  const int64_t off = xd - td;
  auto padded = [&](int64_t i) { return i < off ? int64_t{1} : t.size(i - off); };
  if (padded(0) != 1 && padded(0) != x.size(0)) return false;
  bool ones = true, same = true;
  for (int64_t i = 1; i + 1 < xd; ++i) {
    ones = ones && padded(i) == 1;
    same = same && padded(i) == x.size(i);
  }
  return ones || same;
}

namespace {
// Modulation `t` as a [B or 1, N or 1, D] view of x viewed as [B, N, D] in dtype `dt`: no copy unless
// the token dims of a per-token modulation do not collapse to one stride, D is not unit-stride, or the
// tokens are an expanded (stride 0) view of one row, whose gradient is still per token.
Tensor modulation_rows(const Tensor& t, const Tensor& x, at::ScalarType dt) {
  const int64_t D = x.size(-1);
  const Tensor rows =
      t.to(dt).reshape({bcast_size(t, x, 0), per_token(t, x) ? x.numel() / (x.size(0) * D) : 1, D});
  return (D == 1 || rows.stride(-1) == 1) && (rows.size(1) == 1 || rows.stride(1) != 0) ? rows : rows.contiguous();
}

// The batch and token strides of modulation t broadcast against x, read from t itself (v.sb, v.sn):
// false where D is not unit-stride or t's token dims of size > 1 do not collapse to one stride (or are
// expanded, stride 0: see modulation_rows).
bool strides_in_place(const Tensor& t, const Tensor& x, ModView& v) {
  if (t.size(-1) != 1 && t.stride(-1) != 1) return false;
  const int64_t off = x.dim() - t.dim();  // x's leading dims that t lacks
  v.sb = off == 0 && t.size(0) != 1 ? t.stride(0) : 0;
  v.sn = 0;
  int64_t outer = -1;  // the stride the next outer token dim of size > 1 must have
  for (int64_t j = t.dim() - 2; j >= (off == 0 ? 1 : 0); --j) {  // t's token dims, innermost first
    if (t.size(j) == 1) continue;
    if (t.stride(j) == 0) return false;
    if (outer < 0) v.sn = t.stride(j);
    else if (t.stride(j) != outer) return false;
    outer = t.stride(j) * t.size(j);
  }
  return true;
}
}  // namespace

ModView mod_rows(const Tensor& t, const Tensor& x, at::ScalarType dt, const char* name, Tensor& keep) {
  check_same_device(t, x, name);
  TORCH_CHECK(layout_ok(t, x), "norm_modulate kernels: ", name, " of shape ", dims(t.sizes()),
              " is not a modulation layout (per-sample, per-token or shared) of x of shape ", dims(x.sizes()));
  ModView v;
  if (t.scalar_type() == dt && strides_in_place(t, x, v)) {
    v.ptr = t.data_ptr();
  } else {
    keep = modulation_rows(t, x, dt);
    v.ptr = keep.data_ptr();
    v.sb = keep.size(0) == 1 ? 0 : keep.stride(0);
    v.sn = keep.size(1) == 1 ? 0 : keep.stride(1);
  }
  v.t = to_dtype(dt, name);
  return v;
}

namespace {
// Scale and shift as the norm -> modulate kernels read them, in one dtype (mod_dtype; the segmented
// layout: [segments, D] rows, in their dtype when they agree and it is x's or float32, else float32),
// with any copy kept alive until the launch.
struct ScaleShift {
  ModView scale, shift;  // shift.ptr: nullptr when absent
  at::ScalarType dtype = at::kFloat;
  int64_t segments = 0;  // the segmented layout's row count, else 0
  Tensor keep_scale, keep_shift;
};

ScaleShift scale_shift_rows(const Tensor& x, const Tensor& scale, const optional<Tensor>& shift) {
  ScaleShift s;
  s.dtype = mod_dtype(x, scale, shift);
  s.scale = mod_rows(scale, x, s.dtype, "scale", s.keep_scale);
  if (shift.has_value()) s.shift = mod_rows(*shift, x, s.dtype, "shift", s.keep_shift);
  return s;
}

// (x3: x viewed as [1, T, D])
ScaleShift segment_rows(const Tensor& x3, const Tensor& scale, const optional<Tensor>& shift) {
  ScaleShift s;
  const at::ScalarType st = scale.scalar_type();
  const bool keep = (!shift.has_value() || shift->scalar_type() == st) && (st == x3.scalar_type() || st == at::kFloat);
  s.dtype = keep ? st : at::kFloat;
  s.segments = scale.size(0);
  auto rows = [&](const Tensor& m, Tensor& kept, const char* name) {
    TORCH_CHECK(m.dim() >= 1 && m.size(0) == s.segments, "norm_modulate kernels: segmented ", name, " of shape ",
                dims(m.sizes()), " must have one row per segment, ", num(s.segments), " (scale's rows)");
    kept = m.to(s.dtype);
    if (kept.size(1) != 1 && kept.stride(1) != 1) kept = kept.contiguous();
    ModView v = seg_view(kept, x3, name);
    v.t = to_dtype(s.dtype, name);
    return v;
  };
  s.scale = rows(scale, s.keep_scale, "scale");
  if (shift.has_value()) s.shift = rows(*shift, s.keep_shift, "shift");
  return s;
}
}  // namespace

optional<Tensor> affine_f32(const optional<Tensor>& t) {
  if (!t.has_value() || (t->scalar_type() == at::kFloat && t->is_contiguous())) return t;
  return t->to(at::kFloat).contiguous();
}

Tensor affine_grad(const Tensor& g, const optional<Tensor>& p) {
  return !p.has_value() || p->scalar_type() == at::kFloat ? g : g.to(p->scalar_type());
}

Tensor stat_rows(const Tensor& s) {
  return s.scalar_type() == at::kFloat && s.is_contiguous() ? s : s.to(at::kFloat).contiguous();
}

// A kernel gradient of modulation `t` ([B, N, D] per element or [B, D] per-sample sums), summed over
// the dims where `t` broadcasts, in t's shape and dtype.
Tensor mod_grad(Tensor g, const Tensor& t, const Tensor& x) {
  if (summed_over_batch(t, x)) g = g.sum(at::IntArrayRef{0}, /*keepdim=*/true, at::kFloat);
  return g.reshape(t.sizes()).to(t.scalar_type());
}

Tensor or_empty(const Tensor& g, const Tensor& x) { return g.defined() ? g : x.new_empty({0}); }

namespace {
// What the forward and the backward launchers share of their kernel arguments (FwdArgs, BwdArgs),
// from x viewed as [B, N, D] and its parameters, checked here: the dtypes, the norm, the pointers,
// the sizes, the block-shape cap and ring slots, and `aligned` as far as these tensors go (the
// caller adds its own).
// Segmented layout (`seg`: the segment of each row of x [1, T, D], int32 or int64 [T]): scale and shift
// are [segments, D] rows (segment_rows), read through a.seg.
template <typename Args>
void fill_rows(Args& a, Norm norm, const Tensor& x, const optional<Tensor>& weight, const optional<Tensor>& bias,
               const ScaleShift& ss, int max_threads, int stages, const optional<Tensor>& seg) {
  check_x(x, "x");
  const int64_t D = x.size(2);
  a.xt = to_dtype(x, "x");
  TORCH_CHECK(D <= max_features(a.xt), "norm_modulate kernels: D = ", num(D), " exceeds the kernel's ",
              num(max_features(a.xt)),
              " features for ", x.scalar_type());
  TORCH_CHECK(ss.dtype == x.scalar_type() || ss.dtype == at::kFloat, "norm_modulate kernels: scale and shift must be ",
              "read as float32 or x's dtype ", x.scalar_type(), ", got ", ss.dtype);
  a.mt = ss.scale.t;
  a.norm = norm;
  a.x = x.data_ptr();
  a.weight = affine_ptr(weight, x, "weight");
  a.bias = affine_ptr(bias, x, "bias");
  a.scale = ss.scale;
  a.shift = ss.shift;
  if (seg.has_value()) a.seg = segment_ids_view(*seg, x, ss.segments);
  a.B = x.size(0);
  a.N = x.size(1);
  a.D = static_cast<int>(D);
  a.max_threads = max_threads;
  a.stages = stages;
  const int64_t vec = a.xt == DType::F32 ? 4 : 8;
  a.aligned = D % vec == 0 && aligned16(a.x) && (!a.weight || aligned16(a.weight)) && (!a.bias || aligned16(a.bias)) &&
              mod_aligned(a.scale) && mod_aligned(a.shift);
}
}  // namespace

// The ops' CUDA bodies (norm_modulate_ops.h), for the dispatcher kernels (norm_modulate_dispatch.cu)
// and the bindings below. With segment_ids: the segmented layout (x viewed as one sequence, scale
// and shift [segments, D]), {} where its kernel cannot run.

// {y, mean (undefined for RMSNorm), rstd} in x's shape, y in out_dtype, the per-row statistics in
// fp32: the CUDA body of either op's forward
std::vector<Tensor> op_forward(Norm norm, const Tensor& x, const optional<Tensor>& weight,
                               const optional<Tensor>& bias, const Tensor& scale, const optional<Tensor>& shift,
                               double eps, at::ScalarType out_dtype, const optional<Tensor>& segment_ids) {
  const bool segmented = segment_ids.has_value();
  const Tensor x3 = x.contiguous().view({segmented ? 1 : x.size(0), -1, x.size(-1)});
  const ScaleShift ss = segmented ? segment_rows(x3, scale, shift) : scale_shift_rows(x, scale, shift);
  optional<Tensor> ids;
  if (segmented) ids = segment_ids->contiguous();
  const optional<Tensor> w = affine_f32(weight), bi = affine_f32(bias);  // (alive until the launch)
  const Tuning t = tuning();
  FwdArgs a;
  fill_rows(a, norm, x3, w, bi, ss, t.max_threads, t.fwd_stages, ids);
  c10::cuda::CUDAGuard guard(x.device());
  if (segmented) segment_starts(*ids, ss.segments, nullptr);
  const bool out_fp32 = out_dtype != x.scalar_type();
  const at::IntArrayRef rows = x.sizes().slice(0, x.dim() - 1);
  const auto f32 = x.options().dtype(at::kFloat);
  Tensor y = at::empty(x.sizes(), out_fp32 ? f32 : x.options());
  Tensor mean = norm == Norm::RMS ? Tensor() : at::empty(rows, f32);
  Tensor rstd = at::empty(rows, f32);
  a.ot = out_fp32 ? DType::F32 : a.xt;
  a.y = y.data_ptr();
  a.mean = mean.defined() ? mean.data_ptr<float>() : nullptr;
  a.rstd = rstd.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.store = t.store;
  a.tail_pct = t.tail_pct;
  a.tail_rows = t.tail_rows;
  a.aligned = a.aligned && aligned16(a.y);
  const bool launched = launch_forward(a, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!launched) return {};  // (the segmented layout where its kernel cannot run: the caller's composite)
  if (out_fp32 && out_dtype != at::kFloat) y = y.to(out_dtype);
  return {y, mean, rstd};
}

// {dx, dweight, dbias, dscale, dshift} in the inputs' shapes and dtypes, undefined for an absent
// input: the CUDA body of either op's backward (mean: none for RMSNorm). The kernels write dscale and
// dshift as [B, N, D] per element when the modulation is per-token, else as per-sample (per-segment)
// column sums [rows, D]: in the modulation's dtype when those are its gradient, so that each sum is
// rounded once; in float32 when a modulation shared over a batch > 1 is summed over it afterwards.
std::vector<Tensor> op_backward(Norm norm, const Tensor& dy_in, const Tensor& x, const optional<Tensor>& weight,
                                const optional<Tensor>& bias, const Tensor& scale, const optional<Tensor>& shift,
                                const optional<Tensor>& mean, const Tensor& rstd,
                                const optional<Tensor>& segment_ids, const optional<Tensor>& dx_addend) {
  const bool segmented = segment_ids.has_value();
  const int64_t D = x.size(-1);
  TORCH_CHECK(dy_in.sizes() == x.sizes(), "norm_modulate kernels (backward): dy shape ", dims(dy_in.sizes()),
              " must equal x shape ", dims(x.sizes()));
  const Tensor x3 = x.contiguous().view({segmented ? 1 : x.size(0), -1, D});
  const Tensor dy =
      (dy_in.scalar_type() == x.scalar_type() || dy_in.scalar_type() == at::kFloat ? dy_in : dy_in.to(at::kFloat))
          .contiguous()
          .view(x3.sizes());
  const ScaleShift ss = segmented ? segment_rows(x3, scale, shift) : scale_shift_rows(x, scale, shift);
  optional<Tensor> ids;
  if (segmented) ids = segment_ids->contiguous();
  const Tensor rstd_rows = stat_rows(rstd), mean_rows = mean.has_value() ? stat_rows(*mean) : Tensor();
  const optional<Tensor> w = affine_f32(weight), bi = affine_f32(bias);  // (alive until the launch)
  const Tuning t = tuning();
  BwdArgs a;
  fill_rows(a, norm, x3, w, bi, ss, t.max_threads, t.bwd_stages, ids);
  const int64_t B = a.B, N = a.N;
  check_x(dy, "dy");
  check_same_device(dy, x, "dy");
  a.dyt = to_dtype(dy, "dy");
  TORCH_CHECK(mean.has_value() == (norm == Norm::Layer), "norm_modulate kernels (backward): mean is ",
              norm == Norm::Layer ? "required" : "not taken", " for this norm");
  for (const Tensor* s : {mean_rows.defined() ? &mean_rows : nullptr, &rstd_rows}) {
    if (s == nullptr) continue;
    const char* name = s == &rstd_rows ? "rstd" : "mean";
    check_same_device(*s, x, name);
    TORCH_CHECK(s->numel() == B * N, "norm_modulate kernels (backward): ", name, " must have ", num(B * N),
                " elements (one per row), got shape ", dims(s->sizes()));
  }
  c10::cuda::CUDAGuard guard(x.device());
  a.dy = dy.data_ptr();
  a.mean = mean_rows.defined() ? mean_rows.data_ptr<float>() : nullptr;
  a.rstd = rstd_rows.data_ptr<float>();
  a.two_kernel = t.two_kernel;

  const auto f32 = x.options().dtype(at::kFloat);
  const Tensor dx = at::empty(x.sizes(), x.options());
  a.dx = dx.data_ptr();
  if (dx_addend.has_value()) {
    TORCH_CHECK(dx_addend->sizes() == x.sizes() && dx_addend->scalar_type() == x.scalar_type(),
                "norm_modulate kernels (backward): dx_addend must have x's shape ", dims(x.sizes()),
                " and dtype, got shape ", dims(dx_addend->sizes()));
    check_same_device(*dx_addend, x, "dx_addend");
  }
  const bool scale_pt = a.scale.sn != 0;
  const bool shift_pt = shift.has_value() && a.shift.sn != 0;
  // (segmented: x is one sequence, its gradient rows are per segment and never summed)
  auto summed = [&](const Tensor& m) { return !segmented && summed_over_batch(m, x); };
  const bool in_mt = (scale_pt || !summed(scale)) && (!shift.has_value() || shift_pt || !summed(*shift));
  a.rows_t = in_mt ? a.mt : DType::F32;
  // the kernel's output for modulation m, allocated in m's shape where it is m's gradient as written
  // (`final`), else as the kernels write it, summed and cast afterwards (mod_grad)
  auto mod_out = [&](const Tensor& m, bool pt, bool& final) {
    const at::ScalarType dt = pt || in_mt ? ss.dtype : at::kFloat;
    final = dt == m.scalar_type() && !summed(m);
    const auto options = x.options().dtype(dt);
    if (final) return at::empty(m.sizes(), options);
    return pt ? at::empty({B, N, D}, options) : at::empty({segmented ? ss.segments : B, D}, options);
  };
  bool scale_final = false, shift_final = false;
  const Tensor dscale = mod_out(scale, scale_pt, scale_final);
  const Tensor dshift = shift.has_value() ? mod_out(*shift, shift_pt, shift_final) : Tensor();
  const Tensor dweight = weight.has_value() ? at::empty({D}, f32) : Tensor();
  const Tensor dbias = bias.has_value() ? at::empty({D}, f32) : Tensor();
  if (scale_pt) a.dscale_el = dscale.data_ptr();
  else a.dscale_rows = dscale.data_ptr();
  if (shift_pt) a.dshift_el = dshift.data_ptr();
  else if (shift.has_value()) a.dshift_rows = dshift.data_ptr();
  if (weight.has_value()) a.dweight = dweight.data_ptr<float>();
  if (bias.has_value()) a.dbias = dbias.data_ptr<float>();

  a.aligned = a.aligned && aligned16(a.dy) && aligned16(a.dx) && (!a.dscale_el || aligned16(a.dscale_el)) &&
              (!a.dshift_el || aligned16(a.dshift_el));
  // the addend: read by the per-sample ring kernel (BwdArgs::dx_addend; its row widens the ring's slots,
  // so it is set before the plan), else added after the launch. The kernel reads contiguous, aligned
  // rows: a strided addend is copied, only once the plan has taken that kernel (until then its pointer
  // only tells the plan that there is an addend).
  Tensor addend;  // (the contiguous copy, alive until the launch)
  const bool strided_addend = dx_addend.has_value() && !dx_addend->is_contiguous();
  if (dx_addend.has_value() && !scale_pt && !segmented && (strided_addend || aligned16(dx_addend->data_ptr())))
    a.dx_addend = dx_addend->data_ptr();
  backward_plan(a);  // after the alignment: the ring (a.stages) needs aligned rows
  if (a.stages == 0) {
    a.dx_addend = nullptr;
  } else if (a.dx_addend != nullptr && strided_addend) {
    addend = dx_addend->contiguous();
    a.dx_addend = addend.data_ptr();
  }
  Tensor starts;
  if (segmented) {
    if (a.stages == 0 || a.two_kernel) return {};  // (the ring kernel only; the caller's composite)
    starts = segment_start_rows(*ids, a.seg);
  }
  a.pieces = segmented ? a.tiles + a.seg.count : a.tiles * B;  // (the workspace: piece_of)
  // the planes, then the reduction groups' totals partials (norm_modulate.cuh: reduce_groups)
  const int64_t totals = totals_floats(a);
  const Tensor ws = at::empty({3 * a.pieces * D + totals}, f32);
  a.ws = ws.data_ptr<float>();
  if (totals > 0) a.totals = a.ws + 3 * a.pieces * D;
  a.aligned = a.aligned && aligned16(a.ws);
  launch_backward(a, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (dx_addend.has_value() && a.dx_addend == nullptr) dx.add_(*dx_addend);

  auto grad = [&](const Tensor& g, const Tensor& m, bool final) {
    return final ? g : segmented ? g.to(m.scalar_type()) : mod_grad(g, m, x);
  };
  return {dx, affine_grad(dweight, weight), affine_grad(dbias, bias), grad(dscale, scale, scale_final),
          shift.has_value() ? grad(dshift, *shift, shift_final) : Tensor()};
}

Tensors3 adaln_forward(const Tensor& x, const optional<Tensor>& weight, const optional<Tensor>& bias,
                       const Tensor& scale, const optional<Tensor>& shift, double eps, at::ScalarType out_dtype) {
  auto out = op_forward(Norm::Layer, x, weight, bias, scale, shift, eps, out_dtype);
  return {out[0], out[1], out[2]};
}

Tensors2 rms_forward(const Tensor& x, const optional<Tensor>& weight, const Tensor& scale,
                     const optional<Tensor>& shift, double eps, at::ScalarType out_dtype) {
  auto out = op_forward(Norm::RMS, x, weight, c10::nullopt, scale, shift, eps, out_dtype);
  return {out[0], out[2]};
}

Tensors5 adaln_backward(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight,
                        const optional<Tensor>& bias, const Tensor& scale, const optional<Tensor>& shift,
                        const Tensor& mean, const Tensor& rstd, const optional<Tensor>& dx_addend) {
  auto g = op_backward(Norm::Layer, dy, x, weight, bias, scale, shift, mean, rstd, c10::nullopt, dx_addend);
  return {g[0], or_empty(g[1], x), or_empty(g[2], x), g[3], or_empty(g[4], x)};
}

Tensors4 rms_backward(const Tensor& dy, const Tensor& x, const optional<Tensor>& weight, const Tensor& scale,
                      const optional<Tensor>& shift, const Tensor& rstd, const optional<Tensor>& dx_addend) {
  auto g = op_backward(Norm::RMS, dy, x, weight, c10::nullopt, scale, shift, c10::nullopt, rstd, c10::nullopt,
                       dx_addend);
  return {g[0], or_empty(g[1], x), g[3], or_empty(g[4], x)};
}

}  // namespace adaln

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused norm -> adaptive modulation CUDA kernels (adaptiveload): LayerNorm and RMSNorm, with or without "
            "the residual update in front";
  m.def("forward", &adaln::adaln_forward,
        "y, mean, rstd = forward(x[B,...,D], weight?, bias?, scale, shift?, eps, out_dtype): "
        "the CUDA body of adaptiveload::adaln_modulate (inputs validated by the caller)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("scale"), py::arg("shift"), py::arg("eps"),
        py::arg("out_dtype"));
  m.def("backward", &adaln::adaln_backward,
        "dx, dweight, dbias, dscale, dshift = backward(dy, x, weight?, bias?, scale, shift?, mean, rstd, dx_addend?): "
        "the CUDA body of adaptiveload::adaln_modulate_backward",
        py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("scale"), py::arg("shift"),
        py::arg("mean"), py::arg("rstd"), py::arg("dx_addend"));
  m.def("rms_forward", &adaln::rms_forward,
        "y, rstd = rms_forward(x[B,...,D], weight?, scale, shift?, eps, out_dtype): the CUDA body of "
        "adaptiveload::rms_norm_modulate",
        py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("shift"), py::arg("eps"), py::arg("out_dtype"));
  m.def("rms_backward", &adaln::rms_backward,
        "dx, dweight, dscale, dshift = rms_backward(dy, x, weight?, scale, shift?, rstd, dx_addend?): the CUDA body "
        "of adaptiveload::rms_norm_modulate_backward",
        py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("shift"), py::arg("rstd"),
        py::arg("dx_addend"));
  m.def("residual_forward", &adaln::residual_adaln_forward,
        "r, out, mean, rstd = residual_forward(x[B,...,D], y, gate?, weight?, bias?, scale?, shift?, eps, r_dtype, "
        "out_dtype): the CUDA body of adaptiveload::residual_adaln_modulate (inputs validated by the caller)",
        py::arg("x"), py::arg("y"), py::arg("gate"), py::arg("weight"), py::arg("bias"), py::arg("scale"),
        py::arg("shift"), py::arg("eps"), py::arg("r_dtype"), py::arg("out_dtype"));
  m.def("residual_backward", &adaln::residual_adaln_backward,
        "dx, dy, dgate, dweight, dbias, dscale, dshift = residual_backward(dout, dr?, r, y?, gate?, weight?, bias?, "
        "scale?, shift?, mean, rstd, x_dtype): the CUDA body of adaptiveload::residual_adaln_modulate_backward",
        py::arg("dout"), py::arg("dr"), py::arg("r"), py::arg("y"), py::arg("gate"), py::arg("weight"),
        py::arg("bias"), py::arg("scale"), py::arg("shift"), py::arg("mean"), py::arg("rstd"), py::arg("x_dtype"));
  m.def("residual_rms_forward", &adaln::residual_rms_forward,
        "r, out, rstd = residual_rms_forward(x[B,...,D], y, gate?, weight?, scale?, shift?, eps, r_dtype, out_dtype): "
        "the CUDA body of adaptiveload::residual_rms_norm_modulate",
        py::arg("x"), py::arg("y"), py::arg("gate"), py::arg("weight"), py::arg("scale"), py::arg("shift"),
        py::arg("eps"), py::arg("r_dtype"), py::arg("out_dtype"));
  m.def("residual_rms_backward", &adaln::residual_rms_backward,
        "dx, dy, dgate, dweight, dscale, dshift = residual_rms_backward(dout, dr?, r, y?, gate?, weight?, scale?, "
        "shift?, rstd, x_dtype): the CUDA body of adaptiveload::residual_rms_norm_modulate_backward",
        py::arg("dout"), py::arg("dr"), py::arg("r"), py::arg("y"), py::arg("gate"), py::arg("weight"),
        py::arg("scale"), py::arg("shift"), py::arg("rstd"), py::arg("x_dtype"));
  m.def("rope_forward", &adaln::rms_norm_rope_forward,
        "y, rstd = rope_forward(x[B,...,D], weight?, cos, sin, heads, eps, out_dtype): the CUDA body of "
        "adaptiveload::rms_norm_rope (inputs validated by the caller)",
        py::arg("x"), py::arg("weight"), py::arg("cos"), py::arg("sin"), py::arg("heads"), py::arg("eps"),
        py::arg("out_dtype"));
  m.def("rope_backward", &adaln::rms_norm_rope_backward,
        "dx, dweight = rope_backward(dy, x, weight?, cos, sin, rstd, weight_grad): dx and dweight of "
        "adaptiveload::rms_norm_rope_backward (dweight an empty [0] tensor without a weight or weight_grad)",
        py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("cos"), py::arg("sin"), py::arg("rstd"),
        py::arg("weight_grad"));
  m.def("segmented_forward",
        [](const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
           const at::Tensor& scale, const c10::optional<at::Tensor>& shift, const at::Tensor& segment_ids, double eps,
           at::ScalarType out_dtype, bool rms) {
          return adaln::op_forward(rms ? adaln::Norm::RMS : adaln::Norm::Layer, x, weight, bias, scale, shift, eps,
                                   out_dtype, segment_ids);
        },
        "[y, mean (None for RMSNorm), rstd] = segmented_forward(x[...,D], weight?, bias?, scale[n,D], shift?[n,D], "
        "segment_ids[T], eps, out_dtype, rms): the CUDA body of adaptiveload::{adaln,rms_norm}_modulate_segmented "
        "(inputs validated by the caller; the ids are checked on the device), or [] where the kernel cannot run",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("scale"), py::arg("shift"), py::arg("segment_ids"),
        py::arg("eps"), py::arg("out_dtype"), py::arg("rms"));
  m.def("segmented_backward",
        [](const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& weight,
           const c10::optional<at::Tensor>& bias, const at::Tensor& scale, const c10::optional<at::Tensor>& shift,
           const at::Tensor& segment_ids, const c10::optional<at::Tensor>& mean, const at::Tensor& rstd) {
          return adaln::op_backward(mean.has_value() ? adaln::Norm::Layer : adaln::Norm::RMS, dy, x, weight, bias,
                                    scale, shift, mean, rstd, segment_ids);
        },
        "[dx, dweight, dbias, dscale, dshift] = segmented_backward(dy, x, weight?, bias?, scale, shift?, segment_ids, "
        "mean (None for RMSNorm), rstd) (None for an absent input's gradient), or [] where the kernel cannot run: the "
        "CUDA body of the segmented ops' backward",
        py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("scale"), py::arg("shift"),
        py::arg("segment_ids"), py::arg("mean"), py::arg("rstd"));
  m.def("residual_segmented_forward",
        [](const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& gate,
           const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
           const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& shift,
           const at::Tensor& segment_ids, double eps, at::ScalarType r_dtype, at::ScalarType out_dtype, bool rms) {
          return adaln::residual_op_forward(rms ? adaln::Norm::RMS : adaln::Norm::Layer, x, y, gate, weight, bias,
                                            scale, shift, eps, r_dtype, out_dtype, segment_ids);
        },
        "[r, out, mean (None for RMSNorm), rstd] = residual_segmented_forward(x[...,D], y, gate?[n,D], weight?, bias?, "
        "scale?[n,D], shift?[n,D], segment_ids[T], eps, r_dtype, out_dtype, rms), or [] where the kernel cannot run: "
        "the CUDA body of adaptiveload::residual_{adaln,rms_norm}_modulate_segmented",
        py::arg("x"), py::arg("y"), py::arg("gate"), py::arg("weight"), py::arg("bias"), py::arg("scale"),
        py::arg("shift"), py::arg("segment_ids"), py::arg("eps"), py::arg("r_dtype"), py::arg("out_dtype"),
        py::arg("rms"));
  m.def("residual_segmented_backward",
        [](const at::Tensor& dout, const c10::optional<at::Tensor>& dr, const at::Tensor& r,
           const c10::optional<at::Tensor>& y, const c10::optional<at::Tensor>& gate,
           const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
           const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& shift,
           const at::Tensor& segment_ids, const c10::optional<at::Tensor>& mean, const at::Tensor& rstd,
           at::ScalarType x_dtype) {
          return adaln::residual_op_backward(mean.has_value() ? adaln::Norm::Layer : adaln::Norm::RMS, dout, dr, r, y,
                                             gate, weight, bias, scale, shift, mean, rstd, x_dtype, segment_ids);
        },
        "[dx, dy, dgate, dweight, dbias, dscale, dshift] = residual_segmented_backward(dout, dr?, r, y?, gate?, weight?, "
        "bias?, scale?, shift?, segment_ids, mean (None for RMSNorm), rstd, x_dtype) (None for an absent input's "
        "gradient, and for dy and dgate without a gate), or [] where the kernel cannot run: the CUDA body of the "
        "residual segmented ops' backward",
        py::arg("dout"), py::arg("dr"), py::arg("r"), py::arg("y"), py::arg("gate"), py::arg("weight"),
        py::arg("bias"), py::arg("scale"), py::arg("shift"), py::arg("segment_ids"), py::arg("mean"), py::arg("rstd"),
        py::arg("x_dtype"));
  m.def("set_tuning", &adaln::set_tuning,
        "force kernel choices, process-wide (adaptiveload.ops._tuning.override; benchmarks and tests): "
        "max_threads (0: automatic), fwd_stages / bwd_stages (-1: automatic), store (-1: automatic, 0 threads, "
        "1 bulk), tail_pct (-1: automatic), tail_rows, two_kernel; the defaults are the launchers' own choices. "
        "Returns what is wrong with the arguments, or '' when they are set",
        py::arg("max_threads"), py::arg("fwd_stages"), py::arg("bwd_stages"), py::arg("store"), py::arg("tail_pct"),
        py::arg("tail_rows"), py::arg("two_kernel"));
  m.def("tuning", [] {
    const adaln::Tuning t = adaln::tuning();
    return std::make_tuple(t.max_threads, t.fwd_stages, t.bwd_stages, t.store, t.tail_pct, t.tail_rows, t.two_kernel);
  }, "the kernel choices in force, as set_tuning's arguments");
  m.def("register_dispatch", &adaln::register_dispatch,
        "hand the dispatcher kernels (registered for CUDA and AutogradCUDA when this module loads) the ops' "
        "Python CUDA paths, {op name: callable}, which serve the calls the kernels do not take",
        py::arg("paths"));
  m.def("modulation_view",
        [](const at::Tensor& t, const at::Tensor& x) {
          at::Tensor keep;
          const adaln::ModView v = adaln::mod_rows(t, x, t.scalar_type(), "t", keep);
          return std::make_tuple(reinterpret_cast<int64_t>(v.ptr), v.sb, v.sn, keep);
        },
        "(data_ptr, batch_stride, token_stride, copy) = modulation_view(t, x): how the kernels read modulation t "
        "for x viewed as [B, N, D] (strides in elements, 0 where broadcast): t in place (copy None) unless its token "
        "dims do not collapse to one stride, are expanded, or D is not unit-stride (copy: the [B or 1, N or 1, D] "
        "tensor read instead)",
        py::arg("t"), py::arg("x"));
}
