"""``torch.ops.adaptiveload.adaln_modulate``: LayerNorm followed by adaptive modulation, as one op.

    y = (LayerNorm(x) * (1 + scale) + shift).to(out_dtype)

Registrations, in one place, one per dispatch key: the schemas (``torch.library.Library.define``),
input validation, the fake kernels (symbolic shapes), the autograd formula (an Autograd-key kernel
around a ``torch.autograd.Function`` that calls ``adaptiveload::adaln_modulate_backward``, see
:func:`adaptiveload.ops.common.differentiable`), the reference implementation (``reference.py``:
CPU and any device without its own kernel) and the CUDA path (validation, then the ``csrc/`` kernels,
falling back to the reference with one warning when they cannot be built). float64 inputs and rows
wider than the kernels' limit use the reference. Once the kernels are loaded, CUDA calls go to their
own CUDA and AutogradCUDA kernels, registered from C++ (``csrc/norm_modulate_dispatch.cu``), which
hand the CUDA path below only the calls they do not take (see :mod:`adaptiveload.ops.extension`).

At the end, ``adaln_modulate_segmented`` and its backward: the same op for packed sequences, scale
and shift [n, D] with ``segment_ids`` [T] (their schemas here, their kernels from
:func:`adaptiveload.ops.segmented.register`, which call the two ops above).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from adaptiveload.ops import common, extension, segmented
from adaptiveload.ops.adaln_modulate import reference

_OP = "adaln_modulate"


def check_inputs(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    out_dtype: torch.dtype,
    eps: Optional[float] = None,
) -> None:
    """Validate the op's inputs; raise ``ValueError`` naming the offending tensor and its shape (or
    device), or the bad ``eps`` / ``out_dtype``."""
    common.check_common(_OP, x, {"weight": weight, "bias": bias}, {"scale": scale, "shift": shift}, out_dtype, eps)


def check_backward_inputs(
    dy: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    dx_addend: Optional[Tensor] = None,
) -> None:
    """Validate :func:`adaln_modulate_backward`'s inputs (those of the forward, dy of x's shape, one
    mean/rstd per row, dx_addend None or of x's shape and dtype); raise ``ValueError`` naming the
    offending tensor and its shape."""
    check_inputs(x, weight, bias, scale, shift, x.dtype)
    common.check_backward_common(f"{_OP}_backward", x, {"dy": dy}, {"mean": mean, "rstd": rstd}, dx_addend=dx_addend)


_lib = common.define(
    "adaln_modulate(Tensor x, Tensor? weight, Tensor? bias, Tensor scale, Tensor? shift, float eps, "
    "ScalarType out_dtype) -> (Tensor, Tensor, Tensor)",
    "adaln_modulate_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor scale, Tensor? shift, "
    "Tensor mean, Tensor rstd, Tensor? dx_addend=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
adaln_modulate = torch.ops.adaptiveload.adaln_modulate
adaln_modulate_backward = torch.ops.adaptiveload.adaln_modulate_backward


def _adaln_modulate_reference(x, weight, bias, scale, shift, eps, out_dtype):
    """``adaln_modulate`` on CPU (and any device without its own kernel): fused
    ``LayerNorm(x) * (1 + scale) + shift``, cast to ``out_dtype``.

    Args:
        x: [B, ..., D] float16/bfloat16/float32/float64; the first dim is the modulation batch.
        weight, bias: optional LayerNorm affine parameters, [D].
        scale: modulation, broadcast over x per-sample ([B, 1, D]), per-token ([B, N, D]) or shared
            ([D], [1, 1, D]); strided views (a ``.chunk()`` of a [B, k*D] embedding) are fine.
        shift: optional, same layouts as ``scale`` (each may have its own).
        eps: LayerNorm epsilon.
        out_dtype: dtype of ``y`` (the dtype the replaced chain produced).

    Returns:
        ``(y, mean, rstd)``: y [*x.shape] in ``out_dtype``; mean and rstd [*x.shape[:-1]] in float32
        (float64 for float64 inputs), the per-row statistics saved for backward.

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the tensor and its shape).
    """
    if x.is_cuda:  # until the kernels are loaded; then their own CUDA registration serves it
        return _adaln_modulate_cuda(x, weight, bias, scale, shift, eps, out_dtype)
    common.validate(check_inputs, (x, weight, bias, scale, shift), out_dtype, eps)
    return reference.forward(x, weight, bias, scale, shift, eps, out_dtype)


@torch.library.register_fake("adaptiveload::adaln_modulate", lib=_lib)
def _adaln_modulate_fake(x, weight, bias, scale, shift, eps, out_dtype):
    check_inputs(x, weight, bias, scale, shift, out_dtype, eps)
    stat_dtype = common.compute_dtype(x, weight, bias, scale, shift)
    y = x.new_empty(x.shape, dtype=out_dtype)
    return y, x.new_empty(x.shape[:-1], dtype=stat_dtype), x.new_empty(x.shape[:-1], dtype=stat_dtype)


def _adaln_modulate_backward_reference(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend=None):
    """``adaln_modulate_backward`` on CPU (and any device without its own kernel): the gradients of
    ``adaln_modulate`` from dy [*x.shape] and the saved per-row mean/rstd.

    ``dx_addend`` (optional, x's shape and dtype): a gradient that reaches x by another path, added
    to dx in the compute dtype before dx is rounded to x's dtype (what the backend's post-grad pass,
    :mod:`adaptiveload.fxfuse.grad_adds`, hands the op in place of an add after it).

    Returns ``(dx, dweight, dbias, dscale, dshift)`` in each input's own shape and dtype; the
    gradient of an absent weight/bias/shift is an empty tensor of shape [0].

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the tensor and its shape).
    """
    if x.is_cuda:  # until the kernels are loaded; then their own CUDA registration serves it
        return _adaln_modulate_backward_cuda(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend)
    common.validate(check_backward_inputs, (dy, x, weight, bias, scale, shift, mean, rstd, dx_addend))
    return common.grads_or_empty(reference.backward(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend), x)


@torch.library.register_fake("adaptiveload::adaln_modulate_backward", lib=_lib)
def _adaln_modulate_backward_fake(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend=None):
    check_backward_inputs(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend)
    return tuple(common.empty_like_contiguous(t, x) for t in (x, weight, bias, scale, shift))


_lib.impl("adaln_modulate", _adaln_modulate_reference, "CompositeExplicitAutograd")
_lib.impl("adaln_modulate_backward", _adaln_modulate_backward_reference, "CompositeExplicitAutograd")
common.differentiable(_lib, "adaln_modulate", n_tensors=5)


def _kernels_take(x, weight, bias, scale, shift, out_dtype, eps) -> bool:
    """:func:`check_inputs`, then whether the CUDA kernels take these inputs (remembered per signature
    by :func:`adaptiveload.ops.common.cuda_kernels`)."""
    check_inputs(x, weight, bias, scale, shift, out_dtype, eps)
    return common.kernels_apply(x, (weight, bias), (scale, shift))


def _kernels_take_backward(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend) -> bool:
    """:func:`check_backward_inputs`, then whether the CUDA kernels take these inputs."""
    check_backward_inputs(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend)
    return common.kernels_apply(x, (weight, bias), (scale, shift), (mean, dy, dx_addend))


def _adaln_modulate_cuda(x, weight, bias, scale, shift, eps, out_dtype):
    ops = common.cuda_kernels(_kernels_take, (x, weight, bias, scale, shift), out_dtype, eps)
    if ops is None:
        return reference.forward(x, weight, bias, scale, shift, eps, out_dtype)
    return ops.forward(x, weight, bias, scale, shift, eps, out_dtype)


def _adaln_modulate_backward_cuda(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend=None):
    ops = common.cuda_kernels(_kernels_take_backward, (dy, x, weight, bias, scale, shift, mean, rstd, dx_addend))
    if ops is None:
        return common.grads_or_empty(reference.backward(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend), x)
    return ops.backward(dy, x, weight, bias, scale, shift, mean, rstd, dx_addend)


extension.CUDA_PATHS.update({"adaln_modulate": _adaln_modulate_cuda,
                              "adaln_modulate_backward": _adaln_modulate_backward_cuda})


# --- the segmented layout (:mod:`adaptiveload.ops.segmented`): scale/shift [n, D] and segment_ids [T] ---

_segmented_lib = common.define(
    "adaln_modulate_segmented(Tensor x, Tensor? weight, Tensor? bias, Tensor scale, Tensor? shift, Tensor segment_ids, "
    "float eps, ScalarType out_dtype) -> (Tensor, Tensor, Tensor)",
    "adaln_modulate_segmented_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor scale, Tensor? shift, "
    "Tensor segment_ids, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
segmented.register(_segmented_lib, _OP, params=("weight", "bias"), stats=("mean", "rstd"))
adaln_modulate_segmented = torch.ops.adaptiveload.adaln_modulate_segmented
adaln_modulate_segmented_backward = torch.ops.adaptiveload.adaln_modulate_segmented_backward
