"""Building what ``calibrate`` and ``train`` share from their options: the corpus and the training step.

Corpus: a manifest file (CSV / JSONL / Parquet) or the built-in reference mix. ``downscale`` divides
every sample's height and width by an integer factor (the VAE's spatial stride becomes ``8·k``), so
S shrinks by about k² while the mix of buckets stays the same; the CPU default is 8 (reference mix:
S from 18 to 1,050 tokens instead of 1,560 to 75,600), which lets the tiny model train on a laptop.

Activation checkpointing ``"auto"``: on when the longest sample's estimated activation memory does
not fit on the device next to the weights and optimizer state. The estimate is 70 bytes per token
per model channel per layer (ANCHORS §2: a 10-layer, 1536-channel Wan model uses ~1 GiB per 1k
tokens without checkpointing, bf16), and weights + gradients + AdamW state take 16 bytes per
parameter (float32). Off on CPU.

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

from adaptiveload.sched.manifest import Manifest, load_manifest, reference_mix
from adaptiveload.sched.shapes import WAN_PATCH_SIZE, WAN_VAE_STRIDE
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.step import InputSpec, StepConfig, TrainStep, load_model, transformer_blocks

logger = logging.getLogger("adaptiveload.train")

CPU_DOWNSCALE = 8  # default height/width divisor of the corpus on CPU (module docstring)
ACTIVATION_BYTES_PER_TOKEN_CHANNEL_LAYER = 70  # ANCHORS §2: ~1 GiB per 1k tokens at 10 layers x 1536
TRAINING_STATE_BYTES_PER_PARAM = 16  # float32 weights, gradients, AdamW exp_avg and exp_avg_sq
CHECKPOINT_MODES = ("auto", "on", "off")
DEFAULT_SAMPLES = 256  # size of the reference mix when --samples is not given
CPU_THREADS = 1  # torch intra-op threads of a CPU job without OMP_NUM_THREADS (module docstring)


def set_cpu_threads(device: torch.device) -> None:
    """On CPU, run torch's intra-op work on :data:`CPU_THREADS` threads unless ``OMP_NUM_THREADS``
    is set (module docstring); nothing on GPU."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(CPU_THREADS)


def load_corpus(manifest: Optional[str], num_samples: Optional[int], seed: int, downscale: int,
                patch_size=WAN_PATCH_SIZE) -> Manifest:
    """The training corpus: ``manifest`` (first ``num_samples`` rows) or the reference mix of ``num_samples``.

    Raises:
        ValueError: a bad manifest (the reader names file, row and field), a manifest without
            pixel sizes (latent shapes are needed to make tensors), ``downscale < 1``, or
            ``num_samples < 1``.
        FileNotFoundError: the manifest does not exist.
    """
    if downscale < 1:
        raise ValueError(f"--downscale must be >= 1, got {downscale}")
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"--samples must be >= 1, got {num_samples}")
    st, sh, sw = WAN_VAE_STRIDE
    stride = (st, sh * downscale, sw * downscale)
    if manifest is None:
        return reference_mix(num_samples or DEFAULT_SAMPLES, seed, vae_stride=stride, patch_size=patch_size)
    corpus = load_manifest(manifest, vae_stride=stride, patch_size=patch_size)
    if corpus.latent_shapes is None:
        raise ValueError(f"{manifest}: training needs num_frames,height,width columns (seq_len alone gives no tensor shape)")
    return corpus if num_samples is None else corpus.head(num_samples)


def default_downscale(device: torch.device) -> int:
    """Height/width divisor of the corpus when none is given: 1 on GPU, :data:`CPU_DOWNSCALE` on CPU."""
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


@dataclass
class ModelInfo:
    """What was built, for reports: name, layers, parameters, checkpointing, modulate sites."""

    name: str
    num_layers: Optional[int]
    parameters: int
    activation_checkpointing: bool
    modulate_sites: Optional[int]

    def to_json(self) -> dict:
        return dict(self.__dict__)


def build_step(
    ctx: DistContext,
    *,
    preset: Optional[str],
    factory: Optional[str],
    num_layers: Optional[int],
    step_config: StepConfig,
    activation_checkpointing: str,
    max_seq_len: int,
    seed: int,
) -> tuple[TrainStep, InputSpec, ModelInfo]:
    """Build the model with the same initial weights on every rank (seeded), then the training step.

    Raises:
        ValueError: as :func:`~adaptiveload.train.step.load_model`,
            :func:`resolve_activation_checkpointing` and :func:`~adaptiveload.train.step.checkpoint_blocks`.
    """
    torch.manual_seed(seed)
    model = load_model(preset=preset, factory=factory, num_layers=num_layers)
    spec = InputSpec.from_model(model)
    checkpointing = resolve_activation_checkpointing(activation_checkpointing, model, max_seq_len, ctx.device)
    info = ModelInfo(
        name=preset or factory,
        num_layers=getattr(getattr(model, "config", None), "num_layers", None),
        parameters=sum(p.numel() for p in model.parameters()),
        activation_checkpointing=checkpointing,
        modulate_sites=getattr(model, "num_modulate_sites", None),
    )
    step_config = dataclasses.replace(step_config, activation_checkpointing=checkpointing)
    return TrainStep(model, step_config, ctx), spec, info


def step_settings(info: ModelInfo, step_config: StepConfig, ctx: DistContext, corpus: Manifest) -> dict:
    """How a step is measured, for a calibration's ``settings``: model, depth, backend, activation
    checkpointing, world size, dtype, optimizer and corpus, plus the device's memory in bytes on CUDA
    (:func:`~adaptiveload.sched.plan.make_plan` reads it)."""
    settings = {"model": info.name, "num_layers": info.num_layers, "backend": step_config.describe(),
                "activation_checkpointing": info.activation_checkpointing, "world_size": ctx.world_size,
                "dtype": "bfloat16 autocast" if ctx.device.type == "cuda" else "float32", "optimizer": "AdamW",
                "corpus": corpus.source}
    if ctx.device.type == "cuda":
        settings["device_memory_bytes"] = device_memory_bytes(ctx.device)
    return settings


def device_description(device: torch.device) -> str:
    """``"NVIDIA H200"`` or ``"cpu"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Total memory of a CUDA device, ``None`` on CPU."""
    return int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
