"""A Wan 2.1-style video diffusion transformer (DiT), written in the project, random init.

Structure (Wan 2.1 text-to-video, as diffusers' ``WanTransformer3DModel`` lays it out):

* patch embedding ``Conv3d(in_channels, dim, kernel=stride=patch_size)`` -> tokens [B, S, dim],
  ``S = (T / pt) * (H / ph) * (W / pw)``;
* timestep: sinusoidal embedding (``freq_dim``) -> Linear, SiLU, Linear -> ``temb`` [B, dim];
  SiLU -> Linear(dim, 6 * dim) -> the block modulation ``temb6`` [B, 6, dim];
* text: Linear(text_dim, dim), GELU(tanh), Linear(dim, dim);
* ``num_layers`` blocks of self-attention (3D RoPE, q/k RMSNorm across heads), cross-attention to
  the text tokens, GELU(tanh) FFN; self-attention and FFN inputs are adaptive-LayerNorm modulated
  with shift/scale and their outputs gated, all from ``scale_shift_table + temb6``;
* output head: LayerNorm modulated by ``table + temb``, Linear, unpatchify.

The LayerNorm -> modulate chains are written exactly as Wan writes them (float32 norm and
modulate, cast back to the stream's dtype), so ``adaptiveload.fxfuse`` sees real Wan graphs:
``num_modulate_sites = 2 * num_layers + 1`` (norm1 and norm3 of every block, and the head), of
``num_norm_sites = 3 * num_layers + 1`` LayerNorms (norm2, affine and not modulated, behind the
cross-attention's residual add, is fused together with that add where the residual ops run).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from adaptiveload.models.config import WanConfig, resolve_config
from adaptiveload.models.packed import packed_attention
from adaptiveload.models.rope import apply_rope, rope_tables
from adaptiveload.ops.segmented import gather_by_segment


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 whatever the dtype of its input and weights (as in Wan).

    ``[..., D]`` any floating dtype -> ``[..., D]`` in the input's dtype. Wan calls it on
    ``x.float()``, so in the model its output is float32.
    """

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def timestep_embedding(timestep: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding of diffusion timesteps, cosines first (Wan's / diffusers' convention).

    Args:
        timestep: [B] float timesteps (0..1000).
        dim: embedding size (even).

    Returns:
        [B, dim] float32: ``cat(cos(t * f), sin(t * f))`` with ``f_i = max_period ** (-i / (dim / 2))``
        (Vaswani et al. 2017; DDPM's timestep embedding).
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=timestep.device, dtype=torch.float32) / half)
    angles = timestep.float()[:, None] * freqs[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class _Attention(nn.Module):
    """q, k, v, o projections (dim -> dim) and q/k RMSNorm across all heads, as Wan has them."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)


def _attend(q: Tensor, k: Tensor, v: Tensor, cu_q: Optional[Tensor], cu_kv: Optional[Tensor]) -> Tensor:
    """[B, S, H, d] queries to [B, L, H, d] keys/values -> [B, S, H, d]: dense SDPA over each batch
    row, or, for a pack (B = 1, ``cu_q``/``cu_kv`` int32 [n + 1]), per sample
    (:func:`~adaptiveload.models.packed.packed_attention`, q, k, v in one dtype: autocast's when on)."""
    if cu_q is None:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    dtype = (torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type)
             else torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype))
    return packed_attention(q[0].to(dtype), k[0].to(dtype), v[0].to(dtype), cu_q, cu_kv).unsqueeze(0)


