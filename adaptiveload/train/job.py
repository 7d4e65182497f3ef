"""The ``adaptiveload train`` job: calibrate (or load a calibration) → plan → train → report.

One *run* trains a freshly initialised model (the same seed, so the same weights, every run) over
the corpus with one backend and one sampler:

* ``sampler="dual"``: :meth:`DualConstraintBucketSampler.from_plan` with the plan made for this world
  size and step policy;
* ``sampler="equal"``: the equal-token rule ``B = floor(M_mem_limit / S)`` (the plan's memory limit),
  ranks drawing batches independently (``random``).

``--baseline`` adds a second run in the same invocation: the equal-token sampler with plain
``torch.compile`` (Inductor) on GPU. On CPU the baseline runs eagerly instead (an Inductor CPU
compile of the model costs minutes on two cores), so a CPU baseline compares samplers, not compilers.

Throughput is measured over the same samples for every run: tokens/s = global tokens of all steps ÷
training wall time (data loading and the step; compile warm-up, evaluation and checkpointing
excluded). Compile happens before timing: in the quick calibration and in frozen-weight warm-up
steps, one per kind of batch the sampler yields (:func:`warm_up_batches`); a step that compiled
anyway is flagged in the history (``compiled``) and listed in ``compile_steps``.

Per step every rank reports its batch, status, wall time and (every ``profile_every``-th step) busy
time over the control group; see :mod:`adaptiveload.train.metrics` for busy time, compute-load CV
and idle fraction. A step that fails on any rank (out of memory in a bucket, or a collective that
timed out because a peer failed) stops the run on every rank with a message naming each failing
rank's bucket shape and batch size; the results so far stay in ``results.json`` (rewritten
atomically after every evaluation and at the end).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from adaptiveload.fxfuse.backend import clear_reports, last_reports
from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.manifest import write_manifest
from adaptiveload.sched.plan import Plan, make_plan
from adaptiveload.sched.presets import load_calibration
from adaptiveload.sched.sampler import DualConstraintBucketSampler
from adaptiveload.train.calibrate import calibrate, calibration_grid
from adaptiveload.jsonfile import write_json_atomic
from adaptiveload.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from adaptiveload.train.data import Batch, LatentDataset, collate, synthetic_batch
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.metrics import busy_time_s, load_balance, summarize
from adaptiveload.train.setup import (bucket_shapes, build_step, default_downscale, device_description,
                                     device_memory_bytes, load_corpus, step_settings)
from adaptiveload.train.step import NonFiniteStep, StepConfig, TrainStep

logger = logging.getLogger("adaptiveload.train")

SAMPLERS = ("dual", "equal")
QUICK_BATCH_SIZES = (1, 2, 4)  # quick calibration: batch sizes per shape
QUICK_SHAPES = 3  # quick calibration: bucket shapes spread over S
QUICK_TOKEN_FACTOR = 2  # quick calibration: B*S up to this many longest samples
CALIBRATION_FILE = "calibration.json"  # the quick calibration, in the output folder
RESULTS_FORMAT, RESULTS_VERSION = "adaptiveload.train-results", 1  # results.json


class _StepRow:
    """Columns of the row every rank contributes per step (:func:`_one_step`): status (0 ok, 1 out of
    memory, 2 failed, 3 timed out waiting, 4 non-finite), wall s, busy s, loss, compiled (0/1), B, S,
    latent T, H, W."""
    status, wall, busy, loss, compiled, batch_size, seq_len = range(7)
    latent_shape = slice(7, 10)


def _compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class TrainingFailed(RuntimeError):
    """A step failed on some rank; the message names the ranks, bucket shapes and batch sizes."""


@dataclass
class JobConfig:
    """Options of ``adaptiveload train`` (the CLI flags of the same names)."""

    preset: Optional[str] = "tiny"
    model: Optional[str] = None
    num_layers: Optional[int] = None
    manifest: Optional[str] = None
    samples: Optional[int] = None
    downscale: Optional[int] = None
    seed: int = 0
    steps: Optional[int] = None
    backend: str = "adaptiveload"
    inner: Optional[str] = None
    sampler: str = "dual"
    policy: str = "random"
    calibration: Optional[str] = None
    plan: Optional[str] = None
    memory_budget_gb: Optional[float] = None
    m_mem: Optional[int] = None
    drop_oversized: bool = False
    activation_checkpointing: str = "auto"
    learning_rate: float = 1e-4
    baseline: bool = False
    baseline_backend: Optional[str] = None
    out: str = "adaptiveload-train"
    resume: bool = False
    eval_every: int = 10
    eval_samples: int = 4
    profile_every: int = 5
    checkpoint_every: int = 0
    workers: int = 0
    quiet: bool = False

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose one of {', '.join(SAMPLERS)}")
        for name in ("steps", "eval_every", "eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("profile_every", "checkpoint_every", "workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


@dataclass
class RunSpec:
    """One training run of a job: a name, a compile backend and a sampler."""

    name: str
    backend: str
    inner: str
    sampler: str
    policy: str


@dataclass
class RunState:
    """Progress of a run, saved in checkpoints."""

    step: int = 0
    epoch: int = 0
    consumed_in_epoch: int = 0
    train_wall_s: float = 0.0
    history: list = field(default_factory=list)
    evals: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------ planning


def quick_calibration(step: TrainStep, spec, shapes: np.ndarray, patch_size, ctx: DistContext, settings: dict,
                      progress: bool) -> Calibration:
    """A small calibration with the run's own step (it also compiles the model): 3 shapes,
    B in 1, 2, 4 up to twice the longest sample's tokens, 1 warm-up and 2 timed steps each.

    Raises:
        ValueError: the sweep stopped on an error, or too few points ran to fit a cost model.
    """
    seq = shapes.prod(axis=1) // int(np.prod(patch_size))
    grid = calibration_grid(shapes, patch_size, num_shapes=QUICK_SHAPES, batch_sizes=QUICK_BATCH_SIZES,
                            max_tokens=QUICK_TOKEN_FACTOR * int(seq.max()))
    run = calibrate(step, spec, grid, patch_size=patch_size, warmup=1, repeats=2, progress=progress)
    if run.aborted:
        raise TrainingFailed(f"quick calibration stopped: {run.aborted}")
    return Calibration.from_points(run.points, settings={**settings, "quick": True},
                                   device=device_description(ctx.device))


def resolve_plan(cfg: JobConfig, corpus, calibration: Calibration, ctx: DistContext, policy: str) -> Plan:
    """The plan file given (checked against this world size), or a plan made now.

    Raises:
        ValueError: the plan was made for another world size, or planning fails (oversized buckets).
    """
    if cfg.plan is not None:
        plan = Plan.load(cfg.plan)
        if plan.world_size != ctx.world_size:
            raise ValueError(f"{cfg.plan} was planned for world size {plan.world_size}, but this job runs on "
                             f"{ctx.world_size} rank(s); re-plan with `adaptiveload plan --world-size {ctx.world_size}` "
                             f"or omit --plan")
        return plan
    budget = cfg.memory_budget_gb * 2**30 if cfg.memory_budget_gb is not None else device_memory_bytes(ctx.device)
    if calibration.memory_model is None:
        budget = None  # no memory measured (CPU): the plan uses the largest batch the calibration ran
    return make_plan(corpus, calibration, ctx.world_size, memory_budget_bytes=budget, m_mem=cfg.m_mem,
                     drop_oversized=cfg.drop_oversized, policy=policy)


def make_sampler(kind: str, plan: Plan, corpus, ctx: DistContext, seed: int, policy: str) -> DualConstraintBucketSampler:
    """The run's batch sampler (see the module docstring)."""
    shapes = corpus.latent_shapes
    if kind == "dual":
        return DualConstraintBucketSampler.from_plan(plan, shapes, num_replicas=ctx.world_size, rank=ctx.rank,
                                                     seed=seed, policy=policy)
    return DualConstraintBucketSampler(shapes, m_mem=plan.m_mem_limit, num_replicas=ctx.world_size, rank=ctx.rank,
                                       seed=seed, policy="random", drop_oversized=plan.drop_oversized,
                                       patch_size=plan.patch_size)


