"""The pattern ``rms_norm_modulate`` (adaptiveload/ops/rms_norm_modulate/pattern.py over
adaptiveload/fxfuse/modulate.py and nodes.py) on Dynamo and torch.export graphs.

Every RMSNorm form (``F.rms_norm``, ``torch.rms_norm``, ``nn.RMSNorm``, aten ``rms_norm`` /
``_fused_rms_norm``, and diffusers' hand-written ``x * torch.rsqrt(x.float().pow(2).mean(-1,
keepdim=True) + eps)`` with its variants and casts) followed by each modulate form is
* fused once (the report, the per-pattern counters and the op count agree), its norm nodes gone,
* equal to float64 eager, forward and gradients (the rewritten graph runs the op's autograd).
Each must-not-fuse case (a plain q/k norm, RoPE after the norm, a norm over other dims, a mean
without keepdim, another power, a computed eps, a multiplier without ``1 +``, ...) is left alone,
with its reason where it is seen, and computes what it computed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptiveload.fxfuse import fuse_adaln

D = 16
RMS_OP = torch.ops.adaptiveload.rms_norm_modulate.default


def _mods(emb):
    """shift, scale, gate, shift2, scale2, gate2: [B, D] chunks (strided views) of emb [B, 6D]."""
    return emb.chunk(6, dim=1)


def _diffusers_rms_norm(x, weight=None, eps=1e-6):
    """diffusers' RMSNorm.forward (models/normalization.py), as written there."""
    input_dtype = x.dtype
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight is not None:
        if weight.dtype in [torch.float16, torch.bfloat16]:
            x = x.to(weight.dtype)
        x = x * weight
    else:
        x = x.to(input_dtype)
    return x


def f_functional(x, emb, w):
    sh, sc, *_ = _mods(emb)
    return F.rms_norm(x, (D,), w, 1e-6) * (1 + sc[:, None]) + sh[:, None]


def f_torch_rms_norm_default_eps(x, emb, w):  # eps None: float32's machine epsilon
    sc = _mods(emb)[1]
    return torch.rms_norm(x, (D,)) * (1 + sc[:, None])


class ModuleAddcmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn(D, generator=torch.Generator().manual_seed(1)))

    def forward(self, x, emb, w):
        sh, sc, *_ = _mods(emb)
        return torch.addcmul(sh[:, None], self.norm(x), 1 + sc[:, None])


def f_hand_written_weightless(x, emb, w):  # LTX-Video: RMSNorm(dim, elementwise_affine=False)
    sh, sc, *_ = _mods(emb)
    return _diffusers_rms_norm(x) * (1 + sc[:, None]) + sh[:, None]


def f_hand_written_weight(x, emb, w):  # Lumina2 / Z-Image: RMSNorm(dim) with a weight; scale only
    sc = _mods(emb)[1]
    return _diffusers_rms_norm(x, w) * (1 + sc[:, None])


def f_hand_written_variants(x, emb, w):  # torch.square, .rsqrt(), torch.mean(dim=, keepdim=), scale + 1
    sh, sc, *_ = _mods(emb)
    n = x * (torch.mean(torch.square(x.float()), dim=-1, keepdim=True) + 1e-6).rsqrt()
    return n + n * sc[:, None] + sh[:, None]


def f_hand_written_product(x, emb, w):  # x * x, weight first, Mochi's float32 upcast before the norm
    sc = _mods(emb)[1]
    h = x.to(torch.float32)
    n = w * (h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5))
    return (n * (sc[:, None].float() + 1)).to(x.dtype)


def f_per_token(x, emb, w):
    scale, shift = 0.1 * torch.tanh(x.flip(1)), x.roll(1, dims=1)
    return F.rms_norm(x, (D,), w) * (1 + scale) + shift


def f_shared(x, emb, w):
    return _diffusers_rms_norm(x) * (1 + w)


def f_one_norm_two_modulates(x, emb, w):  # LTX-2's audio_to_video_norm
    sh, sc, _, sh2, sc2, _ = _mods(emb)
    n = F.rms_norm(x, (D,), w, 1e-6)
    return n * (1 + sc[:, None]) + sh[:, None], n * (1 + sc2[:, None]) + sh2[:, None]


VARIANTS = {
    # fn, expected (norm kind, variant) of each chain
    "F.rms_norm": (f_functional, [("F.rms_norm", "norm*(1+scale)+shift")]),
    "torch.rms_norm_default_eps": (f_torch_rms_norm_default_eps, [("F.rms_norm", "norm*(1+scale)")]),
    "nn.RMSNorm_addcmul": (ModuleAddcmul(), [("F.rms_norm", "addcmul")]),
    "hand_written_weightless": (f_hand_written_weightless, [("x*rsqrt(mean(x²)+eps)", "norm*(1+scale)+shift")]),
    "hand_written_weight": (f_hand_written_weight, [("x*rsqrt(mean(x²)+eps)", "norm*(1+scale)")]),
    "hand_written_variants": (f_hand_written_variants, [("x*rsqrt(mean(x²)+eps)", "norm+norm*scale+shift")]),
    "hand_written_product": (f_hand_written_product, [("x*rsqrt(mean(x²)+eps)", "norm*(1+scale)")]),
    "per_token": (f_per_token, [("F.rms_norm", "norm*(1+scale)+shift")]),
    "shared": (f_shared, [("x*rsqrt(mean(x²)+eps)", "norm*(1+scale)")]),
    "one_norm_two_modulates": (f_one_norm_two_modulates, [("F.rms_norm", "norm*(1+scale)+shift")] * 2),
}


