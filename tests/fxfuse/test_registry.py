"""The pattern registry (adaptiveload/fxfuse/registry.py): a pattern and its op defined entirely in
this file, registered with ``register_pattern``, are fused, counted and reported by the backend with
no file under adaptiveload/ edited; registration errors; the built-in patterns and their order."""
from __future__ import annotations

import collections
import operator
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from torch import Tensor
from torch.fx import Node
from torch.profiler import profile

from adaptiveload.fxfuse import Match, collect_reports, patterns, register_pattern, unregister_pattern

# --- a toy op: y = tanh(x) * s, with its backward op ----------------------------------------------


@torch.library.custom_op("adaptiveload_registry_test::tanh_scale", mutates_args=())
def tanh_scale(x: Tensor, s: Tensor) -> Tensor:
    return torch.tanh(x) * s


@tanh_scale.register_fake
def _(x, s):
    return torch.empty_like(x)


@torch.library.custom_op("adaptiveload_registry_test::tanh_scale_backward", mutates_args=())
def tanh_scale_backward(dy: Tensor, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    t = torch.tanh(x)
    return dy * s * (1 - t * t), (dy * t).sum_to_size(s.shape).clone()


@tanh_scale_backward.register_fake
def _(dy, x, s):
    return torch.empty_like(x), torch.empty_like(s)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    return tanh_scale_backward(dy, *ctx.saved_tensors)


tanh_scale.register_autograd(_backward, setup_context=_setup)
TOY_OP = torch.ops.adaptiveload_registry_test.tanh_scale.default

# --- its pattern: torch.tanh(x) * s, s of x's shape --------------------------------------------


@dataclass
class ToyCandidate:
    anchor: Node  # the tanh
    final: Node  # the mul
    scale: Node
    norm: str = "tanh"
    affine: bool = False
    variant: str = "tanh(x)*s"


@dataclass
class ToyVerdict:
    reason: Optional[str]
    layout: str = "same shape"


def toy_match(gm, node) -> Optional[Match]:
    if node.op != "call_function" or node.target is not torch.tanh or len(node.users) != 1:
        return None
    (user,) = node.users
    if user.op != "call_function" or user.target not in (torch.mul, operator.mul):
        return None
    a, b = user.args
    scale = b if a is node else a
    return Match([ToyCandidate(node, user, scale)])


def toy_check(candidate: ToyCandidate, cache: dict) -> ToyVerdict:
    x, s = (n.meta["example_value"] for n in (candidate.anchor.args[0], candidate.scale))
    return ToyVerdict(None if x.shape == s.shape else f"scale of shape {list(s.shape)} is not x's")


def toy_replace(gm, candidate: ToyCandidate, verdict: ToyVerdict, replaced: dict) -> Node:
    graph = gm.graph
    with graph.inserting_before(candidate.final):
        fused = graph.call_function(TOY_OP, (candidate.anchor.args[0], candidate.scale))
    fused.meta = dict(candidate.final.meta)
    candidate.final.replace_all_uses_with(fused)
    replaced[candidate.final] = fused
    graph.erase_node(candidate.final)
    graph.erase_node(candidate.anchor)
    return fused


@pytest.fixture
def toy_pattern():
    register_pattern("toy_tanh_scale", toy_match, toy_check, toy_replace)
    try:
        yield
    finally:
        unregister_pattern("toy_tanh_scale")


def test_a_pattern_defined_outside_the_package_is_fused_counted_and_reported(toy_pattern, counter):
    def f(x, s, t):
        return torch.tanh(x) * s + torch.tanh(x.flip(1)) * t[0]  # the second: t[0] is not x-shaped

    gen = torch.Generator().manual_seed(0)
    x, s, t = (torch.randn(*shape, generator=gen, requires_grad=True) for shape in ((2, 3), (2, 3), (1, 3)))
    ref = f(x, s, t)
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, s, t))
    before = {k: counter(k) for k in ("seen", "fused", "skipped", "toy_tanh_scale.fused", "toy_tanh_scale.skipped")}

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="adaptiveload", options={"inner": "aot_eager"}, fullgraph=True)
    with collect_reports() as reports:
        out = compiled(x, s, t)
    grads = torch.autograd.grad(out.square().sum(), (x, s, t))
    with profile() as prof:
        compiled(x, s, t)

    (report,) = reports
    assert [(c.pattern, c.norm, c.variant, c.fused) for c in report.chains] == [
        ("toy_tanh_scale", "tanh", "tanh(x)*s", True), ("toy_tanh_scale", "tanh", "tanh(x)*s", False)]
    assert report.chains[1].reason == "scale of shape [3] is not x's"
    assert "toy_tanh_scale 1/2" in report.summary() and "toy_tanh_scale" in report.table()
    assert counter("toy_tanh_scale.fused") - before["toy_tanh_scale.fused"] == 1
    assert counter("toy_tanh_scale.skipped") - before["toy_tanh_scale.skipped"] == 1
    assert (counter("seen") - before["seen"], counter("fused") - before["fused"],
            counter("skipped") - before["skipped"]) == (2, 1, 1)
    calls = collections.Counter(e.name for e in prof.events() if e.name.startswith("adaptiveload_registry_test::"))
    assert calls["adaptiveload_registry_test::tanh_scale"] == 1
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_builtin_patterns_first_then_registered_ones_in_order(toy_pattern):
    assert [p.name for p in patterns()] == ["residual_adaln_modulate", "residual_rms_norm_modulate", "adaln_modulate",
                                            "rms_norm_rope", "rms_norm_modulate", "toy_tanh_scale"]
    assert [p.falls_through for p in patterns()] == [True, True, False, True, False, False]


