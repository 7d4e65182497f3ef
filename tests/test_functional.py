"""Tests of ``adaptiveload.functional``: y and every gradient (x, scale, shift, weight, bias) against a
float64 eager reference (``F.layer_norm`` / a hand-written RMS norm, then the modulation) over shapes,
modulation layouts and dtypes, the bound in float32/bfloat16/float16 being a small multiple of the
error of the same chain run eagerly in that dtype; gradcheck in float64; bad inputs; the docstring
examples of it and of ``adaptiveload.nn`` (run as doctests)."""
from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import adaptiveload
from adaptiveload import functional
from adaptiveload.ops.testing import LAYOUTS, TOL, make_mod, rel_err

EPS = 1e-6
# The fused result's relative error vs float64 (y and each gradient) may be at most K times that of
# the eager chain run in the same dtype, or FLOOR where the eager chain is (nearly) exact (D = 1, a
# gradient that is one sum in both). float64: the eager chain is the reference itself, so FLOOR alone.
# Measured over 1200 random cases: fused / eager at most 1.0 in bfloat16 and float16 (often ~0.6: y
# and the sums are rounded once), 4.3 in float32 (dx at D = 3); float64 at most 1.7e-11 (dweight at
# D = 1, rstd = eps^-1/2 amplifying the rounding).
_U = {dtype: torch.finfo(dtype).eps / 2 for dtype in (torch.float32, torch.bfloat16, torch.float16)}
K = {torch.float64: 0.0, torch.float32: 8.0, torch.bfloat16: 1.5, torch.float16: 1.5}
FLOOR = {torch.float64: TOL[torch.float64], torch.float32: 4 * _U[torch.float32],
         torch.bfloat16: _U[torch.bfloat16] / 4, torch.float16: _U[torch.float16] / 4}
KINDS = ("adaln", "rms")


def eager_chain(kind, x, scale, shift=None, weight=None, bias=None):
    """The unfused chain as a user writes it, in the inputs' dtype: ``F.layer_norm`` (adaln) or
    ``x * rsqrt(mean(x^2) + eps) * weight`` (rms), then ``* (1 + scale) [+ shift]``."""
    if kind == "adaln":
        n = F.layer_norm(x, (x.shape[-1],), weight, bias, EPS)
    else:
        n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
        n = n if weight is None else n * weight
    y = n * (1 + scale)
    return y if shift is None else y + shift


def fused(kind, x, scale, shift=None, weight=None, bias=None, eps=EPS):
    if kind == "adaln":
        return functional.adaln_modulate(x, scale, shift, weight=weight, bias=bias, eps=eps)
    return functional.rms_norm_modulate(x, scale, shift, weight=weight, eps=eps)


def _leaf_and_view(t, dtype):
    """A leaf copy of ``t`` (of its base, for a view) in ``dtype`` that requires grad, and ``t``'s
    view of it (a .chunk() of an embedding stays that strided view)."""
    base = t if t._base is None else t._base
    leaf = base.detach().to(dtype).requires_grad_(True)
    return leaf, (leaf if t._base is None else leaf.as_strided(t.shape, t.stride(), t.storage_offset()))


def forward_backward(fn, kind, inputs, dtype, dy):
    """``fn(kind, **inputs)`` on copies of the inputs in ``dtype``; returns y and the gradient of every
    input (of its leaf) by name, for the incoming gradient ``dy``."""
    given_ = {n: t for n, t in inputs.items() if t is not None}
    pairs = {n: _leaf_and_view(t, dtype) for n, t in given_.items()}
    y = fn(kind, **{n: view for n, (_, view) in pairs.items()})
    grads = torch.autograd.grad(y, [leaf for leaf, _ in pairs.values()], dy.to(dtype))
    return y, dict(zip(pairs, grads))


def make_inputs(kind, x_shape, scale_layout, shift_layout, affine, seed, dtype=torch.float64):
    """Inputs in ``dtype``: x of mean 0.3 and std 2, modulation of std 0.5 in the given layouts
    (strided ones views of a larger tensor), affine parameters around 1 / 0 (AdaLN gets a bias, RMS
    norm none), and an incoming gradient dy of x's shape."""
    gen = torch.Generator().manual_seed(seed)
    D = x_shape[-1]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = (randn(*x_shape) * 2 + 0.3).to(dtype)
    weight = (1 + 0.3 * randn(D)).to(dtype) if affine else None
    bias = (0.3 * randn(D)).to(dtype) if affine and kind == "adaln" else None
    scale = make_mod(scale_layout, x_shape, dtype, "cpu", gen)
    shift = None if shift_layout is None else make_mod(shift_layout, x_shape, dtype, "cpu", gen)
    return dict(x=x, scale=scale, shift=shift, weight=weight, bias=bias), randn(*x_shape).to(dtype)


