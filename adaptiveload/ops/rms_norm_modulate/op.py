"""``torch.ops.adaptiveload.rms_norm_modulate``: RMSNorm followed by adaptive modulation, as one op.

    y = (rms_norm(x, weight) * (1 + scale) [+ shift]).to(out_dtype)

Registrations, in one place, one per dispatch key: the schemas (``torch.library.Library.define``),
input validation, the fake kernels (symbolic shapes), the autograd formula (an Autograd-key kernel
around a ``torch.autograd.Function`` that calls ``adaptiveload::rms_norm_modulate_backward``, see
:func:`adaptiveload.ops.common.differentiable`), the reference implementation (``reference.py``: CPU
and any device without its own kernel) and the CUDA path (validation, then the ``csrc/`` kernels,
templated on the norm type with the LayerNorm op's, falling back to the reference with one warning
when they cannot be built). float64 inputs and rows wider than the kernels' limit use the reference.
Once the kernels are loaded, CUDA calls go to their own CUDA and AutogradCUDA kernels, registered from
C++ (``csrc/norm_modulate_dispatch.cu``), which hand the CUDA path below only the calls they do not
take (see :mod:`adaptiveload.ops.extension`).

At the end, ``rms_norm_modulate_segmented`` and its backward: the same op for packed sequences, scale
and shift [n, D] with ``segment_ids`` [T] (their schemas here, their kernels from
:func:`adaptiveload.ops.segmented.register`, which call the two ops above).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from adaptiveload.ops import common, extension, segmented
from adaptiveload.ops.rms_norm_modulate import reference

_OP = "rms_norm_modulate"


def check_inputs(
    x: Tensor,
    weight: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    out_dtype: torch.dtype,
    eps: Optional[float] = None,
) -> None:
    """Validate the op's inputs; raise ``ValueError`` naming the offending tensor and its shape (or
    device), or the bad ``eps`` / ``out_dtype``."""
    common.check_common(_OP, x, {"weight": weight}, {"scale": scale, "shift": shift}, out_dtype, eps)


def check_backward_inputs(
    dy: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    rstd: Tensor,
    dx_addend: Optional[Tensor] = None,
) -> None:
    """Validate :func:`rms_norm_modulate_backward`'s inputs (those of the forward, dy of x's shape,
    one rstd per row, dx_addend None or of x's shape and dtype); raise ``ValueError`` naming the
    offending tensor and its shape."""
    check_inputs(x, weight, scale, shift, x.dtype)
    common.check_backward_common(f"{_OP}_backward", x, {"dy": dy}, {"rstd": rstd}, dx_addend=dx_addend)


_lib = common.define(
    "rms_norm_modulate(Tensor x, Tensor? weight, Tensor scale, Tensor? shift, float eps, ScalarType out_dtype) "
    "-> (Tensor, Tensor)",
    "rms_norm_modulate_backward(Tensor dy, Tensor x, Tensor? weight, Tensor scale, Tensor? shift, Tensor rstd, "
    "Tensor? dx_addend=None) -> (Tensor, Tensor, Tensor, Tensor)",
)
rms_norm_modulate = torch.ops.adaptiveload.rms_norm_modulate
rms_norm_modulate_backward = torch.ops.adaptiveload.rms_norm_modulate_backward


def _rms_norm_modulate_reference(x, weight, scale, shift, eps, out_dtype):
    """``rms_norm_modulate`` on CPU (and any device without its own kernel): fused
    ``rms_norm(x, weight) * (1 + scale) [+ shift]``, cast to ``out_dtype``.

    Args:
        x: [B, ..., D] float16/bfloat16/float32/float64; the first dim is the modulation batch.
        weight: optional RMSNorm weight, [D] (None: LTX-Video's weightless RMSNorm).
        scale: modulation, broadcast over x per-sample ([B, 1, D]), per-token ([B, N, D]) or shared
            ([D], [1, 1, D]); strided views (a ``.chunk()`` of a [B, k*D] embedding) are fine.
        shift: optional (None: scale-only, as Mochi, Lumina2 and Z-Image modulate), same layouts as
            ``scale`` (each may have its own).
        eps: RMSNorm epsilon, added to the mean of squares.
        out_dtype: dtype of ``y`` (the dtype the replaced chain produced).

    Returns:
        ``(y, rstd)``: y [*x.shape] in ``out_dtype``; rstd = 1 / sqrt(mean(x^2) + eps)
        [*x.shape[:-1]] in float32 (float64 for float64 inputs), saved for backward.

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the tensor and its shape).
    """
    if x.is_cuda:  # until the kernels are loaded; then their own CUDA registration serves it
        return _rms_norm_modulate_cuda(x, weight, scale, shift, eps, out_dtype)
    common.validate(check_inputs, (x, weight, scale, shift), out_dtype, eps)
    return reference.forward(x, weight, scale, shift, eps, out_dtype)


@torch.library.register_fake("adaptiveload::rms_norm_modulate", lib=_lib)
def _rms_norm_modulate_fake(x, weight, scale, shift, eps, out_dtype):
    check_inputs(x, weight, scale, shift, out_dtype, eps)
    stat_dtype = common.compute_dtype(x, weight, scale, shift)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape[:-1], dtype=stat_dtype)


def _rms_norm_modulate_backward_reference(dy, x, weight, scale, shift, rstd, dx_addend=None):
    """``rms_norm_modulate_backward`` on CPU (and any device without its own kernel): the gradients
    of ``rms_norm_modulate`` from dy [*x.shape] and the saved per-row rstd.

    ``dx_addend`` (optional, x's shape and dtype): a gradient that reaches x by another path, added
    to dx in the compute dtype before dx is rounded to x's dtype (what the backend's post-grad pass,
    :mod:`adaptiveload.fxfuse.grad_adds`, hands the op in place of an add after it).

    Returns ``(dx, dweight, dscale, dshift)`` in each input's own shape and dtype; the gradient of
    an absent weight/shift is an empty tensor of shape [0].

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the tensor and its shape).
    """
    if x.is_cuda:  # until the kernels are loaded; then their own CUDA registration serves it
        return _rms_norm_modulate_backward_cuda(dy, x, weight, scale, shift, rstd, dx_addend)
    common.validate(check_backward_inputs, (dy, x, weight, scale, shift, rstd, dx_addend))
    return common.grads_or_empty(reference.backward(dy, x, weight, scale, shift, rstd, dx_addend), x)


@torch.library.register_fake("adaptiveload::rms_norm_modulate_backward", lib=_lib)
def _rms_norm_modulate_backward_fake(dy, x, weight, scale, shift, rstd, dx_addend=None):
    check_backward_inputs(dy, x, weight, scale, shift, rstd, dx_addend)
    return tuple(common.empty_like_contiguous(t, x) for t in (x, weight, scale, shift))


_lib.impl("rms_norm_modulate", _rms_norm_modulate_reference, "CompositeExplicitAutograd")
_lib.impl("rms_norm_modulate_backward", _rms_norm_modulate_backward_reference, "CompositeExplicitAutograd")
common.differentiable(_lib, "rms_norm_modulate", n_tensors=4)


def _kernels_take(x, weight, scale, shift, out_dtype, eps) -> bool:
    """:func:`check_inputs`, then whether the CUDA kernels take these inputs (remembered per signature
    by :func:`adaptiveload.ops.common.cuda_kernels`)."""
    check_inputs(x, weight, scale, shift, out_dtype, eps)
    return common.kernels_apply(x, (weight,), (scale, shift))


def _kernels_take_backward(dy, x, weight, scale, shift, rstd, dx_addend) -> bool:
    """:func:`check_backward_inputs`, then whether the CUDA kernels take these inputs."""
    check_backward_inputs(dy, x, weight, scale, shift, rstd, dx_addend)
    return common.kernels_apply(x, (weight,), (scale, shift), (rstd, dy, dx_addend))


def _rms_norm_modulate_cuda(x, weight, scale, shift, eps, out_dtype):
    ops = common.cuda_kernels(_kernels_take, (x, weight, scale, shift), out_dtype, eps)
    if ops is None:
        return reference.forward(x, weight, scale, shift, eps, out_dtype)
    return ops.rms_forward(x, weight, scale, shift, eps, out_dtype)


def _rms_norm_modulate_backward_cuda(dy, x, weight, scale, shift, rstd, dx_addend=None):
    ops = common.cuda_kernels(_kernels_take_backward, (dy, x, weight, scale, shift, rstd, dx_addend))
    if ops is None:
        return common.grads_or_empty(reference.backward(dy, x, weight, scale, shift, rstd, dx_addend), x)
    return ops.rms_backward(dy, x, weight, scale, shift, rstd, dx_addend)


extension.CUDA_PATHS.update({"rms_norm_modulate": _rms_norm_modulate_cuda,
                              "rms_norm_modulate_backward": _rms_norm_modulate_backward_cuda})


# --- the segmented layout (:mod:`adaptiveload.ops.segmented`): scale/shift [n, D] and segment_ids [T] ---

_segmented_lib = common.define(
    "rms_norm_modulate_segmented(Tensor x, Tensor? weight, Tensor scale, Tensor? shift, Tensor segment_ids, float eps, "
    "ScalarType out_dtype) -> (Tensor, Tensor)",
    "rms_norm_modulate_segmented_backward(Tensor dy, Tensor x, Tensor? weight, Tensor scale, Tensor? shift, "
    "Tensor segment_ids, Tensor rstd) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
segmented.register(_segmented_lib, _OP, params=("weight",), stats=("rstd",))
rms_norm_modulate_segmented = torch.ops.adaptiveload.rms_norm_modulate_segmented
rms_norm_modulate_segmented_backward = torch.ops.adaptiveload.rms_norm_modulate_segmented_backward
