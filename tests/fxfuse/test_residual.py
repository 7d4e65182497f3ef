"""The residual patterns (adaptiveload/fxfuse/residual.py): each residual form folded into its norm
site (Wan's ``(x.float() + y * gate).type_as(x)``, Flux/SD3's ``x + gate * y`` in bf16, the plain
``x + y``, ``gate.unsqueeze(1) * y`` written either way round, ``tanh(gate)`` in front, RMSNorm
sites, a plain norm behind a residual), values and gradients against float64 eager; r's other
users; the sites it must leave (each then fused by the plain pattern, the reason recorded); CUDA
sites left to the plain patterns until "cuda" is in FUSED_DEVICES (fake CUDA tensors), and with it
a Wan-like model fused on a GPU (its kernels run, loss and gradients as eager's; skipped without
one); the aten adds and muls each folded site removes from a compiled forward; symbolic sizes."""
from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import profile

import adaptiveload.fxfuse.registry as registry
from adaptiveload.fxfuse import collect_reports, fuse_adaln
from adaptiveload.ops.testing import rel_err

D = 16
ADALN = torch.ops.adaptiveload.adaln_modulate.default
RMS = torch.ops.adaptiveload.rms_norm_modulate.default
RES_ADALN = torch.ops.adaptiveload.residual_adaln_modulate.default
RES_RMS = torch.ops.adaptiveload.residual_rms_norm_modulate.default
OPS = (ADALN, RMS, RES_ADALN, RES_RMS)


def _mods(emb):
    """shift, scale, gate, shift2, scale2, gate2: [B, D] chunks of emb [B, 6D] (strided views)."""
    return emb.chunk(6, dim=1)


def _rms(h, w=None):  # diffusers' RMSNorm, written out
    n = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return n if w is None else n * w


def f_wan(x, y, emb, w):  # Wan: float32 sum rounded once by .type_as(x), norm on .float()
    sh, sc, g, *_ = _mods(emb)
    r = (x.float() + y * g.float().unsqueeze(1)).type_as(x)
    out = (F.layer_norm(r.float(), (D,), eps=1e-6) * (1 + sc.float().unsqueeze(1)) + sh.float().unsqueeze(1))
    return out.type_as(x), r


def f_wan_plain_norm(x, y, emb, w):  # Wan's cross-attention norm2: an affine FP32LayerNorm, no modulation
    g = _mods(emb)[2]
    r = (x.float() + y * g.float().unsqueeze(1)).type_as(x)
    out = F.layer_norm(r.float(), (D,), w.float(), None, 1e-6).to(r.dtype).type_as(r)
    return out, r


def f_flux(x, y, emb, w):  # Flux / SD3: x + gate * y in the model's dtype, then the modulated norm
    sh, sc, g, *_ = _mods(emb)
    x = x + g.unsqueeze(1) * y
    return F.layer_norm(x, (D,), eps=1e-6) * (1 + sc[:, None]) + sh[:, None], x


def f_plain(x, y, emb, w):  # Wan's cross-attention residual: x + y
    sh, sc, *_ = _mods(emb)
    r = x + y
    return F.layer_norm(r, (D,), w, None, 1e-6) * (1 + sc[:, None]) + sh[:, None], r


def f_gate_first_x_second(x, y, emb, w):  # HunyuanVideo's single block: gate.unsqueeze(1) * y + x
    sh, sc, g, *_ = _mods(emb)
    r = torch.mul(g.unsqueeze(1), y).add(x)
    return torch.addcmul(sh[:, None], F.layer_norm(r, (D,)), 1 + sc[:, None]), r


def f_tanh_gate(x, y, emb, w):  # Mochi / Lumina2: tanh(gate) in front, stays a node of its own
    sh, sc, g, *_ = _mods(emb)
    r = x + y * torch.tanh(g).unsqueeze(1)
    return F.layer_norm(r, (D,)) * (1 + sc[:, None]) + sh[:, None], r


def f_per_token_gate(x, y, emb, w):  # a per-token gate [B, N, D] (Wan 2.2's per-token timesteps)
    sh, sc, *_ = _mods(emb)
    r = x + y * torch.sigmoid(x.flip(1))
    return F.layer_norm(r, (D,)) * (1 + sc[:, None]) + sh[:, None], r


