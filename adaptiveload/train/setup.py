"""Building what ``calibrate`` and ``train`` share from their options: the corpus and the training step.

Corpus: a manifest file (CSV / JSONL / Parquet) or the built-in reference mix, its token counts from
the VAE stride (pixels -> latent) and the model's patch size (latent -> tokens). ``downscale``
divides every sample's pixel height and width by an integer factor (the VAE's spatial stride
becomes ``stride·k``), so S shrinks by about k² while the mix of buckets stays the same; the CPU
default is 8 (reference mix: S from 18 to 1,050 tokens instead of 1,560 to 75,600), which lets the
tiny model train on a laptop. A manifest that gives latent sizes or sample files has fixed shapes:
no downscale (1, also on CPU).

Model: a preset (its patch size replaced by ``patch_size`` when given) or the user's factory, whose
``config.patch_size`` is the patch (:class:`ModelSource`).

Activation checkpointing ``"auto"``: on when the longest sample's estimated activation memory does
not fit on the device next to the weights and optimizer state. The estimate is 70 bytes per token
per model channel per layer -- ~1 GiB of activations per 1k tokens for a 10-layer, 1536-channel Wan
model in bf16 without checkpointing, measured on one H200 (torch 2.11, Inductor:
``benchmarks/results/train_h200/x1_inductor_equal.json`` peaked at 90.4 GiB with B·S = 98,280
tokens, 0.85 GiB per 1k tokens after the 7.3 GiB of weights and AdamW state) -- and weights +
gradients + AdamW state take 16 bytes per parameter (float32). Off on CPU.

CPU threads: a CPU job runs torch's intra-op work on one thread unless ``OMP_NUM_THREADS`` is set.
The CPU models' operations are too small to gain from more, and OpenMP threads that spin-wait for a
core another process holds collapse under a competing load: on a 2-core machine with both cores
busy, the default run's compile warm-up took 57.9 s with torch's default 2 threads and 4.5 s with 1.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from torch import nn

from adaptiveload.sched.manifest import Manifest, load_manifest, reference_mix
from adaptiveload.sched.shapes import WAN_PATCH_SIZE, WAN_VAE_STRIDE
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.step import InputSpec, StepConfig, TrainStep, load_model, transformer_blocks

logger = logging.getLogger("adaptiveload.train")

CPU_DOWNSCALE = 8  # default height/width divisor of the corpus on CPU (module docstring)
ACTIVATION_BYTES_PER_TOKEN_CHANNEL_LAYER = 70  # ~1 GiB per 1k tokens at 10 layers x 1536 (module docstring)
TRAINING_STATE_BYTES_PER_PARAM = 16  # float32 weights, gradients, AdamW exp_avg and exp_avg_sq
CHECKPOINT_MODES = ("auto", "on", "off")
DEFAULT_SAMPLES = 256  # size of the reference mix when --samples is not given
FILE_WORKERS = 2  # DataLoader worker processes reading sample files when --workers is not given
CPU_THREADS = 1  # torch intra-op threads of a CPU job without OMP_NUM_THREADS (module docstring)


def set_cpu_threads(device: torch.device) -> None:
    """On CPU, run torch's intra-op work on :data:`CPU_THREADS` threads unless ``OMP_NUM_THREADS``
    is set (module docstring); nothing on GPU."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(CPU_THREADS)