def eval_batches(corpus, spec, seed: int, count: int, device: torch.device) -> list[Batch]:
    """A fixed evaluation set: ``count`` single-sample batches of shapes spread from the shortest to
    the longest bucket, with their own seeded latents, noise and σ (uniform), drawn on ``device``."""
    shapes = bucket_shapes(corpus)
    seq = shapes.prod(axis=1)
    shapes = shapes[np.argsort(seq, kind="stable")]
    picks = shapes[np.unique(np.linspace(0, len(shapes) - 1, count).round().astype(int))]
    picks = np.resize(picks, (count, 3))
    dataset = LatentDataset(picks, spec, seed=seed + 7919, sigma_sampling="uniform", device=device)
    return [collate([dataset[i]]) for i in range(count)]


# ------------------------------------------------------------------------------------------ one run


def _evaluate(step: TrainStep, batches: list[Batch]) -> float:
    losses = [step.evaluate(b) for b in batches]
    return float(torch.cat(losses).mean())


def warm_up_batches(bucket_keys: np.ndarray, batch_kinds: np.ndarray) -> list[tuple[int, tuple]]:
    """Batches that compile, before timing, every graph a run will need: ``(B, latent shape)``, one per
    kind of batch the sampler yields, cheapest (fewest B·S) first.

    One per kind, not one per compiled-graph class: Inductor specialises a graph on size thresholds
    it meets while compiling (a fusion decision above some B·S, 32-bit indexing up to B·S·D < 2^31),
    so two batches of one class can need two graphs. A two-GPU run that warmed up only each class's
    smallest and largest batch recompiled inside its timed steps (25-30 s each).

    Args:
        bucket_keys: int [k, 3] latent shapes (T, H, W) of the buckets.
        batch_kinds: int [n, 2] (bucket, batch size) pairs, as from
            :meth:`DualConstraintBucketSampler.batch_kinds`.
    """
    batches = {(int(size), tuple(int(v) for v in bucket_keys[bucket])) for bucket, size in np.asarray(batch_kinds).tolist()}
    return sorted(batches, key=lambda b: (b[0] * int(np.prod(b[1])), b))


