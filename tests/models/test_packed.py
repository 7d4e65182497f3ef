"""Packs through the reference DiT: ``forward_packed`` equals each sample run alone through
``forward`` (outputs and gradients), the patchify helpers, the per-sample attention op, and bad input."""
import re

import pytest
import torch
from hypothesis import given, strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaptiveload.models import WanConfig, build_model, make_inputs
from adaptiveload.models.packed import packed_attention, patchify_packed, unpatchify_packed
from adaptiveload.ops.testing import OPCHECK_UTILS

# Two blocks, tiny sizes, 1x2x2 patch; T, H, W of the latents below are multiples of it.
CONFIG = WanConfig(dim=24, num_layers=2, num_heads=2, ffn_dim=32, in_channels=3, out_channels=2,
                   text_dim=8, text_len=3, freq_dim=8)
SHAPES = [(1, 2, 2), (1, 4, 6), (2, 2, 4), (3, 4, 2), (2, 4, 4)]  # S = 1, 6, 4, 6, 8 tokens
packs = st.lists(st.sampled_from(SHAPES), min_size=1, max_size=5)


def _samples(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [make_inputs(CONFIG, 1, shape, dtype=dtype, generator=gen) for shape in shapes]


def _pack(samples):
    tokens, grid, cu = patchify_packed([s[0][0] for s in samples], CONFIG.patch_size)
    return tokens, torch.cat([s[1] for s in samples]), torch.cat([s[2] for s in samples]), grid, cu


def _weights(shapes, seed=1):
    """A random weight per output value of each sample: the loss whose gradients are compared."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(CONFIG.out_channels, *shape, generator=gen, dtype=torch.float64) for shape in shapes]


def _alone(model, samples, weights):
    """Outputs of each sample run alone through forward, and the gradients of sum_i <w_i, out_i>."""
    model.zero_grad()
    outs = [model(*s)[0] for s in samples]
    sum((o.double() * w).sum() for o, w in zip(outs, weights)).backward()
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed(model, samples, weights):
    model.zero_grad()
    tokens, timestep, context, grid, cu = _pack(samples)
    outs = unpatchify_packed(model.forward_packed(tokens, timestep, context, grid, cu), grid, CONFIG.patch_size)
    sum((o.double() * w).sum() for o, w in zip(outs, weights)).backward()
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters()}


def _model(dtype, checkpointing=False):
    torch.manual_seed(0)
    return build_model(CONFIG, activation_checkpointing=checkpointing, dtype=dtype)


@given(shapes=packs)
def test_pack_equals_each_sample_alone_float64(shapes):
    """Any composition (repeated shapes, adjacent or not, single-token samples): outputs and every
    parameter's gradient equal the per-sample forward's, in float64 to rounding. The modulation is
    float32 in both (Wan's ``.float()``) and its gradient is summed over tokens in float32 alone,
    per token in a pack: the time-embedding gradients differ by float32 rounding (~1e-8 relative)."""
    model = _model(torch.float64)
    samples, weights = _samples(shapes, torch.float64), _weights(shapes)
    (ref, ref_grads), (out, grads) = _alone(model, samples, weights), _packed(model, samples, weights)
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    for name, g in ref_grads.items():
        assert (grads[name] - g).norm() <= 1e-6 * g.norm() + 1e-12, name


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_pack_matches_float64_reference_in_lower_precision(dtype, rtol):
    """float32 tight, bf16 loose, both against the float64 model run per sample (relative to each
    tensor's norm); activation checkpointing changes nothing."""
    shapes = [(2, 4, 4), (1, 4, 6), (2, 4, 4), (1, 2, 2), (3, 4, 2)]
    weights = _weights(shapes)
    ref, ref_grads = _alone(_model(torch.float64), _samples(shapes, torch.float64), weights)
    for checkpointing in (False, True):
        out, grads = _packed(_model(dtype, checkpointing), _samples(shapes, dtype), weights)
        for r, o in zip(ref, out):
            assert (o.double() - r).norm() <= rtol * r.norm()
        for name, g in ref_grads.items():
            assert (grads[name].double() - g).norm() <= rtol * g.norm() + 1e-12, name


def test_autocast_pack_matches_float32():
    """Under CPU bf16 autocast the attention op gets q, k, v in bf16 (autocast's dtype)."""
    shapes = [(2, 4, 4), (1, 4, 6), (2, 4, 4)]
    samples, weights = _samples(shapes, torch.float32), _weights(shapes)
    model = _model(torch.float32)
    ref, _ = _packed(model, samples, weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = _packed(model, samples, weights)
    for r, o in zip(ref, out):
        assert (o.float() - r).norm() <= 3e-2 * r.norm()


@given(shapes=packs)
def test_patchify_round_trip_and_layout(shapes):
    latents = [torch.randn(3, *s) for s in shapes]
    tokens, grid, cu = patchify_packed(latents, (1, 2, 2))
    assert grid.tolist() == [[t, h // 2, w // 2] for t, h, w in shapes] and cu.dtype == torch.int32
    assert cu.tolist() == [0, *torch.tensor([t * h * w // 4 for t, h, w in shapes]).cumsum(0).tolist()]
    for x, y in zip(latents, unpatchify_packed(tokens, grid, (1, 2, 2))):
        assert torch.equal(x, y)
    # token s of sample 0 holds its patch (t, 2i:2i+2, 2j:2j+2) of every channel, channels first
    t, h, w = grid[0].tolist()
    s = int(cu[1]) - 1  # the last token of sample 0
    ti, hi, wi = s // (h * w), (s // w) % h, s % w
    assert torch.equal(tokens[s], latents[0][:, ti, 2 * hi:2 * hi + 2, 2 * wi:2 * wi + 2].reshape(-1))


def _masked_reference(q, k, v, cu_q, cu_kv):
    """Attention over the whole pack with a block-diagonal mask, in float64."""
    seg_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), torch.diff(cu_q.long()))
    seg_kv = torch.repeat_interleave(torch.arange(len(cu_kv) - 1), torch.diff(cu_kv.long()))
    mask = (seg_q[:, None] == seg_kv[None, :]).to(q.device)  # the offsets stay on the host (as packed_attention's)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def _attention_inputs(q_lens, kv_lens, dtype=torch.float32, device="cpu", seed=0):
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(int(cu_q[-1]), 2, 4, generator=gen).to(device, dtype).requires_grad_()
    k, v = (torch.randn(int(cu_kv[-1]), 2, 4, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
    return q, k, v, cu_q, cu_kv, torch.randn(q.shape, generator=gen).to(device, dtype)


# the flash kernel (log-sum-exp kept, no recomputation) and the math one (recomputed in backward)
CPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@given(q_lens=st.lists(st.sampled_from([1, 3, 5]), min_size=1, max_size=6), text=st.sampled_from([None, 2, 4]))
def test_packed_attention_equals_block_diagonal_attention(backend, q_lens, text):
    """Self-attention (kv = q's lengths) and cross-attention (text tokens per sample): values and
    gradients of q, k, v equal masked dense attention over the pack, whichever kernel runs."""
    q, k, v, cu_q, cu_kv, grad = _attention_inputs(q_lens, q_lens if text is None else [text] * len(q_lens),
                                                   seed=sum(q_lens))
    with sdpa_kernel(backend):
        out = packed_attention(q, k, v, cu_q, cu_kv)
        got = torch.autograd.grad(out, (q, k, v), grad)
    ref = _masked_reference(q, k, v, cu_q, cu_kv)
    expected = torch.autograd.grad(ref, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _attention_kernels(fn) -> tuple[int, int]:
    """Runs ``fn``; returns how many CPU flash attention forwards and backwards it ran (also inside ops)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [event.name for event in prof.events()]
    return (names.count("aten::_scaled_dot_product_flash_attention_for_cpu"),
            names.count("aten::_scaled_dot_product_flash_attention_for_cpu_backward"))


@pytest.mark.parametrize("forward, backward", [(SDPBackend.FLASH_ATTENTION, SDPBackend.MATH),
                                               (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION)])
def test_backward_runs_the_forward_kernel_without_recomputing(forward, backward):
    """Two groups of samples (lengths 3, 3 and 5): after a flash forward, the backward runs the flash
    kernel's backward once per group and no attention forward, even under another SDPA choice
    (math); after a math forward, which keeps no statistics, it recomputes each group's attention
    (with the backward's choice: flash forward and backward)."""
    q, k, v, cu_q, cu_kv, grad = _attention_inputs([3, 3, 5], [3, 3, 5])
    with sdpa_kernel(forward):
        out = packed_attention(q, k, v, cu_q, cu_kv)
    got = []
    with sdpa_kernel(backward):
        counts = _attention_kernels(lambda: got.extend(torch.autograd.grad(out, (q, k, v), grad)))
    assert counts == ((0, 2) if forward == SDPBackend.FLASH_ATTENTION else (2, 2))  # recomputed: the flash forward too
    expected = torch.autograd.grad(_masked_reference(q, k, v, cu_q, cu_kv), (q, k, v), grad.double())
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_attention_opcheck(backend):
    """Schema, autograd registration, fake kernels and AOT dispatch with dynamic shapes."""
    q, k, v, cu_q, cu_kv, _ = _attention_inputs([3, 1, 5, 5], [2, 2, 2, 2])
    with sdpa_kernel(backend):
        torch.library.opcheck(torch.ops.adaptiveload.packed_attention.default, (q, k, v, cu_q, cu_kv),
                              test_utils=OPCHECK_UTILS)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend, kernel", [(SDPBackend.CUDNN_ATTENTION, 2), (SDPBackend.FLASH_ATTENTION, 3),
                                             (SDPBackend.EFFICIENT_ATTENTION, 0), (SDPBackend.MATH, 0)])
def test_packed_attention_cuda_kernels(dtype, backend, kernel):
    """Each CUDA kernel of SDPA (head dim 128, samples of 1,000 and 300 tokens and text of 64):
    values and gradients against masked float64 attention, within 2x the error of plain SDPA in the
    same dtype run on each sample; the kernel recorded for backward is the one picked."""
    gen = torch.Generator().manual_seed(0)
    heads, dim, lens, text = 4, 128, [1000, 300, 1000], 64
    for kv_lens in (lens, [text] * len(lens)):
        cu_q = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        cu_kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(sum(lens), heads, dim, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(sum(kv_lens), heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
        grad = torch.randn(q.shape, generator=gen, dtype=torch.float64)
        leaves = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
        ref_leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
        ref = _masked_reference(*ref_leaves, cu_q, cu_kv)
        expected = (ref, *torch.autograd.grad(ref, ref_leaves, grad.cuda()))
        with sdpa_kernel(backend):
            out, _, kernels = torch.ops.adaptiveload.packed_attention(*leaves, cu_q, cu_kv)
            got = (out, *torch.autograd.grad(out, leaves, grad.to("cuda", dtype)))
            eager = []  # plain SDPA on each sample in dtype: the error to compare with
            for i in range(len(lens)):
                qi, ki, vi = (t[c[i]:c[i + 1]].detach().requires_grad_() for t, c in zip(leaves, (cu_q, cu_kv, cu_kv)))
                oi = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qi, ki, vi)))
                oi = oi[0].transpose(0, 1)
                eager.append((oi, *torch.autograd.grad(oi, (qi, ki, vi), grad[cu_q[i]:cu_q[i + 1]].to("cuda", dtype))))
        assert kernels[:-1].tolist() == [kernel] * len(lens)
        for j, (g, e) in enumerate(zip(got, expected)):
            side = cu_q if j in (0, 1) else cu_kv
            plain = torch.cat([eager[i][j] for i in range(len(lens))]).double()
            bound = 2 * (plain - e).norm() + 1e-6 * e.norm()
            assert (g.double() - e).norm() <= bound, (j, float((g.double() - e).norm()), float(bound), side.tolist())


def test_packed_attention_is_an_opaque_op_under_compile():
    """fullgraph compile (aot_eager) traces through it: the op is one node, no graph break."""
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q, k, v = (torch.randn(5, 2, 4) for _ in range(3))
    compiled = torch.compile(packed_attention, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, cu, cu), packed_attention(q, k, v, cu, cu))


BAD_PACKED = [
    (lambda t, ts, c, g, cu: (t[:, :-1], ts, c, g, cu), "tokens (shape [9, 11], torch.float32) must be floating [sum S, 12]"),
    (lambda t, ts, c, g, cu: (t, ts, c, g, cu.long()), "cu_seqlens (shape [3], torch.int64) must be int32 [n + 1]"),
    (lambda t, ts, c, g, cu: (t, ts, c, g[:1], cu), "grid (shape [1, 3], torch.int64) must be integer [2, 3]"),
    (lambda t, ts, c, g, cu: (t, ts[:1], c, g, cu), "timestep (shape [1], torch.float32) must be [2]"),
    (lambda t, ts, c, g, cu: (t, ts, c[..., :-1], g, cu), "context (shape [2, 3, 7], torch.float32) must be [2, L, 8]"),
    (lambda t, ts, c, g, cu: (t, ts, c, g, torch.tensor([0, 4, 9], dtype=torch.int32)),
     "cu_seqlens [0, 4, 9] must be the cumulative token counts [0, 6, 9]"),
]


@pytest.mark.parametrize("edit, message", BAD_PACKED)
def test_bad_packed_inputs_name_the_tensor(edit, message):
    model = _model(torch.float32)
    shapes = [(1, 4, 6), (3, 2, 2)]
    inputs = edit(*_pack(_samples(shapes, torch.float32)))
    with pytest.raises(ValueError, match=re.escape(f"WanDiT.forward_packed: {message}")):
        model.forward_packed(*inputs)


def test_bad_patchify_and_attention_inputs_name_the_tensor():
    with pytest.raises(ValueError, match=re.escape("latents[1] (shape [3, 1, 3, 4]) must be [C, T, H, W] with C = 3")):
        patchify_packed([torch.zeros(3, 1, 2, 2), torch.zeros(3, 1, 3, 4)], (1, 2, 2))
    with pytest.raises(ValueError, match=re.escape("tokens (shape [4, 12]) must be [5, C * 4]")):
        unpatchify_packed(torch.zeros(4, 12), torch.tensor([[1, 1, 5]]), (1, 2, 2))
    q = torch.zeros(5, 2, 4)
    with pytest.raises(ValueError, match=re.escape("cu_kv (shape [2], torch.int32) must be int32 [n + 1]")):
        packed_attention(q, q, q, torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=re.escape("q, k, v (shapes [5, 2, 4], [5, 2, 4], [5, 2, 4]; torch.float32, "
                                                   "torch.float32, torch.bfloat16)")):
        packed_attention(q, q, q.bfloat16(), torch.tensor([0, 5], dtype=torch.int32),
                         torch.tensor([0, 5], dtype=torch.int32))
