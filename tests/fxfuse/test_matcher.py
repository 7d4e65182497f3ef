"""The chain patterns and their check (adaptiveload/fxfuse/patterns.py, nodes.py), on Dynamo graphs.

Each variant is captured with Dynamo, rewritten with ``fuse_adaln`` and then
* fused the expected number of times (the report, the counter delta and the op count agree),
* left with no norm node where it was fused,
* equal to float64 eager, forward and gradients (the rewritten graph runs the op's autograd).
Each don't-fuse case is left alone, reported with its reason, and still computes the same.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptiveload.fxfuse import fuse_adaln
from adaptiveload.fxfuse.backend import copy_graph_module

D = 16


def _mods(emb):
    """shift, scale, gate, shift2, scale2, gate2: [B, D] chunks (strided views) of emb [B, 6D]."""
    return emb.chunk(6, dim=1)


def v_operator(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    return F.layer_norm(x, (D,)) * (1 + sc.unsqueeze(1)) + sh.unsqueeze(1)


def v_reversed_operands(x, emb, w, b):  # affine, (scale + 1), factor first, shift first, [:, None]
    sh, sc, *_ = _mods(emb)
    return sh[:, None] + (sc[:, None] + 1) * F.layer_norm(x, (D,), w, b, 1e-6)


def v_torch_functions(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    return torch.add(torch.mul(F.layer_norm(x, (D,)), torch.add(sc.unsqueeze(1), 1)), sh.unsqueeze(1))


def v_tensor_methods(x, emb, w, b):  # weight only
    sh, sc, *_ = _mods(emb)
    return F.layer_norm(x, (D,), w).mul(sc.unsqueeze(1).add(1)).add(sh.unsqueeze(1))


def v_addcmul(x, emb, w, b):  # bias only
    sh, sc, *_ = _mods(emb)
    return torch.addcmul(sh[:, None], F.layer_norm(x, (D,), None, b), 1 + sc[:, None])


def v_addcmul_method(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    return sh[:, None].addcmul(1 + sc[:, None], F.layer_norm(x, (D,), w, b))


def v_norm_plus_scaled(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    n = F.layer_norm(x, (D,), w, b)
    return n + n * sc[:, None] + sh[:, None]


def v_norm_plus_scaled_no_shift(x, emb, w, b):
    sc = _mods(emb)[1]
    n = F.layer_norm(x, (D,))
    return n * sc[:, None] + n


def v_view_reshape(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    B = x.shape[0]
    return F.layer_norm(x, (D,)) * (1 + sc.view(B, 1, D)) + sh.reshape(B, 1, D)


def v_split(x, emb, w, b):
    sh, sc = emb.split(D, dim=1)[:2]
    return F.layer_norm(x, (D,)) * (1 + sc[:, None]) + sh[:, None]


def v_indexing(x, emb, w, b):  # [B, 6, D] table indexed: strided [B, 1, D] views
    table = emb.view(x.shape[0], 6, D)
    return F.layer_norm(x, (D,)) * (1 + table[:, 1:2]) + table[:, 0:1]


def v_viewed_one_plus(x, emb, w, b):  # diffusers AdaLayerNormContinuous: (1 + scale)[:, None, :]
    sh, sc, *_ = _mods(emb)
    return F.layer_norm(x, (D,), w, b) * (1 + sc)[:, None, :] + sh[:, None, :]


def v_unsqueezed_one_plus_addcmul(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    return torch.addcmul(sh.unsqueeze(1), F.layer_norm(x, (D,)), (sc + 1).unsqueeze(1))


def v_shared_one_plus(x, emb, w, b):  # one `1 + scale` feeding two chains
    sh, sc, *_ = _mods(emb)
    factor = 1 + sc[:, None]
    y1 = F.layer_norm(x, (D,)) * factor + sh[:, None]
    y2 = F.layer_norm(x.flip(1), (D,), w, b) * factor + sh[:, None]
    return y1, y2


def v_scale_only(x, emb, w, b):
    return F.layer_norm(x, (D,), w, b) * (1 + _mods(emb)[1][:, None])


def v_per_token(x, emb, w, b):  # [B, N, D] modulation
    scale, shift = 0.1 * torch.tanh(x.flip(1)), x.roll(1, dims=1)
    return F.layer_norm(x, (D,)) * (1 + scale) + shift


def v_shared_param_modulation(x, emb, w, b):  # [D] scale and shift, shared by all rows
    return F.layer_norm(x, (D,)) * (1 + w) + b


def v_one_norm_two_modulates(x, emb, w, b):
    sh, sc, _, sh2, sc2, _ = _mods(emb)
    n = F.layer_norm(x, (D,), w, b)
    return n * (1 + sc[:, None]) + sh[:, None], n * (1 + sc2[:, None]) + sh2[:, None]


def v_wan_casts(x, emb, w, b):  # Wan: norm(x.float()) * (1 + scale) + shift in fp32, cast back
    xb = x.to(torch.bfloat16)
    sh, sc, *_ = _mods(emb.float())
    return (F.layer_norm(xb.float(), (D,), eps=1e-6) * (1 + sc[:, None]) + sh[:, None]).type_as(xb)


def v_fp32_layernorm(x, emb, w, b):  # diffusers FP32LayerNorm: .float() params, .to(origin) after
    xb = x.to(torch.bfloat16)
    n = F.layer_norm(xb.float(), (D,), w.float(), b.float(), 1e-6).to(xb.dtype)
    sh, sc, *_ = _mods(emb)
    return (n * (1 + sc[:, None]) + sh[:, None]).to(torch.bfloat16)


class _AdaLNModule(nn.Module):
    """nn.LayerNorm modules (affine and not) inside a module, as in DiT blocks."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(D)

    def forward(self, x, emb, w, b):
        sh, sc, _, sh2, sc2, _ = _mods(emb)
        h = self.norm1(x) * (1 + sc[:, None]) + sh[:, None]
        return self.norm2(h) * (1 + sc2[:, None]) + sh2[:, None]