def _warm_up(step: TrainStep, spec, sampler: DualConstraintBucketSampler, ctx: DistContext,
             progress: bool) -> Optional[str]:
    """Compile before timing: one frozen-weight step per batch of :func:`warm_up_batches` (at most two
    a bucket), with a progress bar when ``progress``.

    Returns:
        ``None``, or the message of a warm-up step that failed on some rank (as for a training step:
        every rank stops; out of memory names the bucket and B).
    """
    plan = warm_up_batches(sampler.bucket_keys, sampler.batch_kinds())
    batches = (synthetic_batch(spec, batch_size, shape, device=step.device) for batch_size, shape in plan)
    with step.frozen_weights(), tqdm(total=len(plan), desc="warm-up (compile)", unit="step",
                                     disable=not progress, leave=False) as bar:
        for index in range(len(plan)):
            _, failure = _one_step(step, batches, ctx, index, profile=False)
            if failure is not None:
                return f"warm-up {failure}"
            bar.update(1)
    return None


def _fusion_summary(regions: int) -> dict:
    """Chains the adaptiveload backend saw and fused per forward, from the graphs compiled since the
    run started: a graph's counts (every graph of a run holds the same chains) times the compiled
    regions one forward runs (each block, under regional compilation)."""
    reports = last_reports()
    return {"fusion_reports": len(reports), "fused_chains": regions * max((r.fused for r in reports), default=0),
            "seen_chains": regions * max((r.seen for r in reports), default=0)}


def _failure_message(rows: np.ndarray, messages: list, step_index: int) -> str:
    parts = []
    for rank, row in enumerate(rows):
        status = int(row[_StepRow.status])
        if status == 0:
            continue
        shape = "x".join(str(int(v)) for v in row[_StepRow.latent_shape])
        what = {1: "ran out of memory", 2: "failed", 3: "gave up waiting for a failed rank (collective timed out)",
                4: "got a non-finite loss or gradient"}[status]
        parts.append(f"rank {rank} {what} on bucket latent {shape} (S={int(row[_StepRow.seq_len]):,}) "
                     f"with B={int(row[_StepRow.batch_size])}"
                     + (f" ({messages[rank]})" if messages[rank] else ""))
    text = f"step {step_index}: " + "; ".join(parts)
    if (rows[:, _StepRow.status] == 4).any():
        text += ("; the weights are unchanged; compare the same bucket under --backend eager to tell a "
                 "model problem from a compiler one")
    if (rows[:, _StepRow.status] == 1).any():
        text += ("; recalibrate with a smaller memory budget (adaptiveload train --memory-budget-gb ..., or "
                 "adaptiveload calibrate) or turn on activation checkpointing")
    return text