def errors(kind, inputs, dy):
    """``{output: (fused error, eager error)}``: relative errors vs float64 eager (on the same values,
    upcast) of y and of every gradient, for inputs and dy all of one dtype; the fused outputs checked
    for x's shape and dtype (y) and each input's own (gradients)."""
    dtype = dy.dtype
    ref_y, ref_grads = forward_backward(eager_chain, kind, inputs, torch.float64, dy)
    y, grads = forward_backward(fused, kind, inputs, dtype, dy)
    eager_y, eager_grads = forward_backward(eager_chain, kind, inputs, dtype, dy)
    assert y.shape == inputs["x"].shape and y.dtype == dtype
    out = {"y": (rel_err(y, ref_y), rel_err(eager_y, ref_y))}
    for name, g in grads.items():
        leaf = ref_grads[name]
        assert g.shape == leaf.shape and g.dtype == dtype, f"d{name}: {g.shape}/{g.dtype} vs {leaf.shape}"
        out[f"d{name}"] = (rel_err(g, leaf), rel_err(eager_grads[name], leaf))
    return out


def assert_as_accurate_as_eager(kind, inputs, dy):
    dtype = dy.dtype
    for what, (err, eager_err) in errors(kind, inputs, dy).items():
        bound = max(K[dtype] * eager_err, FLOOR[dtype])
        assert err <= bound, (f"{kind} {dtype} {what}: rel err {err:.3e} > {bound:.3e} "
                              f"(eager in {dtype}: {eager_err:.3e})")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["per-sample", "per-token", "shared", "strided-per-sample"])
def test_y_and_gradients_match_float64_across_layouts(kind, dtype, layout):
    inputs, dy = make_inputs(kind, (2, 24, 64), layout, layout, True, 1, dtype)
    assert_as_accurate_as_eager(kind, inputs, dy)


@given(kind=st.sampled_from(KINDS), B=st.integers(1, 3), tokens=st.sampled_from([(1,), (5,), (2, 3), (16,)]),
       D=st.sampled_from([1, 3, 8, 40, 130]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       scale_layout=st.sampled_from(LAYOUTS), shift_layout=st.one_of(st.none(), st.sampled_from(LAYOUTS)),
       affine=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_float64_over_shapes_and_layouts(kind, B, tokens, D, dtype, scale_layout, shift_layout, affine, seed):
    inputs, dy = make_inputs(kind, (B, *tokens, D), scale_layout, shift_layout, affine, seed, dtype)
    assert_as_accurate_as_eager(kind, inputs, dy)


def test_two_dim_x_per_sample_modulation():
    """x [B, D] with scale [B, D] is per-sample (one row per sample), not shared."""
    inputs, dy = make_inputs("adaln", (3, 16), "per-sample", "shared", True, 2, torch.float32)
    assert inputs["scale"].shape == (3, 16)
    assert_as_accurate_as_eager("adaln", inputs, dy)
    assert_as_accurate_as_eager("rms", {**inputs, "bias": None}, dy)


def test_hand_computed_values():
    """One row: x = [1, 3], LayerNorm -> [-1, 1] (var 1, eps 0 aside), RMS -> x / sqrt(5);
    scale = [1, 0], shift = [0, 2], weight = [2, 1], bias = [1, 0]."""
    x = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    scale, shift = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 2.0], dtype=torch.float64)
    w, b = torch.tensor([2.0, 1.0], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)
    r = 1 / (1 + EPS) ** 0.5
    y = functional.adaln_modulate(x, scale, shift, weight=w, bias=b)
    torch.testing.assert_close(y, torch.tensor([[(-2 * r + 1) * 2, r + 2]], dtype=torch.float64), rtol=1e-14, atol=0)
    r = 1 / (5 + EPS) ** 0.5
    y = functional.rms_norm_modulate(x, scale, shift, weight=w)
    torch.testing.assert_close(y, torch.tensor([[4 * r, 3 * r + 2]], dtype=torch.float64), rtol=1e-14, atol=0)
    y = functional.rms_norm_modulate(x, scale)  # weightless, scale-only
    torch.testing.assert_close(y, torch.tensor([[2 * r, 3 * r]], dtype=torch.float64), rtol=1e-14, atol=0)


