"""``torch.ops.adaptiveload.residual_adaln_modulate`` and ``.residual_rms_norm_modulate``: the
residual update in front of a norm→modulate site and the site itself, as one op.

    r   = (x + gate * y).to(r_dtype)        # x + y without a gate; summed in float32, rounded once
    out = (norm(r) * (1 + scale) + shift).to(out_dtype)

Schemas (the contract a kernel implements)::

    residual_adaln_modulate(Tensor x, Tensor y, Tensor? gate, Tensor? weight, Tensor? bias,
        Tensor? scale, Tensor? shift, float eps, ScalarType r_dtype, ScalarType out_dtype)
        -> (Tensor r, Tensor out, Tensor mean, Tensor rstd)
    residual_adaln_modulate_backward(Tensor dout, Tensor? dr, Tensor r, Tensor? y, Tensor? gate,
        Tensor? weight, Tensor? bias, Tensor? scale, Tensor? shift, Tensor mean, Tensor rstd,
        ScalarType x_dtype)
        -> (Tensor dx, Tensor dy, Tensor dgate, Tensor dweight, Tensor dbias, Tensor dscale, Tensor dshift)

    residual_rms_norm_modulate(Tensor x, Tensor y, Tensor? gate, Tensor? weight, Tensor? scale,
        Tensor? shift, float eps, ScalarType r_dtype, ScalarType out_dtype)
        -> (Tensor r, Tensor out, Tensor rstd)
    residual_rms_norm_modulate_backward(Tensor dout, Tensor? dr, Tensor r, Tensor? y, Tensor? gate,
        Tensor? weight, Tensor? scale, Tensor? shift, Tensor rstd, ScalarType x_dtype)
        -> (Tensor dx, Tensor dy, Tensor dgate, Tensor dweight, Tensor dscale, Tensor dshift)

Forward arguments:

* x, y: [B, ..., D], the same shape, each in its own floating dtype (x the residual stream, y the
  branch output: attention or FFN).
* gate: None (plain residual ``x + y``), or a modulation of x: per-sample [B, 1, ..., 1, D] (also
  [B, D] for 2-D x), per-token [B or 1, N..., D] or shared [D] (``modulation_layout``), any strides
  (a ``.chunk()`` view of an embedding, read in place). An elementwise function of the gate
  (Mochi's and Lumina2's ``tanh(gate)``) is computed before the op.
* weight, bias: the norm's affine parameters [D] or None (RMSNorm has no bias).
* scale, shift: the modulation, layouts as gate; both None for a plain norm (``out = norm(r)``),
  shift None for scale-only; a shift without a scale is refused.
* eps: the norm's epsilon (LayerNorm: added to the variance; RMSNorm: to the mean of squares).
* r_dtype, out_dtype: floating dtypes of r and out (what the replaced graph produced).

Forward outputs, fresh contiguous tensors: r [*x.shape] in r_dtype (the new residual stream; the
norm reads r as rounded); out [*x.shape] in out_dtype; LayerNorm mean and rstd, RMSNorm rstd
[*x.shape[:-1]] in the compute dtype: float32, float64 when any input is float64.

Backward arguments: dout (out's gradient, [*x.shape]); dr (r's gradient, or None when r has no
other use); r, and y only with a gate (what autograd saves: never the normalised tensor); the
forward's gate, norm and modulation tensors and statistics; x_dtype, x's dtype. Outputs, fresh
contiguous tensors in each input's own shape and dtype: dr_total = dr + d(out)/d(r) . dout summed
in the compute dtype; dx = dr_total in x_dtype; dy = gate * dr_total; dgate = sum of y * dr_total over
gate's broadcast dims; dweight, dbias, dscale, dshift as ``adaln_modulate_backward`` /
``rms_norm_modulate_backward`` give them. An empty [0] tensor for an absent input, and for dy and
dgate without a gate: dx is then the gradient of both x and y (the autograd kernel hands it to y,
cast to y's dtype if it differs). Deterministic: no atomics.

Registrations, one per dispatch key: the schemas, input validation (``ValueError`` naming the tensor,
its shape and dtype), fake kernels, the autograd formula (an Autograd-key kernel around a
``torch.autograd.Function`` calling the backward op; first derivatives only), the reference
implementation (``reference.py``, CompositeExplicitAutograd: CPU, and any device without its own
kernel) and the CUDA path (validation, then the ``csrc/residual_norm_modulate/`` kernels, or the
reference where they do not apply: float64 anywhere, empty x, rows wider than 16,384, or the kernels
unavailable). Once the kernels are loaded, CUDA calls go to their own CUDA and AutogradCUDA kernels,
registered from C++ (``csrc/norm_modulate_dispatch.cu``), which hand the CUDA path below only the
calls they do not take (see :mod:`adaptiveload.ops.extension`). The FX patterns fold residual sites
on the device types of :data:`FUSED_DEVICES` and nothing else.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from adaptiveload.ops import common, extension, segmented
from adaptiveload.ops.residual_norm_modulate import reference

#: Device types on which the FX patterns fold the residual into the norm site; on any other, they
#: leave the site to ``adaln_modulate`` / ``rms_norm_modulate`` (and record why). On CPU the reference
#: is the only implementation of every op, so fusing costs nothing. On CUDA the kernels
#: (``csrc/residual_norm_modulate/``) are validated on an H200: at N = 65536, bf16, D = 1536 / 3072,
#: forward 82-89% and backward 69-87% of speed-of-light (the Wan gated site at D = 1536: 0.224 ms and
#: 0.333 ms), moving 4 and 6 row tensors where the unfused site moves 5 and 8; a diffusers Wan
#: training step with them runs 1.005-1.017x Inductor's (docs/kernels.md, "The residual norm site").
FUSED_DEVICES: frozenset[str] = frozenset({"cpu", "cuda"})

LAYER_NORM = "residual_adaln_modulate"
RMS_NORM = "residual_rms_norm_modulate"


# --- validation ----------------------------------------------------------------------------------


def _check_forward(op: str, x, y, gate, params: dict, scale, shift, r_dtype, out_dtype, eps) -> None:
    common.check_common(op, x, params, {"gate": gate, "scale": scale, "shift": shift}, out_dtype, eps,
                        full={"y": y}, scale_optional=True)
    if r_dtype not in common.FLOATING:
        raise ValueError(f"{op}: r_dtype must be a floating dtype, got {r_dtype}")


def _check_backward(op: str, dout, dr, r, y, gate, params: dict, scale, shift, stats: dict, x_dtype) -> None:
    op = f"{op}_backward"
    if x_dtype not in common.FLOATING:
        raise ValueError(f"{op}: x_dtype must be a floating dtype, got {x_dtype}")
    if gate is not None and y is None:
        raise ValueError(f"{op}: y is required with a gate (dgate sums y * dr_total)")
    common.check_common(op, r, params, {"gate": gate, "scale": scale, "shift": shift}, r.dtype, None,
                        full={"y": y}, scale_optional=True, x_name="r")
    common.check_backward_common(op, r, {"dout": dout, "dr": dr}, stats, x_name="r")


def check_layer_norm_inputs(x: Tensor, y: Tensor, gate: Optional[Tensor], weight: Optional[Tensor],
                            bias: Optional[Tensor], scale: Optional[Tensor], shift: Optional[Tensor],
                            r_dtype: torch.dtype, out_dtype: torch.dtype, eps: Optional[float] = None) -> None:
    """Validate ``residual_adaln_modulate``'s inputs; raise ``ValueError`` naming the offending tensor
    and its shape (or device), or the bad eps / dtype."""
    _check_forward(LAYER_NORM, x, y, gate, {"weight": weight, "bias": bias}, scale, shift, r_dtype, out_dtype, eps)


def check_layer_norm_backward_inputs(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype) -> None:
    """Validate ``residual_adaln_modulate_backward``'s inputs (``ValueError`` naming the tensor)."""
    _check_backward(LAYER_NORM, dout, dr, r, y, gate, {"weight": weight, "bias": bias}, scale, shift,
                    {"mean": mean, "rstd": rstd}, x_dtype)


