"""Packs: samples of different latent shapes as one token sequence, and attention per sample over it.

A pack of n samples is the concatenation of their patchified tokens, ``tokens [sum S_i, C*pt*ph*pw]``,
with ``cu_seqlens`` int32 [n + 1] (sample i owns tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``) and
``grid`` int64 [n, 3], each sample's tokens per axis ``(T/pt, H/ph, W/pw)`` (:func:`patchify_packed`,
:func:`unpatchify_packed`). A token's features are ordered ``(C, pt, ph, pw)``, the order of the
``Conv3d`` patch embedding's flattened weight.

:func:`packed_attention`: attention of each sample's queries to its own keys, as dense attention
called once per group of samples with the same (query, key) lengths: a pack holds a few shapes, so a
step runs a few dense calls. Dense SDPA per group was measured faster than both alternatives on an
H200 (torch 2.11, 12 heads x 128, bf16, forward and backward): one 32,760-token sample 41.7 ms dense,
71.3 ms ``varlen_attn``, 60.7 ms FlexAttention with a document mask; 12 x 1,560 tokens 1.7 / 2.5 / 3.3 ms.

It is a custom op (``torch.ops.adaptiveload.packed_attention``), opaque to ``torch.compile``: the
grouping reads the boundaries on the host, so it stays out of the graph, and a new pack composition
changes only the sizes of the graph's inputs, never its code.

Each group runs the fused kernel ``F.scaled_dot_product_attention`` itself would pick for it
(``torch._fused_sdp_choice``, so ``torch.nn.attention.sdpa_kernel`` applies) through that kernel's
ATen entry point, which also returns the softmax statistics (the log-sum-exp of each query's scores
per head); the op keeps them, and its backward hands them with the output to the same kernel's
backward, as SDPA's own autograd does (FlashAttention-2, Dao 2023, section 3.1): no attention is
recomputed. Kernels with such a pair here: cuDNN and FlashAttention on CUDA, the flash kernel on the
CPU. Any other choice (memory-efficient, math) runs plain SDPA forward and recomputes it in backward
(``torch.func.vjp``): one more attention forward per call. On an H200 (torch 2.11, bf16, cuDNN) a
32,760-token sample's attention forward and backward took 42.5 ms this way against 53.4 ms
recomputing (SDPA's autograd: 43.1 ms), and recomputing made a training step of one 75,600-token
sample 30% slower than its bucketed step (3.46 s vs 2.67 s).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend


def patchify_packed(latents: Sequence[Tensor], patch_size: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """Patchify samples of any latent shapes into one token sequence.

    Args:
        latents: n tensors [C, T_i, H_i, W_i] (one C and dtype), each divisible by ``patch_size``.
        patch_size: (pt, ph, pw).

    Returns:
        ``(tokens, grid, cu_seqlens)``: tokens [sum S_i, C*pt*ph*pw] (features ordered C, pt, ph, pw;
        tokens frame-major, as ``Conv3d(...).flatten(2)``) in the latents' dtype and device; grid int64
        [n, 3] ``(T_i/pt, H_i/ph, W_i/pw)`` and cu_seqlens int32 [n + 1] on the CPU.

    Raises:
        ValueError: no latents, a latent that is not [C, T, H, W] with the first one's C, or a shape not
            divisible by the patch (naming its position and shape).
    """
    if len(latents) == 0:
        raise ValueError("patchify_packed: no latents")
    pt, ph, pw = patch_size
    channels = latents[0].shape[0] if latents[0].dim() == 4 else None
    tokens, grid = [], []
    for i, x in enumerate(latents):
        if x.dim() != 4 or x.shape[0] != channels or x.shape[1] % pt or x.shape[2] % ph or x.shape[3] % pw:
            raise ValueError(f"patchify_packed: latents[{i}] (shape {list(x.shape)}) must be [C, T, H, W] with "
                             f"C = {channels} and T, H, W divisible by the patch size {tuple(patch_size)}")
        t, h, w = x.shape[1] // pt, x.shape[2] // ph, x.shape[3] // pw
        patches = x.reshape(channels, t, pt, h, ph, w, pw).permute(1, 3, 5, 0, 2, 4, 6)
        tokens.append(patches.reshape(t * h * w, channels * pt * ph * pw))
        grid.append((t, h, w))
    grid = torch.tensor(grid, dtype=torch.int64)
    cu_seqlens = torch.zeros(len(grid) + 1, dtype=torch.int32)
    cu_seqlens[1:] = grid.prod(dim=1).cumsum(0)
    return torch.cat(tokens), grid, cu_seqlens


def unpatchify_packed(tokens: Tensor, grid: Tensor, patch_size: tuple) -> list[Tensor]:
    """The inverse of :func:`patchify_packed`: ``tokens [sum S_i, C*pt*ph*pw]`` -> n tensors [C, T_i, H_i, W_i].

    Raises:
        ValueError: ``grid`` not [n, 3], or ``tokens`` not [sum of the grid's tokens, a multiple of
            pt*ph*pw] (naming both shapes).
    """
    pt, ph, pw = patch_size
    volume = pt * ph * pw
    grid = grid.tolist() if isinstance(grid, Tensor) else [list(g) for g in grid]
    total = sum(t * h * w for t, h, w in grid)
    if any(len(g) != 3 for g in grid) or tokens.dim() != 2 or tokens.shape[0] != total or tokens.shape[1] % volume:
        raise ValueError(f"unpatchify_packed: tokens (shape {list(tokens.shape)}) must be [{total}, C * {volume}] "
                         f"for grid (shape [{len(grid)}, 3]) and patch size {tuple(patch_size)}")
    channels = tokens.shape[1] // volume
    out, start = [], 0
    for t, h, w in grid:
        x = tokens[start:start + t * h * w].reshape(t, h, w, channels, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
        out.append(x.reshape(channels, t * pt, h * ph, w * pw))
        start += t * h * w
    return out


def _groups(cu_q: list, cu_kv: list) -> dict:
    """Samples by (query length, key length): ``{(Lq, Lkv): [sample, ...]}``, in pack order."""
    groups: dict = {}
    for i in range(len(cu_q) - 1):
        groups.setdefault((cu_q[i + 1] - cu_q[i], cu_kv[i + 1] - cu_kv[i]), []).append(i)
    return groups


def _take(x: Tensor, starts: list, length: int) -> Tensor:
    """[g, length, ...]: the g segments of ``x`` starting at ``starts`` (a view when they are adjacent)."""
    if all(s == starts[0] + j * length for j, s in enumerate(starts)):
        return x[starts[0]:starts[0] + len(starts) * length].unflatten(0, (len(starts), length))
    return torch.stack([x[s:s + length] for s in starts])


def _put(out: Tensor, value: Tensor, starts: list) -> None:
    """Write ``value`` [g, length, ...] into the g segments of ``out`` starting at ``starts`` (one copy
    when they are adjacent)."""
    length = value.shape[1]
    if all(s == starts[0] + j * length for j, s in enumerate(starts)):
        out[starts[0]:starts[0] + len(starts) * length] = value.flatten(0, 1)
        return
    for j, s in enumerate(starts):
        out[s:s + length] = value[j]


def _heads_first(*tensors: Tensor) -> tuple:
    """[g, L, H, d] -> [g, H, L, d] views: the layout, and the strides, SDPA gives its kernels."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _no_dropout_seed(q: Tensor) -> Tensor:
    """The dropout seed and offset a CUDA kernel's backward takes, unread: the kernels run without dropout."""
    return torch.empty((), dtype=torch.int64, device=q.device)


