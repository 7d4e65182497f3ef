"""``dx_addend`` of the norm-site backward ops (``adaln_modulate_backward``, ``rms_norm_modulate_backward``):
a gradient that reaches x by another path, added to dx in float32 before dx is rounded once to x's
dtype (what the backend's post-grad pass hands the op in place of an add after it).

Against float64: dx with the addend equals dx + addend of the float64 reference; every other
gradient is bit-identical to the call without an addend. On CUDA the per-sample ring kernel reads the
addend itself; every other path adds it after its kernels (per-token scale, unaligned rows on the
register path, the two-kernel design of wide rows, an addend whose start is not 16-byte aligned), and
an addend that is not contiguous is read from a contiguous copy."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import adaptiveload  # noqa: F401  (registers torch.ops.adaptiveload.*)
from adaptiveload.ops import extension
from adaptiveload.ops.testing import OPCHECK_BACKWARD_UTILS, TOL, assert_rel, lay_out_grad, make_mod, \
    property_strategies

EPS = 1e-6
OPS = ("adaln_modulate", "rms_norm_modulate")


def _run(name, x, weight, scale, shift, dy, dx_addend=None):
    """The op's forward for its statistics, then its backward (with the addend if given)."""
    fwd = getattr(torch.ops.adaptiveload, name)
    bwd = getattr(torch.ops.adaptiveload, f"{name}_backward")
    if name == "adaln_modulate":
        y, mean, rstd = fwd(x, weight, weight, scale, shift, EPS, x.dtype)
        return bwd(dy, x, weight, weight, scale, shift, mean, rstd, dx_addend=dx_addend)
    y, rstd = fwd(x, weight, scale, shift, EPS, x.dtype)
    return bwd(dy, x, weight, scale, shift, rstd, dx_addend=dx_addend)


def check(name, shape, dtype, layout, device, seed, addend_layout="contiguous"):
    gen = torch.Generator().manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(device, dtype)

    x, dy, weight = randn(*shape), randn(*shape), randn(shape[-1])
    scale = make_mod(layout, shape, dtype, device, gen)
    shift = make_mod("per-sample", shape, dtype, device, gen)
    if addend_layout == "misaligned":  # contiguous, one element past a 16-byte boundary
        addend = randn(x.numel() + 1)[1:].view(shape)
    else:
        addend = lay_out_grad(addend_layout, randn(*shape))
    got = _run(name, x, weight, scale, shift, dy, addend)
    plain = _run(name, x, weight, scale, shift, dy)
    as64 = [t.double() for t in (x, weight, scale, shift, dy)]
    want = _run(name, *as64)[0] + addend.double()
    assert got[0].dtype == x.dtype and got[0].is_contiguous()
    assert_rel(got[0], want, 2 * TOL[dtype], "dx with dx_addend")
    for i, (g, p) in enumerate(zip(got[1:], plain[1:]), 1):
        assert torch.equal(g, p), f"output {i} changed with dx_addend"


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["per-sample", "per-token", "shared"])
def test_matches_float64_reference_cpu(name, dtype, layout):
    check(name, (2, 5, 8), dtype, layout, "cpu", seed=1)


@settings(max_examples=20)
@given(name=st.sampled_from(OPS), **{k: v for k, v in property_strategies().items()
                                     if k in ("B", "tokens", "D", "dtype", "scale_layout", "grad_layout", "seed")})
def test_property_cpu(name, B, tokens, D, dtype, scale_layout, grad_layout, seed):
    check(name, (B, *tokens, D), dtype, scale_layout, "cpu", seed, addend_layout=grad_layout)


def test_hand_computed_value():
    """D = 2, x = [1, -1] (x_hat = x, rstd = 1 up to eps), scale 0, no shift, no weight, dy = [1, 0]: the
    LayerNorm dx is [0, 0] (g - mean(g) - x_hat * mean(g * x_hat) = [1, 0] - 0.5 - [0.5, -0.5]) and the
    RMSNorm dx is [0.5, 0.5] (g - x_hat * mean(g * x_hat)); an addend [3, 4] is added to each."""
    x = torch.tensor([[[1.0, -1.0]]], dtype=torch.float64)
    scale, dy, addend = torch.zeros(1, 1, 2, dtype=torch.float64), torch.tensor([[[1.0, 0.0]]], dtype=torch.float64), \
        torch.tensor([[[3.0, 4.0]]], dtype=torch.float64)
    torch.testing.assert_close(_run("adaln_modulate", x, None, scale, None, dy, addend)[0],
                               torch.tensor([[[3.0, 4.0]]], dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(_run("rms_norm_modulate", x, None, scale, None, dy, addend)[0],
                               torch.tensor([[[3.5, 4.5]]], dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("bad, message", [
    (lambda x: torch.zeros(x.shape[-1]), r"dx_addend \(shape \[8\].*must have x's shape \[2, 5, 8\]"),
    (lambda x: torch.zeros(x.shape, dtype=torch.float64), r"dx_addend \(shape \[2, 5, 8\], dtype torch.float64\)"),
])
def test_bad_addend_raises_naming_it(name, bad, message):
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=message):
        _run(name, x, None, torch.randn(2, 1, 8), None, torch.randn(2, 5, 8), bad(x))


@pytest.mark.parametrize("name", OPS)
def test_opcheck_with_addend(name):
    gen = torch.Generator().manual_seed(3)
    x, scale = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
    dy, addend = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    fwd = getattr(torch.ops.adaptiveload, name)
    stats = fwd(x, None, None, scale, None, EPS, x.dtype)[1:] if name == "adaln_modulate" else \
        fwd(x, None, scale, None, EPS, x.dtype)[1:]
    args = (dy, x, None, None, scale, None, *stats) if name == "adaln_modulate" else (dy, x, None, scale, None, *stats)
    bwd = getattr(torch.ops.adaptiveload, f"{name}_backward").default
    torch.library.opcheck(bwd, args, {"dx_addend": addend}, test_utils=OPCHECK_BACKWARD_UTILS)


@pytest.mark.cuda
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, layout, addend_layout", [
    ((3, 64, 1536), "per-sample", "contiguous"),          # the ring, per-sample scale
    ((2, 33, 3072), "per-token", "contiguous"),           # the ring, per-token scale
    ((2, 9, 130), "strided-per-sample", "contiguous"),    # unaligned rows: the register path
    ((2, 4, 12288), "per-sample", "contiguous"),          # wide rows: the two-kernel design
    ((2, 17, 2048), "per-sample", "feature-major"),       # an addend that is not contiguous
    ((2, 17, 2048), "per-sample", "misaligned"),          # an addend the ring cannot read: added after
])
def test_kernels_match_float64_reference(name, dtype, shape, layout, addend_layout):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if extension.kernels() is None:
        pytest.skip("the CUDA kernels could not be built")
    check(name, shape, dtype, layout, "cuda", seed=2, addend_layout=addend_layout)
