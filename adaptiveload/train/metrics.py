"""Per-rank busy time from profiled steps, and the load-balance statistics computed from it.

Under FSDP2 every rank waits for the others in each all-gather, so per-rank step *wall* times are
all equal and say nothing about balance. Busy time is the time a rank spends computing:

* on GPU, the summed duration of the step's device kernels other than communication kernels
  (NCCL), from ``torch.profiler``;
* on CPU, the step's wall time minus the time spent inside communication calls (gloo all-gathers,
  reduce-scatters, all-reduces, waits): the union of those calls' intervals, from ``torch.profiler``.

Statistics over the profiled steps (the same definitions as ``adaptiveload simulate``):
compute-load CV = std/mean of the ranks' busy times in a step, idle fraction = 1 − mean/max of
the ranks' busy times in a step; both averaged over profiled steps.
"""
from __future__ import annotations

import re

import numpy as np
import torch

# Names of profiler events that are communication, not compute.
COMMUNICATION = re.compile(
    r"nccl|gloo|c10d::|record_param_comms|all_?gather|reduce_?scatter|all_?reduce|broadcast|wait_tensor",
    re.IGNORECASE,
)


def _is_device_kernel(event) -> bool:
    return event.device_type() != torch.autograd.DeviceType.CPU


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (in their unit)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def busy_time_s(profiler: torch.profiler.profile, device: torch.device, step_wall_s: float) -> float:
    """This rank's compute time in one profiled step (seconds); see the module docstring.

    Args:
        profiler: a finished ``torch.profiler.profile`` that recorded exactly one step.
        device: the rank's device (``cuda`` sums kernels; ``cpu`` subtracts communication time).
        step_wall_s: the step's wall time in seconds (CPU: busy = wall − communication).

    Returns:
        seconds (>= 0).
    """
    # Kineto's raw events: profiler.events() builds the full FunctionEvent tree first, which took
    # 1.45 s a profiled step in the CPU default run under load (a quarter of the run) for the same sums
    events = profiler.profiler.kineto_results.events()
    if device.type == "cuda":
        kernels_ns = sum(e.duration_ns() for e in events if _is_device_kernel(e) and not COMMUNICATION.search(e.name()))
        return kernels_ns / 1e9
    comm = [(e.start_ns(), e.end_ns()) for e in events if not _is_device_kernel(e) and COMMUNICATION.search(e.name())]
    return max(0.0, step_wall_s - _union_length(comm) / 1e9)


def load_balance(busy: np.ndarray) -> dict:
    """Compute-load CV and idle fraction from busy times.

    Args:
        busy: float [steps, world_size], seconds; row = one profiled step.

    Returns:
        ``{"compute_load_cv": float, "idle_fraction": float, "profiled_steps": int}``, averages over
        steps of std/mean and 1 − mean/max across ranks (NaN without profiled steps).
    """
    busy = np.asarray(busy, dtype=np.float64)
    if busy.size == 0:
        return {"compute_load_cv": float("nan"), "idle_fraction": float("nan"), "profiled_steps": 0}
    mean = busy.mean(axis=1)
    ok = mean > 0
    cv = np.where(ok, busy.std(axis=1) / np.where(ok, mean, 1.0), 0.0)
    idle = np.where(ok, 1.0 - mean / np.where(ok, busy.max(axis=1), 1.0), 0.0)
    return {"compute_load_cv": float(cv.mean()), "idle_fraction": float(idle.mean()), "profiled_steps": int(len(busy))}


def summarize(values) -> dict:
    """``{"mean", "median", "p10", "p90", "min", "max"}`` of a sequence of numbers (NaN if empty)."""
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0:
        return {k: float("nan") for k in ("mean", "median", "p10", "p90", "min", "max")}
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
            "p90": float(np.percentile(v, 90)), "min": float(v.min()), "max": float(v.max())}