def f_rms_hand_written(x, y, emb, w):  # LTX-Video: gated residual, diffusers' RMSNorm, weightless
    sh, sc, g, *_ = _mods(emb)
    r = x + y * g[:, None]
    return _rms(r) * (1 + sc[:, None]) + sh[:, None], r


def f_rms_scale_only(x, y, emb, w):  # F.rms_norm with a weight, scale-only modulation
    sc, g = _mods(emb)[1:3]
    r = x + g[:, None] * y
    return F.rms_norm(r, (D,), w, 1e-6) * (1 + sc[:, None]), r


def f_rms_plain_norm(x, y, emb, w):  # a plain RMSNorm behind a plain residual (Lumina2's context refiner)
    r = x + y
    return _rms(r, w), r


def f_scale_after_a_reader(x, y, emb, w):  # Wan's order: the next residual add's `x.float()` before the scale
    r = x + y
    n = F.layer_norm(r, (D,))
    z = r * 2  # reads the sum before the scale below is computed: the scale's nodes move in front of it
    sc = torch.sigmoid(emb[:, :D])[:, None]
    return n * (1 + sc), z


FORMS = {
    # fn, op, variant
    "wan": (f_wan, RES_ADALN, "x+gate*y -> norm*(1+scale)+shift"),
    "wan_plain_norm": (f_wan_plain_norm, RES_ADALN, "x+gate*y -> norm"),
    "flux": (f_flux, RES_ADALN, "x+gate*y -> norm*(1+scale)+shift"),
    "plain": (f_plain, RES_ADALN, "x+y -> norm*(1+scale)+shift"),
    "gate_first_x_second": (f_gate_first_x_second, RES_ADALN, "x+gate*y -> addcmul"),
    "tanh_gate": (f_tanh_gate, RES_ADALN, "x+gate*y -> norm*(1+scale)+shift"),
    "per_token_gate": (f_per_token_gate, RES_ADALN, "x+gate*y -> norm*(1+scale)+shift"),
    "rms_hand_written": (f_rms_hand_written, RES_RMS, "x+gate*y -> norm*(1+scale)+shift"),
    "rms_scale_only": (f_rms_scale_only, RES_RMS, "x+gate*y -> norm*(1+scale)"),
    "rms_plain_norm": (f_rms_plain_norm, RES_RMS, "x+y -> norm"),
    "scale_after_a_reader": (f_scale_after_a_reader, RES_ADALN, "x+y -> norm*(1+scale)"),
}


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, D, generator=gen).mul(2).add(0.3).to(dtype).requires_grad_()
    y = torch.randn(2, 5, D, generator=gen).to(dtype).requires_grad_()
    emb = (0.5 * torch.randn(2, 6 * D, generator=gen)).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).requires_grad_()
    return x, y, emb, w


def _fused_ops(gm):
    return [n.target for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
            if n.target in OPS]


@pytest.mark.parametrize("name", list(FORMS))
def test_form_is_fused_and_exact(name, capture, float64_reference, run_with_grads):
    """float32: one residual op replaces the site; both outputs (out and r) and every gradient match
    float64 eager to float32 rounding."""
    fn, op, variant = FORMS[name]
    inputs = _inputs()
    gm, example_inputs = capture(fn, *inputs)
    report = fuse_adaln(gm)
    assert [(c.pattern, c.variant, c.fused) for c in report.chains] == [(op.name().split("::")[1], variant, True)], \
        report.table()
    assert _fused_ops(gm) == [op] and not report.deferred
    gm.graph.lint()
    (out, r), grads = run_with_grads(lambda *a: gm(*example_inputs), inputs)
    (ref_out, ref_r), ref_grads = float64_reference(fn, inputs)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(r, ref_r) < 1e-6
    for g, ref, n in zip(grads, ref_grads, ("x", "y", "emb", "w")):
        assert (g is None) == (ref is None), n
        assert g is None or rel_err(g, ref) < 1e-5, n


