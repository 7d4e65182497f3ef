"""The ``rms_norm_rope`` pattern on an attention written as diffusers' ``WanAttnProcessor`` writes it
(q/k RMSNorm across heads, the head split, ``apply_rotary_emb``): each site folded into one op call,
training equal to eager; the must-not-fuse cases left as written, with the reason; the device switch.
(diffusers' own Wan model: tests/fxfuse/test_models.py.)"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaptiveload.fxfuse import collect_reports
from adaptiveload.models.rope import apply_rope
from adaptiveload.ops.rms_norm_rope import pattern as rope_pattern

HEADS, HEAD_DIM = 2, 8
DIM = HEADS * HEAD_DIM


def apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):
    """diffusers 0.42.1 ``WanAttnProcessor.__call__``'s inner function, as written there."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def other_rotation(hidden_states, freqs_cos, freqs_sin):
    """Not a rotation: the even outputs add where apply_rotary_emb subtracts."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * freqs_cos[..., 0::2] + x2 * freqs_sin[..., 1::2]
    out[..., 1::2] = x1 * freqs_sin[..., 1::2] + x2 * freqs_cos[..., 0::2]
    return out.type_as(hidden_states)


def rotation_into_float32(hidden_states, freqs_cos, freqs_sin):
    """apply_rotary_emb storing into a float32 buffer (``empty_like(..., dtype=)``): another computation."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states, dtype=torch.float32)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def stacked_rotation(hidden_states, freqs_cos, freqs_sin):
    """adaptiveload's own Wan model (``adaptiveload.models.rope.apply_rope``: a cast to the tables'
    dtype, ``torch.stack`` of the even and odd outputs, ``flatten``, a cast back) on [S, Dh / 2] tables."""
    return apply_rope(hidden_states, freqs_cos[0, :, 0, 0::2], freqs_sin[0, :, 0, 1::2])


def stacked_odd_first(hidden_states, freqs_cos, freqs_sin):
    """Not the rotation: the stack puts the odd outputs first."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack([x1 * sin + x2 * cos, x1 * cos - x2 * sin], dim=-1).flatten(-2)


def stacked_along_pairs(hidden_states, freqs_cos, freqs_sin):
    """Not the rotation: the even and odd halves stacked along another dim (not interleaved)."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-2).flatten(-2)


