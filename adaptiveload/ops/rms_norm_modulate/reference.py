"""Plain-PyTorch reference math of ``rms_norm_modulate``, the fused RMSNorm->modulate op (its CPU
implementation).

    y = (x_hat * weight) * (1 + scale) + shift,   x_hat = x * rstd,   rstd = 1 / sqrt(mean_D(x^2) + eps)

(RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019.) Statistics and
arithmetic run in float32 (float64 when any input is float64, so gradcheck is meaningful); the
output is cast once to the requested dtype. The backward formulas are the ones the CUDA kernels
implement (``csrc/norm_modulate_backward.cuh`` with the RMS norm type):

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
    xf = x.to(ct)
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    y = modulate(_weighted(xf * rstd, weight), scale, shift)
    return output(y, out_dtype), rstd.squeeze(-1).contiguous()


def backward(
    dy: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    rstd: Tensor,
) -> tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]:
    """Reference backward from the saved per-row ``rstd``.

    Returns ``(dx, dweight, dscale, dshift)``, each in its input's own shape and dtype and
    contiguous, whatever the strides of ``dy``, ``x`` or the modulation; modulation gradients are
    summed over the dims where the modulation broadcasts; the gradient of an absent input is None.
    """
    ct = compute_dtype(x, weight, scale, shift)
    r = rstd.to(ct).unsqueeze(-1)
    x_hat = x.to(ct) * r
    dyf = dy.to(ct)
    dscale, dshift = modulation_grads(dyf, _weighted(x_hat, weight), scale, shift)
    dn = dyf * (1 + scale.to(ct))
    row_dims = tuple(range(x.dim() - 1))
    dweight = None if weight is None else (dn * x_hat).sum(dim=row_dims).to(weight.dtype)
    g = _weighted(dn, weight)
    dx = r * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    return output(dx, x.dtype), dweight, dscale, dshift
