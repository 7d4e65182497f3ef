"""``fuse_adaln`` (adaptiveload/fxfuse/rewrite.py): the three graph dialects, subgraphs, metadata,
what gets erased, and the report."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from adaptiveload.fxfuse import FusionReport, fuse_adaln
from adaptiveload.fxfuse.backend import copy_graph_module
from adaptiveload.fxfuse.nodes import fake_value
from adaptiveload.fxfuse.modulate import NO_METADATA

D = 16
FUSED_OP = torch.ops.adaptiveload.adaln_modulate.default
RESIDUAL_OP = torch.ops.adaptiveload.residual_adaln_modulate.default
FUSED_OPS = (FUSED_OP, RESIDUAL_OP)


class Block(nn.Module):
    """Two modulated LayerNorms (one nn.LayerNorm, one F.layer_norm), Wan-style casts, an MLP."""

    def __init__(self, affine: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=affine, eps=1e-6)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=True)
        self.mlp = nn.Linear(D, D)

    def forward(self, x, emb):
        sh, sc, g, sh2, sc2, g2 = emb.chunk(6, dim=1)
        h = (self.norm1(x.float()) * (1 + sc.unsqueeze(1)) + sh.unsqueeze(1)).type_as(x)
        x = x + g.unsqueeze(1) * self.mlp(h)
        h = torch.addcmul(sh2[:, None], self.norm2(x), 1 + sc2[:, None])
        return x + g2.unsqueeze(1) * self.mlp(h)


class Stack(nn.Module):
    """Blocks in sequence (a chain's input is the previous chain's output), optionally checkpointed,
    and a modulated head whose LayerNorm reads the last block's output directly.

    Sites of depth d: the first block's norm1 reads the input (adaln_modulate); every norm2, every
    later norm1 and the head read a residual sum x + g * mlp(h) (residual_adaln_modulate): 1 + 2d.
    Checkpointed, each norm1 and the head read a checkpoint's input or output instead: d + 1 plain,
    d residual."""

    def __init__(self, depth: int = 2, checkpointed: bool = False, affine: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(affine) for _ in range(depth))
        self.checkpointed = checkpointed

    def forward(self, x, emb):
        for block in self.blocks:
            x = checkpoint(block, x, emb, use_reentrant=False) if self.checkpointed else block(x, emb)
        sh, sc = emb[:, :D], emb[:, D : 2 * D]
        return F.layer_norm(x, (D,)) * (1 + sc[:, None]) + sh[:, None]


def _inputs(B=2, N=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, D, generator=gen), 0.5 * torch.randn(B, 6 * D, generator=gen)


def _nodes(gm, predicate):
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes if predicate(n)]


def test_symbolic_trace_without_example_inputs_is_reported_not_touched():
    gm = torch.fx.symbolic_trace(Stack(depth=1))
    code = gm.code
    report = fuse_adaln(gm)
    assert report.seen == 3 and report.fused == 0
    assert {c.reason for c in report.chains} == {NO_METADATA}
    assert [c.norm for c in report.chains] == ["nn.LayerNorm", "nn.LayerNorm", "F.layer_norm"]
    assert gm.code == code


@pytest.mark.parametrize("affine", [False, True])
def test_symbolic_trace_with_example_inputs_fuses_call_module_layernorms(affine):
    model = Stack(depth=2, affine=affine)
    x, emb = _inputs()
    expected = model(x, emb)
    gm = torch.fx.symbolic_trace(model)

    report = fuse_adaln(gm, (x, emb))

    assert report.fused == 5 and report.skipped == 0, report.table()
    assert not _nodes(gm, lambda n: n.op == "call_module" and "norm" in n.target)
    assert len(_nodes(gm, lambda n: n.target is FUSED_OP)) == 1
    assert len(_nodes(gm, lambda n: n.target is RESIDUAL_OP)) == 4
    gm.graph.lint()
    torch.testing.assert_close(gm(x, emb), expected, atol=1e-5, rtol=1e-5)
    assert set(gm.state_dict()) == set(model.state_dict())  # the LayerNorm modules and params stay


@pytest.mark.parametrize("decompose", [False, True], ids=["aten.layer_norm", "aten.native_layer_norm"])
def test_torch_export_graphs(decompose):
    model = Stack(depth=2, affine=True)
    x, emb = _inputs()
    expected = model(x, emb)
    program = torch.export.export(model, (x, emb))
    if decompose:
        program = program.run_decompositions()
    gm = program.graph_module
    impure = _nodes(gm, lambda n: n.op == "call_function" and n.is_impure())
    assert impure  # export's dtype asserts

    report = fuse_adaln(gm)

    assert report.fused == 5 and report.skipped == 0, report.table()
    kind = "aten.native_layer_norm" if decompose else "aten.layer_norm"
    assert {c.norm for c in report.chains} == {kind}
    assert not _nodes(gm, lambda n: n.target in (torch.ops.aten.layer_norm.default,
                                                   torch.ops.aten.native_layer_norm.default))
    # only what the rewrite orphaned is erased: impure nodes stay
    assert all(node in _nodes(gm, lambda n: True) for node in impure)
    for node in _nodes(gm, lambda n: n.target is FUSED_OP):
        assert isinstance(node.meta["val"], tuple) and len(node.meta["val"]) == 3
        (getitem,) = node.users
        assert getitem.meta["val"].shape == (2, 5, D) and "tensor_meta" in getitem.meta
    torch.testing.assert_close(program.module()(x, emb), expected, atol=1e-5, rtol=1e-5)


def test_dynamo_graph_metadata_is_consistent(capture):
    model = Stack(depth=2)
    gm, example_inputs = capture(model, *_inputs())
    work = copy_graph_module(gm)
    fuse_adaln(work)
    fused = _nodes(work, lambda n: n.target in FUSED_OPS)
    assert [n.target for n in fused] == [FUSED_OP] + [RESIDUAL_OP] * 4
    for node in fused:
        *outs, mean, rstd = node.meta["example_value"]  # (y, ...) or (r, out, ...)
        x = fake_value(node.args[0])
        assert all(o.shape == x.shape for o in outs) and mean.shape == x.shape[:-1] and rstd.dtype == torch.float32
        assert [o.dtype for o in outs] == list(node.args[-len(outs):])  # out_dtype (r_dtype, out_dtype)
        getitems = sorted(node.users, key=lambda n: n.args[1])
        assert [g.target for g in getitems] == [operator.getitem] * len(outs)
        assert all(g.meta["example_value"] is o for g, o in zip(getitems, outs))
        assert "stack_trace" in node.meta
    torch.testing.assert_close(work(*example_inputs)[0], model(*_inputs()), atol=1e-5, rtol=1e-5)


def test_float_casts_are_absorbed_and_chains_in_sequence_are_rewired(capture):
    """Block 1's chain ends in .type_as(x); the next LayerNorm reads a rewritten value."""
    model = Stack(depth=2)
    gm, example_inputs = capture(model, *_inputs())
    work = copy_graph_module(gm)
    fuse_adaln(work)
    fused = _nodes(work, lambda n: n.target in FUSED_OPS)
    assert len(fused) == 5
    # Wan-style chain: x enters the op before .float(); the .type_as after is gone
    assert fused[0].args[0].op == "placeholder"
    assert not _nodes(work, lambda n: n.op == "call_method" and n.target in ("float", "type_as"))
    work.graph.lint()


