"""``torch.ops.adaptiveload.adaln_modulate``: LayerNorm followed by adaptive modulation, as one op.

    y = (LayerNorm(x) * (1 + scale) + shift).to(out_dtype)

Registrations, in one place, one per dispatch key: the schemas (``torch.library.Library.define``),
input validation, the fake kernels (symbolic shapes), the autograd formula (an Autograd-key kernel
around a ``torch.autograd.Function`` that calls ``adaptiveload::adaln_modulate_backward``), the
reference implementation (``reference.py``: CPU and any device without its own kernel) and the CUDA
implementation (the ``csrc/`` kernels, falling back to the reference with one warning when they
cannot be built).

The ops are registered with the dispatcher directly rather than with ``torch.library.custom_op``,
whose per-call machinery (argument re-packing, a dataclass, an output-aliasing check, extra
redispatches) made a forward+backward cost the host about 1.7x the time of these registrations
(no-op kernels, CPU). The kernels return fresh tensors, never inputs or views of them (the tests
check it, and opcheck). The eager kernels validate their inputs once per distinct signature of
shapes, dtypes, devices and scalar arguments, the fake kernels on every trace.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch import Tensor

from adaptiveload.ops import extension, reference

# Modulation layouts, as classified by :func:`modulation_layout`.
PER_SAMPLE = "per-sample"  # [B, 1, ..., 1, D] (also [B, D] for 2-D x): one row per sample
PER_TOKEN = "per-token"  # [B or 1, N..., D]: one row per token
SHARED = "shared"  # [D] or [1, ..., 1, D]: one row for everything

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _describe(name: str, t: Tensor) -> str:
    return f"{name} (shape {list(t.shape)}, dtype {t.dtype})"


def _check_devices(op: str, x: Tensor, named: dict) -> None:
    """Every tensor of ``named`` (None skipped) on x's device, else ``ValueError`` naming it."""
    for name, t in named.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {_describe(name, t)} is on {t.device} but x is on {x.device}; "
                             "every input must be on x's device")


def modulation_layout(mod_shape, x_shape) -> str:
    """Classify how a modulation tensor of ``mod_shape`` broadcasts over ``x_shape`` ([B, ..., D]).

    Returns one of ``"per-sample"``, ``"per-token"``, ``"shared"``.

    Raises:
        ValueError: the modulation does not broadcast to ``x_shape`` in one of those three ways
            (wrong last dim, more dims than x, a batch dim other than 1 or B, or middle dims that
            are neither all 1 nor all equal to x's).
    """
    mod_shape, x_shape = list(mod_shape), list(x_shape)
    if len(mod_shape) > len(x_shape) or len(mod_shape) == 0 or mod_shape[-1] != x_shape[-1]:
        raise ValueError(f"shape {mod_shape} does not broadcast over x of shape {x_shape}")
    padded = [1] * (len(x_shape) - len(mod_shape)) + mod_shape
    batch, middle, x_middle = padded[0], padded[1:-1], x_shape[1:-1]
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
    raise ValueError(
        f"shape {mod_shape} is not a supported modulation layout for x of shape {x_shape}: expected "
        f"[B, 1, ..., 1, D] (per-sample), [B or 1, {', '.join(map(str, x_middle)) or 'N'}, D] (per-token) "
        f"or [D] (shared)"
    )


def check_inputs(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    out_dtype: torch.dtype,
    eps: Optional[float] = None,
) -> None:
    """Validate the op's inputs; raise ``ValueError`` naming the offending tensor and its shape (or
    device), or the bad ``eps`` / ``out_dtype``."""
    if scale is None:
        raise ValueError("adaln_modulate: scale is required ([B, 1, D], [B, N, D] or [D]; zeros for a shift only)")
    if eps is not None and not eps >= 0:  # also NaN
        raise ValueError(f"adaln_modulate: eps must be a non-negative number, got {eps}")
    if x.dim() < 2:
        raise ValueError(f"adaln_modulate: {_describe('x', x)} must have at least 2 dims [B, ..., D]")
    if out_dtype not in _FLOATING:
        raise ValueError(f"adaln_modulate: out_dtype must be a floating dtype, got {out_dtype}")
    D = x.shape[-1]
    named = {"x": x, "weight": weight, "bias": bias, "scale": scale, "shift": shift}
    for name, t in named.items():
        if t is not None and t.dtype not in _FLOATING:
            raise ValueError(f"adaln_modulate: {_describe(name, t)} must be floating point")
    _check_devices("adaln_modulate", x, named)
    for name in ("weight", "bias"):
        t = named[name]
        if t is not None and list(t.shape) != [D]:
            raise ValueError(f"adaln_modulate: {_describe(name, t)} must have shape [{D}] (the last dim of x)")
    for name in ("scale", "shift"):
        t = named[name]
        if t is None:
            continue
        try:
            modulation_layout(t.shape, x.shape)
        except ValueError as err:
            raise ValueError(f"adaln_modulate: {_describe(name, t)}: {err}") from None


