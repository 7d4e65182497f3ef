"""Modulation gathered to a pack's tokens, ``m[segment_ids]``, in front of a norm site
(adaptiveload/fxfuse/modulate.py: ``segmented_modulation``; nodes.py: ``row_gather``).

Each gather form (``m[ids]`` with ``[None]`` or ``.unsqueeze(0)`` for x [1, T, D], ``index_select``,
x [T, D] without a view; scale and shift or scale only; LayerNorm and RMSNorm) becomes one call of the
family's segmented op, which gets the per-segment rows [n, D] and ``segment_ids``, the gathers gone
from the graph, and computes what float64 eager computes, forward and every gradient. Where the
two gathers do not share one ``segment_ids`` node, or only the scale is gathered, the chain keeps
the plain op with per-token (or shared) modulation, as before.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaptiveload.fxfuse import fuse_adaln
from adaptiveload.fxfuse.nodes import row_repeat

D, N_SEG = 16, 3
SEGMENTED = {torch.ops.adaptiveload.adaln_modulate_segmented.default,
             torch.ops.adaptiveload.rms_norm_modulate_segmented.default}
PLAIN = {torch.ops.adaptiveload.adaln_modulate.default, torch.ops.adaptiveload.rms_norm_modulate.default}
GATHERS = {torch.index_select, torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default}


def _segment_ids(dtype=torch.int64):
    """Rows of three samples of 5, 1 and 7 tokens, then two more of the first sample (unsorted)."""
    return torch.tensor([0] * 5 + [1] + [2] * 7 + [0] * 2, dtype=dtype)


def _inputs(seed=0, two_dim=False):
    gen = torch.Generator().manual_seed(seed)
    T = _segment_ids().numel()
    x = torch.randn(*(() if two_dim else (1,)), T, D, generator=gen).requires_grad_()
    m = (0.5 * torch.randn(N_SEG, 6, D, generator=gen)).requires_grad_()  # Wan's [n, 6, dim] modulation
    w = (1 + 0.1 * torch.randn(D, generator=gen)).requires_grad_()
    return x, m, w


def _wan_block_chain(ids):
    def fn(x, m, w):  # WanBlock's norm1 site of a pack (adaptiveload/models/wan.py)
        shift, scale = [c[:, 0][ids][None] for c in m.chunk(6, dim=1)[:2]]
        return (F.layer_norm(x.float(), (D,), eps=1e-6) * (1 + scale) + shift).type_as(x)
    return fn


def _unsqueeze(ids):
    def fn(x, m, w):
        shift, scale = [c[:, 0][ids].unsqueeze(0) for c in m.chunk(6, dim=1)[:2]]
        return F.layer_norm(x, (D,), w, None, 1e-5) * (1 + scale) + shift
    return fn


def _index_select(ids):
    def fn(x, m, w):
        sh, sc = m[:, 0], m[:, 1]
        scale, shift = sc.index_select(0, ids)[None], torch.index_select(sh, 0, ids)[None]
        return F.layer_norm(x, (D,), eps=1e-6) * (1 + scale) + shift
    return fn


def _two_dim(ids):
    def fn(x, m, w):  # x [T, D]: the gathers are already x's shape
        return F.layer_norm(x, (D,), eps=1e-6) * (1 + m[:, 1][ids]) + m[:, 0][ids]
    return fn


def _rms_scale_only(ids):
    def fn(x, m, w):  # Lumina2 / Z-Image: RMSNorm with weight, scale only
        return F.rms_norm(x, (D,), w, 1e-6) * (1 + m[:, 1][ids][None])
    return fn


def _rms_int32_ids(ids):
    ids32 = ids.to(torch.int32)

    def fn(x, m, w):
        shift, scale = m[:, 0][ids32][None], m[:, 1][ids32][None]
        return torch.addcmul(shift, F.rms_norm(x, (D,), None, 1e-6), 1 + scale)
    return fn


def _repeat_interleave(ids):
    lengths = torch.bincount(ids)  # sample i: lengths[i] consecutive rows, T in all

    def fn(x, m, w):  # the method form and the function form, output_size given
        T = x.shape[1]
        scale = m[:, 1].repeat_interleave(lengths, dim=0, output_size=T)[None]
        shift = torch.repeat_interleave(m[:, 0], lengths, dim=0, output_size=T).unsqueeze(0)
        return F.layer_norm(x, (D,), w, None, 1e-6) * (1 + scale) + shift
    return fn


def _gathered_then_chunked(ids):
    def fn(x, m, w):  # the whole [n, 6 D] modulation gathered to the tokens, then split
        shift, scale, *_ = m.flatten(1)[ids].chunk(6, dim=-1)
        return F.layer_norm(x, (D,), eps=1e-6) * (1 + scale[None]) + shift[None]
    return fn


def _gathered_viewed_then_chunked(ids):
    def fn(x, m, w):
        shift, scale, *_ = m.flatten(1)[ids][None].chunk(6, dim=2)
        return F.rms_norm(x, (D,), w, 1e-6) * (1 + scale) + shift
    return fn


FORMS = {  # name: (chain builder, x two-dim, expected layout)
    "wan_block": (_wan_block_chain, False, "segmented"),
    "unsqueeze_with_affine": (_unsqueeze, False, "segmented"),
    "index_select": (_index_select, False, "segmented"),
    "two_dim_x": (_two_dim, True, "segmented"),
    "rms_scale_only": (_rms_scale_only, False, "segmented, no shift"),
    "rms_addcmul_int32_ids": (_rms_int32_ids, False, "segmented"),
    "repeat_interleave_output_size": (_repeat_interleave, False, "segmented"),
    "gathered_then_chunked": (_gathered_then_chunked, False, "segmented"),
    "gathered_viewed_then_chunked_rms": (_gathered_viewed_then_chunked, False, "segmented"),
}


def _count(gm, targets):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def _gathers_left(gm):
    """Gathers of modulation rows left in the graph (the segment ids the rewrite computes from
    repeat counts, ``torch.repeat_interleave(lengths, output_size=T)``, gather nothing)."""
    return sum(1 for n in gm.graph.nodes
               if (n.op == "call_function" and (n.target in GATHERS or (
                   n.target.__name__ == "getitem" and isinstance(n.args[1], torch.fx.Node))))
               or (n.op == "call_method" and n.target == "index_select") or row_repeat(n) is not None)


def _grads(fn, inputs, probe_seed=1):
    out = fn(*inputs)
    if isinstance(out, (tuple, list)):  # a captured graph returns its outputs as a tuple
        (out,) = out
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(probe_seed), dtype=torch.float64)
    loss = (out.double() * probe).sum()
    return out.detach(), torch.autograd.grad(loss, inputs, allow_unused=True)


@pytest.mark.parametrize("name", list(FORMS))
def test_gathered_modulation_becomes_one_segmented_call(name, capture):
    build, two_dim, layout = FORMS[name]
    fn = build(_segment_ids())
    inputs = _inputs(two_dim=two_dim)
    gm, example_inputs = capture(fn, *inputs)

    report = fuse_adaln(gm)

    assert report.fused == report.seen == 1, report.table()
    assert report.chains[0].layout == layout, report.table()
    assert _count(gm, SEGMENTED) == 1 and _count(gm, PLAIN) == 0, gm.code
    assert _gathers_left(gm) == 0, gm.code  # no per-token modulation left in the graph
    gm.graph.lint()

    out, grads = _grads(lambda *a: gm(*example_inputs), inputs)
    ref_out, ref_grads = _grads(fn, [t.detach().double().requires_grad_() for t in inputs])
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    for what, g, r in zip(("x", "m", "w"), grads, ref_grads):
        assert (g is None) == (r is None), what
        if g is not None:
            torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=5e-5, msg=what)


def _different_ids(ids):
    other = ids.flip(0)

    def fn(x, m, w):  # shift and scale gathered by two different index tensors
        return F.layer_norm(x, (D,), eps=1e-6) * (1 + m[:, 1][ids][None]) + m[:, 0][other][None]
    return fn


def _shift_not_gathered(ids):
    def fn(x, m, w):  # a shared shift [D] beside a gathered scale
        return F.layer_norm(x, (D,), eps=1e-6) * (1 + m[:, 1][ids][None]) + w
    return fn


def _repeats_of_two_lengths(ids):
    lengths = torch.bincount(ids)
    other = lengths.flip(0)

    def fn(x, m, w):  # scale and shift repeated by two different count tensors
        T = x.shape[1]
        return (F.layer_norm(x, (D,), eps=1e-6) * (1 + m[:, 1].repeat_interleave(lengths, dim=0, output_size=T)[None])
                + m[:, 0].repeat_interleave(other, dim=0, output_size=T)[None])
    return fn


def _gather_along_features(ids):
    cols = torch.arange(D).flip(0)

    def fn(x, m, w):  # a permutation of the features, not a row gather
        scale = m[:, 1][_segment_ids()][:, cols][None]
        return F.layer_norm(x, (D,), eps=1e-6) * (1 + scale)
    return fn


def _gathered_then_one_row(ids):
    def fn(x, m, w):  # a gather, then one of its rows for every token: not a per-token modulation
        scale = m[:, 1][ids][None][:, :1]
        return F.layer_norm(x, (D,), eps=1e-6) * (1 + scale)
    return fn


PER_TOKEN = {  # name: (chain builder, expected layout of the plain op)
    "different_segment_ids": (_different_ids, "per-token"),
    "shift_not_gathered": (_shift_not_gathered, "scale per-token, shift per-sample"),  # [D] over x [1, T, D]
    "gather_along_features": (_gather_along_features, "per-token, no shift"),
    "repeats_of_two_lengths": (_repeats_of_two_lengths, "per-token"),
    "gathered_then_one_row": (_gathered_then_one_row, "per-sample, no shift"),
}


@pytest.mark.parametrize("name", list(PER_TOKEN))
def test_other_gathers_keep_the_plain_op_with_per_token_modulation(name, capture):
    build, layout = PER_TOKEN[name]
    fn = build(_segment_ids())
    inputs = _inputs()
    gm, example_inputs = capture(fn, *inputs)

    report = fuse_adaln(gm)

    assert report.fused == 1 and report.chains[0].layout == layout, report.table()
    assert _count(gm, SEGMENTED) == 0 and _count(gm, PLAIN) == 1, gm.code
    out, grads = _grads(lambda *a: gm(*example_inputs), inputs)
    ref_out, ref_grads = _grads(fn, [t.detach().double().requires_grad_() for t in inputs])
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    for g, r in zip(grads, ref_grads):
        if r is not None:
            torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=5e-5)


def test_backend_with_a_dynamic_token_count_compiles_the_segmented_op_once():
    """Under ``torch.compile(backend="adaptiveload", dynamic=True)`` packs of other lengths reuse the
    graph, which calls the segmented op, and each pack's result matches eager."""
    calls = []

    def fn(x, m, ids):
        shift, scale = [c[:, 0][ids][None] for c in m.chunk(6, dim=1)[:2]]
        return (F.layer_norm(x.float(), (D,), eps=1e-6) * (1 + scale) + shift).type_as(x)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="adaptiveload", dynamic=True, options={"inner": "aot_eager"})
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(3)
    for lengths in ([5, 1, 7], [2, 9, 4], [11, 3, 1]):
        ids = torch.repeat_interleave(torch.arange(N_SEG), torch.tensor(lengths))
        x = torch.randn(1, ids.numel(), D, generator=gen).requires_grad_()
        m = (0.5 * torch.randn(N_SEG, 6, D, generator=gen)).requires_grad_()
        if not calls:
            compiled(x, m, ids)  # compiles (the fake runs of the op would show in the profile)
        with torch.profiler.profile() as prof:
            got, got_grads = _grads(lambda *a: compiled(x, m, ids), [x, m])
        calls.append(sum(1 for e in prof.events() if e.name == "adaptiveload::adaln_modulate_segmented"))
        ref, ref_grads = _grads(lambda *a: fn(*a, ids), [x.detach().double().requires_grad_(),
                                                           m.detach().double().requires_grad_()])
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)
        for g, r in zip(got_grads, ref_grads):
            torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=5e-5)
    assert calls == [1, 1, 1]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames <= 2  # static first, then dynamic