def test_checkpointed_blocks_fuse_like_plain_ones(capture):
    plain, ckpt = Stack(depth=2), Stack(depth=2, checkpointed=True)
    ckpt.load_state_dict(plain.state_dict())
    x, emb = _inputs()
    gm_plain, _ = capture(plain, x, emb)
    gm_ckpt, example_inputs = capture(ckpt.train(), x, emb)
    assert _nodes(gm_ckpt, lambda n: n.target is torch.ops.higher_order.tag_activation_checkpoint)

    work = copy_graph_module(gm_ckpt)
    report_ckpt, report_plain = fuse_adaln(work), fuse_adaln(copy_graph_module(gm_plain))

    assert report_ckpt.fused == report_plain.fused == 5
    assert sum(c.graph.startswith("wrap_body") for c in report_ckpt.chains) == 4
    assert not _nodes(work, lambda n: n.target is F.layer_norm)
    # the original graph (and its subgraphs) is untouched by rewriting the copy
    assert len(_nodes(gm_ckpt, lambda n: n.target is F.layer_norm)) == 5
    torch.testing.assert_close(work(*example_inputs)[0], plain(x, emb), atol=1e-5, rtol=1e-5)


def test_report_counts_summary_and_table(capture):
    def two(x, emb):
        sh, sc = emb[:, :D], emb[:, D : 2 * D]
        y = F.layer_norm(x, (D,)) * (1 + sc[:, None]) + sh[:, None]
        return F.layer_norm(y, (D,)) * sc[:, None] + sh[:, None]

    gm, _ = capture(two, *_inputs())
    report = fuse_adaln(gm)
    assert isinstance(report, FusionReport)
    assert (report.seen, report.fused, report.skipped) == (2, 1, 1)
    unscaled = "multiplier is not `1 + scale` (the op computes norm * (1 + scale))"
    assert report.summary() == f"fused 1 chains (2 seen, 1 skipped: 1× {unscaled}) [fused/seen: adaln_modulate 1/2]"
    assert [c.pattern for c in report.chains] == ["adaln_modulate", "adaln_modulate"]
    lines = report.table().splitlines()
    assert lines[0].split()[:4] == ["#", "pattern", "location", "source"]
    assert "fused" in lines[1] and f"skipped: {unscaled}" in lines[2]
    assert lines[-1] == report.summary()
    assert str(report) == report.table()
