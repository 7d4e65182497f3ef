"""Tests of ``torch.ops.adaptiveload.residual_adaln_modulate`` and ``.residual_rms_norm_modulate``
(the residual update folded into a norm site): r, out, the statistics and every gradient against a
float64 eager composition written here (``x + gate * y``, ``F.layer_norm`` / ``F.rms_norm``,
``* (1 + scale) + shift``) over prologue (plain / gated, every gate layout) x norm (affine or not)
x modulation (none, scale-only, scale+shift, every layout) x dtypes, with and without a gradient
arriving at r; gradcheck; opcheck of both ops (dout non-contiguous included); hand-computed values;
D > 8192; bad inputs; aliasing; the autograd wiring (first derivatives only, only the gradients
asked for, a plain residual's one dr_total for both inputs). On a GPU (marked ``cuda``, skipped
without one) the same checks reach the csrc/residual_norm_modulate/ kernels: every variant, mixed
dtypes, D not a multiple of 8, D = 12288, both backward designs, bit-identical backward runs,
opcheck, and the C++ dispatcher kernels' hand-back to the Python path."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from adaptiveload.ops import _tuning, extension
from adaptiveload.ops.residual_norm_modulate import op as residual_op
from adaptiveload.ops.testing import (EXPANDED_PER_TOKEN, GRAD_LAYOUTS, LAYOUTS, OPCHECK_UTILS, TOL, assert_rel,
                                       check_backward_strides, check_op_against_float64, lay_out_grad, make_mod,
                                       property_strategies, rel_err)

EPS = 1e-6
OPS = {"layer_norm": torch.ops.adaptiveload.residual_adaln_modulate,
       "rms_norm": torch.ops.adaptiveload.residual_rms_norm_modulate}
BACKWARDS = {"layer_norm": torch.ops.adaptiveload.residual_adaln_modulate_backward,
             "rms_norm": torch.ops.adaptiveload.residual_rms_norm_modulate_backward}
MODULATIONS = ("none", "scale", "scale+shift")


def eager_site(norm, x, y, gate, weight, bias, scale, shift, r_dtype=None):
    """The residual update and the norm site as a user writes them (in the inputs' dtype): ``(r,
    out)``. With ``r_dtype`` the norm reads r rounded to it, as Wan's ``.type_as(x)`` then
    ``.float()`` does (the rounding passes gradients through unchanged); r is returned unrounded."""
    r = x + y if gate is None else x + gate * y
    read = r if r_dtype is None else r.to(r_dtype).to(r.dtype)
    if norm == "layer_norm":
        n = F.layer_norm(read, (r.shape[-1],), weight, bias, EPS)
    else:
        n = F.rms_norm(read, (r.shape[-1],), weight, EPS)
    if scale is None:
        return r, n
    out = n * (1 + scale)
    return r, (out if shift is None else out + shift)


def call(norm, v, r_dtype, out_dtype):
    """The op on the inputs ``v`` by name (absent ones None)."""
    norm_args = (v.get("weight"), v.get("bias")) if norm == "layer_norm" else (v.get("weight"),)
    return OPS[norm](v["x"], v["y"], v.get("gate"), *norm_args, v.get("scale"), v.get("shift"), EPS, r_dtype,
                     out_dtype)


def make_inputs(norm, x_shape, dtype, gate_layout, modulation, scale_layout, shift_layout, affine, seed,
                mod_dtype=None, y_dtype=None, device="cpu"):
    """The op's inputs by name (None for absent ones) on ``device``: x, y [x_shape]; gate, scale,
    shift in a layout of LAYOUTS (gate None for a plain residual; modulation "none", "scale" or
    "scale+shift"); weight (and the LayerNorm's bias) when ``affine``. The same values on every
    device (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    D = x_shape[-1]
    mdt = mod_dtype or dtype

    def randn(*shape, scale=1.0, shift=0.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64) + shift).to(dt).to(device)

    named = {"x": randn(*x_shape, scale=2.0, shift=0.3), "y": randn(*x_shape, dt=y_dtype or dtype)}
    named["gate"] = None if gate_layout is None else make_mod(gate_layout, x_shape, mdt, device, gen)
    named["weight"] = randn(D, scale=0.3, shift=1.0) if affine else None
    if norm == "layer_norm":
        named["bias"] = randn(D, scale=0.3) if affine else None
    named["scale"] = None if modulation == "none" else make_mod(scale_layout, x_shape, mdt, device, gen)
    named["shift"] = make_mod(shift_layout, x_shape, mdt, device, gen) if modulation == "scale+shift" else None
    return named


def check_against_float64(norm, x_shape, dtype, gate_layout, modulation, scale_layout, shift_layout, affine, seed,
                          grad_layout="contiguous", with_dr=True, mod_dtype=None, y_dtype=None, device="cpu",
                          out_dtype=None):
    """The op forward and backward (dout, and dr unless ``with_dr`` is False, laid out as
    ``grad_layout``) against float64 autograd of :func:`eager_site` on the same (upcast) inputs, its
    norm reading r rounded to ``dtype`` (the op's r_dtype): r, out (in ``out_dtype``, default
    ``dtype``), the statistics and every gradient."""
    named = make_inputs(norm, x_shape, dtype, gate_layout, modulation, scale_layout, shift_layout, affine, seed,
                        mod_dtype, y_dtype, device)
    out_dtype = out_dtype or dtype
    gen = torch.Generator().manual_seed(seed + 1)
    dout = lay_out_grad(grad_layout, torch.randn(*x_shape, generator=gen, dtype=torch.float64).to(out_dtype).to(device))
    dr = lay_out_grad(grad_layout, torch.randn(*x_shape, generator=gen, dtype=torch.float64).to(dtype).to(device))

    def op_fn(v):
        r, out, *stats = call(norm, v, dtype, out_dtype)
        assert r.dtype == dtype and out.dtype == out_dtype and r.is_contiguous() and out.is_contiguous()
        return (r, out, *stats) if with_dr else (out, r, *stats)

    keys = ("x", "y", "gate", "weight", "bias", "scale", "shift")

    def ref_fn(v):
        r, out = eager_site(norm, *(v.get(k) for k in keys), r_dtype=dtype)
        return (r, out) if with_dr else out

    tol = max(TOL[t] for t in (dtype, mod_dtype or dtype, y_dtype or dtype, out_dtype))
    dys, names = ((dr, dout), ("r", "out")) if with_dr else (dout, ("out",))
    def term_sizes(views, grads):  # dgate = Σ y · dr_total over gate's broadcast dims, and dr_total = dx
        gate = views.get("gate")
        if gate is None or gate.shape == views["x"].shape:
            return {}
        return {"gate": (views["y"].abs() * grads["x"].abs()).sum_to_size(gate.shape)}

    outputs, ref = check_op_against_float64(named, op_fn, ref_fn, dys, tol, names, term_sizes)
    stat_dtype = torch.float64 if torch.float64 in (dtype, mod_dtype, y_dtype) else torch.float32
    r_ref = eager_site(norm, *(ref.get(k) for k in keys))[0].to(dtype).double()  # what the op's norm reads
    stats = outputs[2:]
    assert all(s.dtype == stat_dtype and s.shape == x_shape[:-1] for s in stats)
    if norm == "layer_norm":
        assert_rel(stats[0], r_ref.mean(-1), tol, "mean")
        assert_rel(stats[1], (r_ref.var(-1, unbiased=False) + EPS).rsqrt(), tol, "rstd")
    else:
        assert_rel(stats[0], (r_ref.square().mean(-1) + EPS).rsqrt(), tol, "rstd")


def _site_strategies():
    layouts = st.sampled_from(LAYOUTS)
    return dict(norm=st.sampled_from(sorted(OPS)), gate_layout=st.one_of(st.none(), layouts),
                modulation=st.sampled_from(MODULATIONS), scale_layout=layouts, shift_layout=layouts,
                affine=st.booleans(), with_dr=st.booleans())


_SHAPES = {k: v for k, v in property_strategies().items() if k in ("B", "tokens", "D", "grad_layout", "seed")}


@given(**_SHAPES, **_site_strategies())
def test_matches_float64_eager_in_float64(B, tokens, D, grad_layout, seed, norm, gate_layout, modulation,
                                          scale_layout, shift_layout, affine, with_dr):
    check_against_float64(norm, (B, *tokens, D), torch.float64, gate_layout, modulation, scale_layout, shift_layout,
                          affine, seed, grad_layout, with_dr)


@given(**_SHAPES, **_site_strategies(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       fp32_mod=st.booleans())
def test_matches_float64_eager_in_lower_precision(B, tokens, D, grad_layout, seed, norm, gate_layout, modulation,
                                                  scale_layout, shift_layout, affine, with_dr, dtype, fp32_mod):
    """x, y, r and out in ``dtype``; gate, scale and shift in it or in float32 (Wan's pattern); each
    output within the rounding of one cast to its dtype of the float64 result."""
    check_against_float64(norm, (B, *tokens, D), dtype, gate_layout, modulation, scale_layout, shift_layout, affine,
                          seed, grad_layout, with_dr, mod_dtype=torch.float32 if fp32_mod else None)


@pytest.mark.parametrize("norm", sorted(OPS))
def test_x_and_y_of_different_dtypes_and_wide_rows(norm):
    """y in float32 beside bf16 x (each gradient in its input's dtype); D > 8192."""
    check_against_float64(norm, (2, 3, 8), torch.bfloat16, "per-sample", "scale+shift", "per-token", "shared", True,
                          seed=1, y_dtype=torch.float32)
    check_against_float64(norm, (1, 3, 12288), torch.bfloat16, "strided-per-sample", "scale+shift", "per-sample",
                          "per-sample", True, seed=2, mod_dtype=torch.float32)
    check_against_float64(norm, (1, 2, 9000), torch.float64, None, "none", None, None, False, seed=3)


def test_summed_gradient_error_is_relative_to_its_terms():
    """rel_err by hand: terms 10 and -9.9 sum to 0.1; an error of 0.01 is 10% of the sum but 0.07% of
    the terms' sizes (||[19.9]|| = 19.9), which is what rounding each term scales with; the floor of
    0.1 per element still holds for a sum whose terms are all ~0."""
    got, want = torch.tensor([0.11], dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64)
    assert rel_err(got, want) == pytest.approx(0.1)  # 0.01 over the floor 0.1
    assert rel_err(got, want, torch.tensor([19.9], dtype=torch.float64)) == pytest.approx(0.01 / 19.9)
    assert rel_err(got, want, torch.tensor([1e-12], dtype=torch.float64)) == pytest.approx(0.1)


def test_hand_computed_values():
    """One row by hand, LayerNorm: x = [3, 4], y = [1, -2], gate = [2, 0.5] -> r = [5, 3]; mean 4,
    variance 1, eps 0.5 -> rstd = 1/sqrt(1.5), x_hat = [rstd, -rstd]; weight [2, 1], bias [0, 1],
    scale [1, 0], shift [0, 1] -> out = [2 rstd * 2, (1 - rstd) + 1]. Backward with dout = 0 and
    dr = [1, 1]: dx = [1, 1], dy = gate, dgate = y (gate is shared, [D]: summed over the one row),
    and no norm or modulation gradient."""
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    x, y, gate, w, b, scale, shift = t([3.0, 4.0]), t([1.0, -2.0]), t(2.0, 0.5), t(2.0, 1.0), t(0.0, 1.0), \
        t(1.0, 0.0), t(0.0, 1.0)
    r, out, mean, rstd = OPS["layer_norm"](x, y, gate, w, b, scale, shift, 0.5, torch.float64, torch.float64)
    s = 1 / 1.5 ** 0.5
    torch.testing.assert_close(r, t([5.0, 3.0]), rtol=0, atol=0)
    torch.testing.assert_close(out, t([4 * s, 2 - s]), rtol=1e-15, atol=0)
    torch.testing.assert_close((mean, rstd), (t(4.0), t(s)), rtol=1e-15, atol=0)
    grads = BACKWARDS["layer_norm"](torch.zeros_like(out), torch.ones_like(r), r, y, gate, w, b, scale, shift, mean,
                                    rstd, torch.float64)
    dx, dy, dgate, dw, db, dscale, dshift = grads
    torch.testing.assert_close((dx, dy, dgate), (t([1.0, 1.0]), gate[None], y[0]), rtol=0, atol=0)
    assert all(g.abs().max() == 0 for g in (dw, db, dscale, dshift))


def test_hand_computed_rms_norm_plain_residual():
    """RMSNorm, plain residual, no modulation: x = [1, 2], y = [2, 2] -> r = [3, 4]; mean(r^2) = 12.5,
    eps 0 -> out = r / sqrt(12.5). Without a gate the backward returns dr_total once (dy, dgate
    empty): with dout = 0, dr = [2, -1] it is dr."""
    x, y = torch.tensor([[1.0, 2.0]], dtype=torch.float64), torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    r, out, rstd = OPS["rms_norm"](x, y, None, None, None, None, 0.0, torch.float64, torch.float64)
    torch.testing.assert_close(out, torch.tensor([[3.0, 4.0]], dtype=torch.float64) / 12.5 ** 0.5, rtol=1e-15, atol=0)
    dr = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    dx, dy, dgate, dw, dscale, dshift = BACKWARDS["rms_norm"](torch.zeros_like(out), dr, r, None, None, None, None,
                                                              None, rstd, torch.float64)
    torch.testing.assert_close(dx, dr, rtol=0, atol=0)
    assert [t.shape for t in (dy, dgate, dw, dscale, dshift)] == [(0,)] * 5


def _opcheck_args(norm, gate_layout, modulation, layout, requires_grad=True, dtype=torch.float32):
    named = make_inputs(norm, (2, 5, 8), dtype, gate_layout, modulation, layout, layout, True, seed=3)
    if requires_grad:
        for t in named.values():
            if t is not None:
                (t._base if t._base is not None else t).requires_grad_(True)
    return named


@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("gate_layout", [None, *LAYOUTS])
@pytest.mark.parametrize("modulation", MODULATIONS)
def test_opcheck(norm, gate_layout, modulation):
    v = _opcheck_args(norm, gate_layout, modulation, gate_layout or "per-sample")
    norm_args = (v["weight"], v["bias"]) if norm == "layer_norm" else (v["weight"],)
    args = (v["x"], v["y"], v["gate"], *norm_args, v["scale"], v["shift"], EPS, torch.float32, torch.float32)
    torch.library.opcheck(OPS[norm].default, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("gate_layout", [None, "strided-per-sample", "per-token"])
@pytest.mark.parametrize("grad_layout", GRAD_LAYOUTS[1:])
def test_opcheck_backward_with_noncontiguous_gradients(norm, gate_layout, grad_layout):
    """The backward op's outputs are contiguous (as its fake kernel promises) whatever the layout of
    dout and dr, with and without dr."""
    v = _opcheck_args(norm, gate_layout, "scale+shift", "strided-per-token", requires_grad=False)
    r, out, *stats = call(norm, v, torch.float32, torch.float32)
    gen = torch.Generator().manual_seed(6)
    dout, dr = (lay_out_grad(grad_layout, torch.randn(r.shape, generator=gen)) for _ in range(2))
    norm_args = (v["weight"], v["bias"]) if norm == "layer_norm" else (v["weight"],)
    names = ("dx", "dy", "dgate", "dweight", *(("dbias",) if norm == "layer_norm" else ()), "dscale", "dshift")
    y = v["y"] if gate_layout is not None else None
    for grad_r in (dr, None):
        args = (dout, grad_r, r, y, v["gate"], *norm_args, v["scale"], v["shift"], *stats, torch.float32)
        check_backward_strides(BACKWARDS[norm], args, names)


@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("gate_layout", [None, "per-sample", "strided-per-token", "shared"])
@pytest.mark.parametrize("modulation", MODULATIONS)
def test_gradcheck_float64(norm, gate_layout, modulation):
    named = make_inputs(norm, (2, 3, 5), torch.float64, gate_layout, modulation, "strided-per-sample", "per-token",
                        True, seed=4)
    names = [n for n, t in named.items() if t is not None]
    leaves = [(named[n]._base if named[n]._base is not None else named[n]).detach().requires_grad_(True)
              for n in names]

    def fn(*leaves):
        views = {n: leaf if named[n]._base is None else leaf.as_strided(named[n].shape, named[n].stride(),
                                                                         named[n].storage_offset())
                 for n, leaf in zip(names, leaves)}
        r, out, *_ = call(norm, views, torch.float64, torch.float64)
        return r, out

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("norm", sorted(OPS))
def test_outputs_never_alias_inputs(norm):
    for gate_layout in (None, "per-token"):
        v = _opcheck_args(norm, gate_layout, "scale+shift", "per-token", requires_grad=False)
        r, out, *stats = call(norm, v, torch.float32, torch.float32)
        norm_args = (v["weight"], v["bias"]) if norm == "layer_norm" else (v["weight"],)
        dout, dr = torch.randn_like(r), torch.randn_like(r)
        y = v["y"] if gate_layout is not None else None
        grads = BACKWARDS[norm](dout, dr, r, y, v["gate"], *norm_args, v["scale"], v["shift"], *stats, torch.float32)
        inputs = [t for t in (*v.values(), dout, dr) if t is not None]
        for result in (r, out, *stats, *grads):
            for t in inputs:
                assert result.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.parametrize("norm", sorted(OPS))
def test_plain_residual_hands_dr_total_to_both_inputs(norm):
    """Without a gate the backward op returns dr_total once; y's gradient is that tensor in y's
    dtype (a float32 y beside float64 x gets it cast), and equals float64 eager's."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    for y in (torch.randn(2, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True),
              torch.randn(2, 3, 8, generator=gen, requires_grad=True)):
        r, out, *_ = call(norm, {"x": x, "y": y}, torch.float64, torch.float64)
        dx, dy = torch.autograd.grad((r * 3 + out.square()).sum(), (x, y))
        assert dy.dtype == y.dtype
        torch.testing.assert_close(dy, dx.to(y.dtype), rtol=0, atol=0)
        x_ref = x.detach().requires_grad_()
        r_ref, out_ref = eager_site(norm, x_ref, y.detach().double(), None, None, None, None, None)
        (dx_ref,) = torch.autograd.grad((r_ref * 3 + out_ref.square()).sum(), x_ref)
        assert_rel(dx, dx_ref, 1e-10, "dx")


def test_gradients_only_for_inputs_that_need_them():
    """An input that needs no gradient gets None; x and y get float32 eager's gradients."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    y = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    gate, scale = torch.randn(2, 1, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
    r, out, *_ = OPS["layer_norm"](x, y, gate, None, None, scale, None, EPS, torch.float32, torch.float32)
    out.sum().backward()
    assert gate.grad is None and scale.grad is None
    x_ref, y_ref = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    eager_site("layer_norm", x_ref, y_ref, gate.double(), None, None, scale.double(), None)[1].sum().backward()
    assert_rel(x.grad, x_ref.grad, 2 * TOL[torch.float32], "dx")
    assert_rel(y.grad, y_ref.grad, 2 * TOL[torch.float32], "dy")


def test_double_backward_raises():
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = torch.randn(2, 5, 8)
    r, out, _ = OPS["rms_norm"](x, y, None, None, torch.randn(2, 1, 8), None, EPS, torch.float32, torch.float32)
    (dx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        dx.sum().backward()


def _bad(**changes):
    gen = torch.Generator().manual_seed(0)
    args = {"x": torch.randn(2, 5, 8, generator=gen), "y": torch.randn(2, 5, 8, generator=gen),
            "gate": torch.randn(2, 1, 8, generator=gen), "weight": torch.randn(8, generator=gen),
            "bias": torch.randn(8, generator=gen), "scale": torch.randn(2, 1, 8, generator=gen),
            "shift": torch.randn(2, 1, 8, generator=gen), "r_dtype": torch.float32}
    args.update(changes)
    return args


@pytest.mark.parametrize("kwargs, words", [
    (_bad(y=torch.randn(2, 1, 8)), ["y (shape [2, 1, 8]", "the shape of x [2, 5, 8]"]),
    (_bad(gate=torch.randn(3, 1, 8)), ["gate (shape [3, 1, 8]", "its batch 3 is neither 1 nor x's batch 2"]),
    (_bad(gate=torch.randn(2, 5, 4)), ["gate (shape [2, 5, 4]"]),
    (_bad(weight=torch.randn(7)), ["weight (shape [7]", "must have shape [8]"]),
    (_bad(scale=None), ["shift is given without scale"]),
    (_bad(y=torch.randint(0, 3, (2, 5, 8))), ["y (shape [2, 5, 8], dtype torch.int64)", "floating"]),
    (_bad(x=torch.randn(8), y=torch.randn(8)), ["x (shape [8]", "at least 2 dims"]),
    (_bad(r_dtype=torch.int32), ["r_dtype must be a floating dtype"]),
])
def test_bad_inputs_raise_value_error_naming_the_tensor(kwargs, words):
    a = kwargs
    with pytest.raises(ValueError) as err:
        OPS["layer_norm"](a["x"], a["y"], a["gate"], a["weight"], a["bias"], a["scale"], a["shift"], EPS, a["r_dtype"],
                          torch.float32)
    assert str(err.value).startswith("residual_adaln_modulate: ")
    for word in words:
        assert word in str(err.value)


def test_bad_backward_inputs_raise_value_error_naming_the_tensor():
    a = _bad()
    r, out, rstd = OPS["rms_norm"](a["x"], a["y"], a["gate"], a["weight"], a["scale"], a["shift"], EPS, torch.float32,
                                   torch.float32)
    bwd = BACKWARDS["rms_norm"]
    good = dict(dout=torch.ones_like(r), dr=torch.ones_like(r), r=r, y=a["y"], gate=a["gate"], weight=a["weight"],
                scale=a["scale"], shift=a["shift"], rstd=rstd, x_dtype=torch.float32)
    cases = [(dict(dout=torch.ones(2, 5)), r"dout \(shape \[2, 5\].*of r's shape \[2, 5, 8\]"),
             (dict(dr=torch.ones(2, 5, 4)), r"dr \(shape \[2, 5, 4\]"),
             (dict(rstd=torch.ones(2)), r"rstd \(shape \[2\].*one per row of r"),
             (dict(y=None), "y is required with a gate"),
             (dict(x_dtype=torch.int64), "x_dtype must be a floating dtype")]
    for change, match in cases:
        with pytest.raises(ValueError, match="residual_rms_norm_modulate_backward: " + match):
            bwd(**{**good, **change})


# ---------------------------------------------------------------------------------------------
# CUDA kernels (csrc/residual_norm_modulate/; skipped without a GPU)


@pytest.fixture(scope="module")
def kernels():
    """The loaded kernel module (its C++ dispatcher kernels registered); a build failure fails.
    Module-scoped: the hypothesis test may not use a function-scoped fixture."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ADAPTIVELOAD_REQUIRE_KERNEL", "1")
        yield extension.kernels()


# One row per (gate layout, modulation): the shape, the scale / shift layouts and the switches cycle
# through the cases, so that every gate layout meets every modulation and each shape and layout
# recurs. D = 8 and 1536: aligned rows; 17, 130, 1003: unaligned (D not a multiple of 8); 5120: two
# chunks a thread (one pass); 12288: four (the two-kernel backward, the kernels' own choice).
_CUDA_SHAPES = [(2, (5,), 8), (1, (7, 3), 130), (3, (64,), 1536), (2, (9,), 17), (1, (33,), 5120),
                (2, (4,), 1003), (1, (3,), 12288)]
_CUDA_CASES = [(gate, modulation) for gate in (None, *LAYOUTS) for modulation in MODULATIONS]


def _cuda_case(i):
    B, tokens, D = _CUDA_SHAPES[i % len(_CUDA_SHAPES)]
    return dict(x_shape=(B, *tokens, D), scale_layout=LAYOUTS[i % len(LAYOUTS)],
                shift_layout=LAYOUTS[(i + 2) % len(LAYOUTS)], affine=i % 3 != 2, with_dr=i % 4 != 3,
                grad_layout=GRAD_LAYOUTS[i % len(GRAD_LAYOUTS)])


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(_CUDA_CASES)))
def test_kernels_match_float64(kernels, norm, dtype, case):
    """Every prologue (plain, each gate layout) x modulation (none, scale, scale+shift) x norm x
    dtype: r, out, the statistics and every gradient against float64 eager, with and without dr."""
    gate_layout, modulation = _CUDA_CASES[case]
    c = _cuda_case(case)
    check_against_float64(norm, c["x_shape"], dtype, gate_layout, modulation, c["scale_layout"], c["shift_layout"],
                          c["affine"], case, c["grad_layout"], c["with_dr"], device="cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("norm", sorted(OPS))
def test_expanded_per_token_gate_and_modulation(device, norm):
    """Gate, scale and shift as ``m.expand(B, *tokens, D)`` of one row a sample: each gradient per token."""
    if device == "cuda" and extension.kernels() is None:
        pytest.skip("the CUDA kernels could not be built")
    check_against_float64(norm, (2, 3, 5, 1536), torch.bfloat16, EXPANDED_PER_TOKEN, "scale+shift",
                          EXPANDED_PER_TOKEN, EXPANDED_PER_TOKEN, True, 8, device=device)


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("dtypes", [
    dict(dtype=torch.bfloat16, mod_dtype=torch.float32),  # Wan: bf16 stream, fp32 modulation
    dict(dtype=torch.float32, y_dtype=torch.bfloat16, mod_dtype=torch.bfloat16),  # autocast: fp32 stream
    dict(dtype=torch.bfloat16, y_dtype=torch.float32, out_dtype=torch.float32),
    dict(dtype=torch.float16, mod_dtype=torch.float32, out_dtype=torch.float32),
], ids=["wan", "autocast", "fp32-branch", "fp16-fp32-out"])
@pytest.mark.parametrize("gate_layout", ["strided-per-sample", "per-token", None])
def test_kernels_mixed_dtypes(kernels, norm, dtypes, gate_layout):
    """x, y, the modulation and out each in its own dtype (each gradient in its input's dtype), at an
    aligned and an unaligned D."""
    for i, x_shape in enumerate([(2, 37, 1536), (1, 5, 130)]):
        check_against_float64(norm, x_shape, gate_layout=gate_layout, modulation="scale+shift",
                              scale_layout="strided-per-sample", shift_layout="per-token", affine=True, seed=i,
                              device="cuda", **dtypes)


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("gate_layout, modulation, scale_layout", [
    ("strided-per-sample", "scale+shift", "strided-per-sample"), ("per-token", "scale+shift", "per-token"),
    ("shared", "scale", "batch1-per-token"), (None, "none", None), ("batch1-per-token", "scale+shift", "shared")])
def test_kernels_two_kernel_backward(kernels, norm, gate_layout, modulation, scale_layout):
    """The backward's two-kernel design (dx, then the column sums recomputing dr_total), forced where
    the kernels would take one pass; D = 12288 takes it on its own in test_kernels_match_float64."""
    with _tuning.override(two_kernel=True):
        for i, x_shape in enumerate([(2, 67, 1536), (3, 9, 17)]):
            check_against_float64(norm, x_shape, torch.bfloat16, gate_layout, modulation, scale_layout, "per-sample",
                                  True, seed=i, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("mod_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_layout, scale_layout, shift_layout", [
    ("strided-per-sample", "per-sample", "shared"), ("shared", "strided-per-sample", "per-sample")])
def test_kernels_16_bit_modulation_gradients_are_the_float32_sums_rounded_once(kernels, norm, mod_dtype,
                                                                            gate_layout, scale_layout, shift_layout):
    """16-bit gate, scale and shift: per-sample ones get their gradient rows written in their own dtype by
    the reduce kernel, a shared one is summed over the batch in float32 first; either way each element
    is the float32 sum the same kernels give float32 modulation of equal values, rounded once (within
    one unit in the last place: the two builds' row tiles may differ)."""
    v = make_inputs(norm, (3, 1560, 1536), mod_dtype, gate_layout, "scale+shift", scale_layout, shift_layout,
                    True, 23, device="cuda")
    names = ("gate", "scale", "shift")
    grads = {}
    for mdt in (mod_dtype, torch.float32):
        w = {k: (t.to(mdt) if k in names else t) for k, t in v.items()}  # (exact: 16-bit values in float32)
        leaves = [w[k].detach().requires_grad_(True) for k in names]
        w.update(zip(names, leaves))
        out = call(norm, w, mod_dtype, mod_dtype)[1]
        gen = torch.Generator(device="cuda").manual_seed(5)
        dout = torch.randn(out.shape, generator=gen, device="cuda").to(mod_dtype)
        grads[mdt] = torch.autograd.grad(out, leaves, dout)
    ulp = torch.finfo(mod_dtype).eps
    for name, got, ref in zip(names, grads[mod_dtype], grads[torch.float32]):
        assert got.dtype == mod_dtype and got.shape == v[name].shape, name
        torch.testing.assert_close(got.float(), ref.to(mod_dtype).float(), rtol=ulp, atol=0, msg=name)


@pytest.mark.cuda
@given(**_SHAPES, **_site_strategies(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_kernels_property(kernels, B, tokens, D, grad_layout, seed, norm, gate_layout, modulation, scale_layout,
                          shift_layout, affine, with_dr, dtype):
    check_against_float64(norm, (B, *tokens, D), dtype, gate_layout, modulation, scale_layout, shift_layout, affine,
                          seed, grad_layout, with_dr, device="cuda")


def _backward_args(norm, v, dout, dr, r, stats):
    norm_args = (v["weight"], v["bias"]) if norm == "layer_norm" else (v["weight"],)
    y = v["y"] if v["gate"] is not None else None
    return (dout, dr, r, y, v["gate"], *norm_args, v["scale"], v["shift"], *stats, v["x"].dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("gate_layout, D", [("strided-per-sample", 1024), ("per-token", 1024), (None, 12288)])
@pytest.mark.parametrize("two_kernel", [False, True])
def test_kernels_backward_is_bit_identical_across_runs(kernels, norm, gate_layout, D, two_kernel):
    """Thousands of rows a sample, so that many blocks add into each column sum: every output of two
    more runs equal to the first, bit for bit (no atomics)."""
    x_shape = (2, 4096 if D < 8192 else 300, D)
    v = make_inputs(norm, x_shape, torch.bfloat16, gate_layout, "scale+shift", "strided-per-sample", "per-sample", True,
                    seed=9, mod_dtype=torch.float32, device="cuda")
    r, out, *stats = call(norm, v, torch.bfloat16, torch.bfloat16)
    dout, dr = torch.randn_like(out), torch.randn_like(r)
    args = _backward_args(norm, v, dout, dr, r, stats)
    with _tuning.override(two_kernel=two_kernel):
        first = BACKWARDS[norm](*args)
        for _ in range(2):
            for a, b in zip(first, BACKWARDS[norm](*args)):
                assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("gate_layout", [None, "strided-per-sample", "per-token"])
@pytest.mark.parametrize("modulation", ["none", "scale+shift"])
def test_kernels_opcheck(kernels, norm, gate_layout, modulation):
    """Both ops on CUDA: schema, autograd registration, fake tensors, AOT dispatch; the backward op's
    outputs contiguous whatever the layout of dout and dr."""
    v = make_inputs(norm, (2, 5, 16), torch.bfloat16, gate_layout, modulation, "strided-per-sample", "per-token",
                    True, seed=3, device="cuda")
    for t in v.values():
        if t is not None:
            (t._base if t._base is not None else t).requires_grad_(True)
    norm_args = (v["weight"], v["bias"]) if norm == "layer_norm" else (v["weight"],)
    args = (v["x"], v["y"], v["gate"], *norm_args, v["scale"], v["shift"], EPS, torch.bfloat16, torch.bfloat16)
    torch.library.opcheck(OPS[norm].default, args, test_utils=OPCHECK_UTILS)
    detached = {k: None if t is None else t.detach() for k, t in v.items()}
    r, out, *stats = call(norm, detached, torch.bfloat16, torch.bfloat16)
    names = ("dx", "dy", "dgate", "dweight", *(("dbias",) if norm == "layer_norm" else ()), "dscale", "dshift")
    for layout in GRAD_LAYOUTS[1:]:
        dout, dr = (lay_out_grad(layout, torch.randn_like(r)) for _ in range(2))
        check_backward_strides(BACKWARDS[norm], _backward_args(norm, detached, dout, dr, r, stats), names)


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_layout, x_shape", [
    ("strided-per-sample", (2, 2048, 1536)),  # many rows a block: the ring wraps around many times
    ("per-token", (1, 5, 1536)),  # fewer rows a block than slots
    (None, (1, 33, 5120)),  # two chunks a thread (under a cap of 512 threads: else the wide kernel)
    (None, (2, 257, 1536)),  # no gate, one chunk: the staged instance with the gate compiled out
])
def test_kernels_row_staging_matches_loads_at_use(kernels, norm, dtype, gate_layout, x_shape):
    """The per-thread staging ring (forward: x, y; backward: r, dout, dr, y) at 2, 3 and 8 slots and
    the kernels' own choice gives r, out, the statistics, dx and dy bit for bit as loading each row at
    use (stages 0), which test_kernels_match_float64 checks against float64 (here too, at 2 slots).
    The column sums (dgate, dweight, dbias, dscale, dshift) add the same terms in tiles that depend
    on the occupancy, which the ring's shared memory changes: equal to within their rounding. At
    D = 5120 the staged backward would otherwise take the wide one-chunk kernel (640 threads, its row
    sums added in another order than the 320 threads of loads at use: test_kernels_wide_backward)."""
    cap = 512 if x_shape[-1] == 5120 else "auto"
    v = make_inputs(norm, x_shape, dtype, gate_layout, "scale+shift", "strided-per-sample", "per-token", True,
                    seed=4, mod_dtype=torch.float32, device="cuda")
    dout, dr = (torch.randn(x_shape, device="cuda").to(dtype) for _ in range(2))
    n_rows = 6 if norm == "layer_norm" else 5  # r, out, [mean,] rstd, dx, dy: the per-row outputs

    def run():
        r, out, *stats = call(norm, v, dtype, dtype)
        return [r, out, *stats, *BACKWARDS[norm](*_backward_args(norm, v, dout, dr, r, stats))]

    with _tuning.override(fwd_stages=0, bwd_stages=0, max_threads=cap):
        base = run()
    for stages in (2, 3, 8, "auto"):
        with _tuning.override(fwd_stages=stages, bwd_stages=stages, max_threads=cap):
            got = run()
        for i, (a, b) in enumerate(zip(base, got)):
            if i < n_rows:
                assert torch.equal(a, b), f"stages {stages}: output {i} differs from loads at use"
            elif a.numel():
                assert_rel(b, a, 1e-2 if a.dtype == torch.bfloat16 else 1e-5, f"stages {stages}: output {i}")
    with _tuning.override(fwd_stages=2, bwd_stages=2):
        check_against_float64(norm, (2, 37, 1536), dtype, gate_layout, "scale+shift", "strided-per-sample",
                              "per-token", True, seed=5, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_layout, modulation, D", [
    ("strided-per-sample", "scale+shift", 5120),  # Wan 14B's gated site: the dgate column plane
    (None, "none", 5120),  # a plain residual, affine norm
    ("shared", "scale", 4104),  # 513 groups of 8: 544 threads, the last warp's columns partly past D
])
def test_kernels_wide_backward(kernels, norm, dtype, gate_layout, modulation, D):
    """Rows of more than 512 and at most 640 groups of 8 elements: the staged backward takes one chunk a
    thread on up to 640 threads (res_bwd_wide_kernel) instead of two on 320. Every output against
    float64; bit-identical across runs with many blocks a column; and against the two-chunk kernel (a
    cap of 512 threads), whose row sums add in another order: within rounding, and not bit for bit
    in float32 (so the wide kernel is the one that ran)."""
    check_against_float64(norm, (2, 37, D), dtype, gate_layout, modulation, "strided-per-sample", "per-sample", True,
                          seed=11, device="cuda")
    x_shape = (1, 2048, D)
    v = make_inputs(norm, x_shape, dtype, gate_layout, modulation, "strided-per-sample", "per-sample", True, seed=12,
                    mod_dtype=torch.float32, device="cuda")
    r, out, *stats = call(norm, v, dtype, dtype)
    gen = torch.Generator().manual_seed(13)
    dout, dr = (torch.randn(x_shape, generator=gen).to(dtype).cuda() for _ in range(2))
    args = _backward_args(norm, v, dout, dr, r, stats)
    first = BACKWARDS[norm](*args)
    for a, b in zip(first, BACKWARDS[norm](*args)):
        assert torch.equal(a, b)
    with _tuning.override(max_threads=512):
        capped = BACKWARDS[norm](*args)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for i, (a, b) in enumerate(zip(first, capped)):
        if a is not None and a.numel():
            assert_rel(a, b, tol, f"output {i} against the two-chunk kernel")
    if dtype == torch.float32:
        assert not torch.equal(first[0], capped[0]), "dx bit for bit as the two-chunk kernel: the wide kernel did not run"


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_layout, scale_layout, shift_layout, x_shape", [
    ("per-token", "per-sample", "per-sample", (2, 300, 1536)),  # the gate only (bench_residual's per-token-gate)
    ("strided-per-token", "strided-per-token", "strided-per-token", (1, 77, 3072)),  # all three, chunk views
    ("per-token", "per-token", "per-sample", (2, 5, 1536)),  # a per-sample shift beside a per-token scale
    ("per-sample", "per-sample", "strided-per-token", (1, 40, 5120)),  # two chunks a thread (never more)
    ("per-token", "per-sample", "per-sample", (2, 50, 1024)),  # one chunk a thread (under 192 groups of 8)
])
def test_kernels_per_token_rows_of_r_dtype_through_the_forward_ring(kernels, norm, dtype, gate_layout, scale_layout,
                                                                     shift_layout, x_shape):
    """Per-token gate, scale and shift rows in r's dtype come through the forward's staging ring with x
    and y (res_fwd_staged_rows): r, out and the statistics bit for bit as loading those rows at use
    (stages 0) at 2, 3, 8 slots and the kernels' own choice, and against float64 at the own choice."""
    v = make_inputs(norm, x_shape, dtype, gate_layout, "scale+shift", scale_layout, shift_layout, True, seed=6,
                    device="cuda")
    with _tuning.override(fwd_stages=0):
        base = call(norm, v, dtype, dtype)
    for stages in (2, 3, 8, "auto"):
        with _tuning.override(fwd_stages=stages):
            got = call(norm, v, dtype, dtype)
        for i, (a, b) in enumerate(zip(base, got)):
            if a is not None and a.numel():
                assert torch.equal(a, b), f"stages {stages}: forward output {i} differs from loads at use"
    check_against_float64(norm, x_shape, dtype, gate_layout, "scale+shift", scale_layout, shift_layout, True, seed=6,
                          device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_layout, x_shape, cap", [
    ("per-token", (2, 300, 1536), "auto"),  # one chunk a thread (bench_residual's per-token-gate at D = 1536)
    ("strided-per-token", (1, 77, 3072), "auto"),  # a .chunk() view, two chunks a thread
    ("per-token", (1, 40, 5120), 512),  # two chunks a thread under a cap
    ("per-token", (1, 40, 5120), "auto"),  # the wide one-chunk kernel, 640 threads
])
def test_kernels_per_token_gate_of_r_dtype_through_the_backward_ring(kernels, norm, dtype, gate_layout, x_shape, cap):
    """A per-token gate in r's dtype comes through the backward's staging ring with r, dout, dr and y
    (res_bwd_extra_rows; its own kernel instances): dx, dy and the per-element dgate bit for bit at 2,
    3 and 8 slots and the kernels' own choice, as loading every row at use (stages 0) where that runs the
    same kernel shape (not the wide kernel, whose unstaged fallback is the two-chunk one: there against
    2 slots), the column sums within rounding; and every gradient against float64."""
    v = make_inputs(norm, x_shape, dtype, gate_layout, "scale+shift", "strided-per-sample", "per-sample", True, seed=7,
                    device="cuda")
    assert v["gate"].dtype == dtype and v["gate"].stride()[-2] != 0  # (a per-token gate of r's dtype)
    gen = torch.Generator().manual_seed(8)
    dout, dr = (torch.randn(x_shape, generator=gen).to(dtype).cuda() for _ in range(2))
    r, out, *stats = call(norm, v, dtype, dtype)
    args = _backward_args(norm, v, dout, dr, r, stats)
    wide = x_shape[-1] == 5120 and cap == "auto"
    with _tuning.override(bwd_stages=2 if wide else 0, max_threads=cap):
        base = BACKWARDS[norm](*args)
    for stages in (2, 3, 8, "auto"):
        with _tuning.override(bwd_stages=stages, max_threads=cap):
            got = BACKWARDS[norm](*args)
        for i, (a, b) in enumerate(zip(base, got)):
            if i < 3:  # dx, dy, dgate: per element
                assert torch.equal(a, b), f"stages {stages}: backward output {i} differs from {'2 slots' if wide else 'loads at use'}"
            elif a is not None and a.numel():
                assert_rel(b, a, 1e-2, f"stages {stages}: output {i}")
    with _tuning.override(max_threads=cap):
        check_against_float64(norm, x_shape, dtype, gate_layout, "scale+shift", "strided-per-sample", "per-sample", True,
                              seed=7, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_layout, modulation, x_shape, cap, instance", [
    ("per-token", "scale+shift", (2, 300, 1536), "auto", 1),  # bench_residual's per-token-all: one chunk
    ("strided-per-token", "scale+shift", (1, 77, 3072), 192, 1),  # .chunk() views, two chunks a thread
    (None, "scale+shift", (1, 40, 5120), "auto", 1),  # a per-token scale without a gate: two chunks
    ("per-token", "scale", (2, 60, 2048), "auto", 1),
    ("per-token", "none", (2, 60, 2048), "auto", 1),  # a per-token gate into a plain norm
    (None, "none", (2, 100, 1536), "auto", 2),  # a plain residual into a plain norm: the None instance
])
def test_kernels_backward_without_column_sums_through_the_ring(kernels, norm, dtype, gate_layout, modulation, x_shape,
                                                               cap, instance):
    """A backward with no column sum to form (a norm without weight or bias, every modulation per token
    or absent: Wan 2.2's per-token timesteps) stages its rows, and the per-token gate and scale rows of
    r's dtype, through the ring (res_bwd_stageable; the Staged or None instance the profiler records):
    every gradient bit for bit at 2, 3 and 8 slots and the kernels' own choice as loading every row at use
    (stages 0), and against float64."""
    v = make_inputs(norm, x_shape, dtype, gate_layout, modulation, "per-token", "per-token", False, seed=17,
                    device="cuda")
    gen = torch.Generator().manual_seed(18)
    dout, dr = (torch.randn(x_shape, generator=gen).to(dtype).cuda() for _ in range(2))
    r, out, *stats = call(norm, v, dtype, dtype)
    args = _backward_args(norm, v, dout, dr, r, stats)
    with _tuning.override(max_threads=cap):
        names = _kernel_launches(lambda: BACKWARDS[norm](*args), "res_bwd_row_kernel")
    assert len(names) == 1 and re.search(rf"true, false, \((adaln::)?ResBwdGate\){instance}>", names[0]), names
    with _tuning.override(bwd_stages=0, max_threads=cap):
        base = BACKWARDS[norm](*args)
    for stages in (2, 3, 8, "auto"):
        with _tuning.override(bwd_stages=stages, max_threads=cap):
            got = BACKWARDS[norm](*args)
        for i, (a, b) in enumerate(zip(base, got)):
            if a is not None and a.numel():
                assert torch.equal(a, b), f"stages {stages}: backward output {i} differs from loads at use"
    with _tuning.override(max_threads=cap):
        check_against_float64(norm, x_shape, dtype, gate_layout, modulation, "per-token", "per-token", False, seed=17,
                              device="cuda")


def _kernel_launches(fn, name):
    """The demangled names of the CUDA kernels whose name contains ``name`` that ``fn()`` launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if name in e.name]


@pytest.mark.cuda
@pytest.mark.parametrize("norm", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("site, D, cap, chunks", [
    ("per-token", 1536, 96, 2),  # the per-token forward: two chunks of 96 threads (res_fwd_per_token_shape)
    ("per-token", 3072, 192, 2),
    ("per-token", 1024, 128, 1),  # under 192 groups of 8: one chunk
    ("per-token-all", 4096, 512, 1),  # gate, scale and shift per token: two chunks would keep fewer warps a SM
    ("plain", 1536, 192, 1),  # a plain residual's backward: the gate's None instance, one chunk
    ("plain", 3072, 192, 2),  # two chunks of 192 threads (res_bwd_plain_cap)
    ("plain", 4096, 256, 2),
])
def test_kernels_automatic_shape(kernels, norm, dtype, site, D, cap, chunks):
    """The kernels' own shape where it is not res_row_shape's one chunk of up to 512 threads, or where it
    depends on the row's tensors: the kernel the profiler records has the expected chunks a thread (and,
    for a plain residual's backward, the instance with the gate compiled out); every output bit for bit
    as the same shape forced through the private override; and against float64."""
    gate = None if site == "plain" else "per-token"
    modulation = "none" if site == "plain" else "scale+shift"
    layout = "per-token" if site == "per-token-all" else "per-sample"
    x_shape = (2, 300, D)
    v = make_inputs(norm, x_shape, dtype, gate, modulation, layout, layout, True, seed=14, device="cuda")
    r, out, *stats = call(norm, v, dtype, dtype)
    gen = torch.Generator().manual_seed(15)
    dout, dr = (torch.randn(x_shape, generator=gen).to(dtype).cuda() for _ in range(2))
    args = _backward_args(norm, v, dout, dr, r, stats)
    forward = site != "plain"
    run = (lambda: call(norm, v, dtype, dtype)) if forward else (lambda: BACKWARDS[norm](*args))
    kernel = "res_fwd_kernel" if forward else "res_bwd_row_kernel"
    names = _kernel_launches(run, kernel)
    assert len(names) == 1, names
    assert re.search(kernel + r"<[^,]+, [^,]+, (\d+),", names[0]).group(1) == str(chunks), names[0]
    if not forward:
        assert "ResBwdGate)2>" in names[0], f"not the instance without the gate: {names[0]}"
    auto = run()
    with _tuning.override(max_threads=cap):
        forced = run()
    for i, (a, b) in enumerate(zip(auto, forced)):
        if a is not None and a.numel():
            assert torch.equal(a, b), f"output {i}: the automatic shape differs from max_threads={cap}"
    check_against_float64(norm, (2, 37, D), dtype, gate, modulation, layout, layout, True, seed=16, device="cuda")


@pytest.mark.cuda
def test_kernels_hand_bad_inputs_and_float64_to_the_python_path(kernels):
    """Through the C++ dispatcher kernels: a bad input raises the Python path's ValueError naming the
    tensor; float64 runs the reference (float64 statistics); the kernels still run afterwards."""
    v = make_inputs("layer_norm", (2, 5, 8), torch.bfloat16, "per-sample", "scale+shift", "per-sample", "per-sample",
                    True, seed=0, device="cuda")
    op = OPS["layer_norm"]
    with pytest.raises(ValueError, match=r"residual_adaln_modulate: gate \(shape \[3, 1, 8\]"):
        op(v["x"], v["y"], torch.ones(3, 1, 8, device="cuda"), None, None, v["scale"], None, EPS, torch.bfloat16,
           torch.bfloat16)
    with pytest.raises(ValueError, match="shift is given without scale"):
        op(v["x"], v["y"], None, None, None, None, v["shift"], EPS, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"y \(shape \[2, 5, 8\], dtype torch.bfloat16\) is on cpu"):
        op(v["x"], v["y"].cpu(), None, None, None, None, None, EPS, torch.bfloat16, torch.bfloat16)
    r, out, mean, rstd = op(v["x"].double(), v["y"].double(), None, None, None, None, None, EPS, torch.float64,
                            torch.float64)
    assert mean.dtype == torch.float64
    assert_rel(out, F.layer_norm(v["x"].double() + v["y"].double(), (8,), eps=EPS), 1e-12, "out")
    check_against_float64("layer_norm", (2, 5, 8), torch.bfloat16, "per-sample", "scale+shift", "per-sample",
                          "per-sample", True, seed=1, device="cuda")


@pytest.mark.cuda
def test_kernels_autograd_on_cuda(kernels):
    """The C++ AutogradCUDA kernel: a plain residual's dr_total reaches x and y (y in its own dtype)
    and equals float64 eager's; no double backward."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, 64, generator=gen).to("cuda").requires_grad_()
    y = torch.randn(2, 16, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    scale = torch.randn(2, 1, 64, generator=gen).to("cuda")
    r, out, *_ = OPS["rms_norm"](x, y, None, None, scale, None, EPS, torch.float32, torch.float32)
    dx, dy = torch.autograd.grad((r * 3 + out.square()).sum(), (x, y))
    assert dy.dtype == torch.bfloat16
    torch.testing.assert_close(dy, dx.to(torch.bfloat16), rtol=0, atol=0)
    x_ref = x.detach().double().requires_grad_()
    r_ref, out_ref = eager_site("rms_norm", x_ref, y.detach().double(), None, None, None, scale.double(), None)
    (dx_ref,) = torch.autograd.grad((r_ref * 3 + out_ref.square()).sum(), x_ref)
    assert_rel(dx, dx_ref, 2 * TOL[torch.float32], "dx")
    r, out, *_ = OPS["rms_norm"](x, y, None, None, scale, None, EPS, torch.float32, torch.float32)
    (dx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        dx.sum().backward()


def test_cuda_paths_registered_and_the_patterns_read_fused_devices():
    """The four CUDA paths are handed to the kernel module's dispatcher kernels when it loads, and the
    FX patterns read FUSED_DEVICES itself: adding "cuda" there is the one change that fuses CUDA sites."""
    from adaptiveload.fxfuse import registry

    registry.patterns()  # the built-in patterns registered in their order before the module is imported here
    from adaptiveload.ops.residual_norm_modulate.pattern import LAYER_NORM_PATTERN, RMS_NORM_PATTERN

    assert LAYER_NORM_PATTERN.devices is RMS_NORM_PATTERN.devices is residual_op.FUSED_DEVICES
    assert extension.CUDA_PATHS["residual_adaln_modulate"] is residual_op._residual_adaln_modulate_cuda
    assert (extension.CUDA_PATHS["residual_rms_norm_modulate_backward"]
            is residual_op._residual_rms_norm_modulate_backward_cuda)


@pytest.mark.parametrize("kwargs, words", [
    (_bad(y=torch.randn(2, 1, 8)), ["y (shape [2, 1, 8]", "the shape of x [2, 5, 8]"]),
    (_bad(gate=torch.randn(3, 1, 8)), ["gate (shape [3, 1, 8]", "not a supported modulation layout"]),
    (_bad(scale=None), ["shift is given without scale"]),
    (_bad(r_dtype=torch.int32), ["r_dtype must be a floating dtype"]),
])
def test_the_cuda_path_validates_before_any_kernel(kwargs, words):
    """The Python CUDA path (the first CUDA call, and the calls the C++ kernels hand back) raises the
    ValueError naming the tensor before it reaches the kernels (CPU tensors: no GPU needed)."""
    a = kwargs
    with pytest.raises(ValueError) as err:
        residual_op._residual_adaln_modulate_cuda(a["x"], a["y"], a["gate"], a["weight"], a["bias"], a["scale"],
                                                  a["shift"], EPS, a["r_dtype"], torch.float32)
    assert str(err.value).startswith("residual_adaln_modulate: ")
    for word in words:
        assert word in str(err.value)
    r = torch.ones(2, 5, 8)
    with pytest.raises(ValueError, match=r"residual_rms_norm_modulate_backward: rstd \(shape \[2\]"):
        residual_op._residual_rms_norm_modulate_backward_cuda(r, None, r, None, None, None, None, None, torch.ones(2),
                                                              torch.float32)
