"""Samples for training without disk I/O: latents of each sample's shape, text embeddings, noise, σ.

:class:`LatentDataset` maps a sample index to a dict of tensors. Latents and text embeddings are
random (or come from a user loader); noise ε and the noise level σ are drawn per (seed, epoch,
index), so a sample gets the same noise whichever rank, batch or worker process handles it — a
two-rank run and a one-process run on the same samples see identical inputs.

Where draws happen: on the CPU (``LatentDataset``'s default; in DataLoader workers, then pinned and
copied), or on the training device itself (``device="cuda"``, what ``adaptiveload train`` does
unless ``--workers`` is given) — a GPU draws a batch's random tensors in microseconds,
where one CPU core spends about 15 ms per sample of the Wan shapes (its 512 x 4096 float32 text
embedding), then pins and copies it. The same seed gives the same values on every device of one
type; CPU and CUDA draws differ.

σ sampling: ``"logit_normal"`` (default) draws σ = sigmoid(n), n ~ N(0, 1) — the logit-normal
schedule of Esser et al. 2024 ("Scaling Rectified Flow Transformers", §3.1, m = 0, s = 1), which
weights middle noise levels; ``"uniform"`` draws σ ~ U(0, 1) (plain rectified flow).

:func:`collate` stacks samples of one latent shape into a :class:`Batch`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from adaptiveload.train.step import InputSpec

SIGMA_SAMPLING = ("logit_normal", "uniform")

# A sample loader maps (index, latent_shape (T, H, W)) to (latents [C, T, H, W], context [L, text_dim]).
SampleLoader = Callable[[int, tuple], tuple]


def _generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator on ``device`` seeded from integer keys (numpy's SeedSequence mixes them)."""
    seed = int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(seed)


def sample_sigma(generator: torch.Generator, n: int, sampling: str = "logit_normal") -> Tensor:
    """Draw ``n`` noise levels in (0, 1) (float32 [n]); see the module docstring for the schedules.

    Raises:
        ValueError: unknown ``sampling``.
    """
    if sampling == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=generator, device=generator.device))
    if sampling == "uniform":
        return torch.rand(n, generator=generator, device=generator.device)
    raise ValueError(f"unknown sigma sampling {sampling!r}; choose one of {', '.join(SIGMA_SAMPLING)}")


class LatentDataset(torch.utils.data.Dataset):
    """Samples of given latent shapes for the flow-matching step.

    Args:
        latent_shapes: int [n, 3] (T, H, W) latent grid of every sample (e.g. ``Manifest.latent_shapes``).
        spec: :class:`InputSpec` (channels, text length and width).
        seed: base seed of every random draw.
        sigma_sampling: ``"logit_normal"`` or ``"uniform"``.
        loader: optional ``loader(index, (T, H, W)) -> (latents [C, T, H, W], context [L, text_dim])``
            supplying real data; random N(0, 1) tensors otherwise (throughput runs need no disk I/O).
        device: where the random tensors are drawn and every item's tensors live (default CPU). A
            CUDA device needs a DataLoader without worker processes (``num_workers=0``).

    Items are dicts: ``index`` (int), ``latents`` float32 [C, T, H, W], ``context`` float32
    [L, text_dim], ``noise`` float32 [C, T, H, W], ``sigma`` float32 scalar tensor, all on ``device``.

    Raises:
        ValueError: shapes not [n, 3] positive integers; a loader returning tensors of the wrong
            shape (named, with the sample index).
    """

    def __init__(
        self,
        latent_shapes,
        spec: InputSpec,
        seed: int = 0,
        sigma_sampling: str = "logit_normal",
        loader: Optional[SampleLoader] = None,
        device: torch.device | str = "cpu",
    ):
        shapes = np.asarray(latent_shapes, dtype=np.int64)
        if shapes.ndim != 2 or shapes.shape[1] != 3 or (shapes.size and shapes.min() < 1):
            raise ValueError(f"latent_shapes must be positive integers [n, 3] (T, H, W), got array of shape {shapes.shape}")
        if sigma_sampling not in SIGMA_SAMPLING:
            raise ValueError(f"unknown sigma sampling {sigma_sampling!r}; choose one of {', '.join(SIGMA_SAMPLING)}")
        self.latent_shapes = shapes
        self.spec = spec
        self.seed = int(seed)
        self.sigma_sampling = sigma_sampling
        self.loader = loader
        self.device = torch.device(device)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.latent_shapes)

    def set_epoch(self, epoch: int) -> None:
        """Draw fresh noise and σ for every sample in ``epoch`` (the clean latents stay the same)."""
        self.epoch = int(epoch)

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        shape = tuple(int(v) for v in self.latent_shapes[index])
        latent_size = (self.spec.in_channels, *shape)
        context_size = (self.spec.text_len, self.spec.text_dim)
        if self.loader is not None:
            latents, context = self.loader(index, shape)
            for name, tensor, expected in (("latents", latents, latent_size), ("context", context, context_size)):
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"sample loader: {name} of sample {index} has shape {list(tensor.shape)}, expected {list(expected)}"
                    )
            latents, context = latents.to(self.device, torch.float32), context.to(self.device, torch.float32)
        else:
            data_gen = _generator(self.device, self.seed, index)
            latents = torch.randn(latent_size, generator=data_gen, device=self.device)
            context = torch.randn(context_size, generator=data_gen, device=self.device)
        noise_gen = _generator(self.device, self.seed, self.epoch, index, 1)
        noise = torch.randn(latent_size, generator=noise_gen, device=self.device)
        sigma = sample_sigma(noise_gen, 1, self.sigma_sampling)[0]
        return {"index": index, "latents": latents, "context": context, "noise": noise, "sigma": sigma}