@pytest.mark.parametrize("name", ["wan", "wan_plain_norm", "flux", "plain", "rms_hand_written"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forms_are_as_accurate_as_eager(name, dtype):
    """Through the backend (aot_eager) in bf16/fp16: out, r and every gradient no further from float64
    than eager is (times 1.5, a few roundings apart: Flux's product is not rounded before the add,
    as Inductor's fused kernel does not round it) -- Wan's pattern rounds r once, as eager does."""
    fn = FORMS[name][0]
    inputs = _inputs(dtype, seed=1)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="adaptiveload", options={"inner": "aot_eager"}, fullgraph=True)
    with collect_reports() as reports:
        results = {"fused": compiled(*inputs)}
    assert reports[0].fused == 1 and reports[0].chains[0].pattern.startswith("residual_"), reports[0].table()
    results["eager"], results["ref"] = fn(*inputs), fn(*ref_inputs)
    gen = torch.Generator().manual_seed(2)
    probes = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in results["ref"]]
    grads = {}
    for key, outs in results.items():
        wrt = ref_inputs if key == "ref" else inputs
        grads[key] = torch.autograd.grad(sum((o.double() * p).sum() for o, p in zip(outs, probes)), wrt,
                                         allow_unused=True)
    for i, what in enumerate(("out", "r")):
        fused, eager = (rel_err(results[k][i], results["ref"][i]) for k in ("fused", "eager"))
        assert fused <= 1.5 * eager + 1e-4, (what, fused, eager)
    for i, what in enumerate(("dx", "dy", "demb", "dw")):
        if grads["ref"][i] is None or grads["ref"][i].abs().max() == 0:
            continue
        fused, eager = (rel_err(grads[k][i], grads["ref"][i]) for k in ("fused", "eager"))
        assert fused <= 1.5 * eager + 1e-4, (what, fused, eager)


def test_r_with_other_users_reads_the_ops_r(capture, float64_reference, run_with_grads):
    """r feeds the norm site, a product and a reduction, before and after the site; all read the op's
    r, and the gradients arriving through them are summed with the norm's in the op's backward."""
    def fn(x, y, emb, w):
        shift, scale, gate = (m[:, None] for m in _mods(emb)[:3])
        r = x + gate * y
        early = r.sum(-1, keepdim=True)
        out = F.layer_norm(r, (D,), w, None) * (1 + scale) + shift
        return out * early, r * 3, torch.tanh(r)

    inputs = _inputs()
    gm, example_inputs = capture(fn, *inputs)
    report = fuse_adaln(gm)
    assert report.fused == 1 and _fused_ops(gm) == [RES_ADALN], report.table()
    (fused_node,) = [n for n in gm.graph.nodes if n.target is RES_ADALN]
    r_getitem = [u for u in fused_node.users if u.args[1] == 0][0]
    assert len(r_getitem.users) == 3  # the sum, the product and the tanh
    outs, grads = run_with_grads(lambda *a: gm(*example_inputs), inputs)
    ref_outs, ref_grads = float64_reference(fn, inputs)
    for o, ref in zip(outs, ref_outs):
        assert rel_err(o, ref) < 1e-5
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g, ref) < 1e-5


def _two_norms_one_sum(x, y, emb, w):  # the first site takes the sum; the second reads its r
    sh, sc, g, sh2, sc2, _ = (m[:, None] for m in _mods(emb))
    r = x + g * y
    return F.layer_norm(r, (D,)) * (1 + sc) + sh, F.rms_norm(r, (D,)) * (1 + sc2) + sh2


def _unrounded_sum_used(x, y, emb, w):
    sh, sc, g, *_ = _mods(emb)
    s = x.float() + y * g[:, None].float()
    r = s.to(torch.bfloat16)
    return F.layer_norm(r.float(), (D,)) * (1 + sc[:, None]) + sh[:, None], s


def _product_used(x, y, emb, w):
    sh, sc, g, *_ = _mods(emb)
    p = g[:, None] * y
    return F.layer_norm(x + p, (D,)) * (1 + sc[:, None]) + sh[:, None], p


def _rounded_twice(x, y, emb, w):  # a bf16 sum cast to fp16: the op would round once
    sh, sc, *_ = _mods(emb)
    r = (x.bfloat16() + y.bfloat16()).half()
    return F.layer_norm(r, (D,)) * (1 + sc[:, None].half()) + sh[:, None].half(), r


def _widened_before_use(x, y, emb, w):  # the sum is read as float32 by others: r would be bf16
    sh, sc, *_ = _mods(emb)
    rf = (x.bfloat16() + y.bfloat16()).float()
    return F.layer_norm(rf, (D,)) * (1 + sc[:, None]) + sh[:, None], rf * 2


