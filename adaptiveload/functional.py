"""Functional form of the fused norm→modulate ops, for code that calls them directly (its own modules,
inference) rather than through the ``torch.compile(backend="adaptiveload")`` rewrite.

* :func:`adaln_modulate` -- ``LayerNorm(x) * (1 + scale) [+ shift]``;
* :func:`rms_norm_modulate` -- ``RMSNorm(x) * (1 + scale) [+ shift]``.

Each returns y alone, in x's dtype, and is differentiable in every tensor input (the ops' autograd).
The per-row statistics are computed in float32 (float64 for float64 inputs) whatever x's dtype, and
y is rounded to x's dtype once. The raw ops, which also return the statistics, are
``torch.ops.adaptiveload.adaln_modulate`` / ``rms_norm_modulate`` (:mod:`adaptiveload.ops`).

Modulation layouts (``scale`` and ``shift`` each, independently), for x of shape [B, N..., D]:

* per-sample: [B, 1, ..., 1, D] (for 2-D x [B, D]: [B, D]), one row per sample;
* per-token: [B or 1, N..., D], x's token dims;
* shared: [D] (or [1, ..., 1, D]), one row for everything.

Strided views (a ``.chunk()`` of a [B, k*D] embedding, unsqueezed) are taken without a copy.

Packed sequences (samples of different lengths concatenated into x [1, T, D] or [T, D]) pass
``segment_ids`` [T], the sample of each row of x, and modulation [n, D], one row per sample (the
segmented ops, :mod:`adaptiveload.ops.segmented`): the op gathers the rows to the tokens itself and,
unlike a per-token ``scale[segment_ids]`` argument, keeps no per-token copy for backward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from adaptiveload.ops.common import describe  # (importing adaptiveload.ops registers the ops)

__all__ = ["adaln_modulate", "rms_norm_modulate"]


def _out_dtype(op: str, x: Tensor) -> torch.dtype:
    """x's dtype, the op's ``out_dtype`` here. Checked first: for an integer x the op would report a
    bad ``out_dtype``, an argument the caller never passed.

    Raises:
        TypeError: x is not a tensor.
        ValueError: x is not floating point (named, with its shape).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{op}: {describe('x', x)} must be floating point")
    return x.dtype


def adaln_modulate(
    x: Tensor,
    scale: Tensor,
    shift: Optional[Tensor] = None,
    *,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-6,
    segment_ids: Optional[Tensor] = None,
) -> Tensor:
    """Adaptive LayerNorm: LayerNorm over the last dim of ``x``, then modulation, as one fused op.

        y = ((x - mean) * rstd * weight + bias) * (1 + scale) + shift,
        mean, var = mean and biased variance of x over its last dim, rstd = 1 / sqrt(var + eps)

    (``weight``, ``bias``, ``shift`` left out of the formula when None.)

    Args:
        x: [B, N..., D] (2 or more dims), float16, bfloat16, float32 or float64; the first dim is
            the batch the per-sample modulation indexes.
        scale: [B, 1, ..., 1, D] (per-sample), [B or 1, N..., D] (per-token) or [D] (shared); any
            floating dtype. Zeros for a shift-only modulation.
        shift: None, or a tensor in one of ``scale``'s layouts (its own, not necessarily scale's).
        weight, bias: optional LayerNorm affine parameters, [D].
        eps: added to the variance, >= 0 (in units of x squared).
        segment_ids: None, or int32/int64 [T] on x's device (T = x.numel() // D, x's rows in order):
            the segment (packed sample) of each row, in [0, n), in any order. scale and shift are
            then [n, D], one row per segment, in any strides (a ``.chunk()`` of [n, k*D]).

    Returns:
        y, of x's shape and dtype (contiguous). Statistics in float32 (float64 when any input is
        float64), y rounded to x's dtype once.

    Raises:
        ValueError: a tensor that does not fit, the message naming it with its shape and dtype (a
            ``scale``/``shift`` in none of the layouts, ``weight``/``bias`` not [D], x of fewer than 2
            dims, an integer tensor, a tensor on another device than x), ``scale`` None (a shift
            without scale), or eps < 0. With ``segment_ids``: segment_ids not a 1-D integer tensor
            of one id per row of x (on CPU also an id outside [0, n), naming the first such row),
            scale or shift not [n, D] of one n.
        TypeError: x not a tensor.
        RuntimeError: another tensor argument not a tensor (from the dispatcher).

    Example::

        >>> import torch
        >>> from adaptiveload.functional import adaln_modulate
        >>> x = torch.tensor([[[0.0, 1.0, 2.0], [4.0, 4.0, 7.0]]])  # [B=1, N=2, D=3]
        >>> scale = torch.tensor([0.0, 0.0, 1.0])  # shared [D]
        >>> shift = torch.tensor([[[1.0, 1.0, 1.0]]])  # per-sample [B, 1, D]
        >>> adaln_modulate(x, scale, shift)
        tensor([[[-0.2247,  1.0000,  3.4495],
                 [ 0.2929,  0.2929,  3.8284]]])
        >>> pack = torch.tensor([[0.0, 1.0, 2.0], [4.0, 4.0, 7.0], [1.0, 2.0, 3.0]])  # [T=3, D=3]
        >>> scale = torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])  # [n=2, D]: one row per sample
        >>> shift = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
        >>> adaln_modulate(pack, scale, shift, segment_ids=torch.tensor([1, 0, 1]))  # rows 0, 2: sample 1
        tensor([[-2.4495,  0.0000,  2.4495],
                [ 0.2929,  0.2929,  3.8284],
                [-2.4495,  0.0000,  2.4495]])
    """
    out_dtype = _out_dtype("adaln_modulate", x)
    if segment_ids is not None:
        return torch.ops.adaptiveload.adaln_modulate_segmented(x, weight, bias, scale, shift, segment_ids, eps,
                                                               out_dtype)[0]
    return torch.ops.adaptiveload.adaln_modulate(x, weight, bias, scale, shift, eps, out_dtype)[0]


