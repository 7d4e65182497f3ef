"""Plain-PyTorch reference math of ``rms_norm_modulate``, the fused RMSNorm->modulate op (its CPU
implementation).

    y = (x_hat * weight) * (1 + scale) + shift,   x_hat = x * rstd,   rstd = 1 / sqrt(mean_D(x^2) + eps)

(RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019.) Statistics and
arithmetic run in float32 (float64 when any input is float64, so gradcheck is meaningful); the
output is cast once to the requested dtype. The backward formulas are the ones the CUDA kernels
implement (``csrc/norm_modulate_backward.cuh`` with the RMS norm type); :func:`normalize` and
:func:`grads` are the same math in the compute dtype, which the residual op builds on:

* dshift  = sum of dy over the dims where shift broadcasts
* dscale  = sum of dy * x_hat * w over the dims where scale broadcasts
* dweight = sum over all rows of dy * (1 + scale) * x_hat
* dx      = rstd * (g - x_hat * mean_D(g * x_hat)),   g = dy * (1 + scale) * w
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from adaptiveload.ops.common import compute_dtype, modulate, modulation_grads, output


def _weighted(x_hat: Tensor, weight: Optional[Tensor]) -> Tensor:
    return x_hat if weight is None else x_hat * weight.to(x_hat.dtype)


def normalize(xf: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """``(n, rstd)`` of ``xf`` (already in the compute dtype): n = x_hat * weight [*x.shape] and the
    per-row rstd [*x.shape[:-1]], both in xf's dtype."""
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return _weighted(xf * rstd, weight), rstd.squeeze(-1)


def grads(
    dyf: Tensor,
    xf: Tensor,
    weight: Optional[Tensor],
    scale: Optional[Tensor],
    shift: Optional[Tensor],
    rstd: Tensor,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(dx, dweight, dscale, dshift)`` from dy and x in the compute dtype (``dyf``, ``xf``) and the
    saved rstd: dx in the compute dtype, not rounded (the residual op adds to it); the others in
    their own shape and dtype, contiguous; None for an absent input (scale None: no modulation)."""
    r = rstd.to(xf.dtype).unsqueeze(-1)
    x_hat = xf * r
    dn, dscale, dshift = modulation_grads(dyf, _weighted(x_hat, weight), scale, shift)
    row_dims = tuple(range(xf.dim() - 1))
    dweight = None if weight is None else (dn * x_hat).sum(dim=row_dims).to(weight.dtype)
    g = _weighted(dn, weight)
    dx = r * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    return dx, dweight, dscale, dshift


def forward(
    x: Tensor,
    weight: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Reference forward. Returns ``(y, rstd)``: y [*x.shape] in ``out_dtype`` (contiguous), rstd
    [*x.shape[:-1]] in the compute dtype (float32, or float64 for float64 inputs)."""
    ct = compute_dtype(x, weight, scale, shift)
    n, rstd = normalize(x.to(ct), weight, eps)
    return output(modulate(n, scale, shift), out_dtype), rstd.contiguous()


def backward(
    dy: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    rstd: Tensor,
    dx_addend: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]:
    """Reference backward from the saved per-row ``rstd``; ``dx_addend`` (x's shape), if given, is
    added to dx in the compute dtype before dx is rounded to x's dtype.

    Returns ``(dx, dweight, dscale, dshift)``, each in its input's own shape and dtype and
    contiguous, whatever the strides of ``dy``, ``x`` or the modulation; modulation gradients are
    summed over the dims where the modulation broadcasts; the gradient of an absent input is None.
    """
    ct = compute_dtype(x, weight, scale, shift)
    dx, *rest = grads(dy.to(ct), x.to(ct), weight, scale, shift, rstd)
    if dx_addend is not None:
        dx = dx + dx_addend.to(ct)
    return (output(dx, x.dtype), *rest)