def _scale_from_sum(x, y, emb, w):
    sh = _mods(emb)[0]
    r = x + y
    return F.layer_norm(r, (D,)) * (1 + r.mean(1, keepdim=True)) + sh[:, None], r


def _scale_after_an_in_place_op(x, y, emb, w):  # the scale's nodes after `z` cannot move before it
    r = x + y
    n = F.layer_norm(r, (D,))
    z = r * 2  # reads the sum before the scale below is computed
    e = emb * 1
    sc = torch.sigmoid(e.add_(1)[:, :D])[:, None]
    return n * (1 + sc), z


def _scale_after_an_augmented_assignment(x, y, emb, w):  # as above, `e += 1` (Dynamo: operator.iadd)
    r = x + y
    n = F.layer_norm(r, (D,))
    z = r * 2
    e = emb * 1
    e += 1
    sc = torch.sigmoid(e[:, :D])[:, None]
    return n * (1 + sc), z


def _two_modulations(x, y, emb, w):  # LTX-2's audio_to_video_norm behind a residual
    sh, sc, _, sh2, sc2, _ = _mods(emb)
    n = F.layer_norm(x + y, (D,))
    return n * (1 + sc[:, None]) + sh[:, None], n * (1 + sc2[:, None]) + sh2[:, None]


def _broadcast_x(x, y, emb, w):  # x + bias: not a residual update
    sh, sc, g, *_ = _mods(emb)
    return F.layer_norm(y + g[:, None], (D,)) * (1 + sc[:, None]) + sh[:, None]


def _int_operand(x, y, emb, w):  # an integer operand: not a floating input of the op
    sh, sc, *_ = _mods(emb)
    counts = (x > 0).to(torch.int64)
    return F.layer_norm(counts + y, (D,)) * (1 + sc[:, None]) + sh[:, None]


MUST_NOT_FUSE = {
    # fn, the residual pattern's reason (None: not a residual site at all), plain ops that fuse instead
    "two_norms_one_sum": (_two_norms_one_sum, "is rewritten by the fused site of", [RES_ADALN, RMS]),
    "unrounded_sum_used": (_unrounded_sum_used, "also feeds", [ADALN]),
    "product_used": (_product_used, "also feeds", [ADALN]),
    "rounded_twice": (_rounded_twice, "is rounded to torch.bfloat16 and again to torch.float16", [ADALN]),
    "widened_before_use": (_widened_before_use, "widens the sum", [ADALN]),
    "scale_from_sum": (_scale_from_sum, "scale `mean` is computed from the residual sum", [ADALN]),
    "scale_after_an_in_place_op": (_scale_after_an_in_place_op, "which reads the residual sum, and cannot move",
                                   [ADALN]),
    "scale_after_an_augmented_assignment": (_scale_after_an_augmented_assignment,
                                            "which reads the residual sum, and cannot move", [ADALN]),
    "two_modulations": (_two_modulations, "the normalised tensor feeds 2 modulations", [ADALN, ADALN]),
    "broadcast_x": (_broadcast_x, None, [ADALN]),
    "int_operand": (_int_operand, "residual x (shape [2, 5, 16], dtype int64) is not floating point", [ADALN]),
}


@pytest.mark.parametrize("name", list(MUST_NOT_FUSE))
def test_sites_it_must_leave_are_fused_by_the_plain_pattern(name, capture, float64_reference, run_with_grads):
    """Where the residual cannot be folded (shapes or dtypes not provably compatible, a value the op
    does not output, an order it cannot keep), the residual pattern records why (or does not see a
    residual at all) and the plain norm→modulate pattern fuses the site as before; values and
    gradients stay eager's."""
    fn, reason, ops = MUST_NOT_FUSE[name]
    inputs = _inputs()
    gm, example_inputs = capture(fn, *inputs)
    report = fuse_adaln(gm)
    if reason is None:
        assert not report.deferred
    else:
            assert len(report.deferred) == 1 and reason in report.deferred[0].reason, report.table()
    assert report.skipped == 0 and sorted(_fused_ops(gm), key=str) == sorted(ops, key=str), report.table()
    gm.graph.lint()
    outs, grads = run_with_grads(lambda *a: gm(*example_inputs), inputs)
    ref_outs, ref_grads = float64_reference(fn, inputs)
    for o, ref in zip(outs, ref_outs):
        assert rel_err(o, ref) < 1e-2 if o.dtype in (torch.bfloat16, torch.float16) else rel_err(o, ref) < 1e-5
    for g, ref in zip(grads, ref_grads):
        assert (g is None) == (ref is None) and (g is None or rel_err(g, ref) < 1e-2)