def _warn_if_calibrated_otherwise(calibration: Calibration, settings: dict) -> None:
    """Warn when a loaded calibration measured another model, depth or checkpointing than this run
    (its cost and memory models, hence the plan, may not hold). Only calibrations written by
    ``adaptiveload calibrate`` or a job are compared; the built-in ones describe their source in prose."""
    if "backend" not in calibration.settings:
        return
    keys = ("model", "num_layers", "activation_checkpointing")
    differ = [f"{k}: calibrated {calibration.settings[k]!r}, this run {settings[k]!r}"
              for k in keys if k in calibration.settings and calibration.settings[k] != settings.get(k)]
    if differ:
        logger.warning("the calibration was measured on another setup (%s); its plan may not fit this run "
                       "(recalibrate with adaptiveload calibrate, or leave --calibration out)", "; ".join(differ))


def train_run(cfg: JobConfig, run: RunSpec, corpus, ctx: DistContext, calibration: Optional[Calibration],
              out_dir: str, report) -> tuple[dict, Calibration]:
    """Train one run; return its result dict and the calibration used.

    ``report(result)`` is called (rank 0) with the partial result after every evaluation, so a
    failure later keeps what was measured.

    Raises:
        TrainingFailed: a step failed on some rank (after the partial result was reported).
    """
    seq_max = int(corpus.seq_lens.max())
    step_config = StepConfig(backend=run.backend, inner=run.inner, learning_rate=cfg.learning_rate)
    step, spec, info = build_step(ctx, preset=cfg.preset, factory=cfg.model, num_layers=cfg.num_layers,
                                  step_config=step_config, activation_checkpointing=cfg.activation_checkpointing,
                                  max_seq_len=seq_max, seed=cfg.seed)
    progress = ctx.is_main and not cfg.quiet
    clear_reports()  # fusion reports of this run only
    graphs_before = _compiled_graphs()
    compile_start = time.perf_counter()
    settings = step_settings(info, step_config, ctx, corpus)
    if calibration is None:
        calibration = quick_calibration(step, spec, bucket_shapes(corpus), corpus.patch_size, ctx, settings, progress)
        calibration = ctx.broadcast_object(calibration)  # one fit, so every rank makes the same plan
        if ctx.is_main:  # saved at once: a resumed job plans from the same calibration
            calibration.save(os.path.join(cfg.out, CALIBRATION_FILE))
    elif ctx.is_main:
        _warn_if_calibrated_otherwise(calibration, settings)
    plan = resolve_plan(cfg, corpus, calibration, ctx, run.policy)
    sampler = make_sampler(run.sampler, plan, corpus, ctx, cfg.seed, run.policy)
    failure = _warm_up(step, spec, sampler, ctx, progress)  # before a resume loads optimizer state (frozen_weights clears it)
    warmup_s = time.perf_counter() - compile_start
    graphs_warm = _compiled_graphs()
    # without worker processes the samples are drawn on the training device (data module docstring)
    data_device = ctx.device if cfg.workers == 0 else torch.device("cpu")
    dataset = LatentDataset(corpus.latent_shapes, spec, seed=cfg.seed, device=data_device)
    evals_set = eval_batches(corpus, spec, cfg.seed, cfg.eval_samples, ctx.device)
    steps_per_epoch = sampler.steps_per_epoch()
    total_steps = cfg.steps or steps_per_epoch
    ckpt_dir = os.path.join(out_dir, "checkpoint")

    state = RunState()
    if cfg.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            logger.warning("--resume: no checkpoint in %s, starting from step 0", ckpt_dir)
        else:
            saved = load_checkpoint(path, step.module, step.optimizer, ctx)
            sampler.load_state_dict(saved["sampler"])
            state = RunState(**{k: saved["run_state"][k] for k in dataclasses.asdict(RunState())})
            if ctx.is_main:
                logger.info("resumed %s from %s (step %d)", run.name, path, state.step)

    result = {
        "name": run.name, "backend": step_config.describe(), "sampler": run.sampler, "policy": run.policy,
        "model": info.to_json(), "world_size": ctx.world_size, "device": device_description(ctx.device),
        "plan": {"m_mem": plan.m_mem, "m_mem_limit": plan.m_mem_limit, "step_budget_s": plan.step_budget_s,
                 "predicted": plan.predicted},
        "batch_sizes": {"x".join(map(str, k)): int(b) for k, b in zip(sampler.bucket_keys.tolist(), sampler.bucket_batch_sizes.tolist())},
        "steps_per_epoch": steps_per_epoch, "warmup_s": warmup_s, "status": "running",
    }

    def finish(status: str, error: Optional[str] = None) -> dict:
        result.update(_summarize_run(state, ctx, step, total_steps))
        result["status"], result["error"] = status, error
        result.update(_fusion_summary(step.regions))
        # graphs Dynamo compiled in this process for this run (training buckets, evaluation,
        # calibration: recompiles + 1), and those compiled inside the timed loop (their time counts
        # in tokens/s; `compile_steps` names the steps): the most on any rank (a collective, as above)
        graphs_now = _compiled_graphs()
        counts = ctx.all_gather([graphs_now - graphs_before, graphs_now - graphs_warm]).max(dim=0).values
        result["compiled_graphs"], result["compiled_graphs_in_training"] = int(counts[0]), int(counts[1])
        return result

    def checkpoint() -> None:
        job_state = {"world_size": ctx.world_size, "run": run.name, "run_state": dataclasses.asdict(state),
                     "sampler": sampler.state_dict(consumed_steps=state.consumed_in_epoch)}
        save_checkpoint(ckpt_dir, state.step, step.module, step.optimizer, job_state, ctx)

    def fail(message: str):
        """Stop the run on every rank, keeping what was measured in the results."""
        finish("failed", message)
        if ctx.is_main:
            report(result)
        raise TrainingFailed(message)

    if failure is not None:
        fail(failure)
    if not state.evals:
        state.evals.append([0, _evaluate(step, evals_set)])
    step.reset_peak_memory()
    bar = tqdm(total=total_steps, initial=state.step, desc=run.name, unit="step", disable=not progress, leave=False)
    loader_kwargs = {"num_workers": cfg.workers, "collate_fn": collate}
    if cfg.workers > 0:
        loader_kwargs["pin_memory"] = ctx.device.type == "cuda"
    while state.step < total_steps:
        sampler.set_epoch(state.epoch)
        dataset.set_epoch(state.epoch)
        if sampler.resume_step >= steps_per_epoch:  # resumed exactly at the end of an epoch
            state.epoch, state.consumed_in_epoch = state.epoch + 1, 0
            continue
        state.consumed_in_epoch = sampler.resume_step
        batches = iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **loader_kwargs))
        while state.step < total_steps and state.consumed_in_epoch < steps_per_epoch:
            record, failure = _one_step(step, batches, ctx, state.step,
                                        profile=cfg.profile_every > 0 and state.step % cfg.profile_every == 0)
            if failure is not None:
                fail(failure)
            record["step"] = state.step
            state.history.append(record)
            state.train_wall_s += record["step_time_s"]
            state.step += 1
            state.consumed_in_epoch += 1
            bar.update(1)
            bar.set_postfix_str(f"loss {record['loss']:.4f}")
            if state.step % cfg.eval_every == 0 or state.step == total_steps:
                state.evals.append([state.step, _evaluate(step, evals_set)])
                partial = finish("running")  # collective (gathers peak memory): every rank
                if ctx.is_main:
                    report(partial)
            if cfg.checkpoint_every and (state.step % cfg.checkpoint_every == 0 or state.step == total_steps):
                checkpoint()
        del batches
        if state.consumed_in_epoch >= steps_per_epoch:
            state.epoch, state.consumed_in_epoch = state.epoch + 1, 0
    bar.close()
    if state.evals[-1][0] != state.step:
        state.evals.append([state.step, _evaluate(step, evals_set)])
    return finish("ok"), calibration