def check_rms_norm_inputs(x: Tensor, y: Tensor, gate: Optional[Tensor], weight: Optional[Tensor],
                          scale: Optional[Tensor], shift: Optional[Tensor], r_dtype: torch.dtype,
                          out_dtype: torch.dtype, eps: Optional[float] = None) -> None:
    """Validate ``residual_rms_norm_modulate``'s inputs; raise ``ValueError`` naming the offending
    tensor and its shape (or device), or the bad eps / dtype."""
    _check_forward(RMS_NORM, x, y, gate, {"weight": weight}, scale, shift, r_dtype, out_dtype, eps)


def check_rms_norm_backward_inputs(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype) -> None:
    """Validate ``residual_rms_norm_modulate_backward``'s inputs (``ValueError`` naming the tensor)."""
    _check_backward(RMS_NORM, dout, dr, r, y, gate, {"weight": weight}, scale, shift, {"rstd": rstd}, x_dtype)


# --- schemas ---------------------------------------------------------------------------------------

_lib_layer_norm = common.define(
    "residual_adaln_modulate(Tensor x, Tensor y, Tensor? gate, Tensor? weight, Tensor? bias, Tensor? scale, "
    "Tensor? shift, float eps, ScalarType r_dtype, ScalarType out_dtype) -> (Tensor, Tensor, Tensor, Tensor)",
    "residual_adaln_modulate_backward(Tensor dout, Tensor? dr, Tensor r, Tensor? y, Tensor? gate, Tensor? weight, "
    "Tensor? bias, Tensor? scale, Tensor? shift, Tensor mean, Tensor rstd, ScalarType x_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_lib_rms_norm = common.define(
    "residual_rms_norm_modulate(Tensor x, Tensor y, Tensor? gate, Tensor? weight, Tensor? scale, Tensor? shift, "
    "float eps, ScalarType r_dtype, ScalarType out_dtype) -> (Tensor, Tensor, Tensor)",
    "residual_rms_norm_modulate_backward(Tensor dout, Tensor? dr, Tensor r, Tensor? y, Tensor? gate, "
    "Tensor? weight, Tensor? scale, Tensor? shift, Tensor rstd, ScalarType x_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
residual_adaln_modulate = torch.ops.adaptiveload.residual_adaln_modulate
residual_adaln_modulate_backward = torch.ops.adaptiveload.residual_adaln_modulate_backward
residual_rms_norm_modulate = torch.ops.adaptiveload.residual_rms_norm_modulate
residual_rms_norm_modulate_backward = torch.ops.adaptiveload.residual_rms_norm_modulate_backward


# --- reference and fake kernels -------------------------------------------------------------------


def _residual_adaln_modulate_reference(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype):
    if x.is_cuda:  # until the kernels are loaded; then their own CUDA registration serves it
        return _residual_adaln_modulate_cuda(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype)
    common.validate(check_layer_norm_inputs, (x, y, gate, weight, bias, scale, shift), r_dtype, out_dtype, eps)
    return reference.layer_norm_forward(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype)


def _residual_adaln_modulate_backward_reference(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd,
                                                x_dtype):
    if r.is_cuda:
        return _residual_adaln_modulate_backward_cuda(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd,
                                                      x_dtype)
    common.validate(check_layer_norm_backward_inputs, (dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd),
                    x_dtype)
    grads = reference.layer_norm_backward(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype)
    return common.grads_or_empty(grads, r)


def _residual_rms_norm_modulate_reference(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype):
    if x.is_cuda:
        return _residual_rms_norm_modulate_cuda(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype)
    common.validate(check_rms_norm_inputs, (x, y, gate, weight, scale, shift), r_dtype, out_dtype, eps)
    return reference.rms_norm_forward(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype)


def _residual_rms_norm_modulate_backward_reference(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype):
    if r.is_cuda:
        return _residual_rms_norm_modulate_backward_cuda(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype)
    common.validate(check_rms_norm_backward_inputs, (dout, dr, r, y, gate, weight, scale, shift, rstd), x_dtype)
    grads = reference.rms_norm_backward(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype)
    return common.grads_or_empty(grads, r)


def _fake_outputs(x: Tensor, stat_dtype: torch.dtype, n_stats: int, r_dtype, out_dtype) -> tuple:
    stats = tuple(x.new_empty(x.shape[:-1], dtype=stat_dtype) for _ in range(n_stats))
    return (x.new_empty(x.shape, dtype=r_dtype), x.new_empty(x.shape, dtype=out_dtype), *stats)


def _fake_grads(r: Tensor, x_dtype, y, gate, others: tuple) -> tuple:
    dx = r.new_empty(r.shape, dtype=x_dtype)
    if gate is None:
        return (dx, r.new_empty((0,)), r.new_empty((0,)), *(common.empty_like_contiguous(t, r) for t in others))
    return (dx, *(common.empty_like_contiguous(t, r) for t in (y, gate, *others)))


@torch.library.register_fake("adaptiveload::residual_adaln_modulate", lib=_lib_layer_norm)
def _residual_adaln_modulate_fake(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype):
    check_layer_norm_inputs(x, y, gate, weight, bias, scale, shift, r_dtype, out_dtype, eps)
    stat_dtype = common.compute_dtype(x, y, gate, weight, bias, scale, shift)
    return _fake_outputs(x, stat_dtype, 2, r_dtype, out_dtype)


@torch.library.register_fake("adaptiveload::residual_adaln_modulate_backward", lib=_lib_layer_norm)
def _residual_adaln_modulate_backward_fake(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype):
    check_layer_norm_backward_inputs(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype)
    return _fake_grads(r, x_dtype, y, gate, (weight, bias, scale, shift))


@torch.library.register_fake("adaptiveload::residual_rms_norm_modulate", lib=_lib_rms_norm)
def _residual_rms_norm_modulate_fake(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype):
    check_rms_norm_inputs(x, y, gate, weight, scale, shift, r_dtype, out_dtype, eps)
    stat_dtype = common.compute_dtype(x, y, gate, weight, scale, shift)
    return _fake_outputs(x, stat_dtype, 1, r_dtype, out_dtype)


@torch.library.register_fake("adaptiveload::residual_rms_norm_modulate_backward", lib=_lib_rms_norm)
def _residual_rms_norm_modulate_backward_fake(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype):
    check_rms_norm_backward_inputs(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype)
    return _fake_grads(r, x_dtype, y, gate, (weight, scale, shift))


# --- autograd ----------------------------------------------------------------------------------


def _differentiable(lib: torch.library.Library, name: str, n_norm: int) -> None:
    """Register the Autograd kernels of op ``name`` and its backward. The forward saves r (an output),
    y (with a gate only), gate, the ``n_norm`` norm and modulation tensors and the statistics; its
    backward calls ``name_backward`` with out's gradient and r's (None when r has no other use) and
    keeps the gradients of the inputs that need one. Without a gate the backward op's dx is also y's."""
    forward = getattr(torch.ops.adaptiveload, name).default
    backward = getattr(torch.ops.adaptiveload, f"{name}_backward").default

    class Forward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, x, y, gate, *rest):
            with torch._C._AutoDispatchBelowAutograd():
                r, out, *stats = forward.redispatch(keyset, x, y, gate, *rest)
            ctx.save_for_backward(r, None if gate is None else y, gate, *rest[:n_norm], *stats)
            ctx.dtypes = x.dtype, y.dtype
            ctx.mark_non_differentiable(*stats)
            ctx.set_materialize_grads(False)  # r's gradient stays None when r has no other use
            return (r, out, *stats)

        @staticmethod
        def backward(ctx, dr, dout, *_dstats):
            r, y, gate, *others = ctx.saved_tensors
            x_dtype, y_dtype = ctx.dtypes
            if dout is None:  # only r is used
                dout = torch.zeros_like(r)
            dx, dy, dgate, *norm_grads = backward(dout, dr, r, y, gate, *others, x_dtype)
            if gate is None:
                dy, dgate = (dx if y_dtype == x_dtype else dx.to(y_dtype)), None
            grads = (dx, dy, dgate, *norm_grads)
            needs = ctx.needs_input_grad[1:1 + len(grads)]
            extra = len(ctx.needs_input_grad) - 1 - len(grads)  # eps, r_dtype, out_dtype
            return (None, *(g if need else None for g, need in zip(grads, needs)), *([None] * extra))

    Forward.__name__ = f"{name}_function"
    lib.impl(name, common.autograd_kernel(forward, Forward), "Autograd", with_keyset=True)
    common.first_derivative_only(lib, name)


