"""What every norm→modulate op of the ``adaptiveload`` namespace shares: input checks (modulation
layouts, devices, dtypes), the per-signature validation cache, the Autograd-key kernel, the
reference math's helpers, the reader of the user settings, and the CUDA path's kernel selection.

Each op family (``adaln_modulate/``, ``rms_norm_modulate/``, ``residual_norm_modulate/``) registers
its schemas, fake kernels, reference and CUDA kernels with the dispatcher directly
(``torch.library.Library``) rather than with
``torch.library.custom_op``, whose per-call machinery (argument re-packing, a dataclass, an
output-aliasing check, extra redispatches) made a forward+backward cost the host about 1.7x the time
of these registrations (no-op kernels, CPU). The kernels return fresh tensors, never inputs or views
of them. Eager kernels validate their inputs once per distinct signature of shapes, dtypes, devices
and scalar arguments (:func:`validate`), fake kernels on every trace.

Conventions shared by the norm→modulate families, which :func:`differentiable` relies on:

* forward ``op(x, <tensors>..., float eps, ScalarType out_dtype) -> (y, <per-row statistics>...)``;
* backward ``op_backward(dy, x, <tensors>..., <statistics>...) -> (dx, d<tensor>...)``, one gradient
  per tensor input in its own shape and dtype, an empty [0] tensor for an absent (None) input.

The residual family (``residual_norm_modulate/``), whose op has two differentiable outputs, builds
its autograd kernel from :func:`autograd_kernel` and :func:`first_derivative_only`.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch import Tensor

from adaptiveload.ops import extension

# Modulation layouts, as classified by :func:`modulation_layout`.
PER_SAMPLE = "per-sample"  # [B, 1, ..., 1, D] (also [B, D] for 2-D x): one row per sample
PER_TOKEN = "per-token"  # [B or 1, N..., D]: one row per token
SHARED = "shared"  # [D] or [1, ..., 1, D]: one row for everything

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def describe(name: str, t: Tensor) -> str:
    """``"name (shape [..], dtype ..)"`` for error messages."""
    return f"{name} (shape {list(t.shape)}, dtype {t.dtype})"


def check_devices(op: str, x: Tensor, named: dict) -> None:
    """Every tensor of ``named`` (None skipped) on x's device, else ``ValueError`` naming it."""
    for name, t in named.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {describe(name, t)} is on {t.device} but x is on {x.device}; "
                             "every input must be on x's device")


def modulation_layout(mod_shape, x_shape) -> str:
    """Classify how a modulation tensor of ``mod_shape`` broadcasts over ``x_shape`` ([B, ..., D]).

    Returns one of ``"per-sample"``, ``"per-token"``, ``"shared"``.

    Raises:
        ValueError: the modulation does not broadcast to ``x_shape`` in one of those three ways
            (a last dim other than D, 1 or a 0-dim tensor included, which would broadcast one value
            over the features; more dims than x; a batch dim other than 1 or B; or middle dims that
            are neither all 1 nor all equal to x's). The message lists the three layouts; a 2-D
            table over x of 3+ dims gets a pointer to ``segment_ids`` (rows of a pack, one a sample).
    """
    mod_shape, x_shape = list(mod_shape), list(x_shape)
    x_middle = x_shape[1:-1]
    expected = (f"expected [B, 1, ..., 1, D] (per-sample), [B or 1, {', '.join(map(str, x_middle)) or 'N'}, D] "
                f"(per-token) or [D] (shared)")
    if len(mod_shape) > len(x_shape):
        raise ValueError(f"shape {mod_shape} has more dims than x of shape {x_shape}; {expected}")
    if len(mod_shape) == 0 or (mod_shape[-1] == 1 and x_shape[-1] != 1):
        # broadcastable, but one value for all D features: not a modulation layout the ops take
        raise ValueError(f"shape {mod_shape} has one value for all {x_shape[-1]} features of x of shape {x_shape}: "
                         f"a modulation has one per feature (D = {x_shape[-1]}); {expected}")
    if mod_shape[-1] != x_shape[-1]:
        raise ValueError(f"shape {mod_shape} does not broadcast over x of shape {x_shape}; {expected}")
    padded = [1] * (len(x_shape) - len(mod_shape)) + mod_shape
    batch, middle = padded[0], padded[1:-1]
    if len(x_shape) == 2:  # [B, D]: a row per sample is a row per token
        if batch == 1:
            return SHARED if x_shape[0] != 1 else PER_SAMPLE
        if batch == x_shape[0]:
            return PER_SAMPLE
    elif batch in (1, x_shape[0]):
        if all(m == 1 for m in middle):
            return SHARED if batch == 1 and x_shape[0] != 1 else PER_SAMPLE
        if middle == x_middle:
            return PER_TOKEN
    why = (f" (its batch {batch} is neither 1 nor x's batch {x_shape[0]})" if batch not in (1, x_shape[0])
           else "")
    # a [n, D] table over x of 3+ dims: one row per packed sample, which only segment_ids can place
    pack = ("; rows of a pack, one a sample ([n, D]), take segment_ids= (adaptiveload.functional)"
            if len(mod_shape) == 2 and len(x_shape) > 2 and mod_shape[0] != 1 else "")
    raise ValueError(f"shape {mod_shape} is not a supported modulation layout for x of shape {x_shape}{why}: "
                     f"{expected}{pack}")


