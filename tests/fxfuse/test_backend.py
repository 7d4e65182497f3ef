"""The ``adaptiveload`` torch.compile backend (adaptiveload/fxfuse/backend.py)."""
from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptiveload.fxfuse.backend as backend_mod
import adaptiveload.fxfuse.rewrite as rewrite_mod
from adaptiveload.fxfuse import adaptiveload_backend

D = 16
AOT_EAGER = {"inner": "aot_eager"}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)
        self.ada = nn.Linear(D, 6 * D)

    def forward(self, x, c):
        sh, sc, g, sh2, sc2, g2 = self.ada(F.silu(c)).chunk(6, dim=1)
        x = x + g[:, None] * self.proj(self.norm1(x) * (1 + sc[:, None]) + sh[:, None])
        return x + g2[:, None] * self.proj(self.norm2(x) * (1 + sc2[:, None]) + sh2[:, None])


def _inputs(B=2, N=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, D, generator=gen), torch.randn(B, D, generator=gen)


def _train_step(model, x, c):
    loss = model(x, c).pow(2).mean()
    loss.backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def _fused_total():
    return torch._dynamo.utils.counters["adaptiveload"]["fused"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_entry_point_registers_the_name():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "adaptiveload" in list_backends()
    assert lookup_backend("adaptiveload") is adaptiveload_backend


def test_backend_name_works_without_importing_adaptiveload(tmp_path):
    script = tmp_path / "no_import.py"
    script.write_text(
        "import sys, torch, torch.nn.functional as F\n"
        "f = lambda x, s: F.layer_norm(x, (8,)) * (1 + s) + s\n"
        "x, s = torch.randn(2, 3, 8), torch.randn(2, 1, 8)\n"
        "y = torch.compile(f, backend='adaptiveload', options={'inner': 'eager'}, fullgraph=True)(x, s)\n"
        "assert 'adaptiveload' in sys.modules\n"
        "assert torch._dynamo.utils.counters['adaptiveload']['fused'] == 1\n"
        "torch.testing.assert_close(y, f(x, s))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_training_matches_eager_through_aot_autograd():
    model = Block()
    x, c = _inputs()
    ref_loss, ref_grads = _train_step(model, x, c)
    before = _fused_total()
    compiled = torch.compile(model, backend="adaptiveload", options=AOT_EAGER, fullgraph=True)
    loss, grads = _train_step(compiled, x, c)
    assert _fused_total() - before == 2
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("how", ["options", "env"])
def test_fusion_can_be_turned_off(how, monkeypatch, caplog):
    options = dict(AOT_EAGER)
    if how == "options":
        options["fuse"] = False
    else:
        monkeypatch.setenv("ADAPTIVELOAD_DISABLE", "1")
    backend_mod.clear_reports()
    model = Block()
    x, c = _inputs()
    before = _fused_total()
    with caplog.at_level("INFO", logger="adaptiveload"):
        out = torch.compile(model, backend="adaptiveload", options=options, fullgraph=True)(x, c)
    assert _fused_total() == before and backend_mod.last_reports() == []
    torch.testing.assert_close(out, model(x, c))
    reason = "option fuse=False" if how == "options" else "ADAPTIVELOAD_DISABLE is set"
    assert f"LayerNorm→modulate fusion is off ({reason})" in caplog.text


def test_options_as_keyword_arguments_and_their_errors(capture):
    gm, example_inputs = capture(Block(), *_inputs())
    compiled = adaptiveload_backend(gm, example_inputs, fuse=True, inner="eager")
    assert backend_mod.last_reports()[-1].fused == 2
    torch.testing.assert_close(compiled(*example_inputs)[0], gm(*example_inputs)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="'inner' must be one of"):
        adaptiveload_backend(gm, example_inputs, inner="tvm")
    with pytest.raises(ValueError, match="'fuse' must be True or False"):
        adaptiveload_backend(gm, example_inputs, options={"fuse": "no"})
    with pytest.raises(ValueError, match=r"unknown options \['max_autotune'\]"):
        adaptiveload_backend(gm, example_inputs, options={"inner": "aot_eager", "max_autotune": True})
    with pytest.raises(ValueError, match="mode='max-autotune' is an Inductor setting"):
        adaptiveload_backend(gm, example_inputs, mode="max-autotune", options={"inner": "eager"})


def test_logs_the_summary(caplog):
    with caplog.at_level(logging.INFO, logger="adaptiveload"):
        torch.compile(Block(), backend="adaptiveload", options=AOT_EAGER, fullgraph=True)(*_inputs())
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("adaptiveload")]
    assert "fused 2 LayerNorm→modulate chains (2 seen, 0 skipped)" in messages


def test_a_failing_rewrite_compiles_the_original_graph_and_warns_once(monkeypatch):
    """The failure hits after the first chain was already rewritten: the copy is half rewritten,
    the inner compiler must still get the untouched original."""
    real_replace = rewrite_mod.replace_chain
    calls = []

    def replace_then_fail(gm, chain, verdict, replaced):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real_replace(gm, chain, verdict, replaced)

    seen_by_inner = []
    real_inner = backend_mod._compile_inner

    def spy_inner(inner, gm, *args):
        seen_by_inner.append(gm)
        return real_inner(inner, gm, *args)

    monkeypatch.setattr(rewrite_mod, "replace_chain", replace_then_fail)
    monkeypatch.setattr(backend_mod, "_compile_inner", spy_inner)
    monkeypatch.setattr(backend_mod, "_warned", False)
    model = Block()
    x, c = _inputs()
    ref_loss, ref_grads = _train_step(model, x, c)
    failures = torch._dynamo.utils.counters["adaptiveload"]["pass_failures"]

    with pytest.warns(RuntimeWarning, match="injected failure"):
        loss, grads = _train_step(torch.compile(model, backend="adaptiveload", options=AOT_EAGER), x, c)
    assert torch._dynamo.utils.counters["adaptiveload"]["pass_failures"] == failures + 1
    (gm,) = seen_by_inner
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.adaptiveload.adaln_modulate.default]
    assert len([n for n in gm.graph.nodes if n.target is F.layer_norm]) == 2
    torch.testing.assert_close(loss, ref_loss)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=name)

    calls.clear()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second failure does not warn again
        torch.compile(model, backend="adaptiveload", options=AOT_EAGER)(x, c)
    assert torch._dynamo.utils.counters["adaptiveload"]["pass_failures"] == failures + 2


@pytest.mark.parametrize("how", ["automatic", "mark_dynamic"])
def test_varying_sequence_length_compiles_at_most_twice(how):
    backend_mod.clear_reports()
    model = Block()
    compiled = torch.compile(model, backend="adaptiveload", options=AOT_EAGER, fullgraph=True)
    for N in (5, 9, 16, 23, 40):
        x, c = _inputs(N=N, seed=N)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 1)
        torch.testing.assert_close(compiled(x, c), model(x, c), atol=1e-5, rtol=1e-5)
    reports = backend_mod.last_reports()
    assert len(reports) <= (1 if how == "mark_dynamic" else 2)
    assert all(r.fused == 2 for r in reports)


@pytest.mark.slow
def test_inductor_end_to_end_training_matches_eager():
    """Inductor as the inner compiler, forward and backward (contiguous LayerNorm inputs: see the
    upstream Inductor-CPU transposed-LayerNorm gradient bug in COMMON.md)."""
    model = Block()
    x, c = _inputs()
    ref_loss, ref_grads = _train_step(model, x, c)
    before = _fused_total()
    compiled = torch.compile(model, backend="adaptiveload", fullgraph=True)
    loss, grads = _train_step(compiled, x, c)
    assert _fused_total() - before == 2
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