VARIANTS = {
    "operator": (v_operator, 1),
    "reversed_operands_affine": (v_reversed_operands, 1),
    "torch_functions": (v_torch_functions, 1),
    "tensor_methods_weight_only": (v_tensor_methods, 1),
    "addcmul_bias_only": (v_addcmul, 1),
    "addcmul_method": (v_addcmul_method, 1),
    "norm_plus_norm_times_scale": (v_norm_plus_scaled, 1),
    "norm_plus_norm_times_scale_no_shift": (v_norm_plus_scaled_no_shift, 1),
    "view_reshape": (v_view_reshape, 1),
    "split": (v_split, 1),
    "indexing": (v_indexing, 1),
    "viewed_one_plus_scale": (v_viewed_one_plus, 1),
    "unsqueezed_one_plus_scale_addcmul": (v_unsqueezed_one_plus_addcmul, 1),
    "shared_one_plus_scale": (v_shared_one_plus, 2),
    "scale_only": (v_scale_only, 1),
    "per_token": (v_per_token, 1),
    "shared_modulation": (v_shared_param_modulation, 1),
    "one_norm_two_modulates": (v_one_norm_two_modulates, 2),
    "wan_casts": (v_wan_casts, 1),
    "fp32_layernorm": (v_fp32_layernorm, 1),
    "nn_layernorm_modules": (_AdaLNModule(), 2),
}


def _assert_matches_reference(out, grads, ref_out, ref_grads, low_precision: bool):
    tol = dict(atol=3e-2, rtol=3e-2) if low_precision else dict(atol=1e-5, rtol=1e-5)
    assert len(out) == len(ref_out) and len(grads) == len(ref_grads)
    for o, r in zip(out, ref_out):
        torch.testing.assert_close(o.double(), r.double(), **tol)
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g.double(), r.double(), **tol)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_is_fused_and_exact(name, capture, norm_count, fused_op_count, counter, block_inputs,
                                    float64_reference, run_with_grads):
    fn, expected = VARIANTS[name]
    inputs = block_inputs()
    gm, example_inputs = capture(fn, *inputs)
    norms_before = norm_count(gm)
    work = copy_graph_module(gm)

    before = counter("fused")
    report = fuse_adaln(work)

    assert report.fused == expected and report.skipped == 0, report.table()
    assert counter("fused") - before == expected
    assert fused_op_count(work) == expected
    assert norm_count(work) == norms_before - (1 if name == "one_norm_two_modulates" else expected)
    work.graph.lint()
    # the rewritten graph (the op's autograd) against float64 eager, forward and backward
    ref_out, ref_grads = float64_reference(fn, inputs)
    out, grads = run_with_grads(lambda *a: work(*example_inputs), inputs)
    _assert_matches_reference(out, grads, ref_out, ref_grads, low_precision=name in ("wan_casts", "fp32_layernorm"))