def check_backward_inputs(
    dy: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    scale: Tensor,
    shift: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
) -> None:
    """Validate :func:`adaln_modulate_backward`'s inputs (those of the forward, dy of x's shape and
    one mean/rstd per row); raise ``ValueError`` naming the offending tensor and its shape."""
    check_inputs(x, weight, bias, scale, shift, x.dtype)
    _check_devices("adaln_modulate_backward", x, {"dy": dy, "mean": mean, "rstd": rstd})
    if dy.shape != x.shape or dy.dtype not in _FLOATING:
        raise ValueError(f"adaln_modulate_backward: {_describe('dy', dy)} must be floating point of x's shape "
                         f"{list(x.shape)}")
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t.shape != x.shape[:-1] or t.dtype not in _FLOATING:
            raise ValueError(f"adaln_modulate_backward: {_describe(name, t)} must be floating point of shape "
                             f"{list(x.shape[:-1])} (one per row of x)")


_VALIDATED: set = set()  # signatures (check, others, shapes, dtypes, devices) that passed their check
_MAX_VALIDATED = 4096


def _validate(check: Callable[..., None], tensors: tuple[Optional[Tensor], ...], *others) -> None:
    """``check(*tensors, *others)``, skipped when a call with the same shapes, dtypes, devices and
    ``others`` passed it before (the checks read nothing else of the tensors). Eager kernels only: a
    shape of symbolic sizes (fake tensors) is not hashable. Remembers at most ``_MAX_VALIDATED``
    signatures.

    Raises:
        ValueError: from ``check`` (never remembered, so a bad call raises every time).
    """
    key = (check, others, *[None if t is None else (t.shape, t.dtype, t.device) for t in tensors])
    if key not in _VALIDATED:
        check(*tensors, *others)
        if len(_VALIDATED) >= _MAX_VALIDATED:
            _VALIDATED.clear()
        _VALIDATED.add(key)


