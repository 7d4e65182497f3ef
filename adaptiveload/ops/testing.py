"""What the op tests share: modulation layouts and layouts of the incoming gradient as autograd
and users produce them, and a relative error with a meaningful floor. Used by ``tests/ops`` for
every op family, and usable for testing a new op the same way."""
from __future__ import annotations

import math
from typing import Optional

import torch

LAYOUTS = ("per-sample", "per-token", "shared", "strided-per-sample", "strided-per-token", "batch1-per-token")
# A per-token modulation that is an expanded (stride 0) view of one row a sample, ``m.expand(B, *tokens,
# D)``: each token reads the same row, but its gradient is still per token. Kept out of LAYOUTS (no
# model makes it); the kernels' tests take it by name.
EXPANDED_PER_TOKEN = "expanded-per-token"
# torch.library.opcheck's utilities every op passes; a backward op has no autograd registration of its own
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
OPCHECK_BACKWARD_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
# ||out - ref|| / ||ref|| bound for a result computed in float32 and rounded once to dtype
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 6e-3, torch.float16: 1.5e-3}


def make_mod(layout: str, x_shape, dtype, device, gen) -> torch.Tensor:
    """A leaf modulation tensor for x of x_shape in one of LAYOUTS or EXPANDED_PER_TOKEN (strided
    ones are views of a larger leaf, the way a .chunk() of a [B, k*D] embedding is)."""
    B, D = x_shape[0], x_shape[-1]
    tokens = list(x_shape[1:-1])
    ones = [1] * len(tokens)

    def randn(*shape):
        return (0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).to(device)

    if layout == "per-sample":
        return randn(B, *ones, D)
    if layout == "per-token":
        return randn(B, *tokens, D)
    if layout == "shared":
        return randn(D)
    if layout == "batch1-per-token":
        return randn(1, *tokens, D)
    if layout == "strided-per-sample":  # [B, 3*D].chunk(3)[1], unsqueezed over the tokens
        return randn(B, 3 * D).chunk(3, dim=-1)[1].view(B, *ones, D)
    if layout == "strided-per-token":  # [B, *tokens, 2*D].chunk(2)[1]
        return randn(B, *tokens, 2 * D).chunk(2, dim=-1)[1]
    if layout == EXPANDED_PER_TOKEN:
        return randn(B, *ones, D).expand(B, *tokens, D)
    raise AssertionError(layout)


GRAD_LAYOUTS = ("contiguous", "feature-major", "strided", "expanded")


def lay_out_grad(layout: str, g: torch.Tensor) -> torch.Tensor:
    """``g`` [B, ..., D] in one of GRAD_LAYOUTS, the layouts autograd hands the op's backward:
    contiguous; feature-major (D outermost: the gradient of ``matmul(y.transpose(1, 2), W)``);
    strided (every other element of a wider tensor); expanded (stride 0 along the second-last dim,
    as ``y.sum()`` gives; this one keeps only the first row of that dim)."""
    if layout == "contiguous":
        return g
    if layout == "feature-major":
        return g.movedim(-1, 0).contiguous().movedim(0, -1)
    if layout == "strided":
        return torch.stack([g, torch.zeros_like(g)], dim=-1)[..., 0]
    if layout == "expanded":
        return g.narrow(-2, 0, 1).expand(g.shape)
    raise AssertionError(layout)


def check_backward_strides(backward_op, args: tuple, names: tuple) -> None:
    """opcheck ``backward_op`` on ``args`` and check every output (named by ``names``) is contiguous,
    as its fake kernel promises: compiled backward graphs assert those strides, whatever dy's layout."""
    torch.library.opcheck(backward_op.default, args, test_utils=OPCHECK_BACKWARD_UTILS)
    for name, g in zip(names, backward_op(*args)):
        assert g.is_contiguous(), f"{name}: strides {g.stride()} for shape {list(g.shape)}"


def rel_err(out: torch.Tensor, ref: torch.Tensor, size: Optional[torch.Tensor] = None) -> float:
    """||out - ref|| / ||ref|| in float64, or over ||size|| where that is larger (``size``: the sizes
    of the terms a summed ``ref`` adds up). The denominator has a floor of 0.1 per element (the
    inputs are O(1)): a gradient that is zero in exact arithmetic (D = 1: x_hat = 0) is compared
    absolutely, not against the rounding noise of the reference (float64 eager at D = 1 leaves
    ~2e-12 in dweight after rstd = eps^-1/2 = 1000 amplifies it; the op's exact 0 must pass)."""
    diff = (out.double() - ref.double()).norm().item()
    den = max(ref.double().norm().item(), 0.0 if size is None else size.double().norm().item(),
              1e-1 * math.sqrt(max(ref.numel(), 1)))
    return diff / den