class SelfAttention(_Attention):
    """Multi-head self-attention with q/k RMSNorm across all heads and 3D RoPE.

    ``x`` [B, S, dim], ``cos``/``sin`` [S, head_dim // 2] -> [B, S, dim] in ``x``'s dtype. For a pack
    (``x`` [1, sum S_i, dim]), ``cu_seqlens`` int32 [n + 1] limits attention to each sample.
    """

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        q = self.norm_q(self.q(x)).unflatten(-1, (self.num_heads, -1))
        k = self.norm_k(self.k(x)).unflatten(-1, (self.num_heads, -1))
        v = self.v(x).unflatten(-1, (self.num_heads, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = _attend(q, k, v, cu_seqlens, cu_seqlens)
        return self.o(out.flatten(2))


class CrossAttention(_Attention):
    """Multi-head attention from the video tokens to the text tokens, q/k RMSNorm across heads.

    ``x`` [B, S, dim], ``context`` [B, L, dim] -> [B, S, dim]. For a pack (``x`` [1, sum S_i, dim],
    ``context`` [1, n * L, dim]), sample i's tokens ``cu_seqlens[i]:cu_seqlens[i + 1]`` attend to its
    text tokens ``cu_context[i]:cu_context[i + 1]`` (both int32 [n + 1]).
    """

    def forward(self, x: Tensor, context: Tensor, cu_seqlens: Optional[Tensor] = None,
                cu_context: Optional[Tensor] = None) -> Tensor:
        q = self.norm_q(self.q(x)).unflatten(-1, (self.num_heads, -1))
        k = self.norm_k(self.k(context)).unflatten(-1, (self.num_heads, -1))
        v = self.v(context).unflatten(-1, (self.num_heads, -1))
        out = _attend(q, k, v, cu_seqlens, cu_context)
        return self.o(out.flatten(2))


class WanBlock(nn.Module):
    """One Wan 2.1 transformer block: modulated self-attention, cross-attention, modulated FFN.

    Args of ``forward``:
        x: [B, S, dim] token stream (model dtype).
        context: [B, L, dim] projected text tokens.
        temb6: [B, 6, dim] time modulation (shift, scale, gate for attention, then for the FFN); for
            a pack, [n, 6, dim], one per sample, with ``segment_ids``.
        cos, sin: [S, head_dim // 2] RoPE tables.
        cu_seqlens, cu_context: for a pack (B = 1, ``context`` [1, n * L, dim]), int32 [n + 1]
            boundaries of the samples' tokens and of their text tokens; attention stays within a sample.
        segment_ids: for a pack, int64 [sum S] the sample of each token: each modulation tensor is
            gathered to its tokens (``m[segment_ids]``) inside the block, where the compiler may
            recompute the gather in backward instead of keeping [sum S, dim] tensors alive.

    Returns:
        [B, S, dim] in ``x``'s dtype.
    """

    def __init__(self, config: WanConfig):
        super().__init__()
        dim, eps = config.dim, config.eps
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, config.num_heads, eps)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(dim, config.num_heads, eps)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, config.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(config.ffn_dim, dim))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: Tensor, context: Tensor, temb6: Tensor, cos: Tensor, sin: Tensor,
                cu_seqlens: Optional[Tensor] = None, cu_context: Optional[Tensor] = None,
                segment_ids: Optional[Tensor] = None) -> Tensor:
        modulation = (self.scale_shift_table + temb6.float()).chunk(6, dim=1)  # [B or n, 1, dim] each
        if segment_ids is not None:  # a pack: each sample's modulation to its tokens, [1, sum S, dim] each
            modulation = [m[:, 0][segment_ids][None] for m in modulation]
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = modulation

        norm_x = (self.norm1(x.float()) * (1 + scale_msa) + shift_msa).type_as(x)
        attn = self.self_attn(norm_x, cos, sin, cu_seqlens)
        x = (x.float() + attn * gate_msa).type_as(x)

        norm_x = self.norm2(x.float()).type_as(x)
        x = x + self.cross_attn(norm_x, context, cu_seqlens, cu_context)

        norm_x = (self.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        ff = self.ffn(norm_x)
        return (x.float() + ff.float() * c_gate).type_as(x)


class WanDiT(nn.Module):
    """Wan 2.1-style video DiT: ``(latents, timestep, context) -> prediction`` (e.g. flow velocity).

    Attributes:
        config: the :class:`WanConfig`.
        num_modulate_sites: LayerNorm -> modulate chains one forward executes, ``2 * num_layers + 1``.
        num_norm_sites: LayerNorms one forward executes, ``3 * num_layers + 1``.
        activation_checkpointing: whether blocks are checkpointed in training mode
            (:meth:`set_activation_checkpointing`).
    """

    def __init__(self, config: WanConfig, activation_checkpointing: bool = False):
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.time_embedding = nn.Sequential(nn.Linear(config.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.text_embedding = nn.Sequential(nn.Linear(config.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(WanBlock(config) for _ in range(config.num_layers))
        self.norm_out = FP32LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.out_channels * config.patch_volume)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.activation_checkpointing = activation_checkpointing
        self.reset_parameters()

    @property
    def num_modulate_sites(self) -> int:
        """LayerNorm -> modulate chains per forward: norm1 and norm3 of each block, plus the head."""
        return 2 * self.config.num_layers + 1

    @property
    def num_norm_sites(self) -> int:
        """LayerNorms per forward, the norm sites the backend can fuse: norm1, norm2 and norm3 of
        each block, plus the head (norm2 only together with the residual add in front of it). The
        self-attention's q/k RMSNorm -> RoPE sites (2 a block, ``rms_norm_rope``) are not counted."""
        return 3 * self.config.num_layers + 1

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Checkpoint every block (recompute it in backward) when ``enabled`` and in training mode."""
        self.activation_checkpointing = bool(enabled)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init after Wan 2.1's: Xavier-uniform linears and patch embedding, zero biases,
        N(0, 0.02) text/time embeddings, modulation tables ``randn / sqrt(dim)``, RMSNorm/LayerNorm
        weights one. Unlike Wan, nothing (the output projection) is zero-initialised, so gradients
        reach every modulate chain from the first step."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        nn.init.zeros_(self.patch_embedding.bias)
        for embedding in (self.text_embedding, self.time_embedding):
            for layer in embedding:
                if isinstance(layer, nn.Linear):
                    nn.init.normal_(layer.weight, std=0.02)

    def forward(self, latents: Tensor, timestep: Tensor, context: Tensor) -> Tensor:
        """Predict from noisy latents.

        Args:
            latents: [B, in_channels, T, H, W]; T, H, W divisible by ``patch_size`` (H, W even
                for the default 1x2x2 patch). Cast to the model's dtype on entry.
            timestep: [B] float diffusion time, 0..1000.
            context: [B, L, text_dim] text-encoder states (any L; Wan uses 512).

        Returns:
            [B, out_channels, T, H, W] in ``latents.dtype``.

        Raises:
            ValueError: a tensor of the wrong rank or size (the message names it and its shape).
        """
        self._check_inputs(latents, timestep, context)
        frames, height, width = latents.shape[2:]
        pt, ph, pw = self.config.patch_size
        grid = (frames // pt, height // ph, width // pw)
        param_dtype = self.patch_embedding.weight.dtype

        # [B, S, dim]; made contiguous as diffusers does (Inductor CPU computes a wrong LayerNorm input
        # gradient when the LayerNorm input is this transposed view).
        x = self.patch_embedding(latents.to(param_dtype)).flatten(2).transpose(1, 2).contiguous()

        sinusoid = timestep_embedding(timestep, self.config.freq_dim).to(param_dtype)
        temb = self.time_embedding(sinusoid)  # [B, dim]
        temb6 = self.time_projection(temb).unflatten(1, (6, self.config.dim))  # [B, 6, dim]
        context = self.text_embedding(context.to(param_dtype))  # [B, L, dim]

        table_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = rope_tables(grid, self.config.head_dim, device=x.device, dtype=table_dtype)

        x = self._blocks(x, context, temb6, cos, sin)
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = self.proj_out(self._modulate_head(x, shift, scale))  # [B, S, out_channels * pt * ph * pw]
        return self._unpatchify(x, grid).to(latents.dtype)

    def _modulate_head(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """The output LayerNorm, modulated: ``shift``/``scale`` [B, 1, dim] (per sample) or [B, S, dim]
        (per token) -> [B, S, dim] in ``x``'s dtype."""
        return (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)

    def _blocks(self, x: Tensor, *args) -> Tensor:
        """Run every block on ``x`` (checkpointed in training mode when enabled)."""
        use_checkpoint = self.activation_checkpointing and self.training
        for block in self.blocks:
            if use_checkpoint:
                x = checkpoint(block, x, *args, use_reentrant=False)
            else:
                x = block(x, *args)
        return x

    def forward_packed(self, tokens: Tensor, timestep: Tensor, context: Tensor, grid: Tensor,
                       cu_seqlens: Tensor) -> Tensor:
        """Predict for a pack: n samples of different shapes as one token sequence.

        The same function as :meth:`forward` on each sample alone: each sample's tokens get its own
        3D RoPE positions, timestep modulation (expanded to its tokens) and text, and attend only to
        each other (:func:`~adaptiveload.models.packed.packed_attention`, dense SDPA per group of
        samples of equal length, outside any compiled graph). For compiled blocks, the blocks get
        fresh tensors (no views) and the pack's ``n * L`` text tokens are an unbacked size, so no
        graph depends on the number of samples (docs/load-balancing.md, "Packed training").

        Args:
            tokens: [sum S_i, in_channels * pt * ph * pw] patchified noisy latents
                (:func:`~adaptiveload.models.packed.patchify_packed`); cast to the model's dtype.
            timestep: [n] float diffusion time per sample, 0..1000.
            context: [n, L, text_dim] text-encoder states per sample.
            grid: int [n, 3] tokens per axis of each sample, ``(T/pt, H/ph, W/pw)``.
            cu_seqlens: int32 [n + 1] cumulative token counts ``[0, S_0, S_0 + S_1, ...]`` (CPU or
                device; read on the host once).

        Returns:
            [sum S_i, out_channels * pt * ph * pw] in ``tokens.dtype``, in the layout of ``tokens``
            (:func:`~adaptiveload.models.packed.unpatchify_packed` gives each sample's [C, T, H, W]).

        Raises:
            ValueError: a tensor of the wrong rank, size or dtype, or ``cu_seqlens`` that is not the
                cumulative sum of the grid's token counts (the message names it and its shape).
        """
        cfg = self.config
        cu_host = self._check_packed_inputs(tokens, timestep, context, grid, cu_seqlens)
        param_dtype = self.patch_embedding.weight.dtype
        n, text_len = context.shape[0], context.shape[1]
        # built on the host and copied without waiting (a blocking copy to a GPU waits for its queue)
        segment_ids = torch.repeat_interleave(torch.arange(n), torch.diff(cu_host)).to(tokens.device, non_blocking=True)

        # The blocks get fresh tensors, not views: Dynamo guards on a view's base, so a view in the first
        # block and fresh tensors in the next ones would compile two graphs.
        # The Conv3d patch embedding is a linear map of each patch: [1, sum S, dim].
        x = F.linear(tokens.to(param_dtype), self.patch_embedding.weight.flatten(1),
                     self.patch_embedding.bias)[None].clone()
        temb = self.time_embedding(timestep_embedding(timestep, cfg.freq_dim).to(param_dtype))  # [n, dim]
        temb6 = self.time_projection(temb).unflatten(1, (6, cfg.dim)).clone()  # [n, 6, dim], gathered in the blocks
        context = self.text_embedding(context.to(param_dtype)).flatten(0, 1)[None].clone()  # [1, n * L, dim]
        cu_context = torch.arange(n + 1, dtype=torch.int32) * text_len
        if not torch.compiler.is_compiling():
            # n and n * L are unbacked sizes to the compiled blocks: no guard on them, whatever Inductor's
            # thresholds
            torch._dynamo.decorators.mark_unbacked(context, 1)
            torch._dynamo.decorators.mark_unbacked(temb6, 0)

        table_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        shapes, repeats = torch.unique_consecutive(grid.cpu(), dim=0, return_counts=True)
        tables = [rope_tables(tuple(g), cfg.head_dim, device=x.device, dtype=table_dtype) for g in shapes.tolist()]
        cos, sin = (torch.cat([t for t, k in zip(column, repeats.tolist()) for _ in range(k)])
                    for column in zip(*tables))

        x = self._blocks(x, context, temb6, cos, sin, cu_host, cu_context, segment_ids)
        # the head runs eagerly under the train job's per-block compile: each sample's shift and scale
        # row goes to its tokens through gather_by_segment, whose backward sums by sample without
        # index_put's serial accumulation
        shift, scale = (gather_by_segment(self.scale_shift_table[0, i] + temb, segment_ids)[None] for i in (0, 1))
        x = self.proj_out(self._modulate_head(x, shift, scale))[0]  # [sum S, pt * ph * pw * C]
        # to the input layout: (pt, ph, pw, C) -> (C, pt, ph, pw) per token
        x = x.unflatten(1, (cfg.patch_volume, cfg.out_channels)).transpose(1, 2).flatten(1)
        return x.to(tokens.dtype)

    def _unpatchify(self, x: Tensor, grid: tuple) -> Tensor:
        """[B, S, C * pt * ph * pw] -> [B, C, T, H, W]."""
        frames, rows, cols = grid
        pt, ph, pw = self.config.patch_size
        x = x.reshape(x.shape[0], frames, rows, cols, pt, ph, pw, self.config.out_channels)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(x.shape[0], self.config.out_channels, frames * pt, rows * ph, cols * pw)

    def _check_packed_inputs(self, tokens, timestep, context, grid, cu_seqlens) -> Tensor:
        """Raise ValueError naming a bad input of :meth:`forward_packed`; return ``cu_seqlens`` on the CPU."""
        problem = _packed_inputs_problem(self.config, tokens, timestep, context, grid, cu_seqlens)
        if problem is not None:
            raise ValueError(f"WanDiT.forward_packed: {problem}")
        cu_host = cu_seqlens.cpu()
        expected = torch.cat([grid.new_zeros(1), grid.prod(dim=1).cumsum(0)]).cpu()
        if grid.min() < 1 or not torch.equal(cu_host.long(), expected) or int(cu_host[-1]) != tokens.shape[0]:
            raise ValueError(f"WanDiT.forward_packed: cu_seqlens {cu_host.tolist()} must be the cumulative token counts "
                             f"{expected.tolist()} of grid (positive sizes) and end at the {tokens.shape[0]} tokens "
                             f"(shape {list(tokens.shape)})")
        return cu_host

    def _check_inputs(self, latents: Tensor, timestep: Tensor, context: Tensor) -> None:
        cfg = self.config
        if latents.dim() != 5 or latents.shape[1] != cfg.in_channels:
            raise ValueError(
                f"WanDiT: latents (shape {list(latents.shape)}) must be [B, {cfg.in_channels}, T, H, W]"
            )
        pt, ph, pw = cfg.patch_size
        if latents.shape[2] % pt != 0 or latents.shape[3] % ph != 0 or latents.shape[4] % pw != 0:
            raise ValueError(
                f"WanDiT: latents (shape {list(latents.shape)}): T, H, W must be divisible by the patch size "
                f"{cfg.patch_size}"
            )
        if timestep.dim() != 1 or timestep.shape[0] != latents.shape[0]:
            raise ValueError(
                f"WanDiT: timestep (shape {list(timestep.shape)}) must be [B] with B = {latents.shape[0]} "
                f"(the batch of latents)"
            )
        if context.dim() != 3 or context.shape[0] != latents.shape[0] or context.shape[2] != cfg.text_dim:
            raise ValueError(
                f"WanDiT: context (shape {list(context.shape)}) must be [B, L, {cfg.text_dim}] with "
                f"B = {latents.shape[0]} (the batch of latents)"
            )


def _shape(t) -> str:
    return f"shape {list(t.shape)}, {t.dtype}"


def _packed_inputs_problem(cfg: WanConfig, tokens, timestep, context, grid, cu_seqlens) -> Optional[str]:
    """What is wrong with :meth:`WanDiT.forward_packed`'s inputs, or None."""
    features = cfg.in_channels * cfg.patch_volume
    if tokens.dim() != 2 or tokens.shape[1] != features or not tokens.is_floating_point():
        return f"tokens ({_shape(tokens)}) must be floating [sum S, {features}] (in_channels * pt * ph * pw)"
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.shape[0] < 2:
        return f"cu_seqlens ({_shape(cu_seqlens)}) must be int32 [n + 1] with n >= 1"
    n = cu_seqlens.shape[0] - 1
    if grid.dim() != 2 or grid.shape != (n, 3) or grid.is_floating_point():
        return f"grid ({_shape(grid)}) must be integer [{n}, 3] (n = len(cu_seqlens) - 1)"
    if timestep.dim() != 1 or timestep.shape[0] != n:
        return f"timestep ({_shape(timestep)}) must be [{n}] (n = len(cu_seqlens) - 1)"
    if context.dim() != 3 or context.shape[0] != n or context.shape[2] != cfg.text_dim:
        return f"context ({_shape(context)}) must be [{n}, L, {cfg.text_dim}] (n = len(cu_seqlens) - 1)"
    return None


def build_model(
    config: str | WanConfig = "tiny",
    activation_checkpointing: bool = False,
    device: Optional[torch.device | str] = None,
    dtype: Optional[torch.dtype] = None,
) -> WanDiT:
    """Build a randomly initialised :class:`WanDiT`.

    Args:
        config: a preset name (``"tiny"``, ``"wan2.1-1.3b"``, ``"wan2.1-14b"``) or a ``WanConfig``.
        activation_checkpointing: checkpoint every block in training mode.
        device: where to create the parameters (``"meta"`` builds without allocating memory).
        dtype: parameter dtype (default: torch's default dtype, float32).

    Raises:
        ValueError: an unknown preset name (the message lists the presets).
    """
    config = resolve_config(config)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = WanDiT(config, activation_checkpointing=activation_checkpointing)
    if dtype is not None:
        model = model.to(dtype)
    return model


def make_inputs(
    config: str | WanConfig,
    batch_size: int,
    latent_shape: tuple[int, int, int] = (2, 8, 8),
    device: Optional[torch.device | str] = None,
    dtype: torch.dtype = torch.float32,
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Random model inputs: ``(latents, timestep, context)``.

    Args:
        config: preset name or ``WanConfig``.
        batch_size: B.
        latent_shape: (T, H, W) of the latents (divisible by the patch size).
        device: device of the tensors (default CPU); drawn on ``generator``'s device, then moved.
        dtype: dtype of ``latents`` and ``context``.
        generator: optional ``torch.Generator`` for reproducible draws.

    Returns:
        latents [B, in_channels, T, H, W] ~ N(0, 1) in ``dtype``; timestep [B] float32 uniform in
        [0, 1000); context [B, text_len, text_dim] ~ N(0, 1) in ``dtype``.

    Raises:
        ValueError: unknown preset, batch_size < 1, or a latent shape not divisible by the patch.
    """
    config = resolve_config(config)
    frames, height, width = latent_shape
    if batch_size < 1:
        raise ValueError(f"make_inputs: batch_size must be >= 1, got {batch_size}")
    if any(n < 1 or n % p for n, p in zip(latent_shape, config.patch_size)):
        raise ValueError(
            f"make_inputs: latent_shape {tuple(latent_shape)} must be positive and divisible by the patch size "
            f"{config.patch_size}"
        )
    draw_device = generator.device if generator is not None else device
    latents = torch.randn(batch_size, config.in_channels, frames, height, width, generator=generator, device=draw_device)
    timestep = torch.rand(batch_size, generator=generator, device=draw_device) * 1000.0
    context = torch.randn(batch_size, config.text_len, config.text_dim, generator=generator, device=draw_device)
    return latents.to(device=device, dtype=dtype), timestep.to(device), context.to(device=device, dtype=dtype)