# --- CUDA: left to the plain patterns until the op has a kernel --------------------------------------


def _cuda_site(x, y, emb, w):  # as f_wan, in unsqueeze form (fake CUDA tensors without a GPU lack getitem)
    mods = emb.chunk(6, dim=1)
    sh, sc, g = mods[0], mods[1], mods[2]
    r = (x.float() + y * g.unsqueeze(1)).type_as(x)
    n = F.layer_norm(r.float(), (D,), w, None, 1e-6)
    return (n * (1 + sc.unsqueeze(1)) + sh.unsqueeze(1)).type_as(x), r


def _fuse_on(device: str):
    gm = torch.fx.symbolic_trace(_cuda_site)
    with FakeTensorMode():
        inputs = (torch.empty(2, 5, D, dtype=torch.bfloat16, device=device),
                  torch.empty(2, 5, D, dtype=torch.bfloat16, device=device),
                  torch.empty(2, 6 * D, device=device), torch.empty(D, device=device))
    return gm, fuse_adaln(gm, inputs)


def _without_residual_patterns(monkeypatch):
    """The registry without the residual patterns (the original dict object, and so the order, is
    restored by monkeypatch)."""
    monkeypatch.setattr(registry, "_patterns", {name: p for name, p in registry._patterns.items()
                                                if not name.startswith("residual_")})


def _with_devices(monkeypatch, devices: frozenset):
    """Both residual patterns as they are with FUSED_DEVICES = ``devices`` (restored afterwards)."""
    from adaptiveload.ops.residual_norm_modulate import pattern

    for p in (pattern.LAYER_NORM_PATTERN, pattern.RMS_NORM_PATTERN):
        switched = dataclasses.replace(p, devices=devices)
        (entry,) = [e for e in registry.patterns() if e.name == p.name]
        monkeypatch.setitem(registry._patterns, entry.name, dataclasses.replace(
            entry, match=switched.match, check=switched.check, replace=switched.replace))


def test_cuda_sites_go_to_the_plain_pattern_with_the_reason(monkeypatch):
    """With "cuda" not in FUSED_DEVICES (as until the kernels are validated), on CUDA tensors (fake: no
    GPU needed) the residual pattern defers -- the reason recorded -- and the graph is rewritten
    exactly as without the residual patterns: adaln_modulate on the residual sum."""
    _with_devices(monkeypatch, frozenset({"cpu"}))
    gm, report = _fuse_on("cuda")
    assert [(c.pattern, c.reason) for c in report.deferred] == [
        ("residual_adaln_modulate", "no validated CUDA kernel for residual_adaln_modulate yet (FUSED_DEVICES)")]
    assert [(c.pattern, c.fused) for c in report.chains] == [("adaln_modulate", True)]
    assert "1 deferred to the next pattern" in report.summary()
    assert "deferred: no validated CUDA kernel" in report.table()
    with monkeypatch.context() as patch:
        _without_residual_patterns(patch)
        plain_gm, plain_report = _fuse_on("cuda")
    assert gm.code == plain_gm.code and not plain_report.deferred


def test_a_device_in_the_switch_is_fused(monkeypatch):
    """The one switch: with "cuda" among the pattern's devices (what the kernel author sets in
    FUSED_DEVICES), the same CUDA site is folded."""
    _with_devices(monkeypatch, frozenset({"cpu", "cuda"}))
    gm, report = _fuse_on("cuda")
    assert [(c.pattern, c.fused) for c in report.chains] == [("residual_adaln_modulate", True)] and not report.deferred
    assert _fused_ops(gm) == [RES_ADALN]