def test_fused_result_is_as_accurate_as_eager_in_bfloat16(capture, block_inputs):
    """The op skips the chain's intermediate roundings: never less accurate than the eager chain."""
    def chain_bf16(x, emb, w, b):
        xb, eb = x.to(torch.bfloat16), emb.to(torch.bfloat16)
        sh, sc, *_ = _mods(eb)
        return F.layer_norm(xb, (D,)) * (1 + sc[:, None]) + sh[:, None]

    x, emb, w, b = [t.detach() for t in block_inputs(B=4, N=64)]
    gm, example_inputs = capture(chain_bf16, x, emb, w, b)
    work = copy_graph_module(gm)
    assert fuse_adaln(work).fused == 1
    ref = v_operator(x.to(torch.bfloat16).double(), emb.to(torch.bfloat16).double(), w, b)
    fused, eager = work(*example_inputs)[0].double(), chain_bf16(x, emb, w, b).double()
    assert (fused - ref).norm() / ref.norm() <= (eager - ref).norm() / ref.norm()


def test_autocast_region_is_fused_and_at_least_as_accurate(capture, block_inputs):
    def under_autocast(h, emb, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sh, sc, *_ = _mods(emb)
            return F.layer_norm(h, (D,), w, b) * (1 + sc[:, None]) + sh[:, None]

    x, emb, w, b = [t.detach() for t in block_inputs(B=4, N=64)]
    h, emb = x.to(torch.bfloat16), emb.to(torch.bfloat16)
    gm, example_inputs = capture(under_autocast, h, emb, w, b)
    work = copy_graph_module(gm)
    assert fuse_adaln(work).fused == 1
    fused, eager = work(*example_inputs)[0], under_autocast(h, emb, w, b)
    assert fused.dtype == eager.dtype
    sh, sc, *_ = _mods(emb.double())
    ref = F.layer_norm(h.double(), (D,), w.double(), b.double()) * (1 + sc[:, None]) + sh[:, None]
    assert (fused.double() - ref).norm() / ref.norm() <= (eager.double() - ref).norm() / ref.norm()


# --- chains that must be left alone ------------------------------------------------------------------


def n_outside_user_of_norm(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    n = F.layer_norm(x, (D,))
    return n * (1 + sc[:, None]) + sh[:, None] + n.mean()


def n_outside_user_of_product(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    h = F.layer_norm(x, (D,)) * (1 + sc[:, None])
    return h + sh[:, None], h.sum()


def n_last_two_dims(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    return F.layer_norm(x, x.shape[-2:]) * (1 + sc[:, None]) + sh[:, None]


def n_unscaled(x, emb, w, b):
    sh, sc, *_ = _mods(emb)
    return F.layer_norm(x, (D,)) * sc[:, None] + sh[:, None]


def n_scale_broadcast_over_channels(x, emb, w, b):  # [B, N, 1] scale: not a [.., D] modulation
    sh = _mods(emb)[0]
    return F.layer_norm(x, (D,)) * (1 + emb[:, : x.shape[1], None]) + sh[:, None]


def n_modulation_grows_batch(x, emb, w, b):  # x batch 1, modulation batch 2: output is not x-shaped
    sh, sc, *_ = _mods(emb)
    return F.layer_norm(x[:1], (D,)) * (1 + sc[:, None]) + sh[:, None]


def n_sibling_not_fusable(x, emb, w, b):
    sh, sc, _, sh2, sc2, _ = _mods(emb)
    n = F.layer_norm(x, (D,))
    return n * (1 + sc[:, None]) + sh[:, None], n * sc2[:, None]


UNSCALED = "multiplier is not `1 + scale` (the op computes norm * (1 + scale))"

DONT_FUSE = {
    # fn, the reason of each chain seen (a part of it), in report order
    "norm_has_outside_user": (n_outside_user_of_norm, ["normalised tensor also feeds `mean` outside the chain"]),
    "product_has_outside_user": (n_outside_user_of_product, ["intermediate `h` also feeds `sum_1`"]),
    "layernorm_over_two_dims": (n_last_two_dims, ["LayerNorm over the last 2 dims"]),
    "no_one_plus": (n_unscaled, [UNSCALED]),
    "scale_over_tokens_not_channels": (n_scale_broadcast_over_channels, ["scale: shape [2, 5, 1]"]),
    "modulation_grows_batch": (n_modulation_grows_batch, ["scale: shape [2, 1, 16]"]),
    # the fusable chain sharing the norm with a rejected one says why it is left alone too
    "sibling_chain_not_fusable": (n_sibling_not_fusable,
                                  [f"shares its norm with a chain that is not fused ({UNSCALED})", UNSCALED]),
}


@pytest.mark.parametrize("name", list(DONT_FUSE))
def test_unsafe_chain_is_left_alone(name, capture, norm_count, fused_op_count, counter, block_inputs):
    fn, reasons = DONT_FUSE[name]
    gm, example_inputs = capture(fn, *block_inputs())
    code_before = gm.code
    expected = [o.detach() for o in (lambda r: r if isinstance(r, tuple) else (r,))(gm(*example_inputs))]
    norms = norm_count(gm)

    before = counter("skipped")
    report = fuse_adaln(gm)

    assert report.seen == len(reasons) and report.fused == 0, report.table()
    assert counter("skipped") - before == len(reasons)
    for chain, reason in zip(report.chains, reasons):
        assert reason in chain.reason, report.table()
    assert gm.code == code_before and norm_count(gm) == norms and fused_op_count(gm) == 0
    out = gm(*example_inputs)
    for o, e in zip(out if isinstance(out, tuple) else (out,), expected):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


def test_modulate_without_norm_is_not_a_chain(capture, counter, block_inputs):
    def no_norm(x, emb, w, b):
        sh, sc, *_ = _mods(emb)
        return x * (1 + sc[:, None]) + sh[:, None]

    gm, _ = capture(no_norm, *block_inputs())
    before = counter("seen")
    report = fuse_adaln(gm)
    assert report.seen == 0 and counter("seen") == before


def test_report_records_layout_variant_and_affinity(capture, block_inputs):
    def three(x, emb, w, b):
        sh, sc, *_ = _mods(emb)
        y = F.layer_norm(x, (D,), w, b) * (1 + sc[:, None]) + sh[:, None]  # per-sample
        y = torch.addcmul(b, F.layer_norm(y, (D,)), 1 + x.flip(1))  # per-token scale, shared shift
        return F.layer_norm(y, (D,)) * (1 + w)  # shared, no shift

    gm, _ = capture(three, *block_inputs())
    chains = fuse_adaln(gm).chains
    assert [(c.norm, c.affine, c.variant, c.layout) for c in chains] == [
        ("F.layer_norm", True, "norm*(1+scale)+shift", "per-sample"),
        ("F.layer_norm", False, "addcmul", "scale per-token, shift shared"),
        ("F.layer_norm", False, "norm*(1+scale)", "shared, no shift"),
    ]
    assert all(c.source.startswith("test_matcher.py:") for c in chains)


# --- dtype casts after the chain ----------------------------------------------------------------------


def _modulate(x, emb):
    sh, sc, *_ = _mods(emb)
    return F.layer_norm(x, (D,)) * (1 + sc[:, None]) + sh[:, None]


def c_half_then_float(x, emb):  # the fp16 rounding and overflow (shift 7e4 > 65504) stay
    return _modulate(x, emb).half().float()


def c_bfloat16_then_float(x, emb):
    return _modulate(x, emb).to(torch.bfloat16).float()


def c_wan_type_as(x, emb):  # Wan: fp32 chain of a bf16 stream, cast back with .type_as(x)
    xb = x.to(torch.bfloat16)
    return _modulate(xb.float(), emb).type_as(xb)


def c_double_then_half(x, emb):  # a widening, then a narrowing: the op rounds once, to fp16
    return _modulate(x, emb).double().half()


def c_double(x, emb):  # a widening only: it stays, reading the chain's float32 result
    return _modulate(x, emb).double()


CAST_TAILS = {
    # fn, the op's out dtype (that of the chain's last narrowing), the casts left after the op
    "half_then_float": (c_half_then_float, torch.float16, ["float"]),
    "bfloat16_then_float": (c_bfloat16_then_float, torch.bfloat16, ["float"]),
    "wan_type_as": (c_wan_type_as, torch.bfloat16, []),
    "double_then_half": (c_double_then_half, torch.float16, []),
    "double": (c_double, torch.float32, ["double"]),
}


def _casts_after(node):
    """The ``call_method`` casts reading ``node``, one after the other, by name."""
    names = []
    while len(node.users) == 1 and next(iter(node.users)).op == "call_method":
        node = next(iter(node.users))
        names.append(node.target)
    return names


@pytest.mark.parametrize("name", list(CAST_TAILS))
def test_trailing_casts_are_absorbed_up_to_the_last_narrowing(name, capture, block_inputs):
    fn, out_dtype, left = CAST_TAILS[name]
    x, emb, _, _ = [t.detach() for t in block_inputs(B=2, N=64)]
    emb[0, :D] = 7e4  # sample 0's shift: past float16's largest finite value, 65504
    gm, example_inputs = capture(fn, x, emb)
    work = copy_graph_module(gm)

    assert fuse_adaln(work).fused == 1
    out, eager = work(*example_inputs)[0], fn(x, emb)
    assert out.dtype == eager.dtype
    if out_dtype == torch.float16:
        assert eager[0].isinf().all() and eager[1].isfinite().all()
    # equal to eager up to one rounding step of out_dtype (the op's float32 arithmetic is not the
    # chain's, so a value next to a rounding boundary may round the other way); inf where eager's is
    torch.testing.assert_close(out.double(), eager.double(), rtol=torch.finfo(out_dtype).eps, atol=1e-6)
    # and eager's rounding to out_dtype happened: every value is one of out_dtype's
    assert torch.equal(out.to(out_dtype).to(out.dtype), out), f"the output is not rounded to {out_dtype}"
    (op,) = [n for n in work.graph.nodes if n.target is torch.ops.adaptiveload.adaln_modulate.default]
    assert op.args[-1] == out_dtype
    (getitem,) = op.users
    assert _casts_after(getitem) == left


# --- not modulations: the added term is computed from the normalised tensor -------------------------------


def _rotate_pairs(x):
    """diffusers' apply_rotary_emb (use_real_unbind_dim=-1): (x0, x1) -> (-x1, x0) in each pair."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([-x_imag, x_real], dim=-1).flatten(3)


class _QKNormRoPE(nn.Module):
    """Flux attention: q of [B, N, heads, head_dim] through an RMSNorm (or a LayerNorm) over head_dim,
    then RoPE ``(x.float() * cos + rotate(x).float() * sin).to(x.dtype)`` with cos/sin [N, head_dim]."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm_q = norm

    def forward(self, q, cos, sin):
        x = self.norm_q(q)
        return (x.float() * cos[:, None] + _rotate_pairs(x).float() * sin[:, None]).to(x.dtype)


def n_shift_from_norm(q, cos, sin):  # norm * (1 + scale) + flip(norm): the added term reads the norm
    n = F.layer_norm(q, q.shape[-1:])
    return n * (1 + cos[:, None]) + n.flip(1)


NOT_MODULATIONS = {
    "rope_after_rms_norm": _QKNormRoPE(nn.RMSNorm(8, eps=1e-6)),
    "rope_after_layer_norm": _QKNormRoPE(nn.LayerNorm(8, elementwise_affine=False)),
    "shift_computed_from_the_norm": n_shift_from_norm,
}


@pytest.mark.parametrize("name", list(NOT_MODULATIONS))
def test_terms_computed_from_the_norm_are_no_modulation(name, capture, counter, norm_count):
    fn = NOT_MODULATIONS[name]
    gen = torch.Generator().manual_seed(0)
    q, angles = torch.randn(2, 5, 2, 8, generator=gen), torch.randn(5, 8, generator=gen)
    gm, _ = capture(fn, q, angles.cos(), angles.sin())
    code = gm.code
    assert norm_count(gm) == 1
    before = counter("seen")

    report = fuse_adaln(gm)

    assert report.seen == 0 and counter("seen") == before, report.table()
    assert gm.code == code