def _inputs(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, D, generator=gen).mul(2).add(0.3).to(dtype).requires_grad_()
    emb = (0.5 * torch.randn(2, 6 * D, generator=gen)).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).requires_grad_()
    return x, emb, w


def _rms_norms_left(gm) -> int:
    """RMSNorm-related nodes left: rms_norm calls and rsqrt."""
    targets = {torch.rms_norm, F.rms_norm, torch.rsqrt, torch.ops.aten.rsqrt.default,
               torch.ops.aten.rms_norm.default, torch.ops.aten._fused_rms_norm.default}
    return sum(1 for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
               if n.target in targets or (n.op == "call_method" and n.target == "rsqrt"))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_form_is_fused_and_exact(name, capture, fused_op_count, counter, float64_reference, run_with_grads):
    fn, expected = VARIANTS[name]
    inputs = _inputs()
    gm, example_inputs = capture(fn, *inputs)
    before = {k: counter(k) for k in ("fused", "rms_norm_modulate.fused", "adaln_modulate.fused")}

    report = fuse_adaln(gm)

    assert report.fused == report.seen == len(expected), report.table()
    assert [(c.norm, c.variant) for c in report.chains] == expected
    assert {c.pattern for c in report.chains} == {"rms_norm_modulate"}
    assert counter("fused") - before["fused"] == len(expected)
    assert counter("rms_norm_modulate.fused") - before["rms_norm_modulate.fused"] == len(expected)
    assert counter("adaln_modulate.fused") == before["adaln_modulate.fused"]
    assert sum(1 for n in gm.graph.nodes if n.target is RMS_OP) == len(expected)
    assert fused_op_count(gm) == 0  # no LayerNorm op
    assert _rms_norms_left(gm) == 0
    gm.graph.lint()

    out, grads = run_with_grads(lambda *a: gm(*example_inputs), inputs)
    ref_out, ref_grads = float64_reference(fn, inputs)
    for o, r in zip(out, ref_out):
        torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)
    assert len(grads) == len(ref_grads) == 3
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)  # (w unused by some forms)
        if g is not None:
            torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=5e-5)


def test_bf16_hand_written_chain_is_at_least_as_accurate_as_eager(capture):
    """diffusers' bf16 chain rounds x_hat, x_hat * w and the modulation to bf16 in turn; the op
    computes in float32 and rounds once: closer to float64, and the output keeps the chain's dtype."""
    x, emb, w = (t.detach() for t in _inputs(3, torch.bfloat16))
    x = torch.randn(2, 64, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    gm, example_inputs = capture(f_hand_written_weight, x, emb, w)
    eager = gm(*example_inputs)[0]
    report = fuse_adaln(gm)
    assert report.fused == 1, report.table()
    fused = gm(*example_inputs)[0]
    ref = f_hand_written_weight(x.double(), emb.double(), w.double())
    assert fused.dtype == eager.dtype == torch.bfloat16
    assert (fused.double() - ref).norm() <= (eager.double() - ref).norm()


@pytest.mark.parametrize("decompose", [False, True], ids=["aten.rms_norm", "decomposed"])
def test_torch_export_graphs(decompose):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(D, eps=1e-6)
            self.ada = nn.Linear(D, 2 * D)

        def forward(self, x, c):
            shift, scale = self.ada(c).chunk(2, dim=1)
            return self.norm(x) * (1 + scale[:, None]) + shift[:, None]

    model = Block()
    x, c = torch.randn(2, 5, D), torch.randn(2, D)
    expected = model(x, c)
    program = torch.export.export(model, (x, c))
    if decompose:
        program = program.run_decompositions()
    report = fuse_adaln(program.graph_module)
    assert report.fused == report.seen == 1, report.table()
    assert report.chains[0].norm in ("aten.rms_norm", "aten._fused_rms_norm", "x*rsqrt(mean(x²)+eps)")
    assert _rms_norms_left(program.graph_module) == 0
    torch.testing.assert_close(program.module()(x, c), expected, atol=1e-5, rtol=1e-5)


def test_symbolic_trace_fuses_call_module_rms_norm():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(D, eps=1e-6)

        def forward(self, x, emb):
            sh, sc = emb[:, :D], emb[:, D:2 * D]
            return self.norm(x) * (1 + sc[:, None]) + sh[:, None]

    model = Block()
    x, emb, _ = (t.detach() for t in _inputs())
    gm = torch.fx.symbolic_trace(model)
    report = fuse_adaln(gm, (x, emb))
    assert report.fused == 1 and [c.norm for c in report.chains] == ["nn.RMSNorm"], report.table()
    torch.testing.assert_close(gm(x, emb), model(x, emb), atol=1e-6, rtol=1e-6)


# --- must not fuse ------------------------------------------------------------------------------


def n_qk_norm(x, emb, w):  # a plain q/k norm: the normalised tensor feeds a matmul
    q = F.rms_norm(x, (D,), w, 1e-6)
    return q @ q.transpose(1, 2)


def n_two_dims(x, emb, w):
    sc = _mods(emb)[1]
    return F.rms_norm(x, x.shape[-2:]) * (1 + sc[:, None])


def n_mean_over_tokens(x, emb, w):
    sc = _mods(emb)[1]
    return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * (1 + sc[:, None])


def n_cube(x, emb, w):
    sc = _mods(emb)[1]
    return x * torch.rsqrt(x.abs().pow(3).mean(-1, keepdim=True) + 1e-6) * (1 + sc[:, None])


def n_other_tensor(x, emb, w):  # normalises x by the RMS of x.flip(1)
    sc = _mods(emb)[1]
    return x * torch.rsqrt(x.flip(1).pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + sc[:, None])


def n_narrowed_square(x, emb, w):  # the statistics from a bf16 rounding of x: not x's RMS
    sc = _mods(emb)[1]
    return x * torch.rsqrt(x.bfloat16().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + sc[:, None])


def n_computed_eps(x, emb, w):
    sc = _mods(emb)[1]
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + w[:1].abs()) * (1 + sc[:, None])


