"""The residual ops' segmented layout, ``residual_adaln_modulate_segmented`` and
``residual_rms_norm_modulate_segmented`` (adaptiveload/ops/segmented.py: ``register_residual``): gate,
scale and shift one row per segment [n, D] with ``segment_ids`` [T]. r and out, and the gradients of
every input through both, against float64 math written here (each row's gate and modulation gathered
from its segment's), over the prologue (gated or not) x modulation (scale and shift, scale only, none)
x norm; gradcheck; opcheck; what autograd keeps; bad inputs naming the tensor."""
from __future__ import annotations

import itertools
import re

import pytest
import torch

import adaptiveload  # noqa: F401  (registers torch.ops.adaptiveload.*)
from adaptiveload.ops.testing import OPCHECK_UTILS, TOL, assert_rel

EPS = 1e-6
OPS = {"layer": torch.ops.adaptiveload.residual_adaln_modulate_segmented,
       "rms": torch.ops.adaptiveload.residual_rms_norm_modulate_segmented}
# (gated, modulation): every combination that gives the op something to gather
CASES = [c for c in itertools.product((True, False), ("scale_shift", "scale", "none")) if c != (False, "none")]


def _inputs(norm, gated, modulation, dtype=torch.float32, T=29, D=16, n=4, seed=0, device="cpu", ids=None):
    """Inputs by name, the [n, 3D] leaf of gate, scale and shift, and the ids: ``ids`` given, or
    random ones (unsorted, every segment likely present)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (std * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(device, dtype).requires_grad_()

    table = randn(n, 3 * D, std=0.5)  # gate, scale, shift as .chunk() views of one [n, 3D] leaf
    gate, scale, shift = table.chunk(3, dim=-1)
    v = {"x": randn(1, T, D), "y": randn(1, T, D), "gate": gate if gated else None,
         "weight": 1 + randn(D, std=0.2), "bias": randn(D, std=0.2) if norm == "layer" else None,
         "scale": scale if modulation != "none" else None, "shift": shift if modulation == "scale_shift" else None}
    if ids is None:
        ids = torch.randint(0, n, (T,), generator=gen)
        ids[:3] = n - 1  # unsorted, every segment likely present
    return v, table, ids.to(device)


def _call(norm, v, ids, r_dtype, out_dtype):
    params = (v["weight"], v["bias"]) if norm == "layer" else (v["weight"],)
    return OPS[norm](v["x"], v["y"], v["gate"], *params, v["scale"], v["shift"], ids, EPS, r_dtype, out_dtype)[:2]


def _reference(norm, v, ids):
    """r and out in float64: r = x + gate[ids] * y (x + y without a gate); out = norm(r) [* w + b]
    [* (1 + scale[ids]) + shift[ids]]."""
    shape = v["x"].shape
    rows = {k: None if v[k] is None else v[k][ids].view(shape) for k in ("gate", "scale", "shift")}
    r = v["x"] + (v["y"] if rows["gate"] is None else rows["gate"] * v["y"])
    centred = r - r.mean(-1, keepdim=True) if norm == "layer" else r
    out = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + EPS) * v["weight"]
    if v["bias"] is not None:
        out = out + v["bias"]
    if rows["scale"] is not None:
        out = out * (1 + rows["scale"])
    if rows["shift"] is not None:
        out = out + rows["shift"]
    return r, out


def _leaves(v, table):
    return [table, *(t for k, t in v.items() if k in ("x", "y", "weight", "bias") and t is not None)]


def _grads(outputs, leaves, seed=1):
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum() for o in outputs)
    return torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("norm", list(OPS))
@pytest.mark.parametrize("gated, modulation", CASES)
def test_r_out_and_every_gradient_match_float64(norm, gated, modulation):
    v, table, ids = _inputs(norm, gated, modulation)
    _check_against_float64(norm, v, table, ids, 2e-6, 2e-5)


def _check_against_float64(norm, v, table, ids, out_tol, grad_tol):
    """r, out and every gradient of the op on v against float64 math on the same values."""
    got = _call(norm, v, ids, v["x"].dtype, v["x"].dtype)
    v64 = {k: None if t is None else t.detach().double() for k, t in v.items()}
    table64 = table.detach().double().requires_grad_()
    for k, t in zip(("gate", "scale", "shift"), table64.chunk(3, dim=-1)):
        v64[k] = t if v[k] is not None else None
    for k in ("x", "y", "weight", "bias"):
        if v64[k] is not None:
            v64[k].requires_grad_()
    ref = _reference(norm, v64, ids)
    for what, g, r in zip(("r", "out"), got, ref):
        assert_rel(g, r, out_tol, what)
    for what, g, r in zip(("table", "x", "y", "weight", "bias"), _grads(got, _leaves(v, table)),
                          _grads(ref, _leaves(v64, table64))):
        assert (g is None) == (r is None), what
        if r is not None:
            assert_rel(g, r, grad_tol, f"d{what}")


# lengths of a pack's segments: clips with an empty and a one-row segment, and 25 images
PACKS = {"clips": [1200, 0, 300, 2000, 1], "images": [256] * 20 + [1] * 5}


@pytest.mark.cuda
@pytest.mark.parametrize("norm", list(OPS))
@pytest.mark.parametrize("gated, modulation", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 1536])
@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("order", ["pack", "shuffled"])
def test_cuda_kernels_match_float64(norm, gated, modulation, dtype, D, pack, order):
    """The segmented residual kernels take the call (both bindings return results) and match float64
    in r, out and every gradient: ids in pack order (row tiles cut at segment changes) and shuffled
    (the on-device fallback: a column kernel sums each segment in row order)."""
    from adaptiveload.ops import extension
    lengths = PACKS[pack]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    if order == "shuffled":
        ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(D))]
    v, table, ids = _inputs(norm, gated, modulation, dtype, T=ids.numel(), D=D, n=len(lengths), seed=D,
                            device="cuda", ids=ids)
    ops, rms = extension.kernels(), norm == "rms"
    args = (v["x"], v["y"], v["gate"], v["weight"], v["bias"], v["scale"], v["shift"], ids, EPS)
    out = ops.residual_segmented_forward(*args, dtype, dtype, rms)
    assert out, "the segmented residual forward kernel handed the call back"
    dout = torch.randn_like(out[1])
    grads = ops.residual_segmented_backward(dout, None, out[0], v["y"] if gated else None, v["gate"], v["weight"],
                                            v["bias"], v["scale"], v["shift"], ids, out[2], out[3], dtype)
    assert grads, "the segmented residual backward kernel handed the call back"
    tol = TOL[dtype]
    _check_against_float64(norm, v, table, ids, tol, 2 * tol)


@pytest.mark.cuda
@pytest.mark.parametrize("norm", list(OPS))
@pytest.mark.parametrize("order", ["pack", "shuffled"])
def test_cuda_kernels_backward_bit_identical(norm, order):
    """Two backward runs give the same bits, with 200 segments (past the fallback's 128 a pass)."""
    lengths = [37] * 100 + [0] + [401] * 99
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    if order == "shuffled":
        ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(3))]
    v, table, ids = _inputs(norm, True, "scale_shift", torch.bfloat16, T=ids.numel(), D=1536, n=len(lengths),
                            device="cuda", ids=ids)
    first, second = (_grads(_call(norm, v, ids, torch.bfloat16, torch.bfloat16), _leaves(v, table))
                     for _ in range(2))
    for g1, g2 in zip(first, second):
        assert (g1 is None and g2 is None) or torch.equal(g1, g2)
    _check_against_float64(norm, v, table, ids, TOL[torch.bfloat16], 2 * TOL[torch.bfloat16])


