"""Plain-PyTorch reference math of ``adaln_modulate``, the fused LayerNorm->modulate op (its CPU
implementation).

    y = (x_hat * weight + bias) * (1 + scale) + shift,   x_hat = (x - mean) * rstd   (per row of D)

Statistics and arithmetic run in float32 (float64 when any input is float64, so gradcheck is
meaningful); the output is cast once to the requested dtype. The backward formulas are the ones
the CUDA kernels implement (see ``csrc/norm_modulate_backward.cuh``); :func:`normalize` and
:func:`grads` are the same math in the compute dtype, which the residual op builds on:

* dshift  = sum of dy over the dims where shift broadcasts
* dscale  = sum of dy * (x_hat * w + b) over the dims where scale broadcasts
* dweight = sum over all rows of dy * (1 + scale) * x_hat;   dbias = sum of dy * (1 + scale)
* dx      = rstd * (g - mean_D(g) - x_hat * mean_D(g * x_hat)),   g = dy * (1 + scale) * w
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from adaptiveload.ops.common import compute_dtype, modulate, modulation_grads, output


def _affine(x_hat: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    n = x_hat
    if weight is not None:
        n = n * weight.to(x_hat.dtype)
    if bias is not None:
        n = n + bias.to(x_hat.dtype)
    return n


def normalize(xf: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
              eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(n, mean, rstd)`` of ``xf`` (already in the compute dtype): n = x_hat * weight + bias [*x.shape]
    and the per-row statistics [*x.shape[:-1]], all in xf's dtype."""
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).square().mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    return _affine((xf - mean) * rstd, weight, bias), mean.squeeze(-1), rstd.squeeze(-1)


def grads(
    dyf: Tensor,
    xf: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    scale: Optional[Tensor],
    shift: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(dx, dweight, dbias, dscale, dshift)`` from dy and x in the compute dtype (``dyf``, ``xf``) and
    the saved statistics: dx in the compute dtype, not rounded (the residual op adds to it); the
    others in their own shape and dtype, contiguous; None for an absent input (scale None: no
    modulation, y = n)."""
    ct = xf.dtype
    x_hat = (xf - mean.to(ct).unsqueeze(-1)) * rstd.to(ct).unsqueeze(-1)
    dn, dscale, dshift = modulation_grads(dyf, _affine(x_hat, weight, bias), scale, shift)
    row_dims = tuple(range(xf.dim() - 1))
    dweight = None if weight is None else (dn * x_hat).sum(dim=row_dims).to(weight.dtype)
    dbias = None if bias is None else dn.sum(dim=row_dims).to(bias.dtype)
    g = dn if weight is None else dn * weight.to(ct)
    dx = rstd.to(ct).unsqueeze(-1) * (
        g - g.mean(dim=-1, keepdim=True) - x_hat * (g * x_hat).mean(dim=-1, keepdim=True)
    )
    return dx, dweight, dbias, dscale, dshift


def forward(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference forward. Returns ``(y, mean, rstd)``: y [*x.shape] in ``out_dtype`` (contiguous),
    mean and rstd [*x.shape[:-1]] in the compute dtype (float32, or float64 for float64 inputs)."""
    ct = compute_dtype(x, weight, bias, scale, shift)
    n, mean, rstd = normalize(x.to(ct), weight, bias, eps)
    return output(modulate(n, scale, shift), out_dtype), mean.contiguous(), rstd.contiguous()


def backward(
    dy: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    dx_addend: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor, Optional[Tensor]]:
    """Reference backward from the saved per-row ``mean``/``rstd``; ``dx_addend`` (x's shape), if
    given, is added to dx in the compute dtype before dx is rounded to x's dtype.

    Returns ``(dx, dweight, dbias, dscale, dshift)``, each in its input's own shape and dtype and
    contiguous, whatever the strides of ``dy``, ``x`` or the modulation (the fake kernel promises
    contiguous gradients, and compiled graphs rely on it); modulation gradients are summed over the
    dims where the modulation broadcasts; the gradient of an absent input is None.
    """
    ct = compute_dtype(x, weight, bias, scale, shift)
    dx, *rest = grads(dy.to(ct), x.to(ct), weight, bias, scale, shift, mean, rstd)
    if dx_addend is not None:
        dx = dx + dx_addend.to(ct)
    return (output(dx, x.dtype), *rest)