def _one_step(step: TrainStep, batches, ctx: DistContext, index: int, profile: bool) -> tuple[dict, Optional[str]]:
    """Fetch, agree on the global sample count, train, agree on the outcome; return the step record."""
    start = time.perf_counter()
    batch = next(batches)
    shape = batch.latent_shape
    seq_len = int(np.prod(shape)) // int(np.prod(step_patch(step)))
    counts = ctx.all_gather([len(batch), len(batch) * seq_len]).sum(axis=0)
    status, message, loss, profiler = 0, "", float("nan"), None
    graphs_before = _compiled_graphs()
    try:
        if profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if step.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as profiler:
                loss = float(step(batch, int(counts[0])))
                step.synchronize()
        else:
            loss = float(step(batch, int(counts[0])))
            step.synchronize()
    except NonFiniteStep as err:
        status, message = 4, str(err)
    except torch.OutOfMemoryError as err:
        status, message = 1, str(err).splitlines()[0][:200]
        step.optimizer.zero_grad(set_to_none=True)
    except Exception as err:  # noqa: BLE001 - reported to every rank, then the run stops
        logger.exception("rank %d: step on latent %s with B=%d failed", ctx.rank, "x".join(map(str, shape)), len(batch))
        text = str(err).splitlines()[0][:200] if str(err) else ""
        waited = isinstance(err, torch.distributed.DistError) or "timed out" in text.lower()
        status, message = (3 if waited else 2), f"{type(err).__name__}: {text}"
        step.optimizer.zero_grad(set_to_none=True)
    wall = time.perf_counter() - start
    busy = busy_time_s(profiler, step.device, wall) if profiler is not None and status == 0 else float("nan")
    compiled = _compiled_graphs() > graphs_before
    rows = ctx.all_gather([status, wall, busy, loss, float(compiled), len(batch), seq_len, *shape]).numpy()  # columns: _StepRow
    if rows[:, _StepRow.status].max() > 0:
        return {}, _failure_message(rows, ctx.all_gather_object(message), index)
    record = {
        "global_samples": int(counts[0]), "global_tokens": int(counts[1]),
        "step_time_s": float(rows[:, _StepRow.wall].max()),
        "busy_s": None if np.isnan(rows[:, _StepRow.busy]).any() else rows[:, _StepRow.busy].tolist(),
        "loss": float(rows[:, _StepRow.loss].sum() / counts[0]),
        "compiled": bool(rows[:, _StepRow.compiled].any()),  # a rank compiled a graph here (its time counts)
        "batch_sizes": rows[:, _StepRow.batch_size].astype(int).tolist(),
        "seq_lens": rows[:, _StepRow.seq_len].astype(int).tolist(),
        "indices": ctx.all_gather_object(batch.indices.tolist()),
    }
    return record, None