RESIDUAL_SEGMENTED = torch.ops.adaptiveload.residual_adaln_modulate_segmented.default


def test_a_gathered_gate_and_modulation_fold_into_the_segmented_residual_op(capture):
    """Wan's residual site of a pack (the gate of the branch, then the next norm's scale and shift,
    all gathered from one row a sample) becomes residual_adaln_modulate_segmented on CPU (its
    FUSED_DEVICES), r's other reader sees the op's r, and values and gradients match float64."""
    ids = _segment_ids()

    def fn(x, m, w):
        shift, scale, gate = [c[:, 0][ids][None] for c in m.chunk(6, dim=1)[:3]]
        h = x + torch.tanh(x) * gate  # a branch, gated, added to the stream
        out = (F.layer_norm(h.float(), (D,), eps=1e-6) * (1 + scale) + shift).type_as(h)
        return out + 0.5 * h  # r read again

    inputs = _inputs()
    gm, example_inputs = capture(fn, *inputs)

    report = fuse_adaln(gm)

    assert report.fused == 1 and report.chains[0].layout == "segmented gate, scale, shift", report.table()
    assert _count(gm, {RESIDUAL_SEGMENTED}) == 1 and _gathers_left(gm) == 0, gm.code
    out, grads = _grads(lambda *a: gm(*example_inputs), inputs)
    ref_out, ref_grads = _grads(fn, [t.detach().double().requires_grad_() for t in inputs])
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    for what, g, r in zip(("x", "m"), grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=5e-5, msg=what)
