"""``adaptiveload::rms_norm_rope`` against an independent float64 reference: diffusers' Wan attention
code written out (``F.rms_norm``, ``unflatten`` into heads, ``apply_rotary_emb`` with ``empty_like`` and
strided stores), forward and every gradient (x, weight, cos, sin); float64 gradcheck; hand-computed
cases; the four opcheck utilities; bad inputs named in the error."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import adaptiveload  # noqa: F401  (registers torch.ops.adaptiveload.*)
from adaptiveload.ops.rms_norm_rope import rms_norm_rope, rms_norm_rope_backward
from adaptiveload.ops.testing import GRAD_LAYOUTS, OPCHECK_UTILS, TOL, check_op_against_float64, lay_out_grad

EPS = 1e-6


def wan_chain(x, weight, freqs_cos, freqs_sin, heads, eps=EPS):
    """diffusers 0.42.1 ``WanAttnProcessor``: norm_q, the head split and its ``apply_rotary_emb``."""
    n = F.rms_norm(x, x.shape[-1:], weight, eps).unflatten(-1, (heads, -1))
    x1, x2 = n.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(n)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(n)


def tables(rows, head_dim, layout, dtype, gen):
    """freqs_cos, freqs_sin [.., head_dim] (diffusers' layout: each pair's angle at both of its
    positions) broadcasting over x's rows ``rows`` and the heads, in one of the layouts a model
    passes: "positions" [1, S, 1, head_dim] (Wan), "rows" [*rows, 1, head_dim], "shared" [head_dim]."""
    half = head_dim // 2
    if layout == "positions":
        shape = (1, *rows[1:], 1, half)
    elif layout == "rows":
        shape = (*rows, 1, half)
    else:
        shape = (half,)
    angles = (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 * math.pi).repeat_interleave(2, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def inputs(rows, heads, head_dim, dtype, layout, affine, seed):
    gen = torch.Generator().manual_seed(seed)
    D = heads * head_dim
    x = (2 * torch.randn(*rows, D, generator=gen, dtype=torch.float64) + 0.3).to(dtype)
    weight = (1 + 0.3 * torch.randn(D, generator=gen, dtype=torch.float64)).to(dtype) if affine else None
    freqs_cos, freqs_sin = tables(rows, head_dim, layout, dtype, gen)
    return x, weight, freqs_cos, freqs_sin, gen


def check(rows, heads, head_dim, dtype, layout, affine, seed, grad_layout="contiguous"):
    x, weight, freqs_cos, freqs_sin, gen = inputs(rows, heads, head_dim, dtype, layout, affine, seed)
    # cos and sin as the op receives them: strided views of the tables (no copy)
    named = {"x": x, "weight": weight, "cos": freqs_cos[..., 0::2], "sin": freqs_sin[..., 1::2]}
    dy = lay_out_grad(grad_layout, torch.randn(*rows, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype))

    def op_fn(v):
        y, rstd = rms_norm_rope(v["x"], v.get("weight"), v["cos"], v["sin"], heads, EPS, dtype)
        assert y.dtype == dtype and y.shape == (*rows, heads, head_dim) and y.is_contiguous()
        assert rstd.shape == tuple(rows)
        return y, rstd

    def ref_fn(v):  # the chain on the float64 tables: cos / sin are their even / odd positions
        c, s = v["cos"], v["sin"]
        return wan_chain(v["x"], v.get("weight"), c.repeat_interleave(2, -1), s.repeat_interleave(2, -1), heads)

    outputs, ref = check_op_against_float64(named, op_fn, ref_fn, dy, TOL[dtype])
    rstd_ref = (ref["x"].square().mean(-1) + EPS).rsqrt()
    torch.testing.assert_close(outputs[1].double(), rstd_ref, rtol=TOL[dtype], atol=0)


@given(rows=st.sampled_from([(1, 1), (2, 5), (3, 7), (2, 2, 3)]), heads=st.integers(1, 4),
       head_dim=st.sampled_from([2, 4, 8, 16]), layout=st.sampled_from(["positions", "rows", "shared"]),
       affine=st.booleans(), grad_layout=st.sampled_from(GRAD_LAYOUTS), seed=st.integers(0, 2**16))
def test_matches_the_wan_chain_in_float64(rows, heads, head_dim, layout, affine, grad_layout, seed):
    check(rows, heads, head_dim, torch.float64, layout, affine, seed, grad_layout)


@given(rows=st.sampled_from([(1, 3), (2, 5), (2, 16)]), heads=st.integers(1, 3),
       head_dim=st.sampled_from([8, 16, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       layout=st.sampled_from(["positions", "rows"]), affine=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_the_wan_chain_in_lower_precision(rows, heads, head_dim, dtype, layout, affine, seed):
    """Every input in ``dtype``; each output and gradient within the rounding of one cast to its dtype of
    the float64 result (the op rounds once, the chain after each step)."""
    check(rows, heads, head_dim, dtype, layout, affine, seed)


def test_a_hand_computed_row():
    """One token, one head of 4 (two pairs), no weight: rstd = 1 / sqrt(mean(x^2) + eps) of x = (3, 4,
    0, 0) is 2 / 5 (eps 0), so n = (1.2, 1.6, 0, 0); pair 0 turned by 90 degrees gives (-1.6, 1.2), pair 1
    stays zero."""
    x = torch.tensor([[3.0, 4.0, 0.0, 0.0]], dtype=torch.float64)
    cos = torch.tensor([[0.0, 1.0]], dtype=torch.float64)  # pair 0: 90 degrees, pair 1: 0
    sin = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    y, rstd = rms_norm_rope(x, None, cos.unsqueeze(-2), sin.unsqueeze(-2), 1, 0.0, torch.float64)
    torch.testing.assert_close(rstd, torch.tensor([0.4], dtype=torch.float64))
    torch.testing.assert_close(y, torch.tensor([[[-1.6, 1.2, 0.0, 0.0]]], dtype=torch.float64))


def test_gradcheck_float64():
    x, weight, freqs_cos, freqs_sin, _ = inputs((2, 3), 2, 4, torch.float64, "positions", True, 0)
    args = [x, weight, freqs_cos[..., 0::2].contiguous(), freqs_sin[..., 1::2].contiguous()]
    for t in args:
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: rms_norm_rope(*a, 2, EPS, torch.float64)[0], args)


@pytest.mark.parametrize("affine", [True, False])
def test_opcheck(affine):
    x, weight, freqs_cos, freqs_sin, _ = inputs((2, 5), 2, 8, torch.float32, "positions", affine, 1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    x.requires_grad_(True)
    if weight is not None:
        weight.requires_grad_(True)
    torch.library.opcheck(rms_norm_rope.default, (x, weight, cos, sin, 2, EPS, torch.bfloat16), test_utils=OPCHECK_UTILS)
    y, rstd = rms_norm_rope(x.detach(), None if weight is None else weight.detach(), cos, sin, 2, EPS, torch.float32)
    dy = torch.randn_like(y)
    torch.library.opcheck(rms_norm_rope_backward.default, (dy, x.detach(), None if weight is None else weight.detach(),
                                                           cos, sin, rstd),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_an_absent_weight_gets_an_empty_gradient_and_no_double_backward():
    x, _, freqs_cos, freqs_sin, _ = inputs((2, 3), 1, 4, torch.float32, "positions", False, 2)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    y, rstd = rms_norm_rope(x, None, cos, sin, 1, EPS, torch.float32)
    dx, dweight, dcos, dsin = rms_norm_rope_backward(torch.ones_like(y), x, None, cos, sin, rstd)
    assert dx.shape == x.shape and dweight.shape == (0,) and dcos.shape == cos.shape and dsin.shape == sin.shape
    x.requires_grad_(True)
    (g,) = torch.autograd.grad(rms_norm_rope(x, None, cos, sin, 1, EPS, torch.float32)[0].sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        g.sum().backward()


@pytest.mark.parametrize("change, message", [
    (dict(heads=3), r"x \(shape \[2, 5, 16\].*last dim 16 must split into heads = 3"),
    (dict(heads=16), r"heads = 16 heads of an even head dim"),
    (dict(weight=torch.ones(8)), r"weight \(shape \[8\].*must have shape \[16\]"),
    (dict(cos=torch.ones(1, 5, 1, 8)), r"cos \(shape \[1, 5, 1, 8\].*must broadcast to .* = \[2, 5, 2, 4\]"),
    (dict(sin=torch.ones(3, 5, 1, 4)), r"sin \(shape \[3, 5, 1, 4\].*must broadcast to"),
    (dict(cos=torch.ones(1, 5, 1, 4, dtype=torch.int64)), r"cos \(shape \[1, 5, 1, 4\], dtype torch.int64\) must be floating"),
    (dict(x=torch.ones(16)), r"x \(shape \[16\].*at least 2 dims"),
    (dict(eps=-1.0), r"eps must be a non-negative number"),
    (dict(out_dtype=torch.int32), r"out_dtype must be a floating dtype"),
])
def test_bad_inputs_are_named(change, message):
    args = dict(x=torch.randn(2, 5, 16), weight=torch.ones(16), cos=torch.ones(1, 5, 1, 4), sin=torch.zeros(1, 5, 1, 4),
                heads=2, eps=EPS, out_dtype=torch.float32)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        rms_norm_rope(*args.values())


def test_bad_backward_inputs_are_named():
    x, cos, sin = torch.randn(2, 5, 16), torch.ones(1, 5, 1, 4), torch.zeros(1, 5, 1, 4)
    y, rstd = rms_norm_rope(x, None, cos, sin, 2, EPS, torch.float32)
    with pytest.raises(ValueError, match=r"dy \(shape \[2, 5, 16\].*must have y's shape"):
        rms_norm_rope_backward(torch.ones(2, 5, 16), x, None, cos, sin, rstd)
    with pytest.raises(ValueError, match=r"rstd \(shape \[2, 4\].*one per row of x"):
        rms_norm_rope_backward(torch.ones_like(y), x, None, cos, sin, rstd[:, :4])