def check_common(op: str, x: Tensor, params: dict, mods: dict, out_dtype: torch.dtype,
                 eps: Optional[float], *, full: Optional[dict] = None, scale_optional: bool = False,
                 x_name: str = "x") -> None:
    """The checks every norm→modulate op makes: ``scale`` given (with ``scale_optional``: a ``shift``
    needs a scale), ``eps`` >= 0 (None: not checked), x of 2+ dims, a floating ``out_dtype``, every
    tensor floating and on x's device, each of ``full`` of x's shape, each of ``params`` (the norm's
    affine parameters) of shape [D], each of ``mods`` (scale, shift, a residual's gate) of a
    :func:`modulation_layout` over x. ``x_name``: what the messages call x.

    Raises:
        ValueError: naming the offending tensor and its shape (or device), or the bad eps / out_dtype.
    """
    if mods.get("scale") is None:
        if not scale_optional:
            raise ValueError(f"{op}: scale is required ([B, 1, D], [B, N, D] or [D]; zeros for a shift only)")
        if mods.get("shift") is not None:
            raise ValueError(f"{op}: shift is given without scale (pass zeros for scale: a shift only)")
    if eps is not None and not eps >= 0:  # also NaN
        raise ValueError(f"{op}: eps must be a non-negative number, got {eps}")
    if x.dim() < 2:
        raise ValueError(f"{op}: {describe(x_name, x)} must have at least 2 dims [B, ..., D]")
    if out_dtype not in FLOATING:
        raise ValueError(f"{op}: out_dtype must be a floating dtype, got {out_dtype}")
    D = x.shape[-1]
    full = full or {}
    named = {x_name: x, **full, **params, **mods}
    for name, t in named.items():
        if t is not None and t.dtype not in FLOATING:
            raise ValueError(f"{op}: {describe(name, t)} must be floating point")
    check_devices(op, x, named)
    for name, t in full.items():
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{op}: {describe(name, t)} must have the shape of {x_name} {list(x.shape)}")
    for name, t in params.items():
        if t is not None and list(t.shape) != [D]:
            raise ValueError(f"{op}: {describe(name, t)} must have shape [{D}] (the last dim of {x_name})")
    for name, t in mods.items():
        if t is None:
            continue
        try:
            modulation_layout(t.shape, x.shape)
        except ValueError as err:
            raise ValueError(f"{op}: {describe(name, t)}: {err}") from None


