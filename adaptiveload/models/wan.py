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
``num_modulate_sites = 2 * num_layers + 1`` (norm1 and norm3 of every block, and the head).
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
from adaptiveload.models.rope import apply_rope, rope_tables


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


class SelfAttention(_Attention):
    """Multi-head self-attention with q/k RMSNorm across all heads and 3D RoPE.

    ``x`` [B, S, dim], ``cos``/``sin`` [S, head_dim // 2] -> [B, S, dim] in ``x``'s dtype.
    """

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = self.norm_q(self.q(x)).unflatten(-1, (self.num_heads, -1))
        k = self.norm_k(self.k(x)).unflatten(-1, (self.num_heads, -1))
        v = self.v(x).unflatten(-1, (self.num_heads, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).flatten(2))


class CrossAttention(_Attention):
    """Multi-head attention from the video tokens to the text tokens, q/k RMSNorm across heads.

    ``x`` [B, S, dim], ``context`` [B, L, dim] -> [B, S, dim].
    """

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        q = self.norm_q(self.q(x)).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        k = self.norm_k(self.k(context)).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        v = self.v(context).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).flatten(2))


class WanBlock(nn.Module):
    """One Wan 2.1 transformer block: modulated self-attention, cross-attention, modulated FFN.

    Args of ``forward``:
        x: [B, S, dim] token stream (model dtype).
        context: [B, L, dim] projected text tokens.
        temb6: [B, 6, dim] time modulation (shift, scale, gate for attention, then for the FFN).
        cos, sin: [S, head_dim // 2] RoPE tables.

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

    def forward(self, x: Tensor, context: Tensor, temb6: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = (self.scale_shift_table + temb6.float()).chunk(6, dim=1)

        norm_x = (self.norm1(x.float()) * (1 + scale_msa) + shift_msa).type_as(x)
        attn = self.self_attn(norm_x, cos, sin)
        x = (x.float() + attn * gate_msa).type_as(x)

        norm_x = self.norm2(x.float()).type_as(x)
        x = x + self.cross_attn(norm_x, context)

        norm_x = (self.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        ff = self.ffn(norm_x)
        return (x.float() + ff.float() * c_gate).type_as(x)


class WanDiT(nn.Module):
    """Wan 2.1-style video DiT: ``(latents, timestep, context) -> prediction`` (e.g. flow velocity).

    Attributes:
        config: the :class:`WanConfig`.
        num_modulate_sites: LayerNorm -> modulate chains one forward executes, ``2 * num_layers + 1``.
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

        use_checkpoint = self.activation_checkpointing and self.training
        for block in self.blocks:
            if use_checkpoint:
                x = checkpoint(block, x, context, temb6, cos, sin, use_reentrant=False)
            else:
                x = block(x, context, temb6, cos, sin)

        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)  # [B, S, out_channels * pt * ph * pw]
        return self._unpatchify(x, grid).to(latents.dtype)

    def _unpatchify(self, x: Tensor, grid: tuple) -> Tensor:
        """[B, S, C * pt * ph * pw] -> [B, C, T, H, W]."""
        frames, rows, cols = grid
        pt, ph, pw = self.config.patch_size
        x = x.reshape(x.shape[0], frames, rows, cols, pt, ph, pw, self.config.out_channels)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(x.shape[0], self.config.out_channels, frames * pt, rows * ph, cols * pw)

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