def step_patch(step: TrainStep) -> tuple:
    """The model's patch size (from its config; Wan's 1x2x2 when the model has none)."""
    config = getattr(step.module, "config", None)
    patch = getattr(config, "patch_size", None) if config is not None else None
    return tuple(patch) if patch else (1, 2, 2)


def _rate(records: list) -> float:
    wall = sum(r["step_time_s"] for r in records)
    return sum(r["global_tokens"] for r in records) / wall if wall > 0 else float("nan")


def _summarize_run(state: RunState, ctx: DistContext, step: TrainStep, total_steps: int) -> dict:
    history = state.history
    tokens = sum(r["global_tokens"] for r in history)
    samples = sum(r["global_samples"] for r in history)
    busy = np.array([r["busy_s"] for r in history if r["busy_s"] is not None], dtype=np.float64).reshape(-1, ctx.world_size)
    peaks = ctx.all_gather([step.peak_memory_bytes()])[:, 0].long().tolist()
    return {
        "steps": state.step, "target_steps": total_steps, "epochs_completed": state.epoch,
        "samples": samples, "tokens": tokens, "wall_time_s": state.train_wall_s,
        "tokens_per_s": tokens / state.train_wall_s if state.train_wall_s > 0 else float("nan"),
        # the same over the steps that were not profiled (the profiler's own overhead left out)
        "tokens_per_s_unprofiled": _rate([r for r in history if r["busy_s"] is None]),
        "step_time_s": summarize(r["step_time_s"] for r in history),
        "compile_steps": [r["step"] for r in history if r.get("compiled")],
        "busy_time_s_per_rank": busy.mean(axis=0).tolist() if busy.size else [],
        **load_balance(busy),
        "peak_memory_bytes_per_rank": peaks if ctx.device.type == "cuda" else None,
        "eval_loss": [list(e) for e in state.evals],
        "final_eval_loss": state.evals[-1][1] if state.evals else float("nan"),
        "history": history,
    }


