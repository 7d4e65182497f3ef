"""The ops' CUDA dispatch once the kernels are loaded (csrc/norm_modulate_dispatch.cu): the C++ CUDA
and AutogradCUDA kernels serve what the kernels take and hand the rest to the op's Python CUDA path,
whose ValueError (naming the tensor) or reference result reaches the caller unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaptiveload.ops import extension

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EPS = 1e-6
adaln = torch.ops.adaptiveload.adaln_modulate
rms = torch.ops.adaptiveload.rms_norm_modulate


@pytest.fixture(scope="module", autouse=True)
def loaded():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ADAPTIVELOAD_REQUIRE_KERNEL", "1")
        yield extension.kernels()


def test_bad_inputs_raise_the_python_paths_value_error():
    x = torch.randn(2, 5, 8, device="cuda", dtype=torch.bfloat16)
    scale = torch.randn(2, 1, 8, device="cuda")
    with pytest.raises(ValueError, match=r"adaln_modulate: scale \(shape \[3, 1, 8\]"):
        adaln(x, None, None, torch.randn(3, 1, 8, device="cuda"), None, EPS, torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight \(shape \[8\], dtype torch.float32\) is on cpu but x is on cuda"):
        adaln(x, torch.randn(8), None, scale, None, EPS, torch.bfloat16)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        rms(x, None, scale, None, -1.0, torch.bfloat16)
    with pytest.raises(ValueError, match=r"rms_norm_modulate_backward: rstd \(shape \[2\]"):
        torch.ops.adaptiveload.rms_norm_modulate_backward(x, x, None, scale, None, torch.ones(2, device="cuda"))
    # the kernels still run after the errors
    y = adaln(x, None, None, scale, None, EPS, torch.bfloat16)[0]
    ref = F.layer_norm(x.double(), (8,), eps=EPS) * (1 + scale.double())
    assert (y.double() - ref).abs().max().item() < 0.05


def test_float64_runs_the_reference_through_the_kernels_dispatch():
    x = torch.randn(2, 5, 8, device="cuda", dtype=torch.float64, requires_grad=True)
    scale = (0.1 * torch.randn(2, 1, 8, device="cuda", dtype=torch.float64)).requires_grad_()
    y, mean, rstd = adaln(x, None, None, scale, None, EPS, torch.float64)
    assert mean.dtype == torch.float64
    ref = F.layer_norm(x, (8,), eps=EPS) * (1 + scale)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    dx, ds = torch.autograd.grad(y.square().sum(), (x, scale))
    rx, rs = torch.autograd.grad(ref.square().sum(), (x, scale))
    torch.testing.assert_close(dx, rx, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ds, rs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", ["adaln", "rms"])
def test_double_backward_raises_from_the_cuda_autograd_kernel(op):
    x = torch.randn(2, 5, 8, device="cuda", requires_grad=True)
    scale = torch.randn(2, 1, 8, device="cuda", requires_grad=True)
    if op == "adaln":
        y = adaln(x, None, None, scale, None, EPS, torch.float32)[0]
    else:
        y = rms(x, None, scale, None, EPS, torch.float32)[0]
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        dx.sum().backward()


def test_gradients_match_the_reference_through_the_cuda_autograd_kernel():
    """bf16 x, float32 per-sample modulation: the C++ autograd kernel's gradients against float64."""
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    scale = (0.1 * torch.randn(2, 1, 256, device="cuda")).requires_grad_()
    shift = (0.1 * torch.randn(2, 1, 256, device="cuda")).requires_grad_()
    w = torch.randn(2, 64, 256, device="cuda")
    y = adaln(x, None, None, scale, shift, EPS, torch.bfloat16)[0]
    grads = torch.autograd.grad((y.float() * w).sum(), (x, scale, shift))
    xd, sd, hd = (t.detach().double().requires_grad_() for t in (x, scale, shift))
    ref = F.layer_norm(xd, (256,), eps=EPS) * (1 + sd) + hd
    refs = torch.autograd.grad((ref * w.double()).sum(), (xd, sd, hd))
    for g, r in zip(grads, refs):
        assert ((g.double() - r).norm() / r.norm()).item() < 1e-2