_lib = torch.library.Library("adaptiveload", "FRAGMENT")  # kept alive: the registrations live as long as it
_lib.define(
    "adaln_modulate(Tensor x, Tensor? weight, Tensor? bias, Tensor scale, Tensor? shift, float eps, "
    "ScalarType out_dtype) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.define(
    "adaln_modulate_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor scale, Tensor? shift, "
    "Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
adaln_modulate = torch.ops.adaptiveload.adaln_modulate
adaln_modulate_backward = torch.ops.adaptiveload.adaln_modulate_backward
_FORWARD = adaln_modulate.default
_BACKWARD = adaln_modulate_backward.default


def _adaln_modulate_reference(x, weight, bias, scale, shift, eps, out_dtype):
    """``adaln_modulate`` on CPU (and any device without its own kernel): fused
    ``LayerNorm(x) * (1 + scale) + shift``, cast to ``out_dtype``.

    Args:
        x: [B, ..., D] float16/bfloat16/float32/float64; the first dim is the modulation batch.
        weight, bias: optional LayerNorm affine parameters, [D].
        scale: modulation, broadcast over x per-sample ([B, 1, D]), per-token ([B, N, D]) or shared
            ([D], [1, 1, D]); strided views (a ``.chunk()`` of a [B, k*D] embedding) are fine.
        shift: optional, same layouts as ``scale`` (each may have its own).
        eps: LayerNorm epsilon.
        out_dtype: dtype of ``y`` (the dtype the replaced chain produced).

    Returns:
        ``(y, mean, rstd)``: y [*x.shape] in ``out_dtype``; mean and rstd [*x.shape[:-1]] in float32
        (float64 for float64 inputs), the per-row statistics saved for backward.

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the tensor and its shape).
    """
    _validate(check_inputs, (x, weight, bias, scale, shift), out_dtype, eps)
    return reference.forward(x, weight, bias, scale, shift, eps, out_dtype)


@torch.library.register_fake("adaptiveload::adaln_modulate", lib=_lib)
def _adaln_modulate_fake(x, weight, bias, scale, shift, eps, out_dtype):
    check_inputs(x, weight, bias, scale, shift, out_dtype, eps)
    stat_dtype = reference.compute_dtype(x, weight, bias, scale, shift)
    y = x.new_empty(x.shape, dtype=out_dtype)
    return y, x.new_empty(x.shape[:-1], dtype=stat_dtype), x.new_empty(x.shape[:-1], dtype=stat_dtype)


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    """Ops cannot return None: an absent gradient travels as an empty tensor."""
    return like.new_empty((0,)) if t is None else t


def _adaln_modulate_backward_reference(dy, x, weight, bias, scale, shift, mean, rstd):
    """``adaln_modulate_backward`` on CPU (and any device without its own kernel): the gradients of
    ``adaln_modulate`` from dy [*x.shape] and the saved per-row mean/rstd.

    Returns ``(dx, dweight, dbias, dscale, dshift)`` in each input's own shape and dtype; the
    gradient of an absent weight/bias/shift is an empty tensor of shape [0].

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the tensor and its shape).
    """
    _validate(check_backward_inputs, (dy, x, weight, bias, scale, shift, mean, rstd))
    grads = reference.backward(dy, x, weight, bias, scale, shift, mean, rstd)
    return tuple(_or_empty(g, x) for g in grads)


@torch.library.register_fake("adaptiveload::adaln_modulate_backward", lib=_lib)
def _adaln_modulate_backward_fake(dy, x, weight, bias, scale, shift, mean, rstd):
    check_backward_inputs(dy, x, weight, bias, scale, shift, mean, rstd)
    def like(t):
        return x.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)

    return torch.empty_like(x, memory_format=torch.contiguous_format), like(weight), like(bias), like(scale), like(shift)


_lib.impl("adaln_modulate", _adaln_modulate_reference, "CompositeExplicitAutograd")
_lib.impl("adaln_modulate_backward", _adaln_modulate_backward_reference, "CompositeExplicitAutograd")


# ---------------------------------------------------------------------------------------------
# Autograd: what ``torch.library.register_autograd`` generates (torch/_library/autograd.py), less its
# per-call work for features these schemas do not have (default and keyword-only arguments, out=).
# The dispatch key set of the call travels into the autograd.Function as its first input, so the
# forward redispatches below Autograd exactly as the no-grad path does.

class _AdaLNModulateFunction(torch.autograd.Function):
    """Forward: ``adaln_modulate`` below Autograd, saving the inputs and the per-row mean/rstd
    (non-differentiable outputs); backward: ``adaln_modulate_backward``, with None for the inputs
    that need no gradient (an absent weight/bias/shift never does)."""

    @staticmethod
    def forward(ctx, keyset, x, weight, bias, scale, shift, eps, out_dtype):
        with torch._C._AutoDispatchBelowAutograd():
            y, mean, rstd = _FORWARD.redispatch(keyset, x, weight, bias, scale, shift, eps, out_dtype)
        ctx.save_for_backward(x, weight, bias, scale, shift, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        grads = _BACKWARD(dy, *ctx.saved_tensors)
        needs = ctx.needs_input_grad[1:6]  # x, weight, bias, scale, shift
        return (None, *(g if need else None for g, need in zip(grads, needs)), None, None)


class _AdaLNModulateBackwardFunction(torch.autograd.Function):
    """``adaln_modulate_backward`` below Autograd; it has no derivative (no double backward)."""

    @staticmethod
    def forward(ctx, keyset, *args):
        with torch._C._AutoDispatchBelowAutograd():
            return _BACKWARD.redispatch(keyset, *args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("adaptiveload::adaln_modulate_backward has no derivative: adaln_modulate supports "
                           "first derivatives only (no double backward)")


def _autograd_kernel(op: torch._ops.OpOverload, function: type[torch.autograd.Function]) -> Callable:
    """The Autograd-key kernel of ``op``: ``function`` when grad mode is on and an input requires
    grad, else ``op`` below Autograd."""
    after_autograd = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        keyset = keyset & after_autograd
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(keyset, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset, *args)

    return kernel


_lib.impl("adaln_modulate", _autograd_kernel(_FORWARD, _AdaLNModulateFunction), "Autograd", with_keyset=True)
_lib.impl("adaln_modulate_backward", _autograd_kernel(_BACKWARD, _AdaLNModulateBackwardFunction), "Autograd",
          with_keyset=True)


# ---------------------------------------------------------------------------------------------
# CUDA implementation: the csrc/ kernels (built on first use by ``extension``), else the reference.
# The extension's ``forward`` / ``backward`` take the op's own arguments and do the per-call layout
# work in C++ (x as a contiguous [B, N, D]; each modulation as a [B or 1, N or 1, D] view with unit
# stride along D, its batch and token strides passed, so a .chunk() view is not copied; dy made
# contiguous like x, whatever layout autograd hands it; dtype casts; output views), which costs far
# less host time per launch than the same tensor calls from Python. Every output is a fresh
# contiguous tensor, on the kernel path and the reference path alike: the layout the fake kernels
# promise, which compiled graphs assert.
# float64 inputs and rows wider than the kernels' limit use the reference.

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_FEATURES = 16384  # widest row the kernels take (csrc/adaln_modulate.cuh: kMaxFeatures)


def _setting(name: str, default: str, choices: Optional[tuple[str, ...]] = None) -> str:
    """Environment variable ``name``, stripped and lower-cased (``default`` when unset).

    Raises:
        ValueError: ``choices`` given and the value is not one of them (the message names the variable).
    """
    value = os.environ.get(name, default).strip().lower()
    if choices is not None and value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1])
        raise ValueError(f"{name}={value!r}: expected {listed} or {choices[-1]!r}")
    return value