# Each kernel takes and returns [g, L, H, d] tensors (a group of g samples of one length, tokens first,
# as they lie in the pack) and the log-sum-exp as [g, L, H]. The CUDA pairs were checked on an H200
# (torch 2.11, bf16, 12 heads x 128; 1 x 32,760, 12 x 1,560 and 2 x 4,096 -> 512 tokens): output, dk
# and dv equal to SDPA's autograd bit for bit, dq to 4e-5 (its atomic accumulation), the same time.

def _cpu_flash_forward(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_heads_first(q, k, v), 0.0, False)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _cpu_flash_backward(grad, q, k, v, out, lse):
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_heads_first(grad, q, k, v, out), lse.transpose(1, 2).contiguous(), 0.0, False)
    return tuple(g.transpose(1, 2) for g in grads)


def _cudnn_forward(q, k, v):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(*_heads_first(q, k, v), None, True, 0.0,
                                                                       False, False)
    return out.transpose(1, 2), lse.flatten(2).transpose(1, 2)  # lse [g, H, L, 1]


def _cudnn_backward(grad, q, k, v, out, lse):
    seed = _no_dropout_seed(q)
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        *_heads_first(grad, q, k, v, out), lse.transpose(1, 2).unsqueeze(-1).contiguous(), seed, seed, None, None,
        None, q.shape[1], k.shape[1], 0.0, False)
    return tuple(g.transpose(1, 2) for g in grads)