# ------------------------------------------------------------------------------------------ the job


def default_inner(device: torch.device) -> str:
    """The adaptiveload backend's inner compiler by default: Inductor on GPU; on CPU ``eager`` (the
    rewritten graph runs as captured, fused op included: an Inductor CPU compile of even the tiny
    model takes minutes on two cores, and AOTAutograd alone doubles the compile time)."""
    return "inductor" if device.type == "cuda" else "eager"


def job_runs(cfg: JobConfig, ctx: DistContext) -> list[RunSpec]:
    """The runs of a job: the main one, plus the baseline with ``--baseline``."""
    inner = cfg.inner or default_inner(ctx.device)
    runs = [RunSpec(f"{cfg.backend}+{cfg.sampler}", cfg.backend, inner, cfg.sampler, cfg.policy)]
    if cfg.baseline:
        backend = cfg.baseline_backend or ("inductor" if ctx.device.type == "cuda" else "eager")
        runs.append(RunSpec(f"baseline:{backend}+equal", backend, inner, "equal", "random"))
    return runs


def run_job(cfg: JobConfig, ctx: DistContext) -> dict:
    """Run every run of the job; write ``results.json`` (and ``results.png``) under ``cfg.out``.

    Returns:
        the results dict (what ``results.json`` holds).

    Raises:
        ValueError / FileNotFoundError: bad options, preset, manifest, calibration or plan.
        TrainingFailed: a step failed (results so far are written first).
    """
    downscale = cfg.downscale if cfg.downscale is not None else default_downscale(ctx.device)
    corpus = load_corpus(cfg.manifest, cfg.samples, cfg.seed, downscale)
    calibration = load_calibration(cfg.calibration) if cfg.calibration else None
    saved_calibration = os.path.join(cfg.out, CALIBRATION_FILE)
    if calibration is None and cfg.resume and os.path.isfile(saved_calibration):
        calibration = load_calibration(saved_calibration)  # the one the interrupted job planned with
    if ctx.is_main:
        os.makedirs(cfg.out, exist_ok=True)
    results = {
        "format": RESULTS_FORMAT, "version": RESULTS_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__, "device": device_description(ctx.device), "world_size": ctx.world_size,
        "config": dataclasses.asdict(cfg), "downscale": downscale,
        "corpus": {"source": corpus.source, "samples": len(corpus), "buckets": int(len(bucket_shapes(corpus))),
                   "seq_len_min": int(corpus.seq_lens.min()), "seq_len_max": int(corpus.seq_lens.max())},
        "runs": [],
    }
    results_path = os.path.join(cfg.out, "results.json")
    if ctx.is_main and corpus.pixel_shapes is not None:  # the exact corpus, for `adaptiveload plan/simulate`
        write_manifest(corpus, os.path.join(cfg.out, "manifest.csv"))
        results["corpus"]["manifest"] = os.path.join(cfg.out, "manifest.csv")

    def report(partial: dict) -> None:
        runs = [r for r in results["runs"] if r["name"] != partial["name"]] + [partial]
        write_json_atomic(results_path, {**results, "runs": runs})

    for run in job_runs(cfg, ctx):
        run_dir = os.path.join(cfg.out, run.name.replace(":", "_").replace("+", "_"))
        if ctx.is_main:
            os.makedirs(run_dir, exist_ok=True)
        result, calibration = train_run(cfg, run, corpus, ctx, calibration, run_dir, report)
        results["calibration"] = cfg.calibration or saved_calibration
        results["runs"].append(result)
        if ctx.is_main:
            write_json_atomic(results_path, results)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if ctx.is_main:
        from adaptiveload.train.report import plot_results

        results["plot"] = plot_results(results, os.path.join(cfg.out, "results.png"))
        write_json_atomic(results_path, results)
    return results
