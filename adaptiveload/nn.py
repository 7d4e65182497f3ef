"""Modules around :mod:`adaptiveload.functional`: a norm layer whose output is modulated by a
``scale`` (and optional ``shift``) passed to ``forward``, one fused op forward and backward.

* :class:`AdaLNModulate` -- ``LayerNorm(x) * (1 + scale) [+ shift]`` (DiT, Wan, HunyuanVideo blocks);
* :class:`RMSNormModulate` -- ``RMSNorm(x) * (1 + scale) [+ shift]`` (Mochi, Lumina2 blocks).

Parameters are named and initialised as in ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` (``weight``
ones, ``bias`` zeros), so a state dict of either loads into its counterpart here.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from adaptiveload import functional
from adaptiveload.ops.common import describe

__all__ = ["AdaLNModulate", "RMSNormModulate"]


class _NormModulate(nn.Module):
    """What both modules share: ``dim``, ``eps``, the ``weight`` parameter, ``forward`` (x's last dim
    checked, then ``self._modulate(x, scale, shift)``, which each subclass defines) and the repr."""

    def __init__(self, dim: int, eps: float, elementwise_affine: bool, device, dtype) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"{type(self).__name__}: dim must be a positive int, got {dim!r}")
        if not eps >= 0:  # also NaN
            raise ValueError(f"{type(self).__name__}: eps must be a non-negative number, got {eps}")
        self.dim, self.eps, self.elementwise_affine = dim, float(eps), elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: Tensor, scale: Tensor, shift: Optional[Tensor] = None) -> Tensor:
        """y = norm(x) * (1 + scale) [+ shift], of x's shape and dtype (the class docstring says which
        norm, and the function it calls the layouts and dtypes).

        Args:
            x: [B, N..., D]; scale, shift: [B, 1, ..., 1, D], [B or 1, N..., D] or [D] (shift optional).

        Raises:
            ValueError: x's last dim is not ``dim``, or an input the op rejects (named, with its shape).
        """
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__}: {describe('x', x)} must end in dim={self.dim}")
        return self._modulate(x, scale, shift)

    def extra_repr(self) -> str:
        """``"dim, eps=..., elementwise_affine=..."``, as ``torch.nn.LayerNorm`` prints."""
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class AdaLNModulate(_NormModulate):
    """LayerNorm over the last dim, then ``* (1 + scale) [+ shift]``, fused (see
    :func:`adaptiveload.functional.adaln_modulate` for the formula, layouts and dtypes).

    Args:
        dim: D, the size of x's last dim.
        eps: added to the variance, >= 0.
        elementwise_affine: learn ``weight`` (ones) and ``bias`` (zeros), each [D]; off by default,
            as the adaptive LayerNorms of DiT-style blocks have none (the modulation is the affine).
        device, dtype: of the parameters (``dtype`` None: the default dtype).

    Raises:
        ValueError: dim not a positive int, or eps < 0.

    Example::

        >>> import torch
        >>> from adaptiveload.nn import AdaLNModulate
        >>> norm = AdaLNModulate(4, elementwise_affine=True)
        >>> norm
        AdaLNModulate(4, eps=1e-06, elementwise_affine=True)
        >>> sorted(norm.state_dict())
        ['bias', 'weight']
        >>> x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [B=1, N=1, D=4]
        >>> shift, scale = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]]).chunk(2, dim=-1)
        >>> with torch.no_grad():  # inference; under grad mode y carries a grad_fn
        ...     norm(x, scale.unsqueeze(1), shift.unsqueeze(1))  # per-sample [B, 1, D] views
        tensor([[[-2.6833, -0.8944,  0.8944,  3.6833]]])
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False, *,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(dim, eps, elementwise_affine, device, dtype)
        if elementwise_affine:
            self.bias = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight`` to ones, ``bias`` to zeros (as ``torch.nn.LayerNorm``); nothing without them."""
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def _modulate(self, x: Tensor, scale: Tensor, shift: Optional[Tensor]) -> Tensor:
        return functional.adaln_modulate(x, scale, shift, weight=self.weight, bias=self.bias, eps=self.eps)


class RMSNormModulate(_NormModulate):
    """RMSNorm over the last dim, then ``* (1 + scale) [+ shift]``, fused (see
    :func:`adaptiveload.functional.rms_norm_modulate` for the formula, layouts and dtypes).

    Args:
        dim: D, the size of x's last dim.
        eps: added to the mean of squares, >= 0.
        elementwise_affine: learn ``weight`` [D] (ones), as ``torch.nn.RMSNorm``; False: a weightless
            RMSNorm (LTX-Video's).
        device, dtype: of the parameter (``dtype`` None: the default dtype).

    Raises:
        ValueError: dim not a positive int, or eps < 0.

    Example::

        >>> import torch
        >>> from adaptiveload.nn import RMSNormModulate
        >>> norm = RMSNormModulate(2)
        >>> norm
        RMSNormModulate(2, eps=1e-06, elementwise_affine=True)
        >>> list(norm.state_dict())
        ['weight']
        >>> y = norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 0.0]))  # shared scale [D]
        >>> y.sum().backward()
        >>> norm.weight.grad  # d(sum y)/dweight = x * rstd * (1 + scale)
        tensor([1.6971, 1.1314])
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, *,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(dim, eps, elementwise_affine, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight`` to ones (as ``torch.nn.RMSNorm``); nothing without it."""
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def _modulate(self, x: Tensor, scale: Tensor, shift: Optional[Tensor]) -> Tensor:
        return functional.rms_norm_modulate(x, scale, shift, weight=self.weight, eps=self.eps)