@dataclass
class Batch:
    """Samples of one latent shape, stacked.

    Attributes:
        indices: int64 [B] sample indices.
        latents: [B, C, T, H, W]; noise: [B, C, T, H, W]; context: [B, L, text_dim]; sigma: [B].
    """

    indices: Tensor
    latents: Tensor
    context: Tensor
    noise: Tensor
    sigma: Tensor

    def __len__(self) -> int:
        return int(self.indices.numel())

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(T, H, W) of every sample in the batch."""
        return tuple(int(v) for v in self.latents.shape[2:])

    def pin_memory(self) -> "Batch":
        """Page-locked copies (``DataLoader(pin_memory=True)`` calls this)."""
        return Batch(*(t.pin_memory() for t in (self.indices, self.latents, self.context, self.noise, self.sigma)))


def collate(samples: Sequence[dict]) -> Batch:
    """Stack dataset items of one latent shape into a :class:`Batch`.

    Raises:
        ValueError: an empty list, or items of different latent shapes (named with their indices).
    """
    if not samples:
        raise ValueError("collate: empty batch")
    shapes = {tuple(s["latents"].shape) for s in samples}
    if len(shapes) > 1:
        listing = ", ".join(f"{s['index']}: {list(s['latents'].shape[1:])}" for s in samples)
        raise ValueError(f"collate: a batch must hold one latent shape, got samples {listing}")
    return Batch(
        indices=torch.tensor([s["index"] for s in samples], dtype=torch.int64),
        latents=torch.stack([s["latents"] for s in samples]),
        context=torch.stack([s["context"] for s in samples]),
        noise=torch.stack([s["noise"] for s in samples]),
        sigma=torch.stack([s["sigma"] for s in samples]),
    )


def synthetic_batch(
    spec: InputSpec, batch_size: int, latent_shape: tuple, seed: int = 0, device: torch.device | str = "cpu"
) -> Batch:
    """A random batch of ``batch_size`` samples of one latent shape (calibration, warm-up).

    Draws like :class:`LatentDataset` (on ``device``) with sample indices ``0..batch_size-1``.
    """
    shapes = np.tile(np.asarray(latent_shape, dtype=np.int64), (batch_size, 1))
    dataset = LatentDataset(shapes, spec, seed=seed, device=device)
    return collate([dataset[i] for i in range(batch_size)])