def load_corpus(manifest: Optional[str], num_samples: Optional[int], seed: int, downscale: Optional[int],
                device: torch.device, *, vae_stride=WAN_VAE_STRIDE,
                patch_size=WAN_PATCH_SIZE) -> tuple[Manifest, int]:
    """The training corpus: ``manifest`` (first ``num_samples`` rows) or the reference mix of
    ``num_samples``, and the downscale applied (module docstring).

    Args:
        downscale: pixel height/width divisor; None: :func:`default_downscale` for a corpus of pixel
            sizes, 1 for one of latent sizes or sample files.
        device: the training device (the default downscale depends on it).
        vae_stride, patch_size: (t, h, w) pixel -> latent -> token geometry.

    Raises:
        ValueError: a bad manifest (the reader names file, row and field), a manifest without
            latent or pixel sizes (a tensor shape is needed), a downscale other than 1 for fixed
            shapes, ``downscale < 1``, or ``num_samples < 1``.
        FileNotFoundError: the manifest does not exist.
    """
    if downscale is not None and downscale < 1:
        raise ValueError(f"--downscale must be >= 1, got {downscale}")
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"--samples must be >= 1, got {num_samples}")
    st, sh, sw = vae_stride
    if manifest is None:
        k = downscale or default_downscale(device)
        return reference_mix(num_samples or DEFAULT_SAMPLES, seed, vae_stride=(st, sh * k, sw * k),
                             patch_size=patch_size), k
    corpus = load_manifest(manifest, vae_stride=vae_stride, patch_size=patch_size)
    if corpus.latent_shapes is None:
        raise ValueError(f"{manifest}: training needs num_frames,height,width or latent_t,latent_h,latent_w "
                         "columns (seq_len alone gives no tensor shape)")
    if corpus.pixel_shapes is None or corpus.latent_paths is not None:
        if downscale not in (None, 1):
            fixed = "sample files" if corpus.latent_paths is not None else "latent sizes"
            raise ValueError(f"--downscale {downscale}: {manifest} gives {fixed}, whose shapes are fixed; "
                             "leave --downscale out")
        k = 1
    else:
        k = downscale or default_downscale(device)
        if k > 1:
            try:
                corpus = Manifest.from_pixels(*corpus.pixel_shapes.T, vae_stride=(st, sh * k, sw * k),
                                              patch_size=patch_size, source=corpus.source)
            except ValueError as err:
                raise ValueError(f"{manifest} at --downscale {k}: {err}") from None
    return (corpus if num_samples is None else corpus.head(num_samples)), k


def default_downscale(device: torch.device) -> int:
    """Height/width divisor of a corpus of pixel sizes when none is given: 1 on GPU,
    :data:`CPU_DOWNSCALE` on CPU."""
    return 1 if device.type == "cuda" else CPU_DOWNSCALE


def bucket_shapes(corpus: Manifest) -> np.ndarray:
    """Distinct latent shapes [k, 3] of a corpus."""
    return np.unique(corpus.latent_shapes, axis=0)


def resolve_activation_checkpointing(mode: str, model: torch.nn.Module, max_seq_len: int, device: torch.device) -> bool:
    """Decide activation checkpointing (``"on"``, ``"off"``, ``"auto"``; the rule is in the module docstring).

    The step applies it (:func:`~adaptiveload.train.step.checkpoint_blocks`, which also rejects
    ``"on"`` for a model it cannot checkpoint); ``"auto"`` is off for such a model.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {', '.join(CHECKPOINT_MODES)}")
    if mode == "auto":
        can = bool(transformer_blocks(model)) or hasattr(model, "set_activation_checkpointing")
        config = getattr(model, "config", None)
        if device.type != "cuda" or not can or config is None or not hasattr(config, "dim"):
            return False
        params = sum(p.numel() for p in model.parameters())
        activations = ACTIVATION_BYTES_PER_TOKEN_CHANNEL_LAYER * config.dim * config.num_layers * max_seq_len
        free = 0.9 * torch.cuda.get_device_properties(device).total_memory - TRAINING_STATE_BYTES_PER_PARAM * params
        enabled = activations > free
        logger.info("activation checkpointing %s (longest sample needs ~%.1f GiB of activations, ~%.1f GiB free)",
                    "on" if enabled else "off", activations / 2**30, free / 2**30)
    else:
        enabled = mode == "on"
    return enabled


class ModelSource:
    """The model a job trains, built with the same initial weights (seeded) every time.

    Args:
        preset, factory: one of them (see :func:`~adaptiveload.train.step.load_model`).
        num_layers: a preset's depth (None: its own).
        patch_size: a preset's (pt, ph, pw) patch (None: its own); a factory's model keeps its own
            ``config.patch_size`` (a different one given here is logged as ignored).
        seed: torch's seed before each build.

    Raises:
        ValueError: (from :meth:`spec` and :meth:`build`) as :func:`~adaptiveload.train.step.load_model`
            and :meth:`~adaptiveload.train.step.InputSpec.from_model`.
    """

    def __init__(self, *, preset: Optional[str], factory: Optional[str], num_layers: Optional[int] = None,
                 patch_size: Optional[tuple] = None, seed: int = 0):
        self.preset, self.factory, self.num_layers, self.patch_size = preset, factory, num_layers, patch_size
        self.seed = seed
        self.name = preset or factory
        self._first: Optional[nn.Module] = None  # built by spec(), handed out by the next build()

    def _load(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return load_model(preset=self.preset, factory=self.factory, num_layers=self.num_layers,
                          patch_size=self.patch_size if self.factory is None else None)

    def first(self) -> nn.Module:
        """The model :meth:`build` hands out next, built now if need be (a factory is called once
        for both)."""
        if self._first is None:
            self._first = self._load()
        return self._first

    def spec(self) -> InputSpec:
        """The model's :class:`InputSpec` (its patch size: the token geometry), from :meth:`first`."""
        spec = InputSpec.from_model(self.first())
        if self.factory is not None and self.patch_size is not None and tuple(self.patch_size) != spec.patch_size:
            logger.warning("--patch-size %s ignored: the model's config.patch_size %s is its patch",
                           ",".join(map(str, self.patch_size)), ",".join(map(str, spec.patch_size)))
        return spec

    def build(self) -> nn.Module:
        """A model with the seeded initial weights (the one :meth:`spec` built, the first time)."""
        model = self._first if self._first is not None else self._load()
        self._first = None
        return model


