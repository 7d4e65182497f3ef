"""Plain-PyTorch reference math of ``rms_norm_rope``: an attention projection's RMSNorm over all heads,
then the rotary position embedding of each head's interleaved pairs (its CPU implementation).

    n = x_hat * weight,   x_hat = x * rstd,   rstd = 1 / sqrt(mean_D(x^2) + eps)      x, n: [..., H * Dh]
    n1, n2 = n[..., h, 2i], n[..., h, 2i + 1]       (pairs of head h, i < Dh / 2)
    y[..., h, 2i]     = n1 * cos - n2 * sin
    y[..., h, 2i + 1] = n1 * sin + n2 * cos          cos, sin broadcast to [..., H, Dh / 2]

(RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019; the rotation of
pairs: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021, eq. 34.) This
is diffusers' Wan attention (``WanAttnProcessor``: ``norm_q`` / ``norm_k`` across heads, then its
``apply_rotary_emb`` with ``cos = freqs_cos[..., 0::2]``, ``sin = freqs_sin[..., 1::2]``). Statistics
and arithmetic run in float32 (float64 when any input is float64); y is cast once to ``out_dtype``.

Backward (the rotation is orthogonal per pair, so its transpose rotates back):

* dn1 = dy_even * cos + dy_odd * sin,   dn2 = -dy_even * sin + dy_odd * cos
* dweight = sum over all rows of dn * x_hat
* dx = rstd * (g - x_hat * mean_D(g * x_hat)),   g = dn * weight
* dcos = sum over cos's broadcast dims of (dy_even * n1 + dy_odd * n2),
  dsin = sum over sin's broadcast dims of (dy_odd * n1 - dy_even * n2)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from adaptiveload.ops.common import compute_dtype, output


def _pairs(t: Tensor, rows: torch.Size, heads: int) -> tuple[Tensor, Tensor]:
    """t of ``rows`` rows ([*rows, H * Dh] or [*rows, H, Dh]) as its even and odd elements, each
    [*rows, H, Dh / 2]."""
    paired = t.reshape(*rows, heads, -1, 2)
    return paired[..., 0], paired[..., 1]


def _unpair(even: Tensor, odd: Tensor) -> Tensor:
    """Even and odd elements [..., H, Dh / 2] interleaved into [..., H, Dh]."""
    return torch.stack((even, odd), dim=-1).flatten(-2)


def forward(x: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor, heads: int, eps: float,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(y, rstd)``: y [*x.shape[:-1], heads, Dh] in ``out_dtype``, rstd [*x.shape[:-1]] in the compute
    dtype (float32, or float64 when any input is)."""
    cd = compute_dtype(x, weight, cos, sin)
    xf = x.to(cd)
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    n = xf * rstd if weight is None else xf * rstd * weight.to(cd)
    n1, n2 = _pairs(n, x.shape[:-1], heads)
    c, s = cos.to(cd), sin.to(cd)
    y = _unpair(n1 * c - n2 * s, n1 * s + n2 * c)
    return output(y, out_dtype), rstd.squeeze(-1)


def backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor, rstd: Tensor,
             output_mask: Sequence[bool] = (True,) * 4) -> tuple[Tensor, Optional[Tensor], Optional[Tensor],
                                                                  Optional[Tensor]]:
    """``(dx, dweight, dcos, dsin)`` from dy [*x.shape[:-1], H, Dh]: each in its input's shape and
    dtype; None for dweight without a weight and for any gradient ``output_mask`` (four flags) leaves
    out, except dx, which is always computed."""
    heads = dy.shape[-2]
    cd = compute_dtype(dy, x, weight, cos, sin, rstd)
    xf, r = x.to(cd), rstd.to(cd).unsqueeze(-1)
    x_hat = xf * r
    dy1, dy2 = _pairs(dy.to(cd), x.shape[:-1], heads)
    c, s = cos.to(cd), sin.to(cd)
    dcos = dsin = None
    if output_mask[2] or output_mask[3]:  # (the normalised pairs serve only these two)
        n1, n2 = _pairs(x_hat if weight is None else x_hat * weight.to(cd), x.shape[:-1], heads)
        if output_mask[2]:
            dcos = output((dy1 * n1 + dy2 * n2).sum_to_size(cos.shape), cos.dtype)
        if output_mask[3]:
            dsin = output((dy2 * n1 - dy1 * n2).sum_to_size(sin.shape), sin.dtype)
    dn = _unpair(dy1 * c + dy2 * s, dy2 * c - dy1 * s).flatten(-2)  # [..., H * Dh]
    dweight = None
    g = dn
    if weight is not None:
        if output_mask[1]:
            dweight = output((dn * x_hat).reshape(-1, x.shape[-1]).sum(0), weight.dtype)
        g = dn * weight.to(cd)
    dx = r * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    return output(dx, x.dtype), dweight, dcos, dsin