def rms_norm_modulate(
    x: Tensor,
    scale: Tensor,
    shift: Optional[Tensor] = None,
    *,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    segment_ids: Optional[Tensor] = None,
) -> Tensor:
    """Adaptive RMSNorm: RMSNorm over the last dim of ``x``, then modulation, as one fused op.

        y = x * rstd * weight * (1 + scale) + shift,   rstd = 1 / sqrt(mean of x^2 over the last dim + eps)

    (``weight``, ``shift`` left out of the formula when None: a weightless RMSNorm, a scale-only
    modulation.)

    Args:
        x: [B, N..., D] (2 or more dims), float16, bfloat16, float32 or float64; the first dim is
            the batch the per-sample modulation indexes.
        scale: [B, 1, ..., 1, D] (per-sample), [B or 1, N..., D] (per-token) or [D] (shared); any
            floating dtype. Zeros for a shift-only modulation.
        shift: None, or a tensor in one of ``scale``'s layouts (its own, not necessarily scale's).
        weight: optional RMSNorm weight, [D].
        eps: added to the mean of squares, >= 0 (in units of x squared).
        segment_ids: None, or int32/int64 [T] on x's device (T = x.numel() // D, x's rows in order):
            the segment (packed sample) of each row, in [0, n), in any order. scale and shift are
            then [n, D], one row per segment, in any strides (a ``.chunk()`` of [n, k*D]).

    Returns:
        y, of x's shape and dtype (contiguous). rstd in float32 (float64 when any input is float64),
        y rounded to x's dtype once.

    Raises:
        ValueError: a tensor that does not fit, the message naming it with its shape and dtype (a
            ``scale``/``shift`` in none of the layouts, ``weight`` not [D], x of fewer than 2 dims, an
            integer tensor, a tensor on another device than x), ``scale`` None (a shift without
            scale), or eps < 0. With ``segment_ids``: segment_ids not a 1-D integer tensor of one
            id per row of x (on CPU also an id outside [0, n), naming the first such row), scale or
            shift not [n, D] of one n.
        TypeError: x not a tensor.
        RuntimeError: another tensor argument not a tensor (from the dispatcher).

    Example::

        >>> import torch
        >>> from adaptiveload.functional import rms_norm_modulate
        >>> x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])  # [B=2, D=2]
        >>> scale = torch.tensor([[1.0, 1.0], [0.0, 0.5]])  # per-sample [B, D]
        >>> rms_norm_modulate(x, scale, weight=torch.tensor([1.0, 0.5]))
        tensor([[ 1.6971,  1.1314],
                [ 1.0000, -0.7500]])
        >>> pack = torch.tensor([[3.0, 4.0], [1.0, -1.0], [0.0, 2.0]])  # [T=3, D=2]
        >>> rms_norm_modulate(pack, scale, segment_ids=torch.tensor([0, 1, 0]))  # scale [n=2, D]
        tensor([[ 1.6971,  2.2627],
                [ 1.0000, -1.5000],
                [ 0.0000,  2.8284]])
    """
    out_dtype = _out_dtype("rms_norm_modulate", x)
    if segment_ids is not None:
        return torch.ops.adaptiveload.rms_norm_modulate_segmented(x, weight, scale, shift, segment_ids, eps,
                                                                  out_dtype)[0]
    return torch.ops.adaptiveload.rms_norm_modulate(x, weight, scale, shift, eps, out_dtype)[0]
