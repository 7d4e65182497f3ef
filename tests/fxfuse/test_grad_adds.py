"""The backend's post-grad pass (``adaptiveload.fxfuse.grad_adds``): an add of another gradient to a
norm-site backward op's dx is folded into the op's ``dx_addend``, and every case the module doc
excludes is left alone. Graphs from ``make_fx`` (fake values on every node, as Inductor's post-grad
graphs have), then a block compiled through the backend with Inductor, against eager."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import adaptiveload  # noqa: F401  (registers torch.ops.adaptiveload.*)
from adaptiveload.fxfuse import grad_adds

OPS = torch.ops.adaptiveload
EPS = 1e-6


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, dy, t = (torch.randn(2, 5, 8, generator=gen).to(dtype) for _ in range(3))
    scale = torch.randn(2, 1, 8, generator=gen).to(dtype)
    _, mean, rstd = OPS.adaln_modulate(x, None, None, scale, None, EPS, dtype)
    return dy, x, scale, mean, rstd, t


def _dx(dy, x, scale, mean, rstd):
    return OPS.adaln_modulate_backward(dy, x, None, None, scale, None, mean, rstd)


def _fold(fn, *args):
    """make_fx's graph of fn, the pass run on it: (folded count, graph module)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    n = grad_adds.fold_dx_addends(gm.graph)
    gm.recompile()
    return n, gm


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_after_the_op_is_folded(swap, dtype):
    def fn(dy, x, scale, mean, rstd, t):
        g = _dx(dy, x, scale, mean, rstd)
        return (t + g[0] if swap else g[0] + t), g[3]

    args = _inputs(dtype)
    n, gm = _fold(fn, *args)
    assert n == 1 and torch.ops.aten.add.Tensor not in _targets(gm)
    (op,) = [node for node in gm.graph.nodes if node.target is OPS.adaln_modulate_backward.default]
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    assert op.kwargs["dx_addend"] is placeholders[5]  # t
    got, want = gm(*args), fn(*args)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]  # (bf16: one rounding fewer, within 1 ulp)
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    assert torch.equal(got[1], want[1])


def test_rms_norm_op_and_an_addend_computed_after_the_op():
    """The addend may come later in the graph than the op (the op is moved after it)."""
    def fn(dy, x, scale, rstd, t):
        g = OPS.rms_norm_modulate_backward(dy, x, None, scale, None, rstd)
        return g[0] + t.sin() * 2

    gen = torch.Generator().manual_seed(1)
    x, dy, t, scale = (torch.randn(*s, generator=gen) for s in ((2, 5, 8), (2, 5, 8), (2, 5, 8), (2, 1, 8)))
    _, rstd = OPS.rms_norm_modulate(x, None, scale, None, EPS, x.dtype)
    n, gm = _fold(fn, dy, x, scale, rstd, t)
    assert n == 1
    torch.testing.assert_close(gm(dy, x, scale, rstd, t), fn(dy, x, scale, rstd, t), rtol=1e-6, atol=1e-6)


def test_no_cycle_through_an_earlier_fold():
    """Op A's addend is computed from op B's outputs and B's from A's: folding both would make a cycle
    (A reads B's result, B reads A's), so only the first is folded, and the graph still runs."""
    def fn(dy, x, scale, mean, rstd, t):
        ga = _dx(dy, x, scale, mean, rstd)
        gb = _dx(dy * 2, x, scale, mean, rstd)
        return ga[0] + gb[3] * x, gb[0] + ga[3] * t

    args = _inputs()
    n, gm = _fold(fn, *args)
    assert n == 1
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["dx-used-twice", "broadcast", "other-dtype", "alpha", "not-dx",
                                  "depends-on-the-op", "addend-already"])
def test_must_not_fold(case):
    def fn(dy, x, scale, mean, rstd, t):
        g = _dx(dy, x, scale, mean, rstd)
        if case == "dx-used-twice":
            return g[0] + t, g[0] * 2
        if case == "broadcast":
            return g[0] + t[0, 0]
        if case == "other-dtype":
            return g[0] + t.double()
        if case == "alpha":
            return torch.add(g[0], t, alpha=2)
        if case == "not-dx":
            return g[3] + t[:, :1]
        if case == "depends-on-the-op":
            return g[0] + g[3] * t
        h = OPS.adaln_modulate_backward(dy, x, None, None, scale, None, mean, rstd, dx_addend=t)
        return h[0] + t

    args = _inputs()
    n, gm = _fold(fn, *args)
    assert n == 0 and torch.ops.aten.add.Tensor in _targets(gm)
    torch.testing.assert_close(gm(*args), fn(*args))


class Block(torch.nn.Module):
    """x feeds the modulated norm and the gated residual, as a DiT block's input does: x's gradient is
    the op's dx plus the residual path's."""

    def __init__(self, D=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D, elementwise_affine=False, eps=EPS)
        self.proj = torch.nn.Linear(D, D)
        self.mod = torch.nn.Parameter(0.1 * torch.randn(1, 3, D))

    def forward(self, x):
        shift, scale, gate = self.mod.chunk(3, dim=1)
        return x + gate * self.proj(self.norm(x) * (1 + scale) + shift)


@pytest.mark.parametrize("device, D", [pytest.param("cpu", 16, marks=pytest.mark.slow),
                                       pytest.param("cuda", 1536, marks=pytest.mark.cuda)])
def test_backend_with_inductor_folds_and_matches_eager(device, D):
    """Through ``backend="adaptiveload"`` with Inductor: the fold counted once, x's gradient and every
    parameter gradient equal eager's; a post-grad pass configured before still runs after it. (On
    CUDA at D = 1536: the kernel that reads the addend itself.)"""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model = Block(D).to(device)
    x = torch.randn(2, 7, D, device=device, requires_grad=True)
    model(x).square().sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    seen = []

    def user_pass(graph):
        seen.append(len(graph.nodes))

    before = torch._dynamo.utils.counters["adaptiveload"][grad_adds.COUNTER]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="adaptiveload", options={"post_grad_custom_post_pass": user_pass})
    compiled(x).square().sum().backward()
    assert torch._dynamo.utils.counters["adaptiveload"][grad_adds.COUNTER] - before == 1
    assert len(seen) == 2  # the user's pass ran on the forward and the backward graph
    tol = {"cpu": 1e-6, "cuda": 1e-5}[device]  # (CUDA: eager's and Inductor's GEMMs and sums differ in order)
    for g, w in zip([x.grad] + [p.grad for p in model.parameters()], want):
        assert (g - w).norm() <= tol * w.norm() + tol, (g - w).abs().max()


def test_pass_uuid():
    """Inductor's FX graph cache keys on the pass's uuid: stable for the pass alone and with a chained
    pass that has one; None (no caching) with a chained plain function, as that function alone gives."""
    class Chained(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "chained-v1"

    assert grad_adds.FoldDxAddends().uuid() == grad_adds.FoldDxAddends().uuid() is not None
    assert grad_adds.FoldDxAddends(Chained()).uuid()[1] == "chained-v1"
    assert grad_adds.FoldDxAddends(lambda graph: None).uuid() is None