@dataclass
class ModelInfo:
    """What was built, for reports: name, layers, parameters, checkpointing, modulate sites (norm ->
    modulate chains a forward runs), norm sites (every norm the backend can fuse), patch."""

    name: str
    num_layers: Optional[int]
    parameters: int
    activation_checkpointing: bool
    modulate_sites: Optional[int]
    patch_size: Optional[list] = None
    norm_sites: Optional[int] = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def build_step(
    ctx: DistContext,
    *,
    models: ModelSource,
    step_config: StepConfig,
    activation_checkpointing: str,
    max_seq_len: int,
) -> tuple[TrainStep, InputSpec, ModelInfo]:
    """Build the model (:meth:`ModelSource.build`: the same initial weights on every rank), then the
    training step.

    Raises:
        ValueError: as :meth:`ModelSource.build`, :func:`resolve_activation_checkpointing` and
            :func:`~adaptiveload.train.step.checkpoint_blocks`.
    """
    model = models.build()
    spec = InputSpec.from_model(model)
    checkpointing = resolve_activation_checkpointing(activation_checkpointing, model, max_seq_len, ctx.device)
    info = ModelInfo(
        name=models.name,
        num_layers=getattr(getattr(model, "config", None), "num_layers", None),
        parameters=sum(p.numel() for p in model.parameters()),
        activation_checkpointing=checkpointing,
        modulate_sites=getattr(model, "num_modulate_sites", None),
        patch_size=list(spec.patch_size),
        norm_sites=getattr(model, "num_norm_sites", None),
    )
    step_config = dataclasses.replace(step_config, activation_checkpointing=checkpointing)
    return TrainStep(model, step_config, ctx), spec, info


def step_settings(info: ModelInfo, step_config: StepConfig, ctx: DistContext, corpus: Manifest, *,
                  vae_stride, downscale: int) -> dict:
    """How a step is measured, for a calibration's ``settings``: model, depth, backend, activation
    checkpointing, world size, dtype, optimizer, corpus and its token geometry (``vae_stride`` as
    given, ``downscale``, the model's ``patch_size``; lists), plus the device's memory in bytes on
    CUDA (:func:`~adaptiveload.sched.plan.make_plan` reads it)."""
    settings = {"model": info.name, "num_layers": info.num_layers, "backend": step_config.describe(),
                "activation_checkpointing": info.activation_checkpointing, "world_size": ctx.world_size,
                "dtype": "bfloat16 autocast" if ctx.device.type == "cuda" else "float32", "optimizer": "AdamW",
                "corpus": corpus.source, "vae_stride": list(vae_stride), "downscale": downscale,
                "patch_size": list(corpus.patch_size)}
    if ctx.device.type == "cuda":
        settings["device_memory_bytes"] = device_memory_bytes(ctx.device)
    return settings


def device_description(device: torch.device) -> str:
    """``"NVIDIA H200"`` or ``"cpu"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Total memory of a CUDA device, ``None`` on CPU."""
    return int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