class WanLike(nn.Module):
    """L Wan-style blocks on a bf16 / fp32 residual stream, Linears standing in for attention and the
    FFN: a modulated norm1, the gated residual summed in float32 and rounded by ``.type_as(x)``, an
    affine plain norm2 read by a plain residual (cross-attention), a modulated norm3 and its gated
    residual; a modulated head. Every norm but the first reads a residual sum."""

    def __init__(self, depth: int, dim: int):
        super().__init__()
        self.dim = dim
        self.attn, self.cross, self.ffn = (nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth)) for _ in range(3))
        self.norm2 = nn.ModuleList(nn.LayerNorm(dim, eps=1e-6) for _ in range(depth))

    def forward(self, x, emb):  # emb [B, L + 1, 6 D], in float32 as Wan's
        def modulated(h, shift, scale):
            n = F.layer_norm(h.float(), (self.dim,), eps=1e-6)
            return (n * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)).type_as(h)

        for i in range(len(self.attn)):
            sh, sc, g, sh2, sc2, g2 = emb[:, i].chunk(6, dim=-1)
            x = (x.float() + self.attn[i](modulated(x, sh, sc)) * g.unsqueeze(1)).type_as(x)
            norm2 = self.norm2[i]  # Wan's FP32LayerNorm: float32 math, the model's dtype out
            x = x + self.cross[i](F.layer_norm(x.float(), (self.dim,), norm2.weight.float(), norm2.bias.float(),
                                               1e-6).type_as(x))
            x = (x.float() + self.ffn[i](modulated(x, sh2, sc2)) * g2.unsqueeze(1)).type_as(x)
        sh, sc = emb[:, -1, :2 * self.dim].chunk(2, dim=-1)
        return modulated(x, sh, sc)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wan_like_model_folds_every_residual_site_and_matches_eager(monkeypatch, device, dtype):
    """All 3 L residual sites of a Wan-like model are folded (norm2, norm3, the next norm1 / the head;
    the scale's nodes that Python evaluates after the next add's ``x.float()`` move in front of it),
    and the loss and every gradient match eager's: float32 to float32 rounding; bf16 no further from
    float64 than eager bf16 (x1.5). On CPU through aot_eager; on CUDA with "cuda" in FUSED_DEVICES
    (the switch flipped), Inductor inside, and the residual kernels run (profiler)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        monkeypatch.setenv("ADAPTIVELOAD_REQUIRE_KERNEL", "1")
        _with_devices(monkeypatch, frozenset({"cpu", "cuda"}))
    L, dim = 2, 64
    gen = torch.Generator().manual_seed(0)
    model = WanLike(L, dim).to(device, dtype)
    x = torch.randn(2, 48, dim, generator=gen).to(device, dtype)
    emb = (0.3 * torch.randn(2, L + 1, 6 * dim, generator=gen)).to(device)

    def loss_and_grads(fn, m, cast):
        xs, es = x.detach().to(cast).requires_grad_(), emb.detach().to(torch.float64 if cast == torch.float64
                                                                           else torch.float32).requires_grad_()
        probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
        loss = (fn(xs, es).double() * probe).sum()
        params = list(m.parameters())
        return loss.detach(), torch.autograd.grad(loss, [xs, es, *params])

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="adaptiveload", options={"inner": "aot_eager"} if device == "cpu" else {})
    activities = [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [torch.profiler.ProfilerActivity.CPU]
    with collect_reports() as reports, profile(activities=activities) as prof:
        got = loss_and_grads(compiled, model, dtype)
        if device == "cuda":
            torch.cuda.synchronize()
    residual = sum(r.of_pattern(name).fused for r in reports
                   for name in ("residual_adaln_modulate", "residual_rms_norm_modulate"))
    assert residual == 3 * L, "\n".join(r.table() for r in reports)  # norm2, norm3, the next norm1 / the head
    if device == "cuda":
        kernels = {e.name for e in prof.events()}
        assert any("res_fwd_kernel" in k for k in kernels) and any("res_bwd_row_kernel" in k for k in kernels), kernels
    eager = loss_and_grads(model, model, dtype)
    model64 = copy.deepcopy(model).double()
    ref = loss_and_grads(model64, model64, torch.float64)
    for name, g, e, r in zip(["loss", "dx", "demb", *[n for n, _ in model.named_parameters()]],
                             [got[0], *got[1]], [eager[0], *eager[1]], [ref[0], *ref[1]]):
        if dtype == torch.float32:
            assert rel_err(g, e) < 1e-4, f"{name}: {rel_err(g, e):.2e}"
        else:
            assert rel_err(g, r) <= 1.5 * rel_err(e, r) + 2e-3, \
                f"{name}: {rel_err(g, r):.2e} vs eager {rel_err(e, r):.2e}"


# --- what a compiled forward runs ------------------------------------------------------------------


class Blocks(nn.Module):
    """L blocks h = LayerNorm(x) * (1 + scale) + shift; x = x + gate * Linear(h), and a modulated
    head: block 0's norm reads the input, every later norm (and the head's) a gated residual sum.
    Each block has its own shift, scale and gate (emb [B, 3 (L + 1) D]), so that no two adds are the
    same computation (AOTAutograd merges those)."""

    def __init__(self, depth: int):
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(D, D) for _ in range(depth))

    def forward(self, x, emb):
        mods = [m[:, None] for m in emb.chunk(3 * (len(self.lin) + 1), dim=1)]
        for i, lin in enumerate(self.lin):
            sh, sc, g = mods[3 * i:3 * i + 3]
            h = F.layer_norm(x, (D,)) * (1 + sc) + sh
            x = x + g * lin(h)
        sh, sc, _ = mods[-3:]
        return F.layer_norm(x, (D,)) * (1 + sc) + sh


def _top_level_aten(compiled, *inputs) -> collections.Counter:
    """aten::add / aten::mul calls of one forward, outside the adaptiveload ops (whose CPU reference
    computes with them)."""
    with profile() as prof:
        compiled(*inputs)

    def inside_op(event):
        while event is not None:
            if event.name.startswith("adaptiveload::"):
                return True
            event = event.cpu_parent
        return False

    return collections.Counter(e.name for e in prof.events()
                               if e.name in ("aten::add", "aten::mul") and not inside_op(e))


def test_each_folded_site_removes_its_add_and_mul_from_the_compiled_forward(monkeypatch):
    """inner="aot_eager", depth L: unfused, each block runs 3 adds (1 + scale, + shift, the residual)
    and 2 muls (the modulation, the gate), the head 2 and 1; fused, none are left. Against the plain
    patterns alone (the residual patterns removed), the difference is exactly one add and one mul
    per folded site (L: the later blocks' norms and the head's)."""
    L = 3
    model = Blocks(L)
    gen = torch.Generator().manual_seed(0)
    x, emb = torch.randn(2, 5, D, generator=gen, requires_grad=True), torch.randn(2, 3 * (L + 1) * D, generator=gen)
    counts = {}
    for key, options in (("unfused", {"fuse": False}), ("fused", {})):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="adaptiveload", options={"inner": "aot_eager", **options})
        compiled(x, emb)
        counts[key] = _top_level_aten(compiled, x, emb)
    _without_residual_patterns(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="adaptiveload", options={"inner": "aot_eager"})
    compiled(x, emb)
    counts["plain"] = _top_level_aten(compiled, x, emb)
    assert counts["unfused"] == {"aten::add": 3 * L + 2, "aten::mul": 2 * L + 1}
    assert counts["fused"] == {}
    assert counts["plain"] == {"aten::add": L, "aten::mul": L}
    torch.testing.assert_close(compiled(x, emb), model(x, emb))


def test_symbolic_sizes_fuse_and_do_not_recompile():
    """With the batch and sequence length dynamic (as the train job marks them) the site is folded
    on symbolic shapes, and new sizes reuse the graph."""
    fn = FORMS["flux"][0]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="adaptiveload", options={"inner": "aot_eager"})
    with collect_reports() as reports:
        for b, n in ((2, 5), (3, 7), (4, 9)):
            gen = torch.Generator().manual_seed(n)
            x, y = torch.randn(b, n, D, generator=gen), torch.randn(b, n, D, generator=gen)
            emb = torch.randn(b, 6 * D, generator=gen)
            for t, dims in ((x, (0, 1)), (y, (0, 1)), (emb, (0,))):
                torch._dynamo.mark_dynamic(t, dims)
            for got, want in zip(compiled(x, y, emb, None), fn(x, y, emb, None)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(reports) == 1 and reports[0].of_pattern("residual_adaln_modulate").fused == 1, reports[0].table()