def assert_rel(out, ref, tol, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out.double()).all(), f"{what}: non-finite values"
    err = rel_err(out, ref)
    if not err <= tol:
        bad = (out.double() - ref.double()).abs()
        worst = bad.flatten().argmax().item()
        raise AssertionError(
            f"{what}: rel err {err:.3e} > {tol:.1e}; worst element {worst}: got {out.flatten()[worst].item()!r}, "
            f"want {ref.flatten()[worst].item()!r}; {(bad > tol * ref.double().abs().max()).sum().item()} mismatches"
        )


def check_op_against_float64(named: dict, op_fn, ref_fn, dy, tol: float, names: tuple = ("y",), term_sizes=None):
    """Run an op and its float64 reference on the same inputs, forward and backward, and compare.

    Args:
        named: the op's tensor inputs by name (None for absent ones); a tensor that is a view (a
            .chunk() of a larger tensor) stays that view of a leaf that requires grad.
        op_fn: ``op_fn(views) -> (y, *statistics)`` from a dict of the inputs by name (for an op
            with several differentiable outputs, ``(y0, y1, ..., *statistics)``).
        ref_fn: ``ref_fn(views) -> y`` (or the tuple ``(y0, y1, ...)``) on float64 copies of the
            inputs (the same views).
        dy: the incoming gradient of y, or a tuple of one per differentiable output.
        tol: relative error bound of the outputs; the gradients get twice it (a sum over many rows
            rounded once, and dx one more cancellation).
        names: what the messages call the differentiable outputs.
        term_sizes: for gradients that are sums over rows whose terms can cancel (a shared gate's),
            ``term_sizes(ref_views, ref_grads) -> {input name: Σ|term|}`` (in the input's shape, a
            view's placed in its leaf) from the float64 inputs and gradients by name; the error of each
            named gradient is then taken relative to the larger of ``||ref||`` and ``||Σ|term|||``
            (rounding errors scale with the terms, so a sum that cancels to near zero would blow up
            an error relative to the sum alone).

    Returns:
        ``(outputs, ref_views)``: the op's outputs and the float64 inputs by name, for checks of the
        statistics.

    Raises:
        AssertionError: a value, shape or dtype that differs.
    """
    dys = dy if isinstance(dy, tuple) else (dy,)
    inputs = [n for n, t in named.items() if t is not None]
    leaves = [(named[n]._base if named[n]._base is not None else named[n]).requires_grad_(True) for n in inputs]

    def rebuild(t, leaf):  # the same view, now of a leaf that requires grad
        return leaf if t._base is None else leaf.as_strided(t.shape, t.stride(), t.storage_offset())

    outputs = op_fn({n: rebuild(named[n], leaf) for n, leaf in zip(inputs, leaves)})
    grads = torch.autograd.grad(outputs[:len(dys)], leaves, dys)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref_views = {n: rebuild(named[n], leaf) for n, leaf in zip(inputs, ref_leaves)}
    refs = ref_fn(ref_views)
    refs = refs if isinstance(refs, tuple) else (refs,)
    ref_grads = torch.autograd.grad(refs, ref_leaves, [d.double() for d in dys])
    for name, out, ref in zip(names, outputs, refs):
        assert_rel(out, ref, tol, name)
    sizes = term_sizes(ref_views, dict(zip(inputs, ref_grads))) if term_sizes is not None else {}
    for name, size in sizes.items():  # a view's term sizes, placed in its leaf (0 where the view does not reach)
        view = ref_views[name]
        if view._base is not None:
            sizes[name] = torch.zeros_like(view._base)
            sizes[name].as_strided(view.shape, view.stride(), view.storage_offset()).copy_(size)
    for name, g, r, leaf in zip(inputs, grads, ref_grads, leaves):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype, f"d{name}: {g.shape}/{g.dtype} vs {leaf.shape}"
        if name in sizes:
            err = rel_err(g, r, sizes[name])
            assert err <= 2 * tol, f"d{name}: error {err:.3e} relative to the sum of |terms| > {2 * tol:.1e}"
        else:
            assert_rel(g, r, 2 * tol, f"d{name}")
    return outputs, ref_views


def property_strategies() -> dict:
    """The hypothesis strategies of the op property tests, by argument name: ``B``, ``tokens`` (the
    dims between batch and features), ``D``, ``dtype``, ``scale_layout``, ``shift_layout`` (None:
    no shift), ``grad_layout``, ``seed``. (hypothesis is imported here, a test dependency.)"""
    from hypothesis import strategies as st

    layouts = st.sampled_from(LAYOUTS)
    return dict(
        B=st.integers(1, 3),
        tokens=st.sampled_from([(1,), (5,), (2, 3), (7,), (16,)]),
        D=st.sampled_from([1, 3, 8, 17, 40, 130]),
        dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
        scale_layout=layouts,
        shift_layout=st.one_of(st.none(), layouts),
        grad_layout=st.sampled_from(GRAD_LAYOUTS),
        seed=st.integers(0, 2**16),
    )