def check_backward_common(op: str, x: Tensor, grads: dict, stats: dict, x_name: str = "x",
                          dx_addend: Optional[Tensor] = None) -> None:
    """Each of ``grads`` (the incoming gradients, None skipped) floating of x's shape, each of
    ``stats`` floating with one value per row of x, ``dx_addend`` None or of x's shape and dtype, all
    on x's device. ``x_name``: what the messages call x. Raises ``ValueError`` naming the offending
    tensor and its shape."""
    check_devices(op, x, {**grads, **stats, "dx_addend": dx_addend})
    if dx_addend is not None and (dx_addend.shape != x.shape or dx_addend.dtype != x.dtype):
        raise ValueError(f"{op}: {describe('dx_addend', dx_addend)} must have {x_name}'s shape "
                         f"{list(x.shape)} and dtype {x.dtype}")
    for name, g in grads.items():
        if g is not None and (g.shape != x.shape or g.dtype not in FLOATING):
            raise ValueError(f"{op}: {describe(name, g)} must be floating point of {x_name}'s shape "
                             f"{list(x.shape)}")
    for name, t in stats.items():
        if t.shape != x.shape[:-1] or t.dtype not in FLOATING:
            raise ValueError(f"{op}: {describe(name, t)} must be floating point of shape "
                             f"{list(x.shape[:-1])} (one per row of {x_name})")


_VALIDATED: dict = {}  # signature (check, others, shapes, dtypes, devices) -> what its check returned
_MAX_VALIDATED = 4096
_UNSEEN = object()


def validate(check: Callable[..., object], tensors: tuple[Optional[Tensor], ...], *others):
    """``check(*tensors, *others)``, skipped when a call with the same shapes, dtypes, devices and
    ``others`` passed it before (the checks read nothing else of the tensors): returns what the check
    returned, remembered with the signature. Eager kernels only: a shape of symbolic sizes (fake
    tensors) is not hashable. Remembers at most ``_MAX_VALIDATED`` signatures.

    Raises:
        ValueError: from ``check`` (never remembered, so a bad call raises every time).
    """
    key = (check, others, *[None if t is None else (t.shape, t.dtype, t.device) for t in tensors])
    result = _VALIDATED.get(key, _UNSEEN)
    if result is _UNSEEN:
        result = check(*tensors, *others)
        if len(_VALIDATED) >= _MAX_VALIDATED:
            _VALIDATED.clear()
        _VALIDATED[key] = result
    return result


def or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    """Ops cannot return None: an absent gradient travels as an empty tensor."""
    return like.new_empty((0,)) if t is None else t


def grads_or_empty(grads, x: Tensor) -> tuple:
    return tuple(or_empty(g, x) for g in grads)


def empty_like_contiguous(t: Optional[Tensor], x: Tensor) -> Tensor:
    """The fake output for the gradient of ``t``: a contiguous tensor like it, or [0] for None."""
    return x.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)


# --- reference math ----------------------------------------------------------------------------


def compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """float64 if any given tensor is float64, else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def output(t: Tensor, dtype: torch.dtype, copy: bool = False) -> Tensor:
    """``t`` in ``dtype`` and contiguous, the layout the fake kernels promise for every output (a
    gradient arriving transposed would otherwise lay out dx like it), in at most one copy; a copy
    also when ``copy`` (an op output must not alias an input)."""
    if t.is_contiguous() and not copy:
        return t.to(dtype)
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format).copy_(t)


def modulate(n: Tensor, scale: Optional[Tensor], shift: Optional[Tensor]) -> Tensor:
    """``n * (1 + scale) [+ shift]`` in n's dtype; ``n`` itself without scale (and then no shift)."""
    if scale is None:
        return n
    y = n * (1 + scale.to(n.dtype))
    return y if shift is None else y + shift.to(n.dtype)


