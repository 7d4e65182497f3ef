"""3D rotary position embedding (RoPE) over (frame, row, column) token grids, as in Wan 2.1.

The head dim is split into three parts, one per axis: ``h = w = 2 * (head_dim // 6)`` channels
for rows and columns and the rest, ``t = head_dim - h - w``, for frames (Wan 2.1's split). Each part
is standard RoPE (Su et al., "RoFormer", 2021) with base ``theta = 10000``: channel pair ``i`` of a
part of ``d`` channels rotates by ``position * theta ** (-2 i / d)``. Channel pairs are adjacent
(``(0, 1), (2, 3), ...``), as in Wan's complex-number formulation.

Everything here uses real cos/sin (no complex tensors) and builds the tables from the grid size
each call (no cache keyed by shape), so it traces under ``torch.compile`` with symbolic shapes.
"""
from __future__ import annotations

import torch
from torch import Tensor

THETA = 10000.0


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of the head dim given to the (frame, row, column) axes: ``(t, h, w)``, all even.

    Raises:
        ValueError: ``head_dim`` is odd or smaller than 6.
    """
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"3D RoPE needs an even head dim of at least 6, got {head_dim}")
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def _axis_angles(length, dim: int, device, dtype) -> Tensor:
    """Angles [length, dim // 2]: ``position * THETA ** (-2 i / dim)`` for positions ``0..length-1``."""
    inv_freq = THETA ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    positions = torch.arange(length, device=device, dtype=torch.float64)
    return torch.outer(positions, inv_freq).to(dtype)


def rope_tables(grid: tuple, head_dim: int, device=None, dtype=torch.float32) -> tuple[Tensor, Tensor]:
    """Cos and sin tables for a (frames, rows, columns) token grid flattened frame-major.

    Args:
        grid: ``(T, H, W)`` tokens per axis (ints or symbolic ints); token ``s`` is at
            ``(s // (H * W), (s // W) % H, s % W)``, the order of ``Conv3d(...).flatten(2)``.
        head_dim: channels per head (even).
        device: device of the tables.
        dtype: dtype of the tables (float32; float64 for float64 models).

    Returns:
        ``(cos, sin)``, each [T * H * W, head_dim // 2] in ``dtype``: the rotation of every channel
        pair of every token.
    """
    frames, rows, cols = grid
    t_dim, h_dim, w_dim = rope_axis_dims(head_dim)
    # Angles are formed in float64 (positions reach thousands) and rounded once to ``dtype``.
    t = _axis_angles(frames, t_dim, device, torch.float64)[:, None, None, :].expand(frames, rows, cols, -1)
    h = _axis_angles(rows, h_dim, device, torch.float64)[None, :, None, :].expand(frames, rows, cols, -1)
    w = _axis_angles(cols, w_dim, device, torch.float64)[None, None, :, :].expand(frames, rows, cols, -1)
    angles = torch.cat([t, h, w], dim=-1).reshape(frames * rows * cols, head_dim // 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent channel pairs of ``x`` by the angles of ``cos``/``sin``.

    Args:
        x: [B, S, heads, head_dim] queries or keys, any floating dtype.
        cos, sin: [S, head_dim // 2] from :func:`rope_tables`.

    Returns:
        [B, S, heads, head_dim] in ``x.dtype``; the rotation itself is computed in the tables' dtype
        when that is wider (float32 tables for bf16 ``x``).
    """
    compute = torch.promote_types(x.dtype, cos.dtype)
    x1, x2 = x.to(compute).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return rotated.to(x.dtype)