@pytest.mark.parametrize("first", ["adaptiveload.ops.residual_norm_modulate.pattern",
                                   "adaptiveload.ops.rms_norm_rope.pattern", "adaptiveload.ops.rms_norm_modulate.pattern"])
def test_builtin_order_does_not_depend_on_which_module_is_imported_first(first):
    """Importing a built-in pattern module first (it then registers after the modules its import
    loads) leaves the order of BUILTIN_MODULES: the residual sites ahead of the plain ones, the q/k
    RMSNorm -> RoPE site ahead of the RMSNorm->modulate one."""
    code = (f"import importlib; importlib.import_module({first!r}); "
            "from adaptiveload.fxfuse import patterns; print(' '.join(p.name for p in patterns()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["residual_adaln_modulate", "residual_rms_norm_modulate", "adaln_modulate", "rms_norm_rope",
                   "rms_norm_modulate"]


def test_registration_errors(toy_pattern):
    with pytest.raises(ValueError, match="'toy_tanh_scale' is already registered"):
        register_pattern("toy_tanh_scale", toy_match, toy_check, toy_replace)
    with pytest.raises(ValueError, match="must be an identifier"):
        register_pattern("toy.tanh", toy_match, toy_check, toy_replace)
    with pytest.raises(TypeError, match="check must be callable"):
        register_pattern("toy_other", toy_match, None, toy_replace)
    with pytest.raises(KeyError, match="no pattern named 'not_registered'"):
        unregister_pattern("not_registered")
    same_place = register_pattern("adaln_modulate", toy_match, toy_check, toy_replace, replace_existing=True)
    try:
        assert [p.name for p in patterns()][2] == "adaln_modulate" and patterns()[2] is same_place
    finally:
        from adaptiveload.ops.adaln_modulate.pattern import PATTERN

        register_pattern(PATTERN.name, PATTERN.match, PATTERN.check, PATTERN.replace, replace_existing=True)


@pytest.mark.parametrize("name, args", [
    ("adaln_modulate", lambda x, s: (x, None, None, s, s, 1e-6, torch.float32)),
    ("rms_norm_modulate", lambda x, s: (x, None, s, s, 1e-6, torch.float32)),
])
def test_builtin_ops_backward_is_one_op_named_backward(name, args):
    """The backward of each built-in op is one call of the op ``<name>_backward``."""
    x, s = torch.randn(2, 3, 8, requires_grad=True), torch.randn(2, 1, 8, requires_grad=True)
    y = getattr(torch.ops.adaptiveload, name)(*args(x, s))[0]
    with profile() as prof:
        y.sum().backward()
    calls = collections.Counter(e.name for e in prof.events() if e.name.startswith("adaptiveload::"))
    assert calls == {f"adaptiveload::{name}_backward": 1}
