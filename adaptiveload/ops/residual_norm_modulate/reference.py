"""Plain-PyTorch reference math of the residual norm-site ops (their CPU implementation): the gated
residual update in front of a norm→modulate site, in one op.

    r   = (x + gate * y).to(r_dtype)                        (x + y without a gate)
    out = (norm(r) * (1 + scale) + shift).to(out_dtype)     (norm(r) without modulation)

The sum is computed once in float32 (float64 when any input is float64) and rounded once to
``r_dtype``; the norm reads r as rounded, which is what the replaced graph's norm read. The norm and
modulation math are the LayerNorm / RMSNorm references' own (``adaln_modulate/reference.py``,
``rms_norm_modulate/reference.py``: :func:`normalize` and :func:`grads`, in the compute dtype).

Backward, from the gradients arriving at both outputs (dout; dr, None when r has no other use):

* dr_total = dr + d(out)/d(r) . dout, summed in the compute dtype and rounded once per output;
* dx       = dr_total in x's dtype;
* dy       = gate * dr_total in y's dtype;
* dgate    = sum of y * dr_total over the dims where gate broadcasts, in gate's shape and dtype;
* without a gate, dr_total once (the op's caller hands it to both x and y);
* dweight, dbias, dscale, dshift as the norm→modulate references compute them from r and dout.

Only r and y (not the normalised tensor) are needed for backward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from adaptiveload.ops.adaln_modulate import reference as layer_norm
from adaptiveload.ops.common import compute_dtype, modulate, output
from adaptiveload.ops.rms_norm_modulate import reference as rms_norm


def _compute_dtype(x_dtype: torch.dtype, *tensors: Optional[Tensor]) -> torch.dtype:
    """The forward's compute dtype, seen from the backward (which has x's dtype, not x)."""
    return torch.float64 if x_dtype == torch.float64 else compute_dtype(*tensors)


def residual(x: Tensor, y: Tensor, gate: Optional[Tensor], ct: torch.dtype, r_dtype: torch.dtype) -> Tensor:
    """``x + gate * y`` (``x + y`` without a gate) computed in ``ct`` and rounded once to ``r_dtype``:
    a fresh contiguous tensor."""
    branch = y.to(ct) if gate is None else y.to(ct) * gate.to(ct)
    return output(x.to(ct) + branch, r_dtype)


def residual_grads(dr_norm: Tensor, dr: Optional[Tensor], y: Optional[Tensor], gate: Optional[Tensor],
                   x_dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(dx, dy, dgate)`` from the gradient reaching r through the norm (``dr_norm``, in the compute
    dtype) and the one arriving at r (``dr``, None when r has no other use): dr_total = dr_norm + dr
    in the compute dtype; dx = dr_total in ``x_dtype``; dy = gate * dr_total in y's dtype; dgate the
    sum of y * dr_total over gate's broadcast dims, in gate's shape and dtype. Without a gate, dy
    and dgate are None (dx is the gradient of both x and y)."""
    ct = dr_norm.dtype
    total = dr_norm if dr is None else dr_norm + dr.to(ct)
    dx = output(total, x_dtype)
    if gate is None:
        return dx, None, None
    dy = output(total * gate.to(ct), y.dtype)
    dgate = output((total * y.to(ct)).sum_to_size(gate.shape), gate.dtype)
    return dx, dy, dgate


def layer_norm_forward(x, y, gate, weight, bias, scale, shift, eps, r_dtype, out_dtype):
    """``residual_adaln_modulate``: ``(r, out, mean, rstd)``; r [*x.shape] in ``r_dtype``, out in
    ``out_dtype`` (both contiguous), mean and rstd [*x.shape[:-1]] in the compute dtype."""
    ct = compute_dtype(x, y, gate, weight, bias, scale, shift)
    r = residual(x, y, gate, ct, r_dtype)
    n, mean, rstd = layer_norm.normalize(r.to(ct), weight, bias, eps)
    return r, output(modulate(n, scale, shift), out_dtype), mean.contiguous(), rstd.contiguous()


def layer_norm_backward(dout, dr, r, y, gate, weight, bias, scale, shift, mean, rstd, x_dtype):
    """``residual_adaln_modulate_backward``: ``(dx, dy, dgate, dweight, dbias, dscale, dshift)``,
    None for an absent input (and for dy, dgate without a gate)."""
    ct = _compute_dtype(x_dtype, r, y, gate, weight, bias, scale, shift)
    dr_norm, *norm_grads = layer_norm.grads(dout.to(ct), r.to(ct), weight, bias, scale, shift, mean, rstd)
    return (*residual_grads(dr_norm, dr, y, gate, x_dtype), *norm_grads)


def rms_norm_forward(x, y, gate, weight, scale, shift, eps, r_dtype, out_dtype):
    """``residual_rms_norm_modulate``: ``(r, out, rstd)``; r [*x.shape] in ``r_dtype``, out in
    ``out_dtype`` (both contiguous), rstd [*x.shape[:-1]] in the compute dtype."""
    ct = compute_dtype(x, y, gate, weight, scale, shift)
    r = residual(x, y, gate, ct, r_dtype)
    n, rstd = rms_norm.normalize(r.to(ct), weight, eps)
    return r, output(modulate(n, scale, shift), out_dtype), rstd.contiguous()


def rms_norm_backward(dout, dr, r, y, gate, weight, scale, shift, rstd, x_dtype):
    """``residual_rms_norm_modulate_backward``: ``(dx, dy, dgate, dweight, dscale, dshift)``, None for
    an absent input (and for dy, dgate without a gate)."""
    ct = _compute_dtype(x_dtype, r, y, gate, weight, scale, shift)
    dr_norm, *norm_grads = rms_norm.grads(dout.to(ct), r.to(ct), weight, scale, shift, rstd)
    return (*residual_grads(dr_norm, dr, y, gate, x_dtype), *norm_grads)