def _max_threads() -> int:
    """``ADAPTIVELOAD_MAX_THREADS``: threads-per-block cap of the kernels' row blocks, a tuning knob
    for benchmarks ("auto", the default: the launcher's choice, 0; 32-512: that cap, fewer threads
    meaning more 16-byte chunks a thread).

    Raises:
        ValueError: a value other than "auto" or an integer 32..512.
    """
    value = _setting("ADAPTIVELOAD_MAX_THREADS", "auto")
    if value == "auto":
        return 0
    if value.isdecimal() and 32 <= int(value) <= 512:
        return int(value)
    raise ValueError(f"ADAPTIVELOAD_MAX_THREADS={value!r}: expected 'auto' or 32..512")


def _ring_stages(name: str) -> int:
    """``ADAPTIVELOAD_FWD_STAGES`` / ``ADAPTIVELOAD_BWD_STAGES``: rows of the forward's / backward
    row kernel's shared-memory ring on sm_90 ("auto", the default: the launcher's choice, about
    32 KB (forward) / 64 KB (backward) of rows, 2 rows in the backward with per-token scale; 2-8:
    that many rows; "0": the register prefetch of one row). The kernels use the register prefetch
    where the ring cannot run (unaligned rows, a forward row wider than 4 chunks a thread (2
    per-token), a backward row wider than 16 elements a thread, GPUs before sm_90).

    Raises:
        ValueError: a value other than "auto" or an integer 0, 2..8.
    """
    value = _setting(name, "auto")
    if value == "auto":
        return -1
    if value.isdecimal() and (int(value) == 0 or 2 <= int(value) <= 8):
        return int(value)
    raise ValueError(f"{name}={value!r}: expected 'auto', 0 or 2..8")


def _fwd_interleave() -> bool:
    """``ADAPTIVELOAD_FWD_ROW_ORDER``: which rows a forward block takes ("interleave", the default:
    rows t, t + tiles, t + 2 tiles, ... of its sample, so the blocks of the wave read neighbouring
    rows at any time; "tile": a tile of consecutive rows). A tuning knob for benchmarks; the result
    is bit for bit the same.

    Raises:
        ValueError: a value other than "tile" or "interleave".
    """
    return _setting("ADAPTIVELOAD_FWD_ROW_ORDER", "interleave", ("tile", "interleave")) == "interleave"


_FWD_STORES = {"auto": -1, "threads": 0, "bulk": 1}