def modulation_grads(dyf: Tensor, n: Tensor, scale: Optional[Tensor],
                     shift: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(dn, dscale, dshift)``: the gradients of :func:`modulate` ``(n, scale, shift)`` from dy (all
    in the compute dtype). dn = dy * (1 + scale) in the compute dtype (dy itself without scale);
    dscale and dshift summed over the dims where each broadcasts, in its own dtype, contiguous,
    never aliasing dy (None for an absent one)."""
    if scale is None:
        return dyf, None, None
    # copy=True: for per-token shift the sum is dy itself, and an op output must not alias an input
    dshift = None if shift is None else output(dyf.sum_to_size(shift.shape), shift.dtype, copy=True)
    dscale = output((dyf * n).sum_to_size(scale.shape), scale.dtype)
    return dyf * (1 + scale.to(dyf.dtype)), dscale, dshift


# --- registration -------------------------------------------------------------------------------


def define(forward_schema: str, backward_schema: str) -> torch.library.Library:
    """A FRAGMENT library of the ``adaptiveload`` namespace with an op and its backward op defined
    from their schemas, tagged pt2-compliant. Keep it alive: the registrations live as long as it."""
    lib = torch.library.Library("adaptiveload", "FRAGMENT")
    for schema in (forward_schema, backward_schema):
        lib.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    return lib


# --- autograd -----------------------------------------------------------------------------------
# What ``torch.library.register_autograd`` generates (torch/_library/autograd.py), less its per-call
# work for features these schemas do not have (default and keyword-only arguments, out=). The
# dispatch key set of the call travels into the autograd.Function as its first input, so the forward
# redispatches below Autograd exactly as the no-grad path does.


def autograd_kernel(op: torch._ops.OpOverload, function: type[torch.autograd.Function]) -> Callable:
    """The Autograd-key kernel of ``op`` (register it ``with_keyset=True``): ``function.apply(keyset,
    *args)`` when grad mode is on and an input requires grad, else ``op`` below Autograd."""
    after_autograd = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        keyset = keyset & after_autograd
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(keyset, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset, *args)

    return kernel


def differentiable(lib: torch.library.Library, name: str, n_tensors: int, output_mask: bool = False) -> None:
    """Register the Autograd kernels of ``name`` and ``name_backward`` (the conventions of the
    module doc): the forward saves its ``n_tensors`` tensor inputs and its statistics outputs (which
    are non-differentiable) and its backward calls ``name_backward``, keeping the gradients of the
    inputs that need one; ``name_backward`` has no derivative (:func:`first_derivative_only`). With
    ``output_mask``, ``name_backward`` takes a last argument ``bool[n_tensors] output_mask`` (aten's
    convention, e.g. ``native_layer_norm_backward``): which of the tensor inputs need a gradient."""
    forward = getattr(torch.ops.adaptiveload, name).default
    backward = getattr(torch.ops.adaptiveload, f"{name}_backward").default

    class Forward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            with torch._C._AutoDispatchBelowAutograd():
                y, *stats = forward.redispatch(keyset, *args)
            ctx.save_for_backward(*args[:n_tensors], *stats)
            ctx.mark_non_differentiable(*stats)
            return (y, *stats)

        @staticmethod
        def backward(ctx, dy, *_dstats):
            needs = ctx.needs_input_grad[1:1 + n_tensors]
            grads = backward(dy, *ctx.saved_tensors, *([list(needs)] if output_mask else []))
            extra = len(ctx.needs_input_grad) - 1 - n_tensors  # eps, out_dtype
            return (None, *(g if need else None for g, need in zip(grads, needs)), *([None] * extra))

    Forward.__name__ = f"{name}_function"
    lib.impl(name, autograd_kernel(forward, Forward), "Autograd", with_keyset=True)
    first_derivative_only(lib, name)


def first_derivative_only(lib: torch.library.Library, name: str) -> None:
    """Register the Autograd kernel of ``name_backward``: it runs below Autograd, and differentiating
    its outputs raises ``RuntimeError`` (the ops have first derivatives only, no double backward)."""
    backward = getattr(torch.ops.adaptiveload, f"{name}_backward").default

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            with torch._C._AutoDispatchBelowAutograd():
                return backward.redispatch(keyset, *args)

        @staticmethod
        def backward(ctx, *grads):
            raise RuntimeError(f"adaptiveload::{name}_backward has no derivative: {name} supports first "
                               "derivatives only (no double backward)")

    Backward.__name__ = f"{name}_backward_function"
    lib.impl(f"{name}_backward", autograd_kernel(backward, Backward), "Autograd", with_keyset=True)


# --- user settings ------------------------------------------------------------------------------


def setting(name: str, default: str, choices: Optional[tuple[str, ...]] = None) -> str:
    """Environment variable ``name``, stripped and lower-cased (``default`` when unset): for the user
    settings (``ADAPTIVELOAD_DISABLE``), read where they apply, never on a kernel's call path.

    Raises:
        ValueError: ``choices`` given and the value is not one of them (the message names the variable).
    """
    value = os.environ.get(name, default).strip().lower()
    if choices is not None and value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1])
        raise ValueError(f"{name}={value!r}: expected {listed} or {choices[-1]!r}")
    return value


# --- CUDA path ----------------------------------------------------------------------------------
# The csrc/ kernels (built on first use by ``extension``), else the reference. The extension's entry
# points take the op's own arguments and do the per-call layout work in C++ (x as a contiguous
# [B, N, D]; each modulation as a [B or 1, N or 1, D] view with unit stride along D, its batch and
# token strides passed, so a .chunk() view is not copied; dy made contiguous like x, whatever layout
# autograd hands it; dtype casts; output views), which costs far less host time per launch than the
# same tensor calls from Python. The kernels choose their block shape, ring slots, row order, how y
# is stored and the backward's design themselves (``_tuning`` forces them for benchmarks and tests):
# nothing is read from the environment per call. Every output is a fresh contiguous tensor, on the
# kernel path and the reference path alike: the layout the fake kernels promise, which compiled
# graphs assert.

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_FEATURES = 16384  # widest row the kernels take (csrc/norm_modulate.cuh: kMaxFeatures)


def kernels_apply(x: Tensor, params: tuple, mods: tuple, others: tuple = ()) -> bool:
    """Whether the kernels take these inputs (else the reference runs): not for float64 anywhere (the
    reference computes in float64), empty x, rows wider than the kernels take, or modulation in
    neither x's dtype nor float32 (e.g. bf16 modulation of float32 x under autocast). Reads shapes
    and dtypes only, so :func:`validate` may remember the answer with the signature.

    Args:
        x: the op's input; params: the norm's affine parameters (None for absent ones); mods: scale,
            shift (None when absent); others: further tensors that must be of a kernel dtype (the
            saved statistics, dy).
    """
    if x.numel() == 0 or x.shape[-1] > MAX_FEATURES:
        return False
    if any(t is not None and t.dtype not in KERNEL_DTYPES for t in (x, *params, *others)):
        return False
    # (with x of a kernel dtype this also keeps float64 modulation out)
    return all(m is None or m.dtype in (x.dtype, torch.float32) for m in mods)


def residual_kernels_apply(x: Tensor, tensors: tuple, dtypes: tuple = ()) -> bool:
    """Whether the residual ops' kernels (``csrc/residual_norm_modulate/``) take these inputs (else the
    reference runs): x non-empty with rows of at most :data:`MAX_FEATURES`, and x, every given tensor
    and every dtype of ``dtypes`` (r_dtype, out_dtype; the backward's x_dtype) of a kernel dtype.
    Unlike :func:`kernels_apply` the dtypes may mix freely (the kernels read each tensor in its own
    dtype). Reads shapes and dtypes only, so :func:`validate` may remember the answer.

    Args:
        x: the op's x (the backward's r); tensors: its other tensor inputs (None for absent ones);
            dtypes: its dtype arguments.
    """
    if x.numel() == 0 or x.shape[-1] > MAX_FEATURES:
        return False
    return (all(t is None or t.dtype in KERNEL_DTYPES for t in (x, *tensors))
            and all(d in KERNEL_DTYPES for d in dtypes))


def cuda_kernels(check: Callable[..., bool], tensors: tuple[Optional[Tensor], ...], *others):
    """The kernel module for a CUDA call, or None (reference path): ``check`` validates the call's
    inputs and says whether the kernels take them (:func:`kernels_apply`); both answers are
    remembered per signature (:func:`validate`), so a repeated call costs one dictionary lookup.

    Raises:
        ValueError: from ``check``.
        RuntimeError: the kernels cannot be built and ``ADAPTIVELOAD_REQUIRE_KERNEL=1`` is set.
    """
    return extension.kernels() if validate(check, tensors, *others) else None
