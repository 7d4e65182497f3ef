"""The ``adaptiveload`` torch.compile backend (adaptiveload/fxfuse/backend.py)."""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptiveload.fxfuse.backend as backend_mod
import adaptiveload.fxfuse.registry as registry
from adaptiveload.fxfuse import adaptiveload_backend, collect_reports

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


def _counts():
    """The backend's counters: graphs rewritten, chains seen, fused, skipped."""
    counters = torch._dynamo.utils.counters["adaptiveload"]
    return {key: counters[key] for key in ("graphs", "seen", "fused", "skipped")}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_entry_point_registers_the_name():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "adaptiveload" in list_backends()
    assert lookup_backend("adaptiveload") is adaptiveload_backend


@pytest.mark.slow
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
    model = Block()
    x, c = _inputs()
    before = _counts()
    with caplog.at_level("INFO", logger="adaptiveload"), collect_reports() as reports:
        out = torch.compile(model, backend="adaptiveload", options=options, fullgraph=True)(x, c)
    assert _counts() == before and reports == []
    torch.testing.assert_close(out, model(x, c))
    reason = "option fuse=False" if how == "options" else "ADAPTIVELOAD_DISABLE is set"
    assert f"norm→modulate fusion is off ({reason})" in caplog.text


DISABLE_VALUES = {"1": True, "TRUE": True, " yes ": True, "On": True,
                  "0": False, "false": False, "NO": False, "off": False, "": False, "  ": False}


def test_disable_variable_accepted_values(monkeypatch, capture):
    gm, example_inputs = capture(Block(), *_inputs())
    for value, disabled in DISABLE_VALUES.items():
        monkeypatch.setenv("ADAPTIVELOAD_DISABLE", value)
        with collect_reports() as reports:
            adaptiveload_backend(gm, example_inputs, inner="eager")
        assert [r.fused for r in reports] == ([] if disabled else [2]), repr(value)


def test_disable_variable_rejects_other_values(monkeypatch, capture):
    gm, example_inputs = capture(Block(), *_inputs())
    for value in ("2", "disable", "y", "1 0"):
        monkeypatch.setenv("ADAPTIVELOAD_DISABLE", value)
        with pytest.raises(ValueError, match=f"ADAPTIVELOAD_DISABLE='{value}': expected '0', '1', "):
            adaptiveload_backend(gm, example_inputs, inner="eager")
        with pytest.raises(ValueError, match=f"ADAPTIVELOAD_DISABLE='{value}'"):  # fuse=False does not hide it
            adaptiveload_backend(gm, example_inputs, inner="eager", fuse=False)


def test_collect_reports_nests_and_the_counters_count_each_compile(capture):
    def one_fused_one_skipped(x, c):  # the second chain has no `1 +`: seen, skipped
        y = F.layer_norm(x, (D,)) * (1 + c[:, None]) + c[:, None]
        return F.layer_norm(y, (D,)) * c[:, None] + c[:, None]

    block = capture(Block(), *_inputs())
    other = capture(one_fused_one_skipped, *_inputs())
    before = _counts()
    with collect_reports() as outer:
        adaptiveload_backend(*block, inner="eager")
        with collect_reports() as inner:
            adaptiveload_backend(*other, inner="eager")
            adaptiveload_backend(*block, inner="eager", fuse=False)  # no rewrite: no report, no count
        adaptiveload_backend(*block, inner="eager")
    adaptiveload_backend(*other, inner="eager")  # outside every block

    assert [(r.seen, r.fused, r.skipped) for r in outer] == [(2, 2, 0), (2, 1, 1), (2, 2, 0)]
    assert len(inner) == 1 and inner[0] is outer[1]
    after = _counts()
    assert {key: after[key] - before[key] for key in after} == {"graphs": 4, "seen": 8, "fused": 6, "skipped": 2}


def test_options_as_keyword_arguments_and_their_errors(capture):
    gm, example_inputs = capture(Block(), *_inputs())
    with collect_reports() as reports:
        compiled = adaptiveload_backend(gm, example_inputs, fuse=True, inner="eager")
    assert [r.fused for r in reports] == [2]
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
    """Block: norm1 reads the input (adaln_modulate), norm2 the residual x + g * proj(...)
    (residual_adaln_modulate)."""
    with caplog.at_level(logging.INFO, logger="adaptiveload"):
        torch.compile(Block(), backend="adaptiveload", options=AOT_EAGER, fullgraph=True)(*_inputs())
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("adaptiveload")]
    assert ("fused 2 chains (2 seen, 0 skipped) [fused/seen: adaln_modulate 1/1, residual_adaln_modulate 1/1]"
            in messages)


def test_a_failing_rewrite_compiles_the_original_graph_and_warns_once(monkeypatch):
    """The failure hits after the first chain was already rewritten: the copy is half rewritten,
    the inner compiler must still get the untouched original. (Block's two sites: norm1 by
    adaln_modulate, then norm2 by residual_adaln_modulate, which fails.)"""
    calls = []

    def replace_then_fail(real_replace):
        def replace(gm, chain, verdict, replaced):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return real_replace(gm, chain, verdict, replaced)
        return replace

    seen_by_inner = []
    real_inner = backend_mod._compile_inner

    def spy_inner(inner, gm, *args):
        seen_by_inner.append(gm)
        return real_inner(inner, gm, *args)

    for pattern in registry.patterns():
        if pattern.name in ("adaln_modulate", "residual_adaln_modulate"):
            monkeypatch.setitem(registry._patterns, pattern.name,
                                dataclasses.replace(pattern, replace=replace_then_fail(pattern.replace)))
    monkeypatch.setattr(backend_mod, "_compile_inner", spy_inner)
    monkeypatch.setattr(backend_mod, "_warned", False)
    model = Block()
    x, c = _inputs()
    ref_loss, ref_grads = _train_step(model, x, c)
    failures = torch._dynamo.utils.counters["adaptiveload"]["pass_failures"]
    counts = _counts()

    with pytest.warns(RuntimeWarning, match="injected failure"), collect_reports() as reports:
        loss, grads = _train_step(torch.compile(model, backend="adaptiveload", options=AOT_EAGER), x, c)
    assert torch._dynamo.utils.counters["adaptiveload"]["pass_failures"] == failures + 1
    assert _counts() == counts and reports == []  # the chain rewritten before the failure is not counted
    (gm,) = seen_by_inner
    assert not [n for n in gm.graph.nodes if n.target in (torch.ops.adaptiveload.adaln_modulate.default,
                                                          torch.ops.adaptiveload.residual_adaln_modulate.default)]
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
    model = Block()
    compiled = torch.compile(model, backend="adaptiveload", options=AOT_EAGER, fullgraph=True)
    before = _counts()
    with collect_reports() as reports:
        for N in (5, 9, 16, 23, 40):
            x, c = _inputs(N=N, seed=N)
            if how == "mark_dynamic":
                torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x, c), model(x, c), atol=1e-5, rtol=1e-5)
    assert [r.fused for r in reports] == ([2] if how == "mark_dynamic" else [2, 2])
    assert _counts()["graphs"] - before["graphs"] == len(reports)


@pytest.mark.slow
def test_inductor_end_to_end_training_matches_eager():
    """Inductor as the inner compiler, forward and backward (contiguous LayerNorm inputs: Inductor on
    CPU computes a wrong LayerNorm input gradient for transposed inputs, an upstream bug)."""
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
