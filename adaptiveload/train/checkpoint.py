"""Checkpoint and resume of a training run with ``torch.distributed.checkpoint`` (DCP).

Layout under a run's folder::

    checkpoint/step_000040/          DCP shards of {"model", "optimizer"} (every rank writes its shard)
    checkpoint/step_000040/job.json  step, epoch, sampler state, metric history (rank 0)
    checkpoint/step_000040/rng_rank{r}.pt   each rank's torch RNG states
    checkpoint/latest                name of the newest complete checkpoint (replaced atomically)

``latest`` is only updated after every rank finished writing, so a run killed while saving resumes
from the previous complete checkpoint; older checkpoints are then removed.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from adaptiveload.jsonfile import write_json_atomic
from adaptiveload.train.distributed import DistContext

LATEST = "latest"



def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(folder: str, step_count: int, module, optimizer, job_state: dict, ctx: DistContext) -> str:
    """Save model, optimizer, RNG and ``job_state`` (JSON-able) as ``folder/step_NNNNNN``; return its path.

    Every rank must call it (DCP is collective).
    """
    name = f"step_{step_count:06d}"
    path = os.path.join(folder, name)
    if ctx.is_main:
        os.makedirs(path, exist_ok=True)
    ctx.broadcast_object(None)  # the folder exists before any rank writes into it
    model_state, optim_state = get_state_dict(module, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    torch.save(_rng_state(ctx.device), os.path.join(path, f"rng_rank{ctx.rank}.pt"))
    if ctx.is_main:
        write_json_atomic(os.path.join(path, "job.json"), job_state)
    ctx.all_gather([0.0])  # every rank has written
    if ctx.is_main:
        previous = latest_checkpoint(folder)
        tmp = os.path.join(folder, f"{LATEST}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
        os.replace(tmp, os.path.join(folder, LATEST))
        if previous and os.path.basename(previous) != name:
            shutil.rmtree(previous, ignore_errors=True)
    return path


def latest_checkpoint(folder: str) -> Optional[str]:
    """Path of the newest complete checkpoint in ``folder``, or ``None``."""
    pointer = os.path.join(folder, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        path = os.path.join(folder, f.read().strip())
    return path if os.path.isdir(path) else None


def load_checkpoint(path: str, module, optimizer, ctx: DistContext) -> dict:
    """Restore model, optimizer and this rank's RNG from ``path``; return the saved job state.

    Raises:
        ValueError: the checkpoint lacks the job state or this rank's RNG file (e.g. it was written
            by a different number of ranks).
    """
    job_file = os.path.join(path, "job.json")
    rng_file = os.path.join(path, f"rng_rank{ctx.rank}.pt")
    for needed in (job_file, rng_file):
        if not os.path.isfile(needed):
            raise ValueError(f"checkpoint {path} is incomplete: {os.path.basename(needed)} is missing "
                             f"(written by a different world size?)")
    with open(job_file, encoding="utf-8") as f:
        job_state = json.load(f)
    saved_world = job_state.get("world_size")
    if saved_world is not None and saved_world != ctx.world_size:
        raise ValueError(f"checkpoint {path} was written by {saved_world} rank(s); this run has {ctx.world_size}: "
                         "resume with the same world size (the sample stream depends on it)")
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rng = torch.load(rng_file, weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], ctx.device)
    return job_state
