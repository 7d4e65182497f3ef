"""Sample shapes in three units, and the sequence length S of a video DiT.

Three units appear throughout :mod:`adaptiveload.sched`:

* **pixel** ``(frames, H_px, W_px)`` -- what a manifest stores (an image has ``frames = 1``);
* **latent** ``(T, H, W)`` -- the VAE latent grid fed to the DiT, *before* patchify:
  ``T = (frames - 1) // st + 1``, ``H = H_px // sh``, ``W = W_px // sw`` for VAE strides
  ``(st, sh, sw)`` (Wan 2.1: ``(4, 8, 8)``);
* **token** ``S`` -- the sequence length after patchify with patch ``(pt, ph, pw)`` (Wan 2.1:
  ``(1, 2, 2)``): ``S = (T / pt) * (H / ph) * (W / pw)``.

A bucket is one latent shape: samples with equal S but a different height x width cannot be
stacked into one tensor.

.. note::
    Pixel sizes that do not divide evenly are floored to the nearest multiple of
    ``stride * patch`` (16 px for Wan 2.1) and latent frame counts to a multiple of ``pt``: the
    dataset is expected to resize/crop each sample to its bucket's shape. So a 486x838 clip lands in
    the 480x832 bucket. Formula source: Wan 2.1 (VAE stride 4x8x8, patch 1x2x2),
    ``S = ((F - 1)//4 + 1) * (H/16) * (W/16)``: 81x480x832 -> 32,760; 81x720x1280 -> 75,600;
    one 480x832 image -> 1,560.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# Wan 2.1 defaults: causal video VAE with 4x temporal and 8x spatial compression, DiT patch 1x2x2.
WAN_VAE_STRIDE = (4, 8, 8)
WAN_PATCH_SIZE = (1, 2, 2)


def _check_triple(name: str, value: Sequence[int]) -> tuple[int, int, int]:
    triple = tuple(int(v) for v in value)
    if len(triple) != 3 or any(v < 1 for v in triple):
        raise ValueError(f"{name} must be three positive integers (t, h, w), got {tuple(value)}")
    return triple  # type: ignore[return-value]


def latent_shape(
    num_frames,
    height,
    width,
    *,
    vae_stride: Sequence[int] = WAN_VAE_STRIDE,
    patch_size: Sequence[int] = WAN_PATCH_SIZE,
) -> np.ndarray:
    """Latent grid ``(T, H, W)`` of samples given in pixels, floored to whole patches.

    Args:
        num_frames: int or int array [n], frames per sample (1 for an image), pixel units.
        height, width: int or int array [n], pixel units.
        vae_stride: VAE compression ``(st, sh, sw)``.
        patch_size: DiT patch ``(pt, ph, pw)``.

    Returns:
        int64 array [n, 3] (or [3] for scalar inputs): ``T = ((F - 1)//st + 1)`` floored to a multiple
        of ``pt``; ``H = (H_px // (sh*ph)) * ph``; ``W = (W_px // (sw*pw)) * pw``.

    Raises:
        ValueError: a value is below 1 frame, or a pixel size smaller than one patch (``sh*ph`` px),
            which would give an empty sequence.

    Example::

        >>> latent_shape(81, 480, 832).tolist()
        [21, 60, 104]
    """
    st, sh, sw = _check_triple("vae_stride", vae_stride)
    pt, ph, pw = _check_triple("patch_size", patch_size)
    frames = np.asarray(num_frames, dtype=np.int64)
    h_px = np.asarray(height, dtype=np.int64)
    w_px = np.asarray(width, dtype=np.int64)
    scalar = frames.ndim == 0 and h_px.ndim == 0 and w_px.ndim == 0
    frames, h_px, w_px = np.broadcast_arrays(np.atleast_1d(frames), np.atleast_1d(h_px), np.atleast_1d(w_px))
    for name, values, smallest in (("num_frames", frames, 1), ("height", h_px, sh * ph), ("width", w_px, sw * pw)):
        bad = np.flatnonzero(values < smallest)
        if bad.size:
            raise ValueError(
                f"{name} {int(values[bad[0]])} at index {int(bad[0])} is below the smallest size {smallest} "
                f"(VAE stride {vae_stride}, patch {patch_size})"
            )
    t = (frames - 1) // st + 1
    t = (t // pt) * pt
    if np.any(t < 1):
        bad = int(np.flatnonzero(t < 1)[0])
        raise ValueError(f"num_frames {int(frames[bad])} at index {bad} gives fewer latent frames than one patch ({pt})")
    shapes = np.stack([t, (h_px // (sh * ph)) * ph, (w_px // (sw * pw)) * pw], axis=-1)
    return shapes[0] if scalar else shapes


def tokens_from_latent(latent_shapes, *, patch_size: Sequence[int] = WAN_PATCH_SIZE) -> np.ndarray:
    """Sequence length ``S = (T/pt)(H/ph)(W/pw)`` of latent shapes.

    Args:
        latent_shapes: int array [n, 3] or [3], latent ``(T, H, W)``; each dim must divide by the patch.
        patch_size: DiT patch ``(pt, ph, pw)``.

    Returns:
        int64 array [n] (or a 0-d array for one shape), tokens.

    Raises:
        ValueError: a latent dim is not a positive multiple of its patch size.
    """
    patch = np.asarray(_check_triple("patch_size", patch_size), dtype=np.int64)
    shapes = np.asarray(latent_shapes, dtype=np.int64)
    if shapes.shape[-1:] != (3,):
        raise ValueError(f"latent_shapes must have shape [n, 3] (T, H, W), got {list(shapes.shape)}")
    bad = (shapes < patch) | (shapes % patch != 0)
    if np.any(bad):
        row = np.argwhere(bad)[0]
        raise ValueError(
            f"latent shape {shapes.reshape(-1, 3)[row[0] if shapes.ndim > 1 else 0].tolist()} is not a positive "
            f"multiple of the patch size {tuple(patch.tolist())}"
        )
    return np.prod(shapes // patch, axis=-1)


def sequence_length(
    num_frames,
    height,
    width,
    *,
    vae_stride: Sequence[int] = WAN_VAE_STRIDE,
    patch_size: Sequence[int] = WAN_PATCH_SIZE,
):
    """DiT sequence length S (tokens) of samples given in pixels.

    ``S = ((F - 1)//st + 1) / pt * (H_px // (sh*ph)) * (W_px // (sw*pw))``; with the Wan 2.1
    defaults ``S = ((F - 1)//4 + 1) * (H_px//16) * (W_px//16)``. Pixel sizes are floored to whole
    patches (see the module note).

    Args:
        num_frames: int or int array [n], frames (1 for an image).
        height, width: int or int array [n], pixels.
        vae_stride, patch_size: as in :func:`latent_shape`.

    Returns:
        ``int`` for scalar inputs, else an int64 array [n] of tokens.

    Raises:
        ValueError: as :func:`latent_shape`.

    Example::

        >>> sequence_length([1, 81, 81], [480, 480, 720], [832, 832, 1280]).tolist()
        [1560, 32760, 75600]
    """
    shapes = latent_shape(num_frames, height, width, vae_stride=vae_stride, patch_size=patch_size)
    tokens = tokens_from_latent(shapes, patch_size=patch_size)
    return int(tokens) if tokens.ndim == 0 else tokens
