"""The segmented modulation layout of the norm→modulate families: one modulation row per segment
(packed sample) and the segment of each row of x, instead of a modulation row per token.

    x            [..., D] (2+ dims) of T = x.numel() // D rows: samples of different lengths packed
                 into one sequence ([1, T, D] or [T, D]);
    segment_ids  int32 or int64 [T], on x's device: the segment of each row, in [0, n), in any order
                 (a segment may have no rows; a pack's are non-decreasing, which the CUDA kernels'
                 fast path needs);
    scale, shift [n, D], any strides (a ``.chunk()`` of [n, k*D], ``m[:, i]`` of [n, k, D]); shift
                 optional, with scale's n.

    {base}_segmented(x, ..., scale, shift, segment_ids, eps, out_dtype)
        == {base}(x, ..., scale[segment_ids].view(x.shape), shift[segment_ids].view(x.shape), eps, out_dtype)

Gathering ``scale[segment_ids]`` in the model and calling the base op makes autograd keep that
per-token tensor until backward; the segmented ops keep only their inputs (the compact scale and
shift, segment_ids) and the statistics (:func:`adaptiveload.ops.common.differentiable`).

Kernels. On CUDA every family op runs its segmented CUDA kernels (``csrc/norm_modulate*`` and
``csrc/residual_norm_modulate/``: each row reads its segment's rows; with non-decreasing ids the
backward cuts each row tile where the segment changes and sums each segment's parts in a fixed
order; with ids in any other order a slower column kernel sums each segment's rows in row order;
no atomics either way, and the choice is made on the device) where they apply: tensors of kernel
dtypes with aligned rows and the row ring (sm_90 for the norm -> modulate ops, sm_80 for the
residual ops; modulation in x's dtype or float32 for the former, x, y, r and out of one dtype for
the latter). Every other call takes the composite (CompositeExplicitAutograd, so the base ops below
it dispatch to the CUDA kernels on a GPU): the forward gathers the per-token modulation transiently
(``index_select``, in float32, or float64 for float64 modulation: a 16-bit scale widens exactly,
and the CUDA kernels take float32 modulation with 16-bit x) and calls the base op; the backward
gathers again, calls the base backward op and sums each per-token modulation gradient over its
segment (:func:`segment_sum`: deterministic, no atomics).

Validation: each kernel checks the shapes, dtypes and devices once per signature
(:func:`adaptiveload.ops.common.validate`), the fake kernels on every trace. The values of
segment_ids are checked on CPU on every call (``ValueError``); on CUDA reading them would make the
host wait for the device, so the kernels check them on the device: an id outside [0, n) stops the
kernel with a message naming its row (a device-side error, as ``index_select``'s assert in the
composite).

Each family's ``op.py`` defines its two schemas (``common.define``) and calls :func:`register`.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import torch
from torch import Tensor

from adaptiveload.ops import common
from adaptiveload.ops.common import describe

ID_DTYPES = (torch.int32, torch.int64)


def rows(x: Tensor) -> int:
    """T, the number of rows of x [..., D] (a symbolic size under tracing)."""
    return math.prod(x.shape[:-1])


def check_inputs(op: str, x: Tensor, params: dict, scale: Tensor, shift: Optional[Tensor], segment_ids: Tensor,
                 out_dtype: torch.dtype, eps: Optional[float] = None) -> None:
    """The checks of a segmented op's inputs: those of the base op for x, the norm's affine
    ``params`` (by name), ``out_dtype`` and ``eps`` (None: not checked); scale and shift floating
    [n, D] with one n, on x's device; segment_ids 1-D int32/int64 with one id per row of x, on x's
    device. Shapes, dtypes and devices only (see :func:`check_ids` for the values). Sizes that may
    be unbacked under tracing (n, T) are compared with ``torch._check_value``, which defers the
    check to run time where it cannot decide it.

    Raises:
        ValueError: naming the offending tensor with its shape and dtype (or device), or the bad
            eps / out_dtype.
    """
    common.check_common(op, x, params, {}, out_dtype, eps, scale_optional=True)
    check_rows(op, x, {"scale": scale, "shift": shift}, segment_ids)


def check_backward_inputs(op: str, dy: Tensor, x: Tensor, params: dict, scale: Tensor, shift: Optional[Tensor],
                          segment_ids: Tensor, stats: dict) -> None:
    """:func:`check_inputs` (no eps), then dy floating of x's shape and each of ``stats`` (by name)
    one per row of x. Raises ``ValueError`` naming the offending tensor and its shape."""
    check_inputs(op, x, params, scale, shift, segment_ids, x.dtype)
    common.check_backward_common(op, x, {"dy": dy}, stats)


def check_ids(op: str, segment_ids: Tensor, n: int) -> None:
    """On CPU, every id in [0, n); on other devices nothing (the module doc says why).

    Raises:
        ValueError: an id out of range, naming segment_ids with its shape and the first bad row.
    """
    if segment_ids.device.type != "cpu":
        return
    bad = (segment_ids < 0) | (segment_ids >= n)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"{op}: {describe('segment_ids', segment_ids)} holds {int(segment_ids[row])} at row {row}, "
                         f"outside [0, {n}) (n = the rows of scale)")


def gather(mod: Optional[Tensor], segment_ids: Tensor, x: Tensor) -> Optional[Tensor]:
    """The per-token modulation ``mod[segment_ids]`` [*x.shape] (None for None), fresh and contiguous
    in ``promote_types(mod.dtype, float32)``; the widening is done on the [n, D] rows, before the
    gather, so the only per-token tensor is the result."""
    if mod is None:
        return None
    return mod.to(torch.promote_types(mod.dtype, torch.float32)).index_select(0, segment_ids).view(x.shape)


class _GatherBySegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, segment_ids: Tensor) -> Tensor:
        ctx.save_for_backward(rows, segment_ids)
        return rows.index_select(0, segment_ids)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, segment_ids = ctx.saved_tensors
        return segment_sum(grad, segment_ids, rows, torch.promote_types(grad.dtype, torch.float32)), None


def gather_by_segment(rows: Tensor, segment_ids: Tensor) -> Tensor:
    """``rows[segment_ids]``: each token's row of a per-sample tensor, differentiable in ``rows``, for
    per-token values outside the fused ops (e.g. an eager head) where the gradient is summed by
    :func:`segment_sum` (deterministic, no atomics, float32 or float64 accumulation) instead of the
    backward of ``rows[segment_ids]``: ATen's ``index_put`` with accumulation, which on CUDA sorts the
    ids and then sums each sample's rows one after another (77 ms at 75,600 tokens, D = 1536, bf16 on
    an H200: ``benchmarks/results/profile_train_step_h200_pack.md``).

    Args:
        rows: [n, D], floating, one row per segment.
        segment_ids: int32 or int64 [T] on rows' device, each in [0, n).

    Returns:
        [T, D] in rows' dtype (a fresh tensor).

    Raises:
        ValueError: rows not 2-D floating, segment_ids not a 1-D int32/int64 tensor on rows' device
            (each named with its shape), or, on CPU, an id outside [0, n) (naming its row).
    """
    op = "gather_by_segment"
    if rows.dim() != 2 or not rows.is_floating_point():
        raise ValueError(f"{op}: {describe('rows', rows)} must be a floating [n, D] tensor")
    if segment_ids.dim() != 1 or segment_ids.dtype not in ID_DTYPES or segment_ids.device != rows.device:
        raise ValueError(f"{op}: {describe('segment_ids', segment_ids)} on {segment_ids.device} must be a 1-D "
                         f"int32 or int64 tensor on rows' device ({rows.device})")
    check_ids(op, segment_ids, rows.shape[0])
    return _GatherBySegment.apply(rows, segment_ids)


def segment_sum(per_token: Optional[Tensor], segment_ids: Tensor, mod: Optional[Tensor],
                acc_dtype: torch.dtype) -> Optional[Tensor]:
    """The gradient of ``mod`` [n, D] from that of its gather, ``per_token`` [..., D] (one row per id):
    each segment's rows summed in ``acc_dtype`` (float32, or float64), then cast once to mod's dtype;
    contiguous, zeros for a segment without rows; None when ``mod`` is None.

    On CUDA the sum is a product with the one-hot matrix of segment_ids, [n, T] @ [T, D]: a GEMM
    gives the same bits on every run on one GPU (cuBLAS's reproducibility guarantee), unlike the
    atomics of ``index_add_`` / ``scatter_add_`` and of CUDA's embedding backward (measured not
    bit-identical on an H200), needs no host sync and takes ids in any order. It runs in full float32
    (TF32 off for the call, whatever the user's matmul precision) or float64; 2 n T D flops, small
    beside the per-token backward for packs of up to a few hundred samples. On CPU
    ``aten.embedding_dense_backward`` sums (each thread owns a range of segments and adds its rows in
    row order: the same bits for any thread count, which a CPU GEMM does not promise).
    """
    if mod is None:
        return None
    grad = per_token.reshape(segment_ids.shape[0], per_token.shape[-1]).to(acc_dtype)
    if not grad.is_cuda:
        return torch.ops.aten.embedding_dense_backward(grad, segment_ids.long(), mod.shape[0], -1, False).to(mod.dtype)
    return one_hot_sum(grad, segment_ids, mod.shape[0]).to(mod.dtype)


def one_hot_sum(grad: Tensor, segment_ids: Tensor, n: int) -> Tensor:
    """``[n, D]``: the rows of ``grad`` [T, D] summed by segment, as the product of the [n, T] one-hot
    matrix of ``segment_ids`` [T] and grad, in grad's dtype at full precision (no TF32)."""
    segments = torch.arange(n, device=segment_ids.device, dtype=segment_ids.dtype)
    one_hot = (segment_ids[None, :] == segments[:, None]).to(grad.dtype)
    with _full_precision_matmul():
        return one_hot @ grad


@contextlib.contextmanager
def _full_precision_matmul():
    """CUDA float32 matmuls in full precision (no TF32) inside, the user's setting restored after."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def register(lib: torch.library.Library, base: str, params: tuple[str, ...], stats: tuple[str, ...]) -> None:
    """Register ``{base}_segmented`` and ``{base}_segmented_backward``, whose schemas ``lib`` defines:
    the CompositeExplicitAutograd kernels (see the module doc), the fake kernels (checks, then
    shapes only) and the autograd (:func:`adaptiveload.ops.common.differentiable`).

    Args:
        lib: the family's library, which defined both schemas: the base op's arguments with
            ``Tensor segment_ids`` after shift (forward), after shift and before the statistics
            (backward); an empty [0] tensor as the gradient of segment_ids.
        base: the base op, e.g. ``"adaln_modulate"`` (its backward ``{base}_backward``).
        params: the names of the norm's affine parameters, between x and scale (``("weight", "bias")``).
        stats: the names of the per-row statistics the forward returns after y (``("mean", "rstd")``).
    """
    name = f"{base}_segmented"
    forward_op = getattr(torch.ops.adaptiveload, base).default
    backward_op = getattr(torch.ops.adaptiveload, f"{base}_backward").default
    k = len(params)

    def check_forward(x, *args):  # (x, *params, scale, shift, segment_ids, out_dtype, eps): validate's order
        check_inputs(name, x, dict(zip(params, args[:k])), *args[k:])

    def check_backward(dy, x, *args):  # (dy, x, *params, scale, shift, segment_ids, *stats)
        check_backward_inputs(f"{name}_backward", dy, x, dict(zip(params, args[:k])), *args[k:k + 3],
                              dict(zip(stats, args[k + 3:])))

    # The checks, then whether the CUDA kernels may take the call (x on CUDA, kernel dtypes), for
    # common.cuda_kernels, which remembers both with the signature (eager calls only: the fake
    # kernels run the checks alone)
    def take_forward(x, *args):
        check_forward(x, *args)
        return x.is_cuda and common.kernels_apply(x, args[:k], args[k:k + 2])

    def take_backward(dy, x, *args):
        check_backward(dy, x, *args)
        return x.is_cuda and common.kernels_apply(x, args[:k], args[k:k + 2], (dy, *args[k + 3:]))

    rms = "mean" not in stats  # (RMSNorm keeps no per-row mean)

    def forward(x, *args):
        *affine, scale, shift, segment_ids, eps, out_dtype = args
        ops = common.cuda_kernels(take_forward, (x, *affine, scale, shift, segment_ids), out_dtype, eps)
        check_ids(name, segment_ids, scale.shape[0])
        out = ops.segmented_forward(x, *_weight_bias(affine), scale, shift, segment_ids, eps, out_dtype, rms) if ops else []
        if out:  # [y, mean (None for RMSNorm), rstd]
            return (out[0], out[2]) if rms else tuple(out)
        return forward_op(x, *affine, gather(scale, segment_ids, x), gather(shift, segment_ids, x), eps, out_dtype)

    def forward_fake(x, *args):
        *affine, scale, shift, segment_ids, eps, out_dtype = args
        check_forward(x, *affine, scale, shift, segment_ids, out_dtype, eps)
        stat_dtype = common.compute_dtype(x, *affine, scale, shift)
        return (x.new_empty(x.shape, dtype=out_dtype), *(x.new_empty(x.shape[:-1], dtype=stat_dtype) for _ in stats))

    def backward(dy, x, *args):
        affine, (scale, shift, segment_ids), statistics = args[:k], args[k:k + 3], args[k + 3:]
        ops = common.cuda_kernels(take_backward, (dy, x, *args))
        check_ids(f"{name}_backward", segment_ids, scale.shape[0])
        mean = (None,) if rms else ()  # (the binding's mean: None for RMSNorm)
        grads = ops.segmented_backward(dy, x, *_weight_bias(affine), scale, shift, segment_ids, *mean,
                                       *statistics) if ops else []
        if grads:  # [dx, dweight, dbias, dscale, dshift]
            return common.grads_or_empty((grads[0], *grads[1:1 + k], grads[3], grads[4], None), x)
        dx, *daffine, dscale, dshift = backward_op(dy, x, *affine, gather(scale, segment_ids, x),
                                                   gather(shift, segment_ids, x), *statistics)
        acc_dtype = common.compute_dtype(x, *affine, scale, shift)
        return common.grads_or_empty((dx, *daffine, segment_sum(dscale, segment_ids, scale, acc_dtype),
                                      segment_sum(dshift, segment_ids, shift, acc_dtype), None), x)

    def backward_fake(dy, x, *args):
        check_backward(dy, x, *args)
        affine, (scale, shift) = args[:k], args[k:k + 2]
        return tuple(common.empty_like_contiguous(t, x) for t in (x, *affine, scale, shift, None))

    lib.impl(name, forward, "CompositeExplicitAutograd")
    lib.impl(f"{name}_backward", backward, "CompositeExplicitAutograd")
    torch.library.register_fake(f"adaptiveload::{name}", forward_fake, lib=lib)
    torch.library.register_fake(f"adaptiveload::{name}_backward", backward_fake, lib=lib)
    common.differentiable(lib, name, n_tensors=len(params) + 4)


def _weight_bias(affine) -> tuple:
    """The norm's affine parameters as the bindings take them: (weight, bias), bias None for RMSNorm."""
    return (*affine, None) if len(affine) == 1 else tuple(affine)


def check_rows(op: str, x: Tensor, mods: dict, segment_ids: Tensor) -> None:
    """The segmented layout's checks of every family: each of ``mods`` (scale, shift, a residual's
    gate; None skipped, at least one given) floating [n, D] with one n, on x's device; segment_ids 1-D
    int32/int64 with one id per row of x.

    Raises:
        ValueError: naming the offending tensor with its shape and dtype (or device).
    """
    D, given = x.shape[-1], {name: t for name, t in mods.items() if t is not None}
    if not given:
        raise ValueError(f"{op}: none of {', '.join(mods)} is given: nothing to gather by segment_ids "
                         "(call the op without _segmented)")
    for name, t in given.items():
        if t.dtype not in common.FLOATING or t.dim() != 2 or t.shape[1] != D:
            raise ValueError(f"{op}: {describe(name, t)} must be floating point of shape [n, {D}] (one row per "
                             f"segment, D the last dim of x)")
    if segment_ids.dtype not in ID_DTYPES or segment_ids.dim() != 1:
        raise ValueError(f"{op}: {describe('segment_ids', segment_ids)} must be a 1-D int32 or int64 tensor "
                         "(the segment of each row of x)")
    common.check_devices(op, x, {**given, "segment_ids": segment_ids})
    first, n = next(iter(given)), next(iter(given.values())).shape[0]
    for name, t in given.items():
        torch._check_value(t.shape[0] == n, lambda: f"{op}: {describe(name, t)} must have {first}'s {n} rows "
                           "(one per segment)")
    T = rows(x)
    torch._check_value(segment_ids.shape[0] == T, lambda: f"{op}: {describe('segment_ids', segment_ids)} must "
                       f"have one id per row of x (shape {list(x.shape)}: {T} rows)")


def register_residual(lib: torch.library.Library, base: str, params: tuple[str, ...], differentiable) -> None:
    """Register ``{base}_segmented`` and ``{base}_segmented_backward`` of a residual op (its module
    doc), whose schemas ``lib`` defines: the base op's arguments with ``Tensor segment_ids`` after
    shift, and gate, scale and shift each None or [n, D]. The kernels (CompositeExplicitAutograd,
    fake alike) gather the present ones to the tokens, call the base op, and in backward sum dgate,
    dscale and dshift over each segment (:func:`segment_sum`); ``differentiable(lib, name,
    n_norm)`` registers the autograd (the residual module's, which saves r, y, gate, the
    ``n_norm`` tensors after gate and the statistics).

    Args:
        lib: the family's library; base: e.g. ``"residual_adaln_modulate"``; params: the norm's
            affine parameter names, between gate and scale (``("weight", "bias")``).
    """
    name = f"{base}_segmented"
    forward_op = getattr(torch.ops.adaptiveload, base).default
    backward_op = getattr(torch.ops.adaptiveload, f"{base}_backward").default
    k = len(params)

    def row_check(op: str):  # one function per op: validate remembers signatures per check
        return lambda x, gate, scale, shift, ids: check_rows(op, x, {"gate": gate, "scale": scale, "shift": shift}, ids)

    check_forward, check_backward = row_check(name), row_check(f"{name}_backward")

    rms = k == 1  # (RMSNorm has no bias)

    # The row checks, then whether the CUDA kernels may take the call (x on CUDA, kernel dtypes), for
    # common.cuda_kernels, which remembers both with the signature (eager calls only)
    def take_forward(x, y, gate, *args):  # (*affine, scale, shift, segment_ids, r_dtype, out_dtype)
        *affine, scale, shift, segment_ids, r_dtype, out_dtype = args
        check_forward(x, gate, scale, shift, segment_ids)
        return x.is_cuda and common.residual_kernels_apply(x, (y, gate, *affine, scale, shift), (r_dtype, out_dtype))

    def take_backward(dout, dr, r, y, gate, *args):  # (*affine, scale, shift, segment_ids, *stats, x_dtype)
        affine, (scale, shift, segment_ids), (*stats, x_dtype) = args[:k], args[k:k + 3], args[k + 3:]
        check_backward(r, gate, scale, shift, segment_ids)
        return r.is_cuda and common.residual_kernels_apply(r, (dout, dr, y, gate, *affine, scale, shift, *stats),
                                                           (x_dtype,))

    def forward(x, y, gate, *args, fake=False):
        *affine, scale, shift, segment_ids, eps, r_dtype, out_dtype = args
        if fake:
            check_forward(x, gate, scale, shift, segment_ids)
        else:
            ops = common.cuda_kernels(take_forward, (x, y, gate, *affine, scale, shift, segment_ids), r_dtype,
                                      out_dtype)
            check_ids(name, segment_ids, _segments(gate, scale, shift))
            out = ops.residual_segmented_forward(x, y, gate, *_weight_bias(affine), scale, shift, segment_ids, eps,
                                                 r_dtype, out_dtype, rms) if ops else []
            if out:  # [r, out, mean (None for RMSNorm), rstd]
                return (out[0], out[1], out[3]) if rms else tuple(out)
        return forward_op(x, y, gather(gate, segment_ids, x), *affine, gather(scale, segment_ids, x),
                          gather(shift, segment_ids, x), eps, r_dtype, out_dtype)

    def backward(dout, dr, r, y, gate, *args, fake=False):
        affine, (scale, shift, segment_ids), rest = args[:k], args[k:k + 3], args[k + 3:]
        if fake:
            check_backward(r, gate, scale, shift, segment_ids)
        else:
            ops = common.cuda_kernels(take_backward, (dout, dr, r, y, gate, *affine, scale, shift, segment_ids,
                                                      *rest[:-1]), rest[-1])
            check_ids(f"{name}_backward", segment_ids, _segments(gate, scale, shift))
            *stats, x_dtype = rest
            mean = (None,) if rms else ()  # (the binding's mean: None for RMSNorm)
            grads = ops.residual_segmented_backward(dout, dr, r, y, gate, *_weight_bias(affine), scale, shift,
                                                    segment_ids, *mean, *stats, x_dtype) if ops else []
            if grads:  # [dx, dy, dgate, dweight, dbias, dscale, dshift]
                return common.grads_or_empty((*grads[:3], *grads[3:3 + k], grads[5], grads[6], None), r)
        dx, dy, dgate, *dparams, dscale, dshift = backward_op(
            dout, dr, r, y, gather(gate, segment_ids, r), *affine, gather(scale, segment_ids, r),
            gather(shift, segment_ids, r), *rest)
        acc = common.compute_dtype(r, y, gate, *affine, scale, shift)
        dgate, dscale, dshift = (segment_sum(g, segment_ids, m, acc)
                                 for g, m in ((dgate, gate), (dscale, scale), (dshift, shift)))
        return common.grads_or_empty((dx, dy, dgate, *dparams, dscale, dshift, None), r)  # dy: [0] without a gate

    lib.impl(name, forward, "CompositeExplicitAutograd")
    lib.impl(f"{name}_backward", backward, "CompositeExplicitAutograd")
    torch.library.register_fake(f"adaptiveload::{name}", functools.partial(forward, fake=True), lib=lib)
    torch.library.register_fake(f"adaptiveload::{name}_backward", functools.partial(backward, fake=True), lib=lib)
    differentiable(lib, name, n_norm=k + 3)


def _segments(*mods: Optional[Tensor]) -> int:
    """n, the rows of the first given modulation tensor (:func:`check_rows` requires one)."""
    return next(t.shape[0] for t in mods if t is not None)