_lib_layer_norm.impl(LAYER_NORM, _residual_adaln_modulate_reference, "CompositeExplicitAutograd")
_lib_layer_norm.impl(f"{LAYER_NORM}_backward", _residual_adaln_modulate_backward_reference, "CompositeExplicitAutograd")
_differentiable(_lib_layer_norm, LAYER_NORM, n_norm=4)
_lib_rms_norm.impl(RMS_NORM, _residual_rms_norm_modulate_reference, "CompositeExplicitAutograd")
_lib_rms_norm.impl(f"{RMS_NORM}_backward", _residual_rms_norm_modulate_backward_reference, "CompositeExplicitAutograd")
_differentiable(_lib_rms_norm, RMS_NORM, n_norm=3)


# --- the segmented layout (:mod:`adaptiveload.ops.segmented`): gate/scale/shift [n, D] and segment_ids [T] ---

_segmented_layer_norm = common.define(
    "residual_adaln_modulate_segmented(Tensor x, Tensor y, Tensor? gate, Tensor? weight, Tensor? bias, "
    "Tensor? scale, Tensor? shift, Tensor segment_ids, float eps, ScalarType r_dtype, ScalarType out_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    "residual_adaln_modulate_segmented_backward(Tensor dout, Tensor? dr, Tensor r, Tensor? y, Tensor? gate, "
    "Tensor? weight, Tensor? bias, Tensor? scale, Tensor? shift, Tensor segment_ids, Tensor mean, Tensor rstd, "
    "ScalarType x_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_segmented_rms_norm = common.define(
    "residual_rms_norm_modulate_segmented(Tensor x, Tensor y, Tensor? gate, Tensor? weight, Tensor? scale, "
    "Tensor? shift, Tensor segment_ids, float eps, ScalarType r_dtype, ScalarType out_dtype) "
    "-> (Tensor, Tensor, Tensor)",
    "residual_rms_norm_modulate_segmented_backward(Tensor dout, Tensor? dr, Tensor r, Tensor? y, Tensor? gate, "
    "Tensor? weight, Tensor? scale, Tensor? shift, Tensor segment_ids, Tensor rstd, ScalarType x_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
segmented.register_residual(_segmented_layer_norm, LAYER_NORM, ("weight", "bias"), _differentiable)
segmented.register_residual(_segmented_rms_norm, RMS_NORM, ("weight",), _differentiable)
residual_adaln_modulate_segmented = torch.ops.adaptiveload.residual_adaln_modulate_segmented
residual_rms_norm_modulate_segmented = torch.ops.adaptiveload.residual_rms_norm_modulate_segmented


# --- CUDA path --------------------------------------------------------------------------------------
# Validation, then the kernels (``extension.kernels()``: the bindings residual_forward /
# residual_backward and their RMSNorm twins take the op's own arguments) or the reference. Serves the
# first CUDA call (before the kernels are loaded) and the calls the C++ dispatcher kernels hand back.


def _layer_norm_kernels_take(x, y, gate, weight, bias, scale, shift, r_dtype, out_dtype, eps) -> bool:
    """:func:`check_layer_norm_inputs`, then whether the CUDA kernels take these inputs (remembered per
    signature by :func:`adaptiveload.ops.common.cuda_kernels`)."""
    check_layer_norm_inputs(x, y, gate, weight, bias, scale, shift, r_dtype, out_dtype, eps)
    return common.residual_kernels_apply(x, (y, gate, weight, bias, scale, shift), (r_dtype, out_dtype))


def _layer_norm_backward_kernels_take(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype) -> bool:
    check_layer_norm_backward_inputs(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype)
    return common.residual_kernels_apply(r, (dout, dr, y, gate, weight, bias, scale, shift, mean, rstd), (x_dtype,))


def _rms_norm_kernels_take(x, y, gate, weight, scale, shift, r_dtype, out_dtype, eps) -> bool:
    check_rms_norm_inputs(x, y, gate, weight, scale, shift, r_dtype, out_dtype, eps)
    return common.residual_kernels_apply(x, (y, gate, weight, scale, shift), (r_dtype, out_dtype))


def _rms_norm_backward_kernels_take(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype) -> bool:
    check_rms_norm_backward_inputs(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype)
    return common.residual_kernels_apply(r, (dout, dr, y, gate, weight, scale, shift, rstd), (x_dtype,))


def _residual_adaln_modulate_cuda(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype):
    ops = common.cuda_kernels(_layer_norm_kernels_take, (x, y, gate, weight, bias, scale, shift), r_dtype,
                              out_dtype, eps)
    if ops is None:
        return reference.layer_norm_forward(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype)
    return ops.residual_forward(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype)


def _residual_adaln_modulate_backward_cuda(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype):
    ops = common.cuda_kernels(_layer_norm_backward_kernels_take,
                              (dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd), x_dtype)
    if ops is None:
        grads = reference.layer_norm_backward(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype)
        return common.grads_or_empty(grads, r)
    return ops.residual_backward(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype)


def _residual_rms_norm_modulate_cuda(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype):
    ops = common.cuda_kernels(_rms_norm_kernels_take, (x, y, gate, weight, scale, shift), r_dtype, out_dtype, eps)
    if ops is None:
        return reference.rms_norm_forward(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype)
    return ops.residual_rms_forward(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype)


def _residual_rms_norm_modulate_backward_cuda(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype):
    ops = common.cuda_kernels(_rms_norm_backward_kernels_take, (dout, dr, r, y, gate, weight, scale, shift, rstd),
                              x_dtype)
    if ops is None:
        grads = reference.rms_norm_backward(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype)
        return common.grads_or_empty(grads, r)
    return ops.residual_rms_backward(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype)


extension.CUDA_PATHS.update({LAYER_NORM: _residual_adaln_modulate_cuda,
                              f"{LAYER_NORM}_backward": _residual_adaln_modulate_backward_cuda,
                              RMS_NORM: _residual_rms_norm_modulate_cuda,
                              f"{RMS_NORM}_backward": _residual_rms_norm_modulate_backward_cuda})
