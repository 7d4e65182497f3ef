"""Planning a training run: its calibration (loaded, or a quick one with the run's own step), its
plan (loaded, or made now) and its batch sampler.

Policies (:mod:`adaptiveload.sched.policies`):

* ``dual`` / ``cost_grouped``: :meth:`DualConstraintBucketSampler.from_plan` with the plan made for
  this world size and policy;
* ``equal_token``: the equal-token rule ``B = floor(M_mem_limit / S)`` at the plan's memory limit,
  ranks drawing batches independently;
* ``packed``: :class:`~adaptiveload.sched.packing.PackingSampler` (:func:`~adaptiveload.sched.packing.sampler_from_plan`),
  packs of samples of different lengths for a model with ``forward_packed``. The quick calibration
  still times bucketed batches: a pack's predicted time is the quadratic model summed per sample
  (:meth:`~adaptiveload.sched.cost_model.CostModel.predict_packs`).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np

from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.packing import sampler_from_plan
from adaptiveload.sched.manifest import Manifest
from adaptiveload.sched.plan import Plan, make_plan
from adaptiveload.sched.policies import step_order
from adaptiveload.sched.presets import load_calibration
from adaptiveload.sched.sampler import DualConstraintBucketSampler, EpochBatchSampler, bucket_tokens
from adaptiveload.train.calibrate import calibrate, calibration_grid
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.setup import device_description, device_memory_bytes

logger = logging.getLogger("adaptiveload.train")

QUICK_BATCH_SIZES = (1, 2, 4)  # quick calibration: batch sizes per shape
QUICK_SHAPES = 3  # quick calibration: bucket shapes spread over S
QUICK_TOKEN_FACTOR = 2  # quick calibration: B*S up to this many longest samples
QUICK_MIN_POINTS = 3  # a cost model needs 3 timed points: below, the token cap is lifted
CALIBRATION_FILE = "calibration.json"  # the quick calibration, in the output folder


class CalibrationFailed(RuntimeError):
    """The quick calibration stopped on an error (the message says which point and rank)."""


def saved_calibration(out: str, *, resume: bool) -> Optional[Calibration]:
    """The quick calibration an interrupted job saved in ``out``, when resuming (so the resumed job
    plans from the same calibration); ``None`` otherwise."""
    path = os.path.join(out, CALIBRATION_FILE)
    return load_calibration(path) if resume and os.path.isfile(path) else None


def quick_calibration(step, spec, shapes: np.ndarray, patch_size, ctx: DistContext, settings: dict,
                      progress: bool) -> Calibration:
    """A small calibration with the run's own step (it also compiles the model): 3 shapes,
    B in 1, 2, 4 up to twice the longest sample's tokens, 1 warm-up and 2 timed steps each. Every
    rank gets rank 0's fit, so all make the same plan.

    Raises:
        CalibrationFailed: the sweep stopped on an error.
        ValueError: too few points ran to fit a cost model.
    """
    seq = shapes.prod(axis=1) // int(np.prod(patch_size))
    grid = calibration_grid(shapes, patch_size, num_shapes=QUICK_SHAPES, batch_sizes=QUICK_BATCH_SIZES,
                            max_tokens=QUICK_TOKEN_FACTOR * int(seq.max()))
    if len(grid) < QUICK_MIN_POINTS:  # one or two bucket shapes: time every batch size, past the token cap
        grid = calibration_grid(shapes, patch_size, num_shapes=QUICK_SHAPES, batch_sizes=QUICK_BATCH_SIZES)
    run = calibrate(step, spec, grid, patch_size=patch_size, warmup=1, repeats=2, progress=progress)
    if run.aborted:
        raise CalibrationFailed(f"quick calibration stopped: {run.aborted}")
    try:
        calibration = Calibration.from_points(run.points, settings={**settings, "quick": True},
                                              device=device_description(ctx.device))
    except ValueError as err:
        raise ValueError(f"{err}; the corpus has {len(shapes)} bucket shape(s): give a calibration instead "
                         f"(--calibration calibration.json from adaptiveload calibrate, or anchors-wan1.3b)") from None
    return ctx.broadcast_object(calibration)


def check_model_runs_policy(policy: str, model, name: str) -> None:
    """Refuse a batching policy the model cannot train: ``packed`` puts samples of different lengths
    into one sequence, which needs the model's ``forward_packed`` method.

    Raises:
        ValueError: one line naming the policy, the method and the model.
    """
    if policy == "packed" and not callable(getattr(model, "forward_packed", None)):
        raise ValueError(f"--policy packed needs a model with a forward_packed method (it runs a pack of samples of "
                         f"different lengths as one sequence); {name} ({type(model).__name__}) has none: use --policy "
                         "dual, cost_grouped or equal_token")


def warn_if_calibrated_otherwise(calibration: Calibration, settings: dict) -> None:
    """Warn when a loaded calibration measured another model, depth, checkpointing or patch size than
    this run (its cost and memory models, hence the plan, may not hold). Only calibrations written by
    ``adaptiveload calibrate`` or a job are compared (a key it lacks is not); the built-in ones
    describe their source in prose."""
    if "backend" not in calibration.settings:
        return
    keys = ("model", "num_layers", "activation_checkpointing", "patch_size")
    differ = [f"{k}: calibrated {calibration.settings[k]!r}, this run {settings[k]!r}"
              for k in keys if k in calibration.settings and calibration.settings[k] != settings.get(k)]
    if differ:
        logger.warning("the calibration was measured on another setup (%s); its plan may not fit this run "
                       "(recalibrate with adaptiveload calibrate, or leave --calibration out)", "; ".join(differ))


def warn_if_poor_fit(calibration: Calibration) -> None:
    """Log one warning when the calibration's step-time fit is poor (a noisy or loaded machine): its
    R², the bound it hit and the model used instead (:attr:`~adaptiveload.sched.cost_model.CostModel.warning`)."""
    if calibration.cost_model.warning:
        logger.warning("calibration: %s", calibration.cost_model.warning)


def _triple(values) -> str:
    return ",".join(str(int(v)) for v in values)


def check_plan_fits(plan: Plan, plan_path: str, corpus: Manifest, downscale: int) -> None:
    """Refuse a plan made for another corpus: another patch size, another VAE stride (a plan that
    records one, for a corpus of pixel sizes; ``corpus.vae_stride`` includes the downscale), or
    buckets of this corpus the plan does not hold (another resolution, downscale or mix).

    Raises:
        ValueError: naming what differs and how to re-plan.
    """
    redo = (f"re-plan this corpus with `adaptiveload plan` (the job writes it as manifest.csv in --out; "
            f"--vae-stride {_triple(corpus.vae_stride)} --patch-size {_triple(corpus.patch_size)}) or omit --plan")
    if tuple(plan.patch_size) != tuple(corpus.patch_size):
        raise ValueError(f"{plan_path} was planned for patch size {_triple(plan.patch_size)}, but this job's model "
                         f"has {_triple(corpus.patch_size)}; {redo}")
    planned_stride = getattr(plan, "vae_stride", None)
    if planned_stride is not None and corpus.pixel_shapes is not None \
            and tuple(planned_stride) != tuple(corpus.vae_stride):
        raise ValueError(f"{plan_path} was planned for VAE stride {_triple(planned_stride)}, but this job's corpus "
                         f"uses {_triple(corpus.vae_stride)} (at --downscale {downscale}); {redo}")
    rows = plan.buckets + plan.dropped
    planned = {tuple(int(v) for v in r["key"]) for r in rows}
    keys = corpus.seq_lens[:, None] if len(rows[0]["key"]) == 1 else corpus.latent_shapes  # the plan's kind of key
    keys = np.unique(keys, axis=0)
    seq = bucket_tokens(keys, corpus.patch_size)
    missing = [k for k, key in enumerate(keys.tolist()) if tuple(key) not in planned]
    if missing:
        shown = ", ".join(f"latent {'x'.join(map(str, keys[k]))} (S={seq[k]:,})" if keys.shape[1] == 3
                          else f"S={seq[k]:,}" for k in missing[:3])
        planned_seq = [int(r["seq_len"]) for r in rows]
        raise ValueError(f"{plan_path} was planned for another corpus: {len(missing)} of the {len(keys)} buckets of "
                         f"{corpus.source} (downscale {downscale}) are not in it, e.g. {shown}; the plan's S spans "
                         f"{min(planned_seq):,}..{max(planned_seq):,}, this corpus's {seq.min():,}..{seq.max():,}; "
                         f"{redo}")


def load_plan(plan_path: str, corpus: Manifest, ctx: DistContext, downscale: int) -> Plan:
    """A plan file, checked against this world size and corpus (:func:`check_plan_fits`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a plan, or one made for another world size or corpus.
    """
    plan = Plan.load(plan_path)
    if plan.world_size != ctx.world_size:
        raise ValueError(f"{plan_path} was planned for world size {plan.world_size}, but this job runs on "
                         f"{ctx.world_size} rank(s); re-plan with `adaptiveload plan --world-size {ctx.world_size}` "
                         f"or omit --plan")
    check_plan_fits(plan, plan_path, corpus, downscale)
    return plan


def resolve_plan(plan: Optional[Plan], corpus: Manifest, calibration: Calibration, ctx: DistContext, policy: str, *,
                 memory_budget_gb: Optional[float], m_mem: Optional[int], drop_oversized: bool) -> Plan:
    """``plan`` (from :func:`load_plan`) when given, else a plan made now for ``policy``
    (``memory_budget_gb``: the device's memory when None; ignored without a measured memory model).

    Raises:
        ValueError: planning fails (oversized buckets).
    """
    if plan is not None:
        return plan
    budget = memory_budget_gb * 2**30 if memory_budget_gb is not None else device_memory_bytes(ctx.device)
    if calibration.memory_model is None:
        budget = None  # no memory measured (CPU): the plan uses the largest batch the calibration ran
    return make_plan(corpus, calibration, ctx.world_size, memory_budget_bytes=budget, m_mem=m_mem,
                     drop_oversized=drop_oversized, policy=policy)


def make_sampler(policy: str, plan: Plan, corpus, ctx: DistContext, seed: int) -> EpochBatchSampler:
    """The run's batch sampler for ``policy`` (see the module docstring)."""
    shapes = corpus.latent_shapes
    if policy == "packed":
        return sampler_from_plan(plan, shapes, num_replicas=ctx.world_size, rank=ctx.rank, seed=seed)
    if policy == "equal_token":
        return DualConstraintBucketSampler(shapes, m_mem=plan.m_mem_limit, num_replicas=ctx.world_size, rank=ctx.rank,
                                           seed=seed, policy="random", drop_oversized=plan.drop_oversized,
                                           patch_size=plan.patch_size)
    return DualConstraintBucketSampler.from_plan(plan, shapes, num_replicas=ctx.world_size, rank=ctx.rank,
                                                 seed=seed, policy=step_order(policy))
