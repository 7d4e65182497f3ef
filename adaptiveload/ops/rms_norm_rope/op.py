"""``torch.ops.adaptiveload.rms_norm_rope``: an attention projection's RMSNorm across heads, then the
rotary position embedding of each head's interleaved pairs, as one op (diffusers' Wan attention:
``norm_q`` / ``norm_k``, ``unflatten(2, (heads, -1))``, ``apply_rotary_emb``).

    y = rope(rms_norm(x, weight).unflatten(-1, (heads, -1)), cos, sin).to(out_dtype)

Registrations, one per dispatch key, as the other ops of the package: the schemas, input validation,
the fake kernels, the autograd formula (:func:`adaptiveload.ops.common.differentiable`: the forward
saves x, weight, cos and sin and the per-row rstd; its backward calls
``adaptiveload::rms_norm_rope_backward`` with the mask of the inputs that need a gradient), the
reference implementation (``reference.py``: CPU and any device without its own kernel) and the CUDA
path (validation, then the ``csrc/rms_norm_rope/`` kernels: a block a row forward; backward a full wave
of blocks with dweight summed in a fixed order, so the same bits every run; the reference for float64,
rows wider than the kernels take, and for the gradients of cos and sin, which the models' rotation
tables never need). Once the kernels are loaded, CUDA calls take their C++ dispatcher kernels
(``csrc/norm_modulate_dispatch.cu``, no Python per call), which hand this CUDA path the calls they do
not take. The FX pattern folds sites on the device types of :data:`FUSED_DEVICES`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from adaptiveload.ops import common, extension
from adaptiveload.ops.rms_norm_rope import reference

_OP = "rms_norm_rope"

#: Device types on which the FX pattern folds a q/k RMSNorm -> RoPE site into the op; on any other it
#: leaves the site as written (and records why). CPU: the reference, which fusing costs nothing. CUDA:
#: the op's kernels, called through their C++ dispatcher registration; on an H200 the per-block
#: Wan-1.3B step at 12 x 1,560 with the sites folded takes 0.964x Inductor's time (paired over 11
#: rounds, 0.910-0.982) and 0.60x its norm-site GPU time (benchmarks/results/wan_step_h200_rope_dispatch.md;
#: benchmarks/KERNEL_NOTES.md, "A fused q/k RMSNorm + RoPE op").
FUSED_DEVICES: frozenset[str] = frozenset({"cpu", "cuda"})


def _rope_shape(op: str, x: Tensor, heads: int) -> list:
    """[*x.shape[:-1], heads, Dh / 2], the shape cos and sin broadcast to; raises ``ValueError`` where
    x's last dim is not heads pairs of a head dim."""
    D = x.shape[-1]
    if not isinstance(heads, (int, torch.SymInt)) or heads < 1 or D % heads or (D // heads) % 2:
        raise ValueError(f"{op}: {common.describe('x', x)}: its last dim {D} must split into heads = {heads} "
                         "heads of an even head dim (pairs for the rotation)")
    return [*x.shape[:-1], heads, D // heads // 2]


def _check_rope_tables(op: str, x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> None:
    target = _rope_shape(op, x, heads)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype not in common.FLOATING:
            raise ValueError(f"{op}: {common.describe(name, t)} must be floating point")
        try:
            fits = list(torch.broadcast_shapes(t.shape, target)) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"{op}: {common.describe(name, t)} must broadcast to [*x.shape[:-1], heads, head_dim / 2] "
                             f"= {target} (cos at the even, sin at the odd positions of the tables, "
                             "e.g. freqs_cos[..., 0::2])")


def check_inputs(x: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor, heads: int,
                 out_dtype: torch.dtype, eps: Optional[float] = None) -> None:
    """Validate the op's inputs; raise ``ValueError`` naming the offending tensor and its shape (or
    device), or the bad ``heads`` / ``eps`` / ``out_dtype``."""
    common.check_common(_OP, x, {"weight": weight}, {}, out_dtype, eps, scale_optional=True)
    common.check_devices(_OP, x, {"cos": cos, "sin": sin})
    _check_rope_tables(_OP, x, cos, sin, heads)


def check_backward_inputs(dy: Tensor, x: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor,
                          rstd: Tensor, output_mask: Sequence[bool] = (True,) * 4) -> None:
    """Validate :func:`rms_norm_rope_backward`'s inputs: those of the forward, dy of y's shape
    [*x.shape[:-1], heads, head_dim], one rstd per row of x and four flags in ``output_mask``."""
    op = f"{_OP}_backward"
    rows, D = list(x.shape[:-1]), x.shape[-1]
    if dy.dim() != x.dim() + 1 or list(dy.shape[:-2]) != rows or dy.shape[-2] * dy.shape[-1] != D:
        raise ValueError(f"{op}: {common.describe('dy', dy)} must have y's shape [*x.shape[:-1], heads, head_dim] "
                         f"with heads * head_dim = {D}, for {common.describe('x', x)}")
    check_inputs(x, weight, cos, sin, dy.shape[-2], x.dtype)
    common.check_backward_common(op, x, {}, {"rstd": rstd})
    if dy.dtype not in common.FLOATING:
        raise ValueError(f"{op}: {common.describe('dy', dy)} must be floating point")
    common.check_devices(op, x, {"dy": dy})
    if len(output_mask) != 4:
        raise ValueError(f"{op}: output_mask {list(output_mask)} must have 4 flags (dx, dweight, dcos, dsin)")


_lib = common.define(
    "rms_norm_rope(Tensor x, Tensor? weight, Tensor cos, Tensor sin, int heads, float eps, ScalarType out_dtype) "
    "-> (Tensor, Tensor)",
    "rms_norm_rope_backward(Tensor dy, Tensor x, Tensor? weight, Tensor cos, Tensor sin, Tensor rstd, "
    "bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)",
)
rms_norm_rope = torch.ops.adaptiveload.rms_norm_rope
rms_norm_rope_backward = torch.ops.adaptiveload.rms_norm_rope_backward


def _rms_norm_rope_reference(x, weight, cos, sin, heads, eps, out_dtype):
    """``rms_norm_rope`` on CPU (and any device without its own kernel): RMSNorm of x across heads,
    then the rotation of each head's pairs (:mod:`adaptiveload.ops.rms_norm_rope.reference`).

    Args:
        x: [B, ..., heads * head_dim] float16/bfloat16/float32/float64 (a q or k projection).
        weight: optional RMSNorm weight [heads * head_dim].
        cos, sin: the rotation's cosines and sines of each pair, broadcast to [B, ..., heads,
            head_dim / 2] (diffusers' Wan: ``freqs_cos[..., 0::2]`` and ``freqs_sin[..., 1::2]``,
            [1, S, 1, head_dim / 2]); strided views are fine.
        heads: the number of heads x's last dim splits into.
        eps: RMSNorm epsilon, added to the mean of squares.
        out_dtype: dtype of ``y`` (the dtype the replaced chain produced).

    Returns:
        ``(y, rstd)``: y [B, ..., heads, head_dim] in ``out_dtype``; rstd = 1 / sqrt(mean(x^2) + eps)
        [B, ...] in float32 (float64 for float64 inputs), saved for backward.

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the tensor and its shape).
    """
    if x.is_cuda:
        return _rms_norm_rope_cuda(x, weight, cos, sin, heads, eps, out_dtype)
    common.validate(check_inputs, (x, weight, cos, sin), heads, out_dtype, eps)
    return reference.forward(x, weight, cos, sin, heads, eps, out_dtype)


@torch.library.register_fake("adaptiveload::rms_norm_rope", lib=_lib)
def _rms_norm_rope_fake(x, weight, cos, sin, heads, eps, out_dtype):
    check_inputs(x, weight, cos, sin, heads, out_dtype, eps)
    stat_dtype = common.compute_dtype(x, weight, cos, sin)
    y = x.new_empty((*x.shape[:-1], heads, x.shape[-1] // heads), dtype=out_dtype)
    return y, x.new_empty(x.shape[:-1], dtype=stat_dtype)


def _rms_norm_rope_backward_reference(dy, x, weight, cos, sin, rstd, output_mask):
    """``rms_norm_rope_backward``: the gradients of ``rms_norm_rope`` from dy [*x.shape[:-1], heads,
    head_dim] and the saved per-row rstd.

    Args:
        output_mask: four flags, which of (dx, dweight, dcos, dsin) to compute; dx is always computed.

    Returns ``(dx, dweight, dcos, dsin)``, each in its input's shape and dtype; the gradient of an
    absent weight, and of one not asked for, is an empty tensor of shape [0].

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the tensor and its shape).
    """
    if x.is_cuda:
        return _rms_norm_rope_backward_cuda(dy, x, weight, cos, sin, rstd, output_mask)
    common.validate(check_backward_inputs, (dy, x, weight, cos, sin, rstd), tuple(output_mask))
    return common.grads_or_empty(reference.backward(dy, x, weight, cos, sin, rstd, output_mask), x)


@torch.library.register_fake("adaptiveload::rms_norm_rope_backward", lib=_lib)
def _rms_norm_rope_backward_fake(dy, x, weight, cos, sin, rstd, output_mask):
    check_backward_inputs(dy, x, weight, cos, sin, rstd, output_mask)
    wanted = (x, *(t if need else None for t, need in zip((weight, cos, sin), output_mask[1:])))
    return tuple(common.empty_like_contiguous(t, x) for t in wanted)


_lib.impl("rms_norm_rope", _rms_norm_rope_reference, "CompositeExplicitAutograd")
_lib.impl("rms_norm_rope_backward", _rms_norm_rope_backward_reference, "CompositeExplicitAutograd")
common.differentiable(_lib, "rms_norm_rope", n_tensors=4, output_mask=True)


def _kernels_take(x, weight, cos, sin, heads, out_dtype, eps) -> bool:
    """:func:`check_inputs`, then whether the CUDA kernels take these inputs (remembered per signature
    by :func:`adaptiveload.ops.common.cuda_kernels`): x, weight and out_dtype of a kernel dtype, cos and
    sin of one or float32 (float64 tables make the op compute in float64: the reference)."""
    check_inputs(x, weight, cos, sin, heads, out_dtype, eps)
    return (common.kernels_apply(x, (weight, cos, sin), ())
            and out_dtype in common.KERNEL_DTYPES)


def _kernels_take_backward(dy, x, weight, cos, sin, rstd, output_mask) -> bool:
    """:func:`check_backward_inputs`, then whether the kernels serve this call: they compute dx and
    dweight; the gradients of cos and sin, when asked for, come from the reference (whole call)."""
    check_backward_inputs(dy, x, weight, cos, sin, rstd, output_mask)
    return not any(output_mask[2:]) and common.kernels_apply(x, (weight, cos, sin), (), (dy, rstd))


def _rms_norm_rope_cuda(x, weight, cos, sin, heads, eps, out_dtype):
    ops = common.cuda_kernels(_kernels_take, (x, weight, cos, sin), heads, out_dtype, eps)
    if ops is None:
        return reference.forward(x, weight, cos, sin, heads, eps, out_dtype)
    return ops.rope_forward(x, weight, cos, sin, heads, eps, out_dtype)


def _rms_norm_rope_backward_cuda(dy, x, weight, cos, sin, rstd, output_mask):
    mask = tuple(output_mask)
    ops = common.cuda_kernels(_kernels_take_backward, (dy, x, weight, cos, sin, rstd), mask)
    if ops is None:
        return common.grads_or_empty(reference.backward(dy, x, weight, cos, sin, rstd, mask), x)
    dx, dweight = ops.rope_backward(dy, x, weight, cos, sin, rstd, mask[1])
    return dx, dweight, common.or_empty(None, x), common.or_empty(None, x)


extension.CUDA_PATHS.update({"rms_norm_rope": _rms_norm_rope_cuda,
                              "rms_norm_rope_backward": _rms_norm_rope_backward_cuda})
