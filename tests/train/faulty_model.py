"""Model factories for fault tests (``--model faulty_model:NAME`` with tests/train on PYTHONPATH):
the tiny Wan DiT that raises, on some ranks, for some batch shapes -- a stand-in for a GPU running
out of memory in a long bucket -- or that gets non-finite gradients (a stand-in for a compiler bug)."""
import glob
import os
import sys

import torch
import torch.distributed as dist

from adaptiveload.models import WanDiT
from adaptiveload.models.config import PRESETS


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class NaNGradDiT(WanDiT):
    """The tiny Wan DiT whose output gradient is NaN for batches of 13 or more latent frames (the
    loss stays finite): a stand-in for a compiler bug at one shape."""

    def forward(self, latents, timestep, context):
        out = super().forward(latents, timestep, context)
        if latents.shape[2] >= 13 and out.requires_grad:
            out.register_hook(lambda g: torch.full_like(g, float("nan")))
        return out


def nan_gradient_on_long_videos():
    return NaNGradDiT(PRESETS["tiny"])


class FaultyDiT(WanDiT):
    def __init__(self, fails):
        super().__init__(PRESETS["tiny"])
        self.fails = fails

    def forward(self, latents, timestep, context):
        tokens = latents.shape[0] * latents.shape[2] * (latents.shape[3] // 2) * (latents.shape[4] // 2)
        error = self.fails(_rank(), latents.shape[0], tokens, tuple(latents.shape[2:]))
        if error is not None:
            raise error
        return super().forward(latents, timestep, context)


def oom_on_rank1_long_videos():
    """Rank 1 runs out of memory on batches of two or more clips of 13 or more latent frames."""
    return FaultyDiT(lambda rank, b, tokens, shape: torch.OutOfMemoryError("simulated: out of memory")
                     if rank == 1 and shape[0] >= 13 and b >= 2 else None)


def error_on_rank1_after_first_shape():
    """Rank 1 fails (not out of memory) on every batch of more than 18 tokens per sample."""
    return FaultyDiT(lambda rank, b, tokens, shape: RuntimeError("simulated: device lost")
                     if rank == 1 and tokens // b > 18 else None)


def oom_over_1000_tokens():
    """Every rank runs out of memory above 1000 tokens per batch (a real memory limit)."""
    return FaultyDiT(lambda rank, b, tokens, shape: torch.OutOfMemoryError("simulated: out of memory")
                     if tokens > 1000 else None)


_built = []  # models built in this process by nan_time_embedding_in_second_model


def nan_time_embedding_in_second_model():
    """The tiny Wan DiT; the second one built in a process -- a job's baseline, after its main run --
    gets NaN gradients in its time embedding (the loss stays finite): a stand-in for Inductor's
    wrong time-embedding gradients (pytorch/pytorch#193061)."""
    model = WanDiT(PRESETS["tiny"])
    _built.append(model)
    if len(_built) == 2:
        for p in model.time_embedding.parameters():
            p.register_hook(lambda g: torch.full_like(g, float("nan")))
    return model


class UnpackedDiT(WanDiT):
    """A DiT without forward_packed (as a model written before packs): --policy packed refuses it."""

    forward_packed = None


def without_forward_packed():
    return UnpackedDiT(PRESETS["tiny"])


class DiesAfterCheckpoint(WanDiT):
    """Exits the process (status 9, as if killed) in the first packed step after the checkpoint named
    by ``ADAPTIVELOAD_TEST_DIE_AT`` (e.g. ``step_000004``) became the latest of the run's folder
    (``--out``'s run folder); trains normally without the variable."""

    def forward_packed(self, *args):
        name = os.environ.get("ADAPTIVELOAD_TEST_DIE_AT")
        if name and torch.is_grad_enabled():
            for latest in glob.glob(os.path.join(_out(), "*", "checkpoint", "latest")):
                if open(latest).read().strip() == name:
                    os._exit(9)
        return super().forward_packed(*args)


def _out() -> str:
    argv = sys.argv
    return argv[argv.index("--out") + 1]


def dies_after_checkpoint():
    return DiesAfterCheckpoint(PRESETS["tiny"])