@pytest.mark.parametrize("norm", list(OPS))
def test_gradcheck_float64(norm):
    v, table, ids = _inputs(norm, True, "scale_shift", dtype=torch.float64, T=7, D=6, n=3)

    def fn(table, x, y, weight):
        gate, scale, shift = table.chunk(3, dim=-1)
        w = {**v, "gate": gate, "scale": scale, "shift": shift, "x": x, "y": y, "weight": weight}
        return _call(norm, w, ids, torch.float64, torch.float64)

    assert torch.autograd.gradcheck(fn, (table, v["x"], v["y"], v["weight"]))


@pytest.mark.parametrize("norm", list(OPS))
@pytest.mark.parametrize("gated, modulation", [(True, "scale_shift"), (False, "scale")])
def test_opcheck(norm, gated, modulation):
    v, _, ids = _inputs(norm, gated, modulation, T=9, D=8, n=3)
    params = (v["weight"], v["bias"]) if norm == "layer" else (v["weight"],)
    args = (v["x"], v["y"], v["gate"], *params, v["scale"], v["shift"], ids, EPS, torch.float32, torch.float32)
    torch.library.opcheck(OPS[norm].default, args, test_utils=OPCHECK_UTILS)


def test_autograd_keeps_no_per_token_gate_or_modulation():
    v, table, ids = _inputs("layer", True, "scale_shift", T=64, D=16, n=4)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        _call("layer", v, ids, torch.float32, torch.float32)
    per_token = [t for t in kept if t.shape == v["x"].shape]
    assert len(per_token) == 2  # r and y (the gated branch), nothing gathered
    assert any(t.shape == (4, 16) for t in kept)


@pytest.mark.parametrize("edit, message", [
    (lambda v, ids: ({**v, "gate": None, "scale": None, "shift": None}, ids), "none of gate, scale, shift"),
    (lambda v, ids: (v, ids[:-1]), "segment_ids (shape [28]"),
    (lambda v, ids: ({**v, "gate": v["gate"][:2]}, ids),
     "scale (shape [4, 16], dtype torch.float32) must have gate's 2 rows"),
    (lambda v, ids: ({**v, "scale": v["scale"][:, :5]}, ids), "scale (shape [4, 5]"),
    (lambda v, ids: (v, ids.float()), "1-D int32 or int64"),
    (lambda v, ids: (v, torch.where(ids == 1, 9, ids)), "outside [0, 4)"),
])
def test_bad_inputs_name_the_tensor(edit, message):
    v, _, ids = _inputs("layer", True, "scale_shift")
    v, ids = edit({k: None if t is None else t.detach() for k, t in v.items()}, ids)
    with pytest.raises(ValueError, match=re.escape(message)):
        _call("layer", v, ids, torch.float32, torch.float32)