class Attention(nn.Module):
    """Self-attention as WanAttnProcessor computes it; ``rotate`` picks the rotation, ``leak`` also
    returns the split query (read outside the rotation)."""

    def __init__(self, rotate=apply_rotary_emb, leak=False, rope=True):
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(DIM, DIM) for _ in range(4))
        self.norm_q, self.norm_k = nn.RMSNorm(DIM, eps=1e-6), nn.RMSNorm(DIM, eps=1e-6)
        with torch.no_grad():
            for norm in (self.norm_q, self.norm_k):
                norm.weight.uniform_(0.5, 1.5)
        self.rotate, self.leak, self.rope = rotate, leak, rope

    def forward(self, x, freqs_cos, freqs_sin):
        q, k, v = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(x)), self.to_v(x)
        q, k, v = (t.unflatten(2, (HEADS, -1)) for t in (q, k, v))
        split_q = q
        if self.rope:
            q, k = self.rotate(q, freqs_cos, freqs_sin), self.rotate(k, freqs_cos, freqs_sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = self.to_out(out.transpose(1, 2).flatten(2))
        return (out, split_q) if self.leak else out


def _inputs(S=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, S, DIM, generator=gen)
    angles = (torch.rand(1, S, 1, HEAD_DIM // 2, generator=gen) * 6.28).repeat_interleave(2, -1)
    return x, angles.cos(), angles.sin()


def _loss(out):
    return sum(o.float().square().mean() for o in (out if isinstance(out, tuple) else (out,)))


def _compiled_run(module, args, inner="aot_eager"):
    """Loss, gradients, the backend's reports and the adaptiveload op calls of one compiled forward."""
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="adaptiveload", options={"inner": inner}, fullgraph=True)
    with collect_reports() as reports:
        loss = _loss(compiled(*args))
    grads = torch.autograd.grad(loss, list(module.parameters()))
    with torch.profiler.profile() as prof:
        compiled(*args)
    calls = collections.Counter(e.name for e in prof.events() if e.name.startswith("adaptiveload::"))
    return loss, grads, reports, calls


@pytest.mark.parametrize("rotate, variant", [(apply_rotary_emb, rope_pattern.VARIANT),
                                             (stacked_rotation, rope_pattern.VARIANT_STACK)])
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_wan_attention_folds_q_and_k_and_trains_as_eager(rotate, variant, dtype, rtol):
    """Both sites folded, in either written form of the rotation; loss and every gradient equal eager's
    (in bf16 within its rounding: the op rounds once where the chain rounds after each step, as
    Inductor's generated kernel does)."""
    torch.manual_seed(0)
    module, args = Attention(rotate=rotate).to(dtype), tuple(t.to(dtype) for t in _inputs())
    ref_loss = _loss(module(*args))
    ref_grads = torch.autograd.grad(ref_loss, list(module.parameters()))
    loss, grads, reports, calls = _compiled_run(module, args)
    (report,) = reports
    rope = report.of_pattern("rms_norm_rope")
    assert rope.fused == 2 and rope.skipped == 0, report.table()
    assert all(c.norm == "F.rms_norm" and c.affine and c.variant == variant for c in rope.chains), report.table()
    # (nn.RMSNorm inlined)
    assert calls == {"adaptiveload::rms_norm_rope": 2}
    torch.testing.assert_close(loss, ref_loss, rtol=rtol / 10, atol=1e-6)
    for g, r in zip(grads, ref_grads):  # (plus an absolute floor: the key bias's true gradient is ~0)
        assert (g.double() - r.double()).norm() <= rtol * r.double().norm() + 1e-5


@pytest.mark.parametrize("kwargs, fused, reason", [
    (dict(leak=True), 1, "is also read by"),  # the split query also leaves the graph: k's site alone folds
    (dict(rotate=other_rotation), 0, None),  # not the rotation: no site
    (dict(rotate=rotation_into_float32), 0, None),  # a buffer of another dtype: no site
    (dict(rotate=stacked_odd_first), 0, None),  # the stack's outputs swapped: no site
    (dict(rotate=stacked_along_pairs), 0, None),  # stacked along another dim: no site
    (dict(rope=False), 0, None),  # a plain q/k norm: no site
])
def test_what_is_not_a_site_is_left_as_written(kwargs, fused, reason):
    torch.manual_seed(0)
    module, args = Attention(**kwargs), _inputs()
    ref_loss = _loss(module(*args))
    loss, _, reports, calls = _compiled_run(module, args)
    (report,) = reports
    left = [c for c in report.deferred if c.pattern == "rms_norm_rope"]
    assert report.of_pattern("rms_norm_rope").fused == fused and calls["adaptiveload::rms_norm_rope"] == fused
    if reason is None:
        assert not left, report.table()
    else:
        assert len(left) == 1 and reason in left[0].reason, report.table()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_a_device_type_outside_fused_devices_defers_the_site(monkeypatch):
    """The device switch: on a device type outside FUSED_DEVICES the site is left as written, recorded
    as deferred with the reason (here the CPU taken out of the set)."""
    monkeypatch.setattr(rope_pattern, "FUSED_DEVICES", frozenset())
    torch.manual_seed(0)
    _, _, reports, calls = _compiled_run(Attention(), _inputs())
    (report,) = reports
    assert not calls
    assert [c.reason for c in report.deferred] == ["rms_norm_rope does not fold CPU sites (not in FUSED_DEVICES)"] * 2


def test_a_new_sequence_length_reuses_the_fold():
    """Dynamic sequence lengths: a second length recompiles once with symbolic sizes and still folds."""
    torch.manual_seed(0)
    module = Attention()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="adaptiveload", options={"inner": "aot_eager"})
    with collect_reports() as reports:
        for S in (6, 10, 14):
            x, c, s = _inputs(S)
            torch.testing.assert_close(compiled(x, c, s), module(x, c, s), rtol=1e-5, atol=1e-6)
    assert all(r.of_pattern("rms_norm_rope").fused == 2 for r in reports) and 1 <= len(reports) <= 2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_sites_fold_into_the_kernels_under_inductor(dtype, rtol):
    """On CUDA ("cuda" in FUSED_DEVICES), with Inductor compiling the rest: both sites folded into the
    op's kernels, loss and every gradient equal to eager's on the same GPU (bf16 within its rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert "cuda" in rope_pattern.FUSED_DEVICES
    torch.manual_seed(0)
    module = Attention().to("cuda", dtype)
    args = tuple(t.to("cuda", dtype) for t in _inputs(S=40))
    ref_loss = _loss(module(*args))
    ref_grads = torch.autograd.grad(ref_loss, list(module.parameters()))
    loss, grads, reports, calls = _compiled_run(module, args, inner="inductor")
    (report,) = reports
    assert report.of_pattern("rms_norm_rope").fused == 2, report.table()
    assert calls["adaptiveload::rms_norm_rope"] == 2
    torch.testing.assert_close(loss, ref_loss, rtol=rtol / 10, atol=1e-6)
    for g, r in zip(grads, ref_grads):  # (plus an absolute floor: the key bias's true gradient is ~0)
        assert (g.double() - r.double()).norm() <= rtol * r.double().norm() + 1e-5
