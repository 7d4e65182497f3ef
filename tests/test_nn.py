"""Tests of ``adaptiveload.nn``: AdaLNModulate / RMSNormModulate against their torch.nn counterparts
(LayerNorm / RMSNorm in float64, then the modulation) for y and the gradients of every input and
parameter; parameters initialised and named as the counterparts' (their state dicts load; deferred
init on the meta device); eps reaching the op; bfloat16 modules; repr; argument checks."""
from __future__ import annotations

import pytest
import torch

from adaptiveload.nn import AdaLNModulate, RMSNormModulate
from adaptiveload.ops.testing import TOL, make_mod, rel_err

PAIRS = [(AdaLNModulate, torch.nn.LayerNorm), (RMSNormModulate, torch.nn.RMSNorm)]


def modulated(norm, x, scale, shift):
    """The unfused chain: ``norm(x) * (1 + scale) + shift``."""
    return norm(x) * (1 + scale) + shift


@pytest.mark.parametrize("cls, counterpart", PAIRS, ids=["adaln", "rms"])
@pytest.mark.parametrize("scale_layout, shift_layout", [("per-sample", "per-token"),
                                                        ("per-token", "shared")])
def test_loads_the_torch_norm_and_matches_it_in_float64(cls, counterpart, scale_layout, shift_layout):
    """A trained torch.nn.LayerNorm / RMSNorm state dict loads under the same keys; y and the gradients
    of x, scale, shift and every parameter match the counterpart's chain run in float64 on the same
    values. float32 bound 1e-6: the chain's own float32 eager error is ~1e-7."""
    gen = torch.Generator().manual_seed(6)
    norm = counterpart(16, eps=1e-6)
    with torch.no_grad():  # parameters away from ones/zeros, as after training
        for p in norm.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    module = cls(16, elementwise_affine=True)
    module.load_state_dict(norm.state_dict())
    x = (2 * torch.randn(2, 5, 16, generator=gen) + 0.3).requires_grad_(True)
    scale, shift = (make_mod(layout, x.shape, torch.float32, "cpu", gen).requires_grad_(True)
                    for layout in (scale_layout, shift_layout))
    dy = torch.randn(x.shape, generator=gen)
    y = module(x, scale, shift)
    inputs = [x, scale, shift, *module.parameters()]
    grads = torch.autograd.grad(y, inputs, dy)
    norm64 = norm.double()
    ref_inputs = [t.detach().double().requires_grad_(True) for t in (x, scale, shift)]
    y_ref = modulated(norm64, *ref_inputs)
    ref_grads = torch.autograd.grad(y_ref, [*ref_inputs, *norm64.parameters()], dy.double())
    assert y.dtype == torch.float32 and rel_err(y, y_ref) <= 1e-6, rel_err(y, y_ref)
    names = ["x", "scale", "shift", *(n for n, _ in module.named_parameters())]
    assert names[3:] == [n for n, _ in norm.named_parameters()]
    for name, g, r in zip(names, grads, ref_grads):
        assert g.shape == r.shape and rel_err(g, r) <= 1e-6, f"d{name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("cls, counterpart", PAIRS, ids=["adaln", "rms"])
def test_parameters_initialisation_and_state_dict(cls, counterpart):
    assert (cls(8).weight is not None) == (cls is RMSNormModulate)  # the defaults: AdaLN without affine
    bare = cls(8, elementwise_affine=False)
    assert bare.weight is None and list(bare.parameters()) == [] and list(bare.state_dict()) == []
    module, norm = cls(8, elementwise_affine=True), counterpart(8)
    assert list(module.state_dict()) == list(norm.state_dict()) == (["weight", "bias"] if cls is AdaLNModulate
                                                                    else ["weight"])
    for (name, p), (_, q) in zip(module.named_parameters(), norm.named_parameters()):
        assert p.requires_grad and torch.equal(p, q), name  # ones / zeros
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(3.0)
    module.reset_parameters()
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), norm.parameters()))
    lazy = cls(8, elementwise_affine=True, device="meta", dtype=torch.bfloat16)  # deferred init, as FSDP does
    lazy.to_empty(device="cpu").reset_parameters()
    assert [p.dtype for p in lazy.parameters()] == [torch.bfloat16] * len(list(norm.parameters()))
    assert all(torch.equal(p.float(), q) for p, q in zip(lazy.parameters(), norm.parameters()))


def test_eps_reaches_the_op():
    """x = [0, 2]: LayerNorm gives [-1, 1] / sqrt(1 + eps), eps = 3 halving it; RMS norm
    x / sqrt(2 + eps), eps = 2 giving [0, 1]."""
    x, zero = torch.tensor([[0.0, 2.0]]), torch.zeros(2)
    torch.testing.assert_close(AdaLNModulate(2, eps=3.0)(x, zero), torch.tensor([[-0.5, 0.5]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(RMSNormModulate(2, eps=2.0, elementwise_affine=False)(x, zero),
                               torch.tensor([[0.0, 1.0]]), rtol=1e-6, atol=1e-7)


def test_bfloat16_module_gives_bfloat16_and_parameter_gradients():
    """bf16 parameters and x: y in bf16 within one rounding of float64 LayerNorm; dbias (a sum over
    all rows, computed in float32 and rounded once) within two."""
    gen = torch.Generator().manual_seed(7)
    module = AdaLNModulate(8, elementwise_affine=True, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 8, generator=gen).bfloat16()
    scale, shift = (make_mod("per-sample", x.shape, torch.bfloat16, "cpu", gen) for _ in range(2))
    dy = torch.randn(x.shape, generator=gen).bfloat16()
    y = module(x, scale, shift)
    y.backward(dy)
    ref = modulated(torch.nn.LayerNorm(8, eps=1e-6).double(), x.double(), scale.double(), shift.double())
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) <= TOL[torch.bfloat16]
    dbias_ref = (dy.double() * (1 + scale.double())).sum((0, 1))
    assert module.bias.grad.dtype == torch.bfloat16 and rel_err(module.bias.grad, dbias_ref) <= 2 * TOL[torch.bfloat16]


def test_repr_and_bad_arguments():
    assert repr(AdaLNModulate(64)) == "AdaLNModulate(64, eps=1e-06, elementwise_affine=False)"
    assert repr(RMSNormModulate(32, eps=1e-5)) == "RMSNormModulate(32, eps=1e-05, elementwise_affine=True)"
    for cls in (AdaLNModulate, RMSNormModulate):
        for dim in (0, 8.0, True):
            with pytest.raises(ValueError, match=f"dim must be a positive int, got {dim!r}"):
                cls(dim)
        with pytest.raises(ValueError, match="eps must be a non-negative number, got -1"):
            cls(8, eps=-1)
        for affine in (False, True):  # without weight the op has no [D] tensor to catch a wrong D
            with pytest.raises(ValueError, match=r"x \(shape \[2, 5, 7\], dtype torch.float32\) must end in dim=8"):
                cls(8, elementwise_affine=affine)(torch.randn(2, 5, 7), torch.randn(7))
        with pytest.raises(ValueError, match=r"scale \(shape \[3, 1, 8\]"):  # the op's own check
            cls(8)(torch.randn(2, 5, 8), torch.randn(3, 1, 8))
