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
from adaptiveload.ops import _tuning, extension
from adaptiveload.ops.rms_norm_rope import op as rope_op
from adaptiveload.ops.rms_norm_rope import rms_norm_rope, rms_norm_rope_backward
from adaptiveload.ops.testing import (GRAD_LAYOUTS, OPCHECK_UTILS, TOL, assert_rel, check_op_against_float64,
                                      lay_out_grad, rel_err)

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


def tables(rows, head_dim, layout, dtype, gen, heads=1):
    """freqs_cos, freqs_sin [.., head_dim] (diffusers' layout: each pair's angle at both of its
    positions) broadcasting over x's rows ``rows`` and the heads, in one of the layouts a model
    passes: "positions" [1, S, 1, head_dim] (Wan), "rows" [*rows, 1, head_dim], "shared" [head_dim],
    or "heads" [1, S, heads, head_dim] (an angle of each head's own)."""
    half = head_dim // 2
    if layout == "positions":
        shape = (1, *rows[1:], 1, half)
    elif layout == "rows":
        shape = (*rows, 1, half)
    elif layout == "heads":
        shape = (1, *rows[1:], heads, half)
    else:
        shape = (half,)
    angles = (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 * math.pi).repeat_interleave(2, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def inputs(rows, heads, head_dim, dtype, layout, affine, seed):
    """x [*rows, heads * head_dim], weight or None, freqs_cos, freqs_sin (on CPU) and the generator."""
    gen = torch.Generator().manual_seed(seed)
    D = heads * head_dim
    x = (2 * torch.randn(*rows, D, generator=gen, dtype=torch.float64) + 0.3).to(dtype)
    weight = (1 + 0.3 * torch.randn(D, generator=gen, dtype=torch.float64)).to(dtype) if affine else None
    freqs_cos, freqs_sin = tables(rows, head_dim, layout, dtype, gen, heads)
    return x, weight, freqs_cos, freqs_sin, gen


def check(rows, heads, head_dim, dtype, layout, affine, seed, grad_layout="contiguous", device="cpu"):
    x, weight, freqs_cos, freqs_sin, gen = inputs(rows, heads, head_dim, dtype, layout, affine, seed)
    x, weight, freqs_cos, freqs_sin = (None if t is None else t.to(device) for t in (x, weight, freqs_cos, freqs_sin))
    # cos and sin as the op receives them: strided views of the tables (no copy)
    named = {"x": x, "weight": weight, "cos": freqs_cos[..., 0::2], "sin": freqs_sin[..., 1::2]}
    dy = lay_out_grad(grad_layout, torch.randn(*rows, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype))
    dy = dy.to(device)

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
       head_dim=st.sampled_from([2, 4, 8, 16]), layout=st.sampled_from(["positions", "rows", "shared", "heads"]),
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
    for mask in ([True] * 4, [True, affine, False, False]):
        torch.library.opcheck(rms_norm_rope_backward.default,
                              (dy, x.detach(), None if weight is None else weight.detach(), cos, sin, rstd, mask),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_an_absent_weight_gets_an_empty_gradient_and_no_double_backward():
    x, _, freqs_cos, freqs_sin, _ = inputs((2, 3), 1, 4, torch.float32, "positions", False, 2)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    y, rstd = rms_norm_rope(x, None, cos, sin, 1, EPS, torch.float32)
    dx, dweight, dcos, dsin = rms_norm_rope_backward(torch.ones_like(y), x, None, cos, sin, rstd, [True] * 4)
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
        rms_norm_rope_backward(torch.ones(2, 5, 16), x, None, cos, sin, rstd, [True] * 4)
    with pytest.raises(ValueError, match=r"rstd \(shape \[2, 4\].*one per row of x"):
        rms_norm_rope_backward(torch.ones_like(y), x, None, cos, sin, rstd[:, :4], [True] * 4)


def test_output_mask_leaves_out_the_gradients_not_asked_for():
    """The backward's output_mask: dx always; dweight, dcos and dsin only where asked, each equal to the
    full call's; autograd asks for the inputs that require grad (here x alone)."""
    x, weight, freqs_cos, freqs_sin, gen = inputs((2, 5), 2, 8, torch.float32, "positions", True, 3)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    y, rstd = rms_norm_rope(x, weight, cos, sin, 2, EPS, torch.float32)
    dy = torch.randn(y.shape, generator=gen)
    full = rms_norm_rope_backward(dy, x, weight, cos, sin, rstd, [True] * 4)
    part = rms_norm_rope_backward(dy, x, weight, cos, sin, rstd, [False, True, False, True])
    assert [tuple(g.shape) for g in part] == [tuple(x.shape), tuple(weight.shape), (0,), tuple(sin.shape)]
    for i in (0, 1, 3):
        torch.testing.assert_close(part[i], full[i], rtol=0, atol=0)
    leaf = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(rms_norm_rope(leaf, weight, cos, sin, 2, EPS, torch.float32)[0], leaf, dy)
    torch.testing.assert_close(g, full[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"output_mask \[True, True, True\] must have 4 flags"):
        rms_norm_rope_backward(dy, x, weight, cos, sin, rstd, [True] * 3)


# ---------------------------------------------------------------------------------------------
# CUDA kernels (skipped without a GPU)


@pytest.fixture
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if extension.kernels() is None:
        pytest.skip("the CUDA kernels could not be built")


def check_kernels(rows, heads, head_dim, dtype, layout, affine, seed, out_dtype=None, x_view=False,
                  table_dtype=torch.float32, weight_dtype=None):
    """The kernels' y, rstd, dx and dweight against the Wan chain in float64, with rotation tables (of
    ``table_dtype``) that need no gradient (as the models' are), so the kernels serve forward and
    backward; the weight in ``weight_dtype`` (default x's). x_view: x as every other row of a larger
    tensor (which the host makes contiguous)."""
    out_dtype = out_dtype or dtype
    x, weight, freqs_cos, freqs_sin, gen = inputs(rows, heads, head_dim, dtype, layout, affine, seed)
    if weight is not None and weight_dtype is not None:
        weight = weight.to(weight_dtype)
    cos, sin = freqs_cos.to("cuda", table_dtype)[..., 0::2], freqs_sin.to("cuda", table_dtype)[..., 1::2]
    dy = torch.randn(*rows, heads, head_dim, generator=gen).to("cuda", out_dtype)
    if x_view:
        big = torch.full((*rows[:-1], 2 * rows[-1], x.shape[-1]), float("nan"), dtype=dtype, device="cuda")
        big[..., ::2, :] = x.cuda()
        x = big.requires_grad_(True)[..., ::2, :]
    else:
        x = x.cuda().requires_grad_(True)
    weight = None if weight is None else weight.cuda().requires_grad_(True)
    leaves = [t for t in (x, weight) if t is not None]
    assert rope_op._kernels_take(x, weight, cos, sin, heads, out_dtype, EPS)
    y, rstd = rms_norm_rope(x, weight, cos, sin, heads, EPS, out_dtype)
    assert y.dtype == out_dtype and y.shape == (*rows, heads, head_dim) and rstd.dtype == torch.float32
    grads = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = wan_chain(ref_leaves[0], ref_leaves[1] if affine else None, cos.double().repeat_interleave(2, -1),
                    sin.double().repeat_interleave(2, -1), heads)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    tol = TOL[dtype]
    assert_rel(y, ref, max(tol, TOL[out_dtype]), "y")  # (rounded once to out_dtype)
    assert_rel(rstd, (ref_leaves[0].detach().square().mean(-1) + EPS).rsqrt(), tol, "rstd")
    for name, g, r, leaf in zip(("dx", "dweight"), grads, ref_grads, leaves):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype, f"{name}: {g.shape}/{g.dtype}"
        assert_rel(g, r, 2 * max(tol, TOL[g.dtype]), name)  # (dweight rounded once to the weight's dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("rows, heads, head_dim", [
    ((2, 5), 1, 2), ((1, 7, 3), 2, 4), ((3, 9), 3, 10), ((2, 33), 12, 128), ((1, 9), 40, 128), ((2, 4), 16, 256),
    ((1, 3), 64, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["positions", "rows", "shared", "heads"])
@pytest.mark.parametrize("affine", [True, False])
def test_kernels_match_float64(kernels, rows, heads, head_dim, dtype, layout, affine):
    """Row widths from one pair to kMaxFeatures = 16,384 (one to four groups a thread; D = 30 off the
    16-byte vector), every table layout, with and without a weight: tables broadcast over the heads
    take the kernels' one set of angles a thread where its groups lie whole heads apart, "heads" and
    the odd widths a set a group."""
    check_kernels(rows, heads, head_dim, dtype, layout, affine, seed=sum(rows) + heads)


@pytest.mark.cuda
@pytest.mark.parametrize("max_threads", [32, 64, 96, 160])
@pytest.mark.parametrize("rows, heads, head_dim", [((2, 33), 12, 128), ((1, 9), 40, 128), ((3, 9), 3, 10)])
@pytest.mark.parametrize("layout", ["positions", "heads"])
def test_kernels_at_forced_thread_caps(kernels, max_threads, rows, heads, head_dim, layout):
    """Threads a row capped below the backward's own choice (and, at 32 and 64, the forward's), so more
    groups a thread (2, 3 and 8 at D = 1,536; 4 and 8 at 5,120), with one set of angles a thread and
    with a set a group."""
    with _tuning.override(max_threads=max_threads):
        check_kernels(rows, heads, head_dim, torch.bfloat16, layout, True, seed=max_threads + heads)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_kernels_with_y_in_another_dtype(kernels, dtype, out_dtype):
    """y (and so dy) in a dtype other than x's: the backward reads dy in its own dtype."""
    check_kernels((2, 17), 12, 128, dtype, "positions", True, 5, out_dtype=out_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, table_dtype, weight_dtype", [
    (torch.bfloat16, torch.bfloat16, None),  # a model cast to bf16: its tables and weights bf16
    (torch.bfloat16, torch.float16, torch.float32),
    (torch.float32, torch.bfloat16, torch.bfloat16),  # a 16-bit weight beside fp32 rows: read by element
])
def test_kernels_read_the_tables_and_the_weight_in_their_dtype(kernels, dtype, table_dtype, weight_dtype):
    """Tables and weight of fp32, bf16 or fp16 are read as they are: the op's forward and backward launch
    their own kernels and no copy; every output against float64, dweight in the weight's dtype, at one
    group a thread (D = 1536) and more (D = 5120)."""
    for rows, heads in (((2, 33), 12), ((1, 9), 40)):
        check_kernels(rows, heads, 128, dtype, "positions", True, heads, table_dtype=table_dtype,
                      weight_dtype=weight_dtype)
    x, weight, freqs_cos, freqs_sin, gen = inputs((2, 33), 12, 128, dtype, "positions", True, 3)
    x, weight = x.cuda(), weight.to("cuda", weight_dtype or dtype)
    cos, sin = freqs_cos.to("cuda", table_dtype)[..., 0::2], freqs_sin.to("cuda", table_dtype)[..., 1::2]
    dy = torch.randn(2, 33, 12, 128, generator=gen).to("cuda", dtype)

    def both():
        y, rstd = rms_norm_rope(x, weight, cos, sin, 12, EPS, dtype)
        rms_norm_rope_backward(dy, x, weight, cos, sin, rstd, [True, True, False, False])

    both()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        both()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert names and all("rope_" in n for n in names), names


@pytest.mark.cuda
def test_kernels_take_a_strided_x(kernels):
    check_kernels((3, 11), 4, 64, torch.bfloat16, "positions", True, 6, x_view=True)


@pytest.mark.cuda
@pytest.mark.parametrize("D_heads", [(1536, 12), (5120, 40)])
def test_kernels_backward_is_bit_identical_across_runs(kernels, D_heads):
    """Many rows a block (B * S = 8,192 rows, a wave of blocks): dweight summed in a fixed order."""
    D, heads = D_heads
    x, weight, freqs_cos, freqs_sin, gen = inputs((2, 4096), heads, D // heads, torch.bfloat16, "positions", True, 7)
    x, weight = x.cuda(), weight.cuda()
    cos, sin = freqs_cos.float().cuda()[..., 0::2], freqs_sin.float().cuda()[..., 1::2]
    y, rstd = rms_norm_rope(x, weight, cos, sin, heads, EPS, torch.bfloat16)
    dy = torch.randn(y.shape, generator=gen).to("cuda", torch.bfloat16)
    mask = [True, True, False, False]
    first = rms_norm_rope_backward(dy, x, weight, cos, sin, rstd, mask)
    for _ in range(3):
        for a, b in zip(first, rms_norm_rope_backward(dy, x, weight, cos, sin, rstd, mask)):
            assert torch.equal(a, b)
    ref = [g.to("cuda", first[i].dtype) for i, g in enumerate(rms_norm_rope_backward(
        dy.cpu(), x.cpu(), weight.cpu(), cos.cpu(), sin.cpu(), rstd.cpu(), mask)[:2])]
    assert_rel(first[0], ref[0], 2 * TOL[torch.bfloat16], "dx")
    assert_rel(first[1], ref[1], 2 * TOL[torch.bfloat16], "dweight")


@pytest.mark.cuda
def test_kernels_bf16_at_least_as_accurate_as_the_eager_chain(kernels):
    """bf16: one rounding of y (the kernels) against eager's rounding of the norm's output before the
    rotation; y and dx no further from float64 than the eager chain's."""
    x, weight, freqs_cos, freqs_sin, gen = inputs((2, 1560), 12, 128, torch.bfloat16, "positions", True, 8)
    x, weight = x.cuda(), weight.cuda()
    fc, fs = freqs_cos.float().cuda(), freqs_sin.float().cuda()
    dy = torch.randn(2, 1560, 12, 128, generator=gen).to("cuda", torch.bfloat16)

    def run(fn, cast):
        leaf = x.detach().to(cast).requires_grad_(True)
        y = fn(leaf)
        return y.detach(), torch.autograd.grad(y, leaf, dy.to(cast))[0]

    ref = run(lambda v: wan_chain(v, weight.double(), fc.double(), fs.double(), 12), torch.float64)
    fused = run(lambda v: rms_norm_rope(v, weight, fc[..., 0::2], fs[..., 1::2], 12, EPS, torch.bfloat16)[0],
                torch.bfloat16)
    eager = run(lambda v: wan_chain(v, weight, fc, fs, 12), torch.bfloat16)
    for i, what in enumerate(("y", "dx")):
        assert rel_err(fused[i], ref[i]) <= rel_err(eager[i], ref[i]) * 1.01, what


@pytest.mark.cuda
def test_tables_that_need_a_gradient_take_the_reference_on_cuda(kernels):
    """cos and sin that require grad: their gradients (and the call's others) from the reference."""
    check(((2, 5)), 2, 8, torch.float32, "positions", True, 9, device="cuda")


def test_cuda_paths_are_handed_to_the_dispatcher_kernels():
    """The op's two Python CUDA paths are in extension.CUDA_PATHS, which the kernel module's C++
    dispatcher kernels get on load for the calls they do not take."""
    assert extension.CUDA_PATHS["rms_norm_rope"] is rope_op._rms_norm_rope_cuda
    assert extension.CUDA_PATHS["rms_norm_rope_backward"] is rope_op._rms_norm_rope_backward_cuda


@pytest.mark.cuda
def test_dispatcher_kernels_hand_bad_inputs_and_float64_to_the_python_path(kernels):
    """Once the kernels are loaded, CUDA calls take the C++ CUDA and AutogradCUDA kernels; a bad input
    still raises the Python path's ValueError naming the tensor, float64 runs the reference, and
    the kernels serve the next good call."""
    for key in ("CUDA", "AutogradCUDA"):
        for name in ("rms_norm_rope", "rms_norm_rope_backward"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"adaptiveload::{name}", key), (name, key)
    x = torch.randn(2, 5, 16, device="cuda")
    cos, sin = torch.ones(1, 5, 1, 4, device="cuda"), torch.zeros(1, 5, 1, 4, device="cuda")
    bad = [(dict(heads=3), r"rms_norm_rope: x \(shape \[2, 5, 16\].*heads = 3"),
           (dict(cos=torch.ones(1, 5, 1, 8, device="cuda")), r"cos \(shape \[1, 5, 1, 8\].*must broadcast"),
           (dict(sin=torch.zeros(1, 5, 1, 4)), r"sin \(shape \[1, 5, 1, 4\].*is on cpu"),
           (dict(weight=torch.ones(8, device="cuda")), r"weight \(shape \[8\].*must have shape \[16\]"),
           (dict(eps=-1.0), "eps must be a non-negative number")]
    for change, message in bad:
        args = dict(x=x, weight=None, cos=cos, sin=sin, heads=2, eps=EPS, out_dtype=torch.float32)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            rms_norm_rope(*args.values())
    y, rstd = rms_norm_rope(x.double(), None, cos, sin, 2, EPS, torch.float64)
    assert rstd.dtype == torch.float64
    ref = wan_chain(x.double(), None, cos.double().repeat_interleave(2, -1), sin.double().repeat_interleave(2, -1), 2)
    assert_rel(y, ref, 1e-12, "y")
    with pytest.raises(ValueError, match=r"rms_norm_rope_backward: dy \(shape \[2, 5, 16\]"):
        rms_norm_rope_backward(torch.ones_like(x), x, None, cos, sin, rstd.float(), [True, False, False, False])
    check_kernels((2, 9), 2, 64, torch.bfloat16, "positions", True, 10)


@pytest.mark.cuda
def test_dispatcher_autograd_asks_only_for_the_gradients_needed(kernels):
    """The C++ AutogradCUDA kernel passes the backward op the mask of what autograd asks for: x alone,
    weight alone, each equal to the backward op's answer for that mask; no double backward."""
    x, weight, freqs_cos, freqs_sin, gen = inputs((2, 33), 4, 32, torch.bfloat16, "positions", True, 11)
    x, weight = x.cuda(), weight.cuda()
    cos, sin = freqs_cos.float().cuda()[..., 0::2], freqs_sin.float().cuda()[..., 1::2]
    y, rstd = rms_norm_rope(x, weight, cos, sin, 4, EPS, torch.bfloat16)
    dy = torch.randn(y.shape, generator=gen).to("cuda", torch.bfloat16)
    dx, dweight, *_ = rms_norm_rope_backward(dy, x, weight, cos, sin, rstd, [True, True, False, False])
    for leaf, want in ((x, dx), (weight, dweight)):
        leaf.requires_grad_(True)
        (g,) = torch.autograd.grad(rms_norm_rope(x, weight, cos, sin, 4, EPS, torch.bfloat16)[0], leaf, dy)
        assert torch.equal(g, want)
        leaf.requires_grad_(False)
    x.requires_grad_(True)
    (g,) = torch.autograd.grad(rms_norm_rope(x, None, cos, sin, 4, EPS, torch.float32)[0].square().sum(), x,
                               create_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        g.sum().backward()