def n_unscaled(x, emb, w):
    sh, sc, *_ = _mods(emb)
    return F.rms_norm(x, (D,)) * sc[:, None] + sh[:, None]


def n_norm_used_elsewhere(x, emb, w):
    sc = _mods(emb)[1]
    n = _diffusers_rms_norm(x, w)
    return n * (1 + sc[:, None]), n.sum()


UNSCALED = "multiplier is not `1 + scale` (the op computes norm * (1 + scale))"
DONT_FUSE = {
    # fn, the reason of each chain seen (a part of it); [] for nothing seen
    "qk_norm": (n_qk_norm, []),
    "two_dims": (n_two_dims, ["RMSNorm over the last 2 dims"]),
    "mean_over_tokens": (n_mean_over_tokens, ["the mean is over dims [1], not the last one"]),
    "cube": (n_cube, ["raises to the power 3, not 2"]),
    "other_tensor": (n_other_tensor, ["squares `flip`, not an exact cast of the normalised"]),
    "narrowed_square": (n_narrowed_square, ["squares `bfloat16`, not an exact cast of the normalised"]),
    "computed_eps": (n_computed_eps, ["eps is computed in the graph"]),
    "no_one_plus": (n_unscaled, [UNSCALED]),
    "norm_used_elsewhere": (n_norm_used_elsewhere, ["normalised tensor also feeds `sum_1` outside the chain"]),
}


@pytest.mark.parametrize("name", list(DONT_FUSE))
def test_unsafe_chain_is_left_alone(name, capture, counter):
    fn, reasons = DONT_FUSE[name]
    gm, example_inputs = capture(fn, *_inputs())
    code = gm.code
    expected = gm(*example_inputs)
    before = counter("rms_norm_modulate.skipped")

    report = fuse_adaln(gm)

    assert report.seen == len(reasons) and report.fused == 0, report.table()
    assert counter("rms_norm_modulate.skipped") - before == len(reasons)
    for chain, reason in zip(report.chains, reasons):
        assert reason in chain.reason, report.table()
    assert gm.code == code
    out = gm(*example_inputs)
    for o, e in zip(out, expected):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


def test_backend_fuses_both_patterns_and_counts_each(counter):
    """One compile with a LayerNorm chain and an RMSNorm chain: the totals and each pattern's
    counters, and one forward call of each op."""
    def two(x, emb, w):
        sh, sc, *_ = _mods(emb)
        y = F.layer_norm(x, (D,)) * (1 + sc[:, None]) + sh[:, None]
        return _diffusers_rms_norm(y, w) * (1 + sc[:, None])

    x, emb, w = _inputs()
    before = {k: counter(k) for k in ("fused", "seen", "adaln_modulate.fused", "rms_norm_modulate.fused")}
    torch._dynamo.reset()
    compiled = torch.compile(two, backend="adaptiveload", options={"inner": "aot_eager"}, fullgraph=True)
    out = compiled(x, emb, w)
    assert counter("fused") - before["fused"] == 2 and counter("seen") - before["seen"] == 2
    assert counter("adaln_modulate.fused") - before["adaln_modulate.fused"] == 1
    assert counter("rms_norm_modulate.fused") - before["rms_norm_modulate.fused"] == 1
    torch.testing.assert_close(out, two(x, emb, w), atol=1e-5, rtol=1e-5)