def _flash_forward(q, k, v):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(*_heads_first(q, k, v), 0.0, False, False)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _flash_backward(grad, q, k, v, out, lse):
    seed = _no_dropout_seed(q)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        *_heads_first(grad, q, k, v, out), lse.transpose(1, 2).contiguous(), None, None, q.shape[1], k.shape[1], 0.0,
        False, seed, seed)
    return tuple(g.transpose(1, 2) for g in grads)


def _sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Dense attention of [g, L, H, d] queries to [g, Lkv, H, d] keys and values -> [g, L, H, d]."""
    return F.scaled_dot_product_attention(*_heads_first(q, k, v)).transpose(1, 2)


def _recompute_forward(q, k, v):
    return _sdpa(q, k, v), q.new_zeros(q.shape[:3], dtype=_lse_dtype(q.dtype))


def _recompute_backward(grad, q, k, v, out, lse):
    # torch.func: autograd is off inside a custom op's implementation, its transforms still work
    _, vjp = torch.func.vjp(_sdpa, q, k, v)
    return vjp(grad)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' log-sum-exp dtype: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Kernel(NamedTuple):
    forward: Callable  # (q, k, v) -> (out, lse)
    backward: Callable  # (grad, q, k, v, out, lse) -> (dq, dk, dv)


# Index 0 recomputes; the others are SDPA backends by (device type, torch.nn.attention.SDPBackend).
_KERNELS = (_Kernel(_recompute_forward, _recompute_backward), _Kernel(_cpu_flash_forward, _cpu_flash_backward),
            _Kernel(_cudnn_forward, _cudnn_backward), _Kernel(_flash_forward, _flash_backward))
_KERNEL_OF_BACKEND = {("cpu", int(SDPBackend.FLASH_ATTENTION)): 1, ("cuda", int(SDPBackend.CUDNN_ATTENTION)): 2,
                      ("cuda", int(SDPBackend.FLASH_ATTENTION)): 3}


def _kernel_for(q: Tensor, k: Tensor, v: Tensor) -> int:
    """The index in ``_KERNELS`` of the backend SDPA picks for these [g, L, H, d] tensors."""
    return _KERNEL_OF_BACKEND.get((q.device.type, int(torch._fused_sdp_choice(*_heads_first(q, k, v)))), 0)


def _boundaries(cu_q: Tensor, cu_kv: Tensor, q_len: int, kv_len: int) -> tuple[list, list]:
    """``cu_q`` and ``cu_kv`` as lists; ValueError unless both run from 0 in increasing steps to the
    query and key totals."""
    bounds = cu_q.tolist(), cu_kv.tolist()
    for name, cu, total in zip(("cu_q", "cu_kv"), bounds, (q_len, kv_len)):
        if cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"packed_attention: {name} {cu} must increase from 0 to the {total} tokens of "
                             f"{'q' if name == 'cu_q' else 'k and v'}")
    return bounds


@torch.library.custom_op("adaptiveload::packed_attention", mutates_args=())
def _packed_attention_op(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    cq, ckv = _boundaries(cu_q, cu_kv, q.shape[0], k.shape[0])
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:2], dtype=_lse_dtype(q.dtype))
    # sample i's kernel at i; as long as cu_q, since a size n of its own would add a guard on n
    kernels = torch.zeros(len(cq), dtype=torch.int8)
    for (lq, lkv), samples in _groups(cq, ckv).items():
        q_starts, kv_starts = [cq[i] for i in samples], [ckv[i] for i in samples]
        group = _take(q, q_starts, lq), _take(k, kv_starts, lkv), _take(v, kv_starts, lkv)
        index = _kernel_for(*group)
        out_g, lse_g = _KERNELS[index].forward(*group)
        _put(out, out_g, q_starts)
        _put(lse, lse_g, q_starts)
        kernels[samples] = index
    return out, lse, kernels


@_packed_attention_op.register_fake
def _(q, k, v, cu_q, cu_kv):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:2], dtype=_lse_dtype(q.dtype)),
            torch.empty(cu_q.shape[0], dtype=torch.int8, device="cpu"))


@torch.library.custom_op("adaptiveload::packed_attention_backward", mutates_args=())
def _packed_attention_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  cu_q: Tensor, cu_kv: Tensor, kernels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    cq, ckv = cu_q.tolist(), cu_kv.tolist()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    chosen = kernels.tolist()
    for (lq, lkv), samples in _groups(cq, ckv).items():
        q_starts, kv_starts = [cq[i] for i in samples], [ckv[i] for i in samples]
        grads = _KERNELS[chosen[samples[0]]].backward(
            _take(grad, q_starts, lq), _take(q, q_starts, lq), _take(k, kv_starts, lkv), _take(v, kv_starts, lkv),
            _take(out, q_starts, lq), _take(lse, q_starts, lq))
        for target, value, starts in zip((dq, dk, dv), grads, (q_starts, kv_starts, kv_starts)):
            _put(target, value, starts)
    return dq, dk, dv


@_packed_attention_backward_op.register_fake
def _(grad, q, k, v, out, lse, cu_q, cu_kv, kernels):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    out, lse, kernels = output
    ctx.save_for_backward(*inputs, out, lse, kernels)
    ctx.mark_non_differentiable(lse, kernels)


def _backward(ctx, grad, grad_lse, grad_kernels):
    q, k, v, cu_q, cu_kv, out, lse, kernels = ctx.saved_tensors
    dq, dk, dv = _packed_attention_backward_op(grad.contiguous(), q, k, v, out, lse, cu_q, cu_kv, kernels)
    return dq, dk, dv, None, None


_packed_attention_op.register_autograd(_backward, setup_context=_setup_context)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor) -> Tensor:
    """Attention of each sample's queries to its own keys and values, over packed sequences.

    Args:
        q: [sum Lq_i, H, d] queries of n samples, concatenated.
        k, v: [sum Lkv_i, H, d] keys and values of the same n samples (the queries' own tokens for
            self-attention, each sample's text tokens for cross-attention); the dtype of ``q``.
        cu_q, cu_kv: int32 [n + 1] cumulative lengths (sample i's queries are
            ``q[cu_q[i]:cu_q[i + 1]]``, at least one query and one key each), best on the CPU (read
            on the host; a CUDA copy costs a sync).

    Returns:
        [sum Lq_i, H, d] in ``q``'s dtype: per sample, ``softmax(q k^T / sqrt(d)) v`` (no mask inside a
        sample), computed by one dense attention kernel per group of samples of equal (Lq, Lkv), its
        backward without recomputation where the kernel allows (module docstring).

    Raises:
        ValueError: tensors of the wrong rank, heads, dtype or total length, or bad ``cu_q``/``cu_kv``
            (each named with its shape or values).
    """
    for name, cu, x in (("cu_q", cu_q, q), ("cu_kv", cu_kv, k)):
        if cu.dim() != 1 or cu.shape[0] < 2 or cu.dtype != torch.int32 or cu.shape != cu_q.shape:
            raise ValueError(f"packed_attention: {name} (shape {list(cu.shape)}, {cu.dtype}) must be int32 [n + 1], "
                             f"as long as cu_q (shape {list(cu_q.shape)})")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:-1] != v.shape[:-1] or k.shape[1] != q.shape[1] \
            or k.shape[-1] != q.shape[-1] or len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"packed_attention: q, k, v (shapes {list(q.shape)}, {list(k.shape)}, {list(v.shape)}; "
                         f"{q.dtype}, {k.dtype}, {v.dtype}) must be [sum Lq, H, d], [sum Lkv, H, d], [sum Lkv, H, dv] "
                         "of one dtype")
    return _packed_attention_op(q, k, v, cu_q, cu_kv)[0]
