"""Shape benchmarking: time real training steps over a (B, S) grid of latent shapes.

Each grid point runs the :class:`~adaptiveload.train.step.TrainStep` the train job runs — same
compiled model, loss, backward, AdamW step, FSDP2 sharding and activation checkpointing — on a
synthetic batch of B samples of one latent shape (per rank). The weights do not change
(:meth:`TrainStep.frozen_weights`). Per point: ``warmup`` untimed steps, then the median of
``repeats`` timed steps (CUDA events on GPU, ``time.perf_counter`` on CPU) and the peak memory.

Faults: an out-of-memory error at a point is caught and recorded (status ``"oom"``), larger batch
sizes of that shape are skipped, and the sweep continues. Under torchrun every rank runs the same
point and the ranks then exchange their outcome over the control group
(:class:`~adaptiveload.train.distributed.DistContext`): a point is ``"ok"`` only if it ran on every
rank, its time is the slowest rank's, its memory the largest. A rank that failed for another reason
(or timed out waiting for a failed peak in a collective) makes every rank record ``"error"`` and stop
the sweep — the process group can no longer be trusted — keeping the points measured so far.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from adaptiveload.train.data import synthetic_batch
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.step import InputSpec, TrainStep

logger = logging.getLogger("adaptiveload.train")

STATUS_CODES = {"ok": 0, "oom": 1, "error": 2}
STATUS_NAMES = {code: name for name, code in STATUS_CODES.items()}
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)


def calibration_grid(
    bucket_shapes,
    patch_size=(1, 2, 2),
    *,
    num_shapes: int = 5,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    max_tokens: Optional[int] = None,
) -> list[tuple[int, tuple[int, int, int]]]:
    """Grid points ``(B, (T, H, W))``: ``num_shapes`` bucket shapes spread over S, each with every
    batch size whose ``B·S <= max_tokens``.

    Args:
        bucket_shapes: int [k, 3] distinct latent shapes (e.g. a manifest's buckets).
        patch_size: DiT patch; S = T·H·W / (pt·ph·pw).
        num_shapes: shapes to keep, the shortest, the longest and the rest evenly spaced in log S.
        batch_sizes: batch sizes to try per shape (ascending).
        max_tokens: cap on ``B·S`` (None: no cap; out-of-memory points are then found by running).

    Returns:
        points ordered by shape (short to long), then by B ascending.

    Raises:
        ValueError: no shapes, a non-positive batch size or ``num_shapes < 1``.
    """
    shapes = np.unique(np.asarray(bucket_shapes, dtype=np.int64).reshape(-1, 3), axis=0)
    if len(shapes) == 0:
        raise ValueError("calibration grid: no latent shapes to measure")
    if num_shapes < 1 or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"calibration grid: num_shapes ({num_shapes}) and batch sizes ({list(batch_sizes)}) must be >= 1")
    seq = shapes.prod(axis=1) // int(np.prod(patch_size))
    order = np.argsort(seq, kind="stable")
    shapes, seq = shapes[order], seq[order]
    if len(shapes) > num_shapes:
        targets = np.geomspace(seq[0], seq[-1], num_shapes)
        picked = sorted({int(np.argmin(np.abs(np.log(seq) - np.log(t)))) for t in targets})
        shapes, seq = shapes[picked], seq[picked]
    return [
        (int(b), tuple(int(v) for v in shape))
        for shape, s in zip(shapes, seq)
        for b in sorted(set(int(b) for b in batch_sizes))
        if max_tokens is None or b * s <= max_tokens
    ]


@dataclass
class CalibrationRun:
    """Result of :func:`calibrate`.

    Attributes:
        points: agreed point dicts (the format of :mod:`adaptiveload.sched.calibration`).
        aborted: why the sweep stopped early (a rank's error), or ``None``.
    """

    points: list
    aborted: Optional[str] = None


def _timed_steps(step: TrainStep, batch, global_samples: int, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        step(batch, global_samples)
    times = []
    for _ in range(repeats):
        if step.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(batch, global_samples)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step(batch, global_samples)
            times.append(time.perf_counter() - t0)
    return times


def measure_point(
    step: TrainStep, spec: InputSpec, batch_size: int, latent_shape, *, warmup: int, repeats: int, seed: int = 0
) -> dict:
    """Run one grid point on this rank only (no agreement): status, median step time, peak memory.

    Returns:
        ``{"status", "step_time_s", "peak_memory_bytes", "message"}`` (time/memory None unless ok;
        peak memory None on CPU).
    """
    batch = synthetic_batch(spec, batch_size, tuple(latent_shape), seed=seed, device=step.device)
    global_samples = batch_size * step.ctx.world_size
    step.synchronize()
    step.reset_peak_memory()
    try:
        times = _timed_steps(step, batch, global_samples, warmup, repeats)
        step.synchronize()
    except torch.OutOfMemoryError as err:
        step.optimizer.zero_grad(set_to_none=True)
        del batch
        if step.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"status": "oom", "step_time_s": None, "peak_memory_bytes": None, "message": str(err).splitlines()[0]}
    except Exception as err:  # noqa: BLE001 - any failure of the step is recorded, the ranks then agree
        step.optimizer.zero_grad(set_to_none=True)
        return {"status": "error", "step_time_s": None, "peak_memory_bytes": None,
                "message": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    peak = step.peak_memory_bytes() or None
    return {"status": "ok", "step_time_s": float(statistics.median(times)), "peak_memory_bytes": peak, "message": ""}


def agree(ctx: DistContext, local: dict) -> tuple[dict, list]:
    """Combine every rank's outcome of one point (over the control group).

    Returns:
        ``(agreed, per_rank)``: agreed ``status`` (the worst), ``step_time_s`` (slowest rank),
        ``peak_memory_bytes`` (largest); ``per_rank`` lists (rank, status) of ranks that failed.
    """
    nan = float("nan")
    row = [STATUS_CODES[local["status"]], local["step_time_s"] if local["step_time_s"] is not None else nan,
           float(local["peak_memory_bytes"]) if local["peak_memory_bytes"] is not None else nan]
    table = ctx.all_gather(row).numpy()
    worst = int(table[:, 0].max())
    agreed = {"status": STATUS_NAMES[worst], "step_time_s": None, "peak_memory_bytes": None}
    if worst == 0:
        agreed["step_time_s"] = float(table[:, 1].max())
        if not np.isnan(table[:, 2]).all():
            agreed["peak_memory_bytes"] = int(np.nanmax(table[:, 2]))
    failed = [(rank, STATUS_NAMES[int(code)]) for rank, code in enumerate(table[:, 0]) if code != 0]
    return agreed, failed


def calibrate(
    step: TrainStep,
    spec: InputSpec,
    grid: Sequence[tuple[int, tuple[int, int, int]]],
    *,
    patch_size=(1, 2, 2),
    warmup: int = 1,
    repeats: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> CalibrationRun:
    """Measure every grid point (see the module docstring); the model's weights are left unchanged.

    Args:
        step: the training step to time.
        spec: input geometry of the model.
        grid: ``(B, (T, H, W))`` per point, B per rank (e.g. from :func:`calibration_grid`).
        patch_size: to compute S of each shape.
        warmup, repeats: untimed and timed steps per point (``repeats >= 1``).
        seed: seed of the synthetic batches.
        progress: show a tqdm bar (rank 0 only).

    Returns:
        :class:`CalibrationRun`.

    Raises:
        ValueError: ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"calibrate: repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    ctx = step.ctx
    points: list = []
    too_big: dict = {}  # latent shape -> smallest B that ran out of memory
    bar = tqdm(grid, desc="calibrate", unit="point", disable=not (progress and ctx.is_main), leave=False)
    with step.frozen_weights():
        for batch_size, shape in bar:
            if shape in too_big and batch_size > too_big[shape]:
                continue  # a smaller batch of this shape already ran out of memory
            seq_len = int(np.prod(shape)) // int(np.prod(patch_size))
            bar.set_postfix_str(f"B={batch_size} S={seq_len}")
            local = measure_point(step, spec, batch_size, shape, warmup=warmup, repeats=repeats, seed=seed)
            agreed, failed = agree(ctx, local)
            point = {"batch_size": batch_size, "seq_len": seq_len, "latent_shape": list(shape), **agreed}
            points.append(point)
            if agreed["status"] == "oom":
                too_big[shape] = batch_size
                logger.info("calibrate: B=%d latent %s (S=%d) ran out of memory on rank(s) %s", batch_size,
                            shape, seq_len, [r for r, _ in failed])
            elif agreed["status"] == "error":
                reasons = ctx.all_gather_object(local["message"])
                detail = "; ".join(f"rank {r}: {reasons[r]}" for r, status in failed)
                message = f"B={batch_size} latent {tuple(shape)} (S={seq_len}) failed: {detail}"
                if ctx.distributed:  # collectives may be out of step: stop, keep what was measured
                    return CalibrationRun(points, aborted=message)
                logger.warning("calibrate: %s", message)
    return CalibrationRun(points)
