"""Process-group set-up for training and calibration, and the control plane the ranks agree through.

Under ``torchrun`` (``WORLD_SIZE`` > 1) :func:`init_distributed` creates the main process group
(NCCL on GPUs, gloo on CPU) that FSDP2 uses, plus a separate gloo *control* group. Agreement on
outcomes (did this step or grid point run out of memory?) goes through the control group, so a rank
whose step failed part-way never mixes its status message into the main group's sequence of FSDP
all-gathers. A rank that is still waiting in a main-group collective for the failed rank gets a
collective timeout (``timeout_s``) — with NCCL the communicator is aborted rather than the process
killed (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless the user set it) — and then reaches the same
control all-gather, so every rank learns the outcome and none hangs.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("adaptiveload.train")

# Seconds the control group waits before giving up on a silent rank: longer than the main group's
# timeout, so ranks stuck in a main-group collective time out there first and then report here.
_CONTROL_TIMEOUT_MARGIN_S = 60.0


@dataclass
class DistContext:
    """Where this process runs: rank, world size, device, and the process groups.

    Attributes:
        rank, world_size: this process's rank and the number of ranks (1 without torchrun).
        device: the device this rank computes on (``cuda:LOCAL_RANK`` or ``cpu``).
        control_group: gloo group for agreement messages; ``None`` when ``world_size == 1``.
        owns_group: whether :func:`init_distributed` created the default group (and
            :meth:`close` should destroy it).
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    control_group: Optional[object] = None
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and writes shared files."""
        return self.rank == 0

    def all_gather(self, values) -> torch.Tensor:
        """Gather a small float vector from every rank over the control group.

        Args:
            values: sequence of floats (the same length on every rank).

        Returns:
            float64 [world_size, len(values)] on CPU; row r is rank r's values.
        """
        local = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        if not self.distributed:
            return local.unsqueeze(0)
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(rows, local, group=self.control_group)
        return torch.stack(rows)

    def all_gather_object(self, obj) -> list:
        """Gather one picklable object per rank over the control group (a list indexed by rank)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control_group)
        return out

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank (over the control group)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def wait_for_all(self) -> None:
        """Wait until every rank gets here (a barrier on the control group; no-op on one rank).

        Ranks call it before leaving, so a rank that is done early (e.g. rank 1 after agreeing on a
        failure) does not tear down its connections while a peer still writes results. The wait
        is bounded by the control group's timeout (``timeout_s`` of :func:`init_distributed` + 60 s);
        if a peer died, the failure is logged as a warning, not raised.
        """
        if not self.distributed:
            return
        try:
            dist.barrier(group=self.control_group)
        except RuntimeError as err:  # DistError and gloo timeouts derive from RuntimeError
            logger.warning("rank %d: not every rank reached the end (%s)", self.rank, str(err).splitlines()[0])

    def close(self) -> None:
        """:meth:`wait_for_all`, then destroy the default process group (and with it the control
        group) when :func:`init_distributed` created it; a group the caller created is left alone."""
        self.wait_for_all()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(device: Optional[str] = None, timeout_s: float = 300.0) -> DistContext:
    """Join the job's process group when launched by ``torchrun``; otherwise a single-rank context.

    Args:
        device: ``"cuda"``, ``"cpu"`` or ``None`` (CUDA when available). Under torchrun each rank
            takes ``cuda:LOCAL_RANK``.
        timeout_s: seconds a main-group collective may wait for a peer before it fails (how long
            a rank whose peer crashed or ran out of memory waits before it learns about it).

    Returns:
        a :class:`DistContext`.

    Raises:
        ValueError: ``device="cuda"`` without CUDA, or more local ranks than GPUs.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but CUDA is not available")
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size <= 1 and not dist.is_initialized():
        return DistContext(device=torch.device("cuda", 0) if use_cuda else torch.device("cpu"))

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local_rank)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort communicators, keep the process
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
        owns = True
    control = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=timeout_s + _CONTROL_TIMEOUT_MARGIN_S)
    )
    ctx = DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"),
        control_group=control,
        owns_group=owns,
    )
    logger.info("rank %d of %d on %s", ctx.rank, ctx.world_size, ctx.device)
    return ctx
