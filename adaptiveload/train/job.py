"""The ``adaptiveload train`` job: calibrate (or load a calibration) → plan → train → report.

One *run* trains a freshly initialised model (the same seed, so the same weights, every run) over
the corpus with one backend and one batching policy (:mod:`adaptiveload.sched.policies`). The job's
pieces, one module each:

* :mod:`~adaptiveload.train.planning` -- the run's calibration, plan and sampler;
* :mod:`~adaptiveload.train.loop` -- warm-up, the step loop, and the failure protocol;
* :mod:`~adaptiveload.train.results` -- the run's measurements and ``results.json``.

``--baseline`` adds a second run in the same invocation: the equal-token policy with plain
``torch.compile`` (Inductor) on GPU. On CPU the baseline runs eagerly instead (an Inductor CPU
compile of the model costs minutes on two cores), so a CPU baseline compares policies, not compilers.

Data: synthetic by default (random latents and text embeddings of each sample's shape, drawn on the
training device: throughput runs need no disk I/O); a manifest with ``latent_path`` / ``text_path``
columns trains on those files instead (:class:`~adaptiveload.train.data.SampleFiles`, read by
:data:`FILE_WORKERS` DataLoader worker processes unless ``workers`` says otherwise). The evaluation
set is drawn from the same samples.

A step that fails on any rank stops the run on every rank with a message naming each failing
rank's bucket shape and batch size (:class:`TrainingFailed`); the results so far stay in
``results.json``. A failed main run stops the job; a failed baseline is recorded (status ``failed``,
its ``error`` and a ``hint`` when the failure looks like a known compiler bug) and the job still
reports both runs.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from adaptiveload.fxfuse.backend import collect_reports
from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.manifest import Manifest, write_manifest
from adaptiveload.sched.plan import Plan
from adaptiveload.sched.policies import policy_name
from adaptiveload.sched.presets import load_calibration
from adaptiveload.sched.shapes import WAN_VAE_STRIDE
from adaptiveload.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from adaptiveload.train.data import Batch, LatentDataset, SampleFiles, collate
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.loop import (LoopOptions, RunState, StepFailed, compiler_hint, silent_kineto, train_steps,
                                     warm_up)
from adaptiveload.train.planning import (CALIBRATION_FILE, CalibrationFailed, check_model_runs_policy, load_plan,
                                         make_sampler, quick_calibration, resolve_plan, saved_calibration,
                                         warn_if_calibrated_otherwise, warn_if_poor_fit)
from adaptiveload.train.results import ResultsFile, RunResult, fusion_summary
from adaptiveload.train.setup import (FILE_WORKERS, ModelSource, bucket_shapes, build_step, device_description,
                                     load_corpus, set_cpu_threads, step_settings)
from adaptiveload.train.step import InputSpec, StepConfig, TrainStep

logger = logging.getLogger("adaptiveload.train")


class TrainingFailed(RuntimeError):
    """A run stopped: a step failed on some rank (the message names the ranks, bucket shapes and batch
    sizes), or the quick calibration stopped on an error."""


@dataclass
class JobConfig:
    """Options of ``adaptiveload train`` (the CLI flags of the same names)."""

    preset: Optional[str] = "tiny"
    model: Optional[str] = None
    num_layers: Optional[int] = None
    patch_size: Optional[tuple] = None
    vae_stride: tuple = WAN_VAE_STRIDE
    manifest: Optional[str] = None
    samples: Optional[int] = None
    downscale: Optional[int] = None
    seed: int = 0
    steps: Optional[int] = None
    backend: str = "adaptiveload"
    inner: Optional[str] = None
    policy: str = "dual"
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
    workers: Optional[int] = None
    quiet: bool = False

    def __post_init__(self):
        self.policy = policy_name(self.policy)
        for name in ("steps", "eval_every", "eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("profile_every", "checkpoint_every", "workers"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


@dataclass
class RunSpec:
    """One training run of a job: a name, a compile backend and a batching policy."""

    name: str
    backend: str
    inner: str
    policy: str


@dataclass
class JobData:
    """What every run of a job shares: the model source, the corpus, the downscale applied to it,
    and the plan given (``--plan``; checked against the corpus), if any."""

    models: ModelSource
    corpus: Manifest
    downscale: int
    plan: Optional[Plan]


def eval_indices(corpus: Manifest, count: int) -> list[int]:
    """Samples of the fixed evaluation set: ``count`` sample indices of buckets spread from the
    shortest to the longest (evenly over the buckets sorted by S; a bucket picked again gives its
    next sample, round the bucket)."""
    shapes = bucket_shapes(corpus)
    shapes = shapes[np.argsort(shapes.prod(axis=1), kind="stable")]
    picks = np.resize(np.unique(np.linspace(0, len(shapes) - 1, count).round().astype(int)), count)
    indices = []
    for n, k in enumerate(picks):
        members = np.flatnonzero((corpus.latent_shapes == shapes[k]).all(axis=1))
        indices.append(int(members[np.count_nonzero(picks[:n] == k) % len(members)]))
    return indices


def eval_batches(corpus: Manifest, spec: InputSpec, seed: int, count: int, device: torch.device,
                 files: Optional[SampleFiles] = None) -> list[Batch]:
    """A fixed evaluation set: single-sample batches of the samples :func:`eval_indices` picks, with
    their own seeded noise and σ (uniform); latents and text read from ``files`` (on the CPU) or
    drawn on ``device``.

    Raises:
        SampleError: a sample file that cannot be read or does not match its row.
    """
    dataset = LatentDataset(corpus.latent_shapes, spec, seed=seed + 7919, sigma_sampling="uniform", loader=files,
                            device=device if files is None else torch.device("cpu"))
    return [collate([dataset[i]], text_len=spec.text_len) for i in eval_indices(corpus, count)]


def _evaluate(step: TrainStep, batches: list[Batch]) -> float:
    losses = [step.evaluate(b) for b in batches]
    return float(torch.cat(losses).mean())


def _resume(cfg: JobConfig, ckpt_dir: str, step: TrainStep, sampler, ctx: DistContext, name: str) -> RunState:
    """The run's state from the newest checkpoint in ``ckpt_dir`` (weights, optimizer and sampler
    restored), or a fresh state without ``--resume`` or without a checkpoint."""
    path = latest_checkpoint(ckpt_dir) if cfg.resume else None
    if path is None:
        if cfg.resume:
            logger.warning("--resume: no checkpoint in %s, starting from step 0", ckpt_dir)
        return RunState()
    saved = load_checkpoint(path, step.module, step.optimizer, ctx)
    sampler.load_state_dict(saved["sampler"])
    if ctx.is_main:
        logger.info("resumed %s from %s (step %d)", name, path, saved["run_state"]["step"])
    return RunState(**{k: saved["run_state"][k] for k in dataclasses.asdict(RunState())})


def _checkpoint(ckpt_dir: str, step: TrainStep, sampler, state: RunState, ctx: DistContext, name: str) -> None:
    job_state = {"world_size": ctx.world_size, "run": name, "run_state": dataclasses.asdict(state),
                 "sampler": sampler.state_dict(consumed_steps=state.consumed_in_epoch)}
    save_checkpoint(ckpt_dir, state.step, step.module, step.optimizer, job_state, ctx)


def train_run(cfg: JobConfig, run: RunSpec, data: JobData, ctx: DistContext, calibration: Optional[Calibration],
              out_dir: str, results: ResultsFile) -> tuple[dict, Calibration]:
    """Train one run; return its result and the calibration used (the quick one when none was given).

    The partial result is written to ``results`` after every evaluation, so a failure later keeps
    what was measured.

    Raises:
        TrainingFailed: a step failed on some rank (after the partial result was written, with a
            ``hint`` line when :func:`~adaptiveload.train.loop.compiler_hint` has one), or the quick
            calibration stopped on an error.
    """
    corpus = data.corpus
    step_config = StepConfig(backend=run.backend, inner=run.inner, learning_rate=cfg.learning_rate)
    step, spec, info = build_step(ctx, models=data.models, step_config=step_config,
                                  activation_checkpointing=cfg.activation_checkpointing,
                                  max_seq_len=int(corpus.seq_lens.max()))
    progress = ctx.is_main and not cfg.quiet
    result = RunResult(corpus.seq_lens, name=run.name, backend=step_config.describe(), policy=run.policy, model=info.to_json(),
                       world_size=ctx.world_size, device=device_description(ctx.device))
    files = (SampleFiles(corpus.latent_paths, corpus.text_paths, spec, corpus.source)
             if corpus.latent_paths is not None else None)
    if files is not None:
        files.check_present()  # a missing file fails now, not after calibration and warm-up
    workers = cfg.workers if cfg.workers is not None else (FILE_WORKERS if files is not None else 0)
    with collect_reports() as reports:  # the fusion reports of this run's graphs
        start = time.perf_counter()
        settings = step_settings(info, step_config, ctx, corpus, vae_stride=cfg.vae_stride, downscale=data.downscale)
        if calibration is None:
            try:
                calibration = quick_calibration(step, spec, bucket_shapes(corpus), corpus.patch_size, ctx, settings,
                                                progress)
            except CalibrationFailed as err:
                raise TrainingFailed(str(err)) from None
            if ctx.is_main:  # saved at once: a resumed job plans from the same calibration
                calibration.save(os.path.join(cfg.out, CALIBRATION_FILE))
                warn_if_poor_fit(calibration)
        elif ctx.is_main:
            warn_if_calibrated_otherwise(calibration, settings)
        plan = resolve_plan(data.plan, corpus, calibration, ctx, run.policy, memory_budget_gb=cfg.memory_budget_gb,
                            m_mem=cfg.m_mem, drop_oversized=cfg.drop_oversized)
        sampler = make_sampler(run.policy, plan, corpus, ctx, cfg.seed)
        failure = warm_up(step, spec, sampler, ctx, progress, corpus.latent_shapes)  # before a resume loads optimizer state (frozen_weights clears it)
        result.planned(plan, sampler, time.perf_counter() - start, calibration.cost_model)
        # synthetic samples without worker processes are drawn on the training device (data module docstring)
        dataset = LatentDataset(corpus.latent_shapes, spec, seed=cfg.seed, loader=files,
                                device=ctx.device if workers == 0 and files is None else torch.device("cpu"))
        evals_set = eval_batches(corpus, spec, cfg.seed, cfg.eval_samples, ctx.device, files)
        ckpt_dir = os.path.join(out_dir, "checkpoint")
        state = _resume(cfg, ckpt_dir, step, sampler, ctx, run.name)
        total_steps = cfg.steps or sampler.steps_per_epoch()

        def record(status: str, error: Optional[str] = None, hint: Optional[str] = None) -> dict:
            entry = result.update(state, ctx, step.peak_memory_bytes(), total_steps, status=status, error=error,
                                  hint=hint, fusion=fusion_summary(reports, step.regions))
            if ctx.is_main:
                results.put(entry)
            return entry

        try:
            if failure is not None:
                raise StepFailed(failure)
            if not state.evals:
                state.evals.append([0, _evaluate(step, evals_set)])
            step.reset_peak_memory()
            options = LoopOptions(total_steps=total_steps, eval_every=cfg.eval_every, profile_every=cfg.profile_every,
                                  checkpoint_every=cfg.checkpoint_every, workers=workers, progress=progress,
                                  name=run.name)
            with silent_kineto():
                train_steps(step, sampler, dataset, ctx, state, options,
                            evaluate=functools.partial(_evaluate, step, evals_set),
                            on_eval=functools.partial(record, "running"),  # collective: every rank
                            save_checkpoint=functools.partial(_checkpoint, ckpt_dir, step, sampler, state, ctx,
                                                              run.name))
        except StepFailed as err:
            hint = compiler_hint(step_config, str(err), torch.__version__)
            record("failed", str(err), hint)
            raise TrainingFailed(str(err) + (f"\n{hint}" if hint else "")) from None
        if state.evals[-1][0] != state.step:
            state.evals.append([state.step, _evaluate(step, evals_set)])
        return record("ok"), calibration


def default_inner(device: torch.device) -> str:
    """The adaptiveload backend's inner compiler by default: Inductor on GPU; on CPU ``eager`` (the
    rewritten graph runs as captured, fused op included: an Inductor CPU compile of even the tiny
    model takes minutes on two cores, and AOTAutograd alone doubles the compile time)."""
    return "inductor" if device.type == "cuda" else "eager"


def job_runs(cfg: JobConfig, ctx: DistContext) -> list[RunSpec]:
    """The runs of a job: the main one, plus the baseline with ``--baseline``."""
    inner = cfg.inner or default_inner(ctx.device)
    runs = [RunSpec(f"{cfg.backend}+{cfg.policy}", cfg.backend, inner, cfg.policy)]
    if cfg.baseline:
        backend = cfg.baseline_backend or ("inductor" if ctx.device.type == "cuda" else "eager")
        runs.append(RunSpec(f"baseline:{backend}+equal_token", backend, inner, "equal_token"))
    return runs


def _results_file(cfg: JobConfig, ctx: DistContext, corpus: Manifest, downscale: int) -> ResultsFile:
    """The job's ``results.json`` with its header (the corpus: its source, ``data`` ``"synthetic"``
    or ``"files"``, size, buckets, S range and token geometry); rank 0 also writes the corpus as
    ``manifest.csv`` (the exact corpus, for ``adaptiveload plan/simulate``)."""
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__, "device": device_description(ctx.device), "world_size": ctx.world_size,
        "config": dataclasses.asdict(cfg), "downscale": downscale,
        "corpus": {"source": corpus.source, "data": "synthetic" if corpus.latent_paths is None else "files",
                   "samples": len(corpus), "buckets": int(len(bucket_shapes(corpus))),
                   "seq_len_min": int(corpus.seq_lens.min()), "seq_len_max": int(corpus.seq_lens.max()),
                   "vae_stride": list(corpus.vae_stride), "patch_size": list(corpus.patch_size)},
    }
    if ctx.is_main:
        os.makedirs(cfg.out, exist_ok=True)
        header["corpus"]["manifest"] = os.path.join(cfg.out, "manifest.csv")
        write_manifest(corpus, header["corpus"]["manifest"])
    return ResultsFile(os.path.join(cfg.out, "results.json"), header, write=ctx.is_main)


def run_job(cfg: JobConfig, ctx: DistContext) -> dict:
    """Run every run of the job; write ``results.json`` (and ``results.png``) under ``cfg.out``.

    On CPU, torch's intra-op threads are set first (:func:`~adaptiveload.train.setup.set_cpu_threads`).

    Returns:
        the results dict (what ``results.json`` holds); a failed baseline is in it with status
        ``"failed"``.

    Raises:
        ValueError / FileNotFoundError: bad options, preset, model, manifest, calibration or plan.
        TrainingFailed: a step of the main run failed (results so far are written first).
    """
    set_cpu_threads(ctx.device)
    models = ModelSource(preset=cfg.preset, factory=cfg.model, num_layers=cfg.num_layers, patch_size=cfg.patch_size,
                         seed=cfg.seed)
    spec = models.spec()  # the model's patch: the corpus's token geometry
    check_model_runs_policy(cfg.policy, models.first(), models.name)
    corpus, downscale = load_corpus(cfg.manifest, cfg.samples, cfg.seed, cfg.downscale, ctx.device,
                                    vae_stride=cfg.vae_stride, patch_size=spec.patch_size)
    plan = load_plan(cfg.plan, corpus, ctx, downscale) if cfg.plan else None
    calibration = (load_calibration(cfg.calibration) if cfg.calibration
                   else saved_calibration(cfg.out, resume=cfg.resume))
    results = _results_file(cfg, ctx, corpus, downscale)
    data = JobData(models, corpus, downscale, plan)
    for index, run in enumerate(job_runs(cfg, ctx)):
        run_dir = os.path.join(cfg.out, run.name.replace(":", "_").replace("+", "_"))
        if ctx.is_main:
            os.makedirs(run_dir, exist_ok=True)
        try:
            result, calibration = train_run(cfg, run, data, ctx, calibration, run_dir, results)
        except TrainingFailed:
            if index == 0:
                raise
            continue  # the baseline failed: its entry (status, error, hint) is in results, for the report
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        results.doc["calibration"] = cfg.calibration or os.path.join(cfg.out, CALIBRATION_FILE)
        results.put(result)
    if ctx.is_main:
        from adaptiveload.train.report import plot_results

        results.doc["plot"] = plot_results(results.doc, os.path.join(cfg.out, "results.png"))
        results.save()
    return results.doc