def _fwd_store() -> int:
    """``ADAPTIVELOAD_FWD_STORE``: how the ring forward writes y ("auto", the default, -1: the
    launcher's choice, "bulk" for rows of up to 6 KB; "threads", 0: each thread its own 16-byte
    groups; "bulk", 1: into the row's ring slot, then one bulk store by the copy engine, where the
    modulation is per-sample or shared, y has x's element size and the ring has 3 or more slots,
    else as "threads"). A tuning knob for benchmarks; y is bit for bit the same.

    Raises:
        ValueError: a value other than "auto", "threads" or "bulk".
    """
    return _FWD_STORES[_setting("ADAPTIVELOAD_FWD_STORE", "auto", tuple(_FWD_STORES))]


def _fwd_tail() -> tuple:
    """``ADAPTIVELOAD_FWD_TAIL``: "auto" (the launcher's share), "0" (none) or "P" / "P/R": P percent
    (0..50) of each sample's rows left to short blocks of R (1..65536, default 8) consecutive rows,
    launched after the interleaved wave. A tuning knob for benchmarks; y is bit for bit the same.

    Raises:
        ValueError: anything else.
    """
    value = _setting("ADAPTIVELOAD_FWD_TAIL", "auto")
    if value == "auto":
        return -1, 8
    pct, slash, rows = value.partition("/")
    rows = rows if slash else "8"
    if pct.isdecimal() and int(pct) <= 50 and rows.isdecimal() and 1 <= int(rows) <= 65536:
        return int(pct), int(rows)
    raise ValueError(f"ADAPTIVELOAD_FWD_TAIL={value!r}: expected 'auto', 'P' or 'P/R' (P 0..50, R 1..65536)")


def _two_kernel_backward() -> bool:
    """``ADAPTIVELOAD_BWD``: the backward's design ("one_pass", the default: one pass over (dy, x)
    with the column partials kept per tile; "two_kernel": the reference design, a dx kernel and a
    column kernel re-reading x and dy). A knob for benchmarks; the gradients agree to fp32 rounding.

    Raises:
        ValueError: a value other than "one_pass" or "two_kernel".
    """
    return _setting("ADAPTIVELOAD_BWD", "one_pass", ("one_pass", "two_kernel")) == "two_kernel"


def _kernel_module(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], scale: Tensor,
                   shift: Optional[Tensor], *others: Optional[Tensor]):
    """The kernel module when the kernels apply to these inputs, else None (reference path): float64
    anywhere (the reference computes in float64), empty x, rows wider than the kernels take, and
    modulation in neither x's dtype nor float32 (e.g. bf16 modulation of float32 x under autocast)."""
    if x.numel() == 0 or x.shape[-1] > _MAX_FEATURES:
        return None
    if any(t is not None and t.dtype not in _KERNEL_DTYPES for t in (x, weight, bias, *others)):
        return None
    if any(m is not None and m.dtype not in (x.dtype, torch.float32) for m in (scale, shift)):
        return None  # (with x of a kernel dtype this also keeps float64 modulation out)
    return extension.kernels()


def _adaln_modulate_cuda(x, weight, bias, scale, shift, eps, out_dtype):
    _validate(check_inputs, (x, weight, bias, scale, shift), out_dtype, eps)
    # the settings are read on every CUDA call, so that a bad value raises also where the reference runs
    settings = (_max_threads(), _ring_stages("ADAPTIVELOAD_FWD_STAGES"), _fwd_interleave(), _fwd_store(),
                *_fwd_tail())
    ops = _kernel_module(x, weight, bias, scale, shift)
    if ops is None:
        return reference.forward(x, weight, bias, scale, shift, eps, out_dtype)
    return ops.forward(x, weight, bias, scale, shift, float(eps), out_dtype, *settings)


def _adaln_modulate_backward_cuda(dy, x, weight, bias, scale, shift, mean, rstd):
    _validate(check_backward_inputs, (dy, x, weight, bias, scale, shift, mean, rstd))
    settings = (_two_kernel_backward(), _max_threads(), _ring_stages("ADAPTIVELOAD_BWD_STAGES"))  # (as the forward's)
    ops = _kernel_module(x, weight, bias, scale, shift, mean)
    if ops is None or dy.dtype == torch.float64:
        grads = reference.backward(dy, x, weight, bias, scale, shift, mean, rstd)
        return tuple(_or_empty(g, x) for g in grads)
    return ops.backward(dy, x, weight, bias, scale, shift, mean, rstd, *settings)


_lib.impl("adaln_modulate", _adaln_modulate_cuda, "CUDA")
_lib.impl("adaln_modulate_backward", _adaln_modulate_backward_cuda, "CUDA")