def test_eps_is_passed_to_the_op():
    """x = [0, 2]: LayerNorm gives [-1, 1] / sqrt(1 + eps), so eps = 3 halves it; RMS norm
    x / sqrt(2 + eps), so eps = 2 gives [0, 1]."""
    x, zero = torch.tensor([[0.0, 2.0]], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    torch.testing.assert_close(functional.adaln_modulate(x, zero, eps=3.0),
                               torch.tensor([[-0.5, 0.5]], dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(functional.rms_norm_modulate(x, zero, eps=2.0),
                               torch.tensor([[0.0, 1.0]], dtype=torch.float64), rtol=1e-14, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale_layout, shift_layout", [("per-sample", "per-token"), ("strided-per-token", "shared")])
def test_gradcheck_float64(kind, scale_layout, shift_layout):
    inputs, _ = make_inputs(kind, (2, 3, 5), scale_layout, shift_layout, True, 3)
    names = [n for n, t in inputs.items() if t is not None]
    pairs = [_leaf_and_view(inputs[n], torch.float64) for n in names]

    def fn(*leaves):
        views = [leaf if t._base is None else leaf.as_strided(t.shape, t.stride(), t.storage_offset())
                 for leaf, t in zip(leaves, (inputs[n] for n in names))]
        return fused(kind, **dict(zip(names, views)))

    assert torch.autograd.gradcheck(fn, [leaf for leaf, _ in pairs], eps=1e-6, atol=1e-8, rtol=1e-6)


def test_compiles_without_graph_breaks():
    """Under torch.compile the functional API traces as the op (fullgraph: no graph break)."""
    inputs, _ = make_inputs("adaln", (2, 4, 8), "per-sample", "per-token", True, 4)
    compiled = torch.compile(lambda x, s, t, w, b: functional.adaln_modulate(x, s, t, weight=w, bias=b)
                             + functional.rms_norm_modulate(x, s, weight=w), backend="eager", fullgraph=True)
    x, s, t, w, b = (inputs[n] for n in ("x", "scale", "shift", "weight", "bias"))
    ref = eager_chain("adaln", x, s, t, w, b) + eager_chain("rms", x, s, weight=w)  # float64
    assert rel_err(compiled(*(a.float() for a in (x, s, t, w, b))), ref) <= 1e-6


# ---------------------------------------------------------------------------------------------
# Bad inputs


def _good():
    return dict(x=torch.randn(2, 5, 8), scale=torch.randn(2, 1, 8), shift=None, weight=None, bias=None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(scale=torch.randn(2, 1, 7)), r"scale \(shape \[2, 1, 7\].* does not broadcast over x of shape \[2, 5"),
        (dict(scale=torch.randn(2, 1, 1)),  # broadcasts in PyTorch, but one value for all features
         r"scale \(shape \[2, 1, 1\].*has one value for all 8 features of x of shape \[2, 5, 8\]: a modulation has one "
         r"per feature \(D = 8\); expected \[B, 1, \.\.\., 1, D\]"),
        (dict(scale=torch.randn(1, 2, 1, 8)),
         r"scale \(shape \[1, 2, 1, 8\].*has more dims than x of shape \[2, 5, 8\]"),
        (dict(scale=torch.randn(3, 1, 8)), r"scale \(shape \[3, 1, 8\].*\(its batch 3 is neither 1 nor x's batch 2\): expected \[B, 1, \.\.\., 1, D\]"),
        (dict(scale=torch.randn(2, 8)),
         r"scale \(shape \[2, 8\].*not a supported modulation layout.*\[D\] \(shared\); rows of a pack, one a sample "
         r"\(\[n, D\]\), take segment_ids="),
        (dict(shift=torch.randn(2, 4, 8)), r"shift \(shape \[2, 4, 8\]"),
        (dict(x=torch.randn(2, 5, 9)), r"scale \(shape \[2, 1, 8\].*x of shape \[2, 5, 9\]"),  # wrong D
        (dict(weight=torch.ones(9)), r"weight \(shape \[9\].*must have shape \[8\]"),
        (dict(scale=None, shift=torch.randn(8)), r"scale is required"),  # shift without scale
        (dict(shift=torch.randn(8, device="meta")), r"shift \(shape \[8\].*is on meta but x is on cpu"),
        (dict(x=torch.randn(8), scale=torch.randn(8)), r"x \(shape \[8\].*at least 2 dims"),
        (dict(x=torch.ones(2, 5, 8, dtype=torch.int64)), r"x \(shape \[2, 5, 8\], dtype torch.int64\) must be float"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_tensor(kind, bad, match):
    args = {**_good(), **bad}
    if kind == "rms":
        args.pop("bias")
    with pytest.raises(ValueError, match=match):
        fused(kind, **args)


@pytest.mark.parametrize("kind", KINDS)
def test_x_not_a_tensor_raises_type_error(kind):
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        fused(kind, [[1.0, 2.0]], torch.zeros(2))


@pytest.mark.parametrize("kind", KINDS)
def test_bad_eps_raises(kind):
    good = _good()
    with pytest.raises(ValueError, match="eps must be a non-negative number, got -1.0"):
        fused(kind, good["x"], good["scale"], eps=-1.0)


# ---------------------------------------------------------------------------------------------
# Namespaces and docstrings


def test_package_exports():
    assert adaptiveload.functional is functional
    assert {"functional", "nn", "ops"} <= set(adaptiveload.__all__)
    assert adaptiveload.nn.AdaLNModulate.__module__ == "adaptiveload.nn"
    assert not hasattr(adaptiveload.ops, "AdaLNModulate")  # ops stays the raw-op namespace


@pytest.mark.parametrize("module", [functional, adaptiveload.nn], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 8, f"{module.__name__}: {result.attempted} examples"
    assert result.failed == 0

