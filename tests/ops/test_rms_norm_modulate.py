"""Tests of ``torch.ops.adaptiveload.rms_norm_modulate``: values and gradients against float64 eager
``F.rms_norm(x, weight) * (1 + scale) [+ shift]`` over shapes, dtypes, modulation layouts (scale-only
and weightless included) and layouts of the incoming gradient (CPU reference path, and the CUDA
kernels on a GPU); registration checks (opcheck of both ops, dy non-contiguous included; gradcheck);
accuracy against the eager chain; bad inputs; aliasing; determinism of the kernels' backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import adaptiveload  # noqa: F401  (registers torch.ops.adaptiveload.*)
from adaptiveload.ops import _tuning, extension
from adaptiveload.ops.rms_norm_modulate import op as rms_op
from adaptiveload.ops.testing import (EXPANDED_PER_TOKEN, GRAD_LAYOUTS, LAYOUTS, OPCHECK_UTILS, TOL, assert_rel,
                                       check_backward_strides, check_op_against_float64, lay_out_grad, make_mod,
                                       property_strategies, rel_err)

EPS = 1e-6
OP = torch.ops.adaptiveload.rms_norm_modulate
BACKWARD = torch.ops.adaptiveload.rms_norm_modulate_backward


def eager_chain(x, weight, scale, shift):
    """``F.rms_norm(x, ...) * (1 + scale) [+ shift]`` as a user writes it (in x's dtype)."""
    y = F.rms_norm(x, (x.shape[-1],), weight, EPS) * (1 + scale)
    return y if shift is None else y + shift


def check_against_float64(x_shape, dtype, scale_layout, shift_layout, weighted, device, seed, grad_layout="contiguous"):
    """The op forward and backward (dy laid out as ``grad_layout``) against float64 autograd of the
    eager chain on the same (upcast) inputs: y, rstd and every gradient."""
    gen = torch.Generator().manual_seed(seed)
    D = x_shape[-1]
    x = torch.randn(*x_shape, generator=gen, dtype=torch.float64).mul(2).add(0.3).to(dtype).to(device)
    weight = (1 + 0.3 * torch.randn(D, generator=gen, dtype=torch.float64)).to(dtype).to(device) if weighted else None
    scale = make_mod(scale_layout, x_shape, dtype, device, gen)
    shift = None if shift_layout is None else make_mod(shift_layout, x_shape, dtype, device, gen)
    named = {"x": x, "weight": weight, "scale": scale, "shift": shift}
    dy = lay_out_grad(grad_layout, torch.randn(*x_shape, generator=gen, dtype=torch.float64).to(dtype).to(device))
    (y, rstd), ref = check_op_against_float64(
        named, lambda v: OP(v["x"], v.get("weight"), v["scale"], v.get("shift"), EPS, dtype),
        lambda v: eager_chain(v["x"], v.get("weight"), v["scale"], v.get("shift")), dy, TOL[dtype])
    assert y.dtype == dtype and rstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_rel(rstd, ref["x"].square().mean(-1).add(EPS).rsqrt(), TOL[dtype], "rstd")


@given(**property_strategies(), weighted=st.booleans())
def test_matches_float64_reference_cpu(B, tokens, D, dtype, scale_layout, shift_layout, weighted, grad_layout, seed):
    check_against_float64((B, *tokens, D), dtype, scale_layout, shift_layout, weighted, "cpu", seed, grad_layout)


def test_two_dim_x_and_wide_rows_cpu():
    check_against_float64((3, 8), torch.float32, "per-sample", "shared", True, "cpu", 1)
    check_against_float64((2, 3, 8192), torch.bfloat16, "per-sample", None, False, "cpu", 2)


def test_hand_computed_values():
    """One row by hand: x = [3, 4], mean(x^2) = 12.5, rstd = 1/sqrt(12.5 + eps); w = [2, 1],
    scale = [1, 0], shift = [0, 1] -> y = [3 * rstd * 2 * 2, 4 * rstd + 1]."""
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    y, rstd = OP(x, torch.tensor([2.0, 1.0], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64),
                 torch.tensor([0.0, 1.0], dtype=torch.float64), 0.5, torch.float64)
    r = 1 / 13 ** 0.5
    torch.testing.assert_close(rstd, torch.tensor([r], dtype=torch.float64), rtol=1e-15, atol=0)
    torch.testing.assert_close(y, torch.tensor([[12 * r, 4 * r + 1]], dtype=torch.float64), rtol=1e-15, atol=0)


def _opcheck_args(layout, weighted, shifted=True, requires_grad=True, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    x_shape = (2, 5, 8)
    x = torch.randn(*x_shape, generator=gen).to(device, dtype)
    scale = make_mod(layout, x_shape, dtype, device, gen)
    shift = make_mod(layout, x_shape, dtype, device, gen) if shifted else None
    w = torch.randn(8, generator=gen).to(device, dtype) if weighted else None
    if requires_grad:
        for t in (x, scale, shift, w):
            if t is not None:
                (t._base if t._base is not None else t).requires_grad_(True)
    return x, w, scale, shift


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weighted, shifted", [(True, True), (False, True), (True, False), (False, False)])
def test_opcheck(layout, weighted, shifted):
    x, w, scale, shift = _opcheck_args(layout, weighted, shifted)
    torch.library.opcheck(
        OP.default, (x, w, scale, shift, EPS, torch.float32),
        test_utils=OPCHECK_UTILS,
    )


BACKWARD_PLACES = [pytest.param("cpu", torch.float32, id="cpu"),
                   pytest.param("cuda", torch.float32, marks=pytest.mark.cuda, id="cuda-kernels"),
                   pytest.param("cuda", torch.float64, marks=pytest.mark.cuda, id="cuda-reference")]


@pytest.mark.parametrize("device, dtype", BACKWARD_PLACES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad_layout", GRAD_LAYOUTS[1:])
def test_opcheck_backward_with_noncontiguous_dy(device, dtype, layout, grad_layout):
    """The backward op's outputs have the strides its fake kernel promises (contiguous) whatever the
    layout of dy: compiled backward graphs assert them."""
    x, w, scale, shift = _opcheck_args(layout, True, requires_grad=False, device=device, dtype=dtype)
    _, rstd = OP(x, w, scale, shift, EPS, dtype)
    dy = lay_out_grad(grad_layout, torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(device, dtype))
    assert not dy.is_contiguous()
    check_backward_strides(BACKWARD, (dy, x, w, scale, shift, rstd), ("dx", "dweight", "dscale", "dshift"))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shifted", [True, False])
def test_gradcheck_float64(layout, shifted):
    gen = torch.Generator().manual_seed(4)
    x_shape = (2, 3, 5)
    x = torch.randn(*x_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    mods = [make_mod(layout, x_shape, torch.float64, "cpu", gen) for _ in range(2 if shifted else 1)]
    leaves = [(m._base if m._base is not None else m).detach().requires_grad_(True) for m in mods]

    def fn(x, w, *leaves):
        views = [leaf if m._base is None else leaf.as_strided(m.shape, m.stride(), m.storage_offset())
                 for m, leaf in zip(mods, leaves)]
        return OP(x, w, views[0], views[1] if shifted else None, EPS, torch.float64)[0]

    assert torch.autograd.gradcheck(fn, (x, w, *leaves))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["per-sample", "per-token"])
def test_fused_at_least_as_accurate_as_eager(dtype, layout):
    gen = torch.Generator().manual_seed(5)
    x_shape = (2, 64, 256)
    x = torch.randn(*x_shape, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(256, generator=gen)).to(dtype)
    scale = make_mod(layout, x_shape, dtype, "cpu", gen)
    shift = make_mod(layout, x_shape, dtype, "cpu", gen)
    ref = eager_chain(x.double(), w.double(), scale.double(), shift.double())
    fused = OP(x, w, scale, shift, EPS, dtype)[0]
    assert rel_err(fused, ref) <= rel_err(eager_chain(x, w, scale, shift), ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_never_alias_inputs(layout):
    x, w, scale, shift = _opcheck_args(layout, True, requires_grad=False)
    outs = OP(x, w, scale, shift, EPS, torch.float32)
    grads = BACKWARD(torch.randn_like(x), x, w, scale, shift, outs[1])
    inputs = [t for t in (x, w, scale, shift)]
    for out in (*outs, *grads):
        for t in inputs:
            assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def _bad(**changes):
    gen = torch.Generator().manual_seed(0)
    args = {"x": torch.randn(2, 5, 8, generator=gen), "weight": torch.randn(8, generator=gen),
            "scale": torch.randn(2, 1, 8, generator=gen), "shift": torch.randn(2, 1, 8, generator=gen)}
    args.update(changes)
    return args


@pytest.mark.parametrize("kwargs, names", [
    (_bad(weight=torch.randn(7)), ["weight", "[7]"]),
    (_bad(scale=torch.randn(3, 1, 8)), ["scale", "[3, 1, 8]"]),
    (_bad(shift=torch.randn(2, 5, 4)), ["shift", "[2, 5, 4]"]),
    (_bad(x=torch.randn(8)), ["x", "[8]"]),
    (_bad(x=torch.randint(0, 3, (2, 5, 8))), ["x", "floating"]),
    (_bad(scale=None), ["scale is required"]),
])
@pytest.mark.parametrize("impl", ["op", "cuda-impl"])
def test_bad_inputs_raise_value_error_naming_the_tensor(kwargs, names, impl):
    """Through the op (the reference on CPU) and through the CUDA implementation's own checks."""
    forward = {"op": OP, "cuda-impl": rms_op._rms_norm_modulate_cuda}[impl]
    with pytest.raises(ValueError) as err:
        forward(kwargs["x"], kwargs["weight"], kwargs["scale"], kwargs["shift"], EPS, torch.float32)
    for name in names:
        assert name in str(err.value)
    assert "rms_norm_modulate" in str(err.value)


@pytest.mark.parametrize("impl", ["op", "cuda-impl"])
def test_bad_eps_and_backward_inputs_raise(impl):
    forward, backward = {"op": (OP, BACKWARD),
                         "cuda-impl": (rms_op._rms_norm_modulate_cuda, rms_op._rms_norm_modulate_backward_cuda)}[impl]
    a = _bad()
    with pytest.raises(ValueError, match="eps must be a non-negative number, got -1"):
        forward(a["x"], a["weight"], a["scale"], a["shift"], -1.0, torch.float32)
    rstd = torch.ones(2, 5)
    with pytest.raises(ValueError, match=r"rms_norm_modulate_backward: dy \(shape \[2, 5\]"):
        backward(torch.ones(2, 5), a["x"], a["weight"], a["scale"], a["shift"], rstd)
    with pytest.raises(ValueError, match=r"rms_norm_modulate_backward: rstd \(shape \[2\]"):
        backward(torch.ones_like(a["x"]), a["x"], a["weight"], a["scale"], a["shift"], torch.ones(2))


def test_double_backward_raises():
    x = torch.randn(2, 5, 8, requires_grad=True)
    scale = torch.randn(2, 1, 8, requires_grad=True)
    y = OP(x, None, scale, None, EPS, torch.float32)[0]
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        dx.sum().backward()


def test_gradients_only_for_inputs_that_need_them():
    """Weight and shift that need no gradient get None; a scale-only call gives dx and dscale."""
    x = torch.randn(2, 5, 8, requires_grad=True)
    scale = torch.randn(2, 1, 8, requires_grad=True)
    w, shift = torch.randn(8), torch.randn(2, 1, 8)
    y = OP(x, w, scale, shift, EPS, torch.float32)[0]
    y.sum().backward()
    assert x.grad is not None and scale.grad is not None and w.grad is None and shift.grad is None


# ---------------------------------------------------------------------------------------------
# CUDA kernels (skipped without a GPU)


@pytest.fixture
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    module = extension.kernels()
    if module is None:
        pytest.skip("the CUDA kernels could not be built")
    return module


@pytest.mark.cuda
@pytest.mark.parametrize("B, tokens, D, scale_layout, shift_layout", [
    (2, (4099,), 3072, "strided-per-sample", "per-sample"), (1, (300,), 12288, "per-sample", "shared"),
    (2, (517,), 1536, "per-token", "per-sample")])
def test_kernels_two_kernel_backward(kernels, B, tokens, D, scale_layout, shift_layout):
    """The backward's two-kernel design (dx, then the column sums re-reading x and dy), forced where
    the kernels would take one pass, and at D = 12288, where it is their own choice."""
    with _tuning.override(two_kernel=True):
        check_against_float64((B, *tokens, D), torch.bfloat16, scale_layout, shift_layout, True, "cuda", 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("shift_layout", [None, EXPANDED_PER_TOKEN])
def test_expanded_per_token_modulation(device, shift_layout):
    """Scale (and shift) as ``m.expand(B, *tokens, D)`` of one row a sample: the gradient per token."""
    if device == "cuda" and extension.kernels() is None:
        pytest.skip("the CUDA kernels could not be built")
    check_against_float64((2, 3, 5, 2048), torch.bfloat16, EXPANDED_PER_TOKEN, shift_layout, False, device, 4)


@pytest.mark.cuda
@pytest.mark.parametrize("B, tokens, D", [(2, (5,), 8), (1, (7, 3), 130), (3, (64,), 1536), (2, (33,), 3072),
                                          (1, (9,), 5000), (2, (4,), 16384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_layout, shift_layout", [("per-sample", None), ("per-token", "per-token"),
                                                        ("strided-per-sample", "shared"), ("strided-per-token", None),
                                                        ("batch1-per-token", "per-sample")])
@pytest.mark.parametrize("weighted", [True, False])
def test_kernels_match_float64_reference(kernels, B, tokens, D, dtype, scale_layout, shift_layout, weighted):
    check_against_float64((B, *tokens, D), dtype, scale_layout, shift_layout, weighted, "cuda", D)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["per-sample", "per-token"])
@pytest.mark.parametrize("N", [4096, 65536])
def test_kernels_backward_is_bit_identical_across_runs(kernels, layout, N):
    gen = torch.Generator().manual_seed(9)
    x_shape = (2, N, 1024)
    x = torch.randn(*x_shape, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(1024, generator=gen).to("cuda", torch.bfloat16)
    scale = make_mod(layout, x_shape, torch.bfloat16, "cuda", gen)
    shift = make_mod(layout, x_shape, torch.bfloat16, "cuda", gen)
    dy = torch.randn(*x_shape, generator=gen).to("cuda", torch.bfloat16)
    _, rstd = OP(x, w, scale, shift, EPS, torch.bfloat16)
    first = BACKWARD(dy, x, w, scale, shift, rstd)
    for _ in range(3):
        for a, b in zip(first, BACKWARD(dy, x, w, scale, shift, rstd)):
            assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["per-sample", "per-token"])
def test_kernels_bf16_at_least_as_accurate_as_inductor(kernels, layout):
    """bf16 output rounded once from fp32, forward and backward: no worse than Inductor's compiled
    chain against float64 (Inductor also computes the chain in float32 and rounds once)."""
    gen = torch.Generator().manual_seed(11)
    x_shape = (2, 2048, 2048)
    x = torch.randn(*x_shape, generator=gen).to("cuda", torch.bfloat16)
    w = (1 + 0.2 * torch.randn(2048, generator=gen)).to("cuda", torch.bfloat16)
    scale = make_mod(layout, x_shape, torch.bfloat16, "cuda", gen)
    shift = make_mod(layout, x_shape, torch.bfloat16, "cuda", gen)
    dy = torch.randn(*x_shape, generator=gen).to("cuda", torch.bfloat16)

    def grads(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (x, w, scale, shift)]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, dy.to(cast))]

    ref = grads(eager_chain, torch.float64)
    fused = grads(lambda *a: OP(*a, EPS, torch.bfloat16)[0], torch.bfloat16)
    torch._dynamo.reset()
    inductor = grads(torch.compile(eager_chain), torch.bfloat16)
    for name, f, i, r in zip(("y", "dx", "dweight", "dscale", "dshift"), fused, inductor, ref):
        assert rel_err(f, r) <= 1.05 * rel_err(i, r) + 1e-4, f"{name}: fused {rel_err(f, r):.2e}, inductor {rel_err(i, r):.2e}"
