"""Shared helpers of the fxfuse tests, as fixtures (tests import nothing from each other)."""
from __future__ import annotations

import copy

import pytest
import torch

from adaptiveload.fxfuse.nodes import norm_site

FUSED_OP = torch.ops.adaptiveload.adaln_modulate.default


def _capture(fn, *inputs):
    """``(gm, example_inputs)``: the single Dynamo graph of ``fn(*inputs)`` (fullgraph)."""
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    assert len(captured) == 1
    return captured[0]


def _graph_modules(gm):
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def _count_nodes(gm, predicate) -> int:
    return sum(1 for sub in _graph_modules(gm) for n in sub.graph.nodes if predicate(sub, n))


def _norm_count(gm) -> int:
    """Norm calls (LayerNorm or RMSNorm, any form) left in ``gm`` and its subgraphs."""
    return _count_nodes(gm, lambda sub, n: norm_site(sub, n) is not None)


def _fused_count(gm) -> int:
    return _count_nodes(gm, lambda sub, n: n.op == "call_function" and n.target is FUSED_OP)


@pytest.fixture
def capture():
    return _capture


@pytest.fixture
def norm_count():
    return _norm_count


@pytest.fixture
def fused_op_count():
    return _fused_count


@pytest.fixture
def counter():
    """``counter("fused")``: the current value of ``torch._dynamo.utils.counters["adaptiveload"][name]``."""
    return lambda name: torch._dynamo.utils.counters["adaptiveload"][name]


def _float64_reference(fn, inputs):
    """``fn`` on float64 copies of ``inputs``: the output and the gradients of ``sum(out * probe)``
    with respect to every input that requires grad."""
    copies = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    if isinstance(fn, torch.nn.Module):
        fn = copy.deepcopy(fn).double()
    return _run_with_grads(fn, copies)


def _run_with_grads(fn, inputs, probe_seed: int = 0):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(probe_seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() for o in outs)
    wrt = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [o.detach() for o in outs], grads


@pytest.fixture
def float64_reference():
    return _float64_reference


@pytest.fixture
def run_with_grads():
    return _run_with_grads


def make_block_inputs(B=2, N=5, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=gen).requires_grad_()
    emb = (0.5 * torch.randn(B, 6 * D, generator=gen)).requires_grad_()
    w = (1 + 0.1 * torch.randn(D, generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(D, generator=gen)).requires_grad_()
    return x, emb, w, b


@pytest.fixture
def block_inputs():
    """``(x [2, 5, 16], emb [2, 96], w [16], b [16])``, all requiring grad."""
    return make_block_inputs
