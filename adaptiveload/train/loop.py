"""The step loop of one training run, and what happens when a step fails.

Per step every rank fetches its batch, the ranks agree on the global sample count (the loss is
normalised by it), train, and then exchange one row each (:class:`StepRow`): status, wall time, busy
time (every ``profile_every``-th step, over the control group; see :mod:`adaptiveload.train.metrics`),
loss, whether Dynamo compiled during the step, and the batch's B, S, latent shape and tokens. A pack
(policy ``packed``) records its n samples as B, its longest sample's S and shape, and its tokens
``sum S_i``; a padding pack (loss weight 0, :meth:`~adaptiveload.sched.packing.PackingSampler.loss_weight`)
counts as 0 samples and 0 tokens and records no indices.

Failure protocol: a step that fails on any rank (a batch that could not be loaded -- e.g. a missing
or mismatched sample file --, out of memory in a bucket, an exception, a non-finite loss or gradient,
or a collective that timed out because a peer failed) makes every rank raise :class:`StepFailed`
with one message naming each failing rank's bucket shape and batch size (or, for a batch that could
not be loaded, the manifest row and file). The ranks agree on the fetch before training, so no rank
trains a step another could not load. The run's state then holds the steps before it; the caller
records them and stops. When the failure looks like a known compiler bug, :func:`compiler_hint`
adds a line naming it.

Compile happens before timing (:func:`warm_up`): one frozen-weight step per kind of batch the
sampler yields (:func:`warm_up_batches`), or, for packs, on the largest and the smallest pack of
each octave of token counts in epoch 0 and a one-sample pack (:func:`warm_up_packs`: the compiled
blocks see every pack through graphs that differ only by Inductor's thresholds on the token count),
and on CUDA on packs that hold every attention group (size, length) of epoch 0 (cuDNN's execution
plans); a step that compiled anyway is flagged (``compiled``).
"""
from __future__ import annotations

import functools
import logging
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from adaptiveload.sched.packing import EpochPacking, PackingSampler
from adaptiveload.sched.sampler import EpochBatchSampler
from adaptiveload.train.data import (Batch, PackBatch, SampleError, collate, collate_pack, sample_error_message,
                                     synthetic_batch, synthetic_pack)
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.metrics import busy_time_s
from adaptiveload.train.step import NonFiniteStep, StepConfig, TrainStep

logger = logging.getLogger("adaptiveload.train")

KINETO_LOG_LEVEL_ENV = "KINETO_LOG_LEVEL"
KINETO_SILENT = "6"  # Kineto's level above every message: hides its profiler_start/stop lines on stderr
# Parameters of the time embedding and the adaLN modulation, by name (the reference model's and diffusers')
TIME_OR_MODULATION = re.compile(r"time_emb|time_proj|timestep|temb|modulation|scale_shift|adaln", re.IGNORECASE)
INDUCTOR_GRADIENT_BUG_RELEASES = ((2, 10), (2, 11))  # torch releases of pytorch/pytorch#193061


class StepRow:
    """Columns of the row every rank contributes per step (:func:`one_step`): status (0 ok, 1 out of
    memory, 2 failed, 3 timed out waiting, 4 non-finite, 5 batch not loaded), wall s, busy s, loss,
    compiled (0/1), B, S, latent T, H, W, tokens (module docstring: a pack's B is its sample count,
    its S and shape the longest sample's)."""
    status, wall, busy, loss, compiled, batch_size, seq_len = range(7)
    latent_shape = slice(7, 10)
    tokens = 10


class StepFailed(RuntimeError):
    """A step failed on some rank; the message names the ranks, bucket shapes and batch sizes."""


@dataclass
class RunState:
    """Progress of a run, saved in checkpoints."""

    step: int = 0
    epoch: int = 0
    consumed_in_epoch: int = 0
    train_wall_s: float = 0.0
    history: list = field(default_factory=list)
    evals: list = field(default_factory=list)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def step_patch(step: TrainStep) -> tuple:
    """The model's patch size (from its config; Wan's 1x2x2 when the model has none)."""
    config = getattr(step.module, "config", None)
    patch = getattr(config, "patch_size", None) if config is not None else None
    return tuple(patch) if patch else (1, 2, 2)


@contextmanager
def silent_kineto():
    """Silence Kineto's own stderr lines (``profiler_start`` / ``profiler_stop`` at every profiled
    step, mixed into the progress bars) unless ``KINETO_LOG_LEVEL`` is set by the user; restored on exit."""
    if KINETO_LOG_LEVEL_ENV in os.environ:
        yield
        return
    os.environ[KINETO_LOG_LEVEL_ENV] = KINETO_SILENT
    try:
        yield
    finally:
        os.environ.pop(KINETO_LOG_LEVEL_ENV, None)


def failure_message(rows: np.ndarray, messages: list, step_index: int) -> str:
    """One message for a failed step from every rank's :class:`StepRow` and message (ranks with
    status 0 are left out; out of memory and non-finite values add what to do)."""
    parts = []
    for rank, row in enumerate(rows):
        status = int(row[StepRow.status])
        if status == 0:
            continue
        if status == 5:
            parts.append(f"rank {rank} could not load its batch: {messages[rank]}")
            continue
        shape = "x".join(str(int(v)) for v in row[StepRow.latent_shape])
        what = {1: "ran out of memory", 2: "failed", 3: "gave up waiting for a failed rank (collective timed out)",
                4: "got a non-finite loss or gradient"}[status]
        parts.append(f"rank {rank} {what} on bucket latent {shape} (S={int(row[StepRow.seq_len]):,}) "
                     f"with B={int(row[StepRow.batch_size])}"
                     + (f" ({messages[rank]})" if messages[rank] else ""))
    text = f"step {step_index}: " + "; ".join(parts)
    if (rows[:, StepRow.status] == 4).any():
        text += ("; the weights are unchanged; compare the same bucket under --backend eager to tell a "
                 "model problem from a compiler one")
    if (rows[:, StepRow.status] == 1).any():
        text += ("; recalibrate with a smaller memory budget (adaptiveload train --memory-budget-gb ..., or "
                 "adaptiveload calibrate) or turn on activation checkpointing")
    return text


def compiler_hint(config: StepConfig, message: str, torch_version: str) -> Optional[str]:
    """A one-line hint when a failure looks like pytorch/pytorch#193061: the run compiled with
    Inductor (plain, or inside the adaptiveload backend) on torch 2.10 or 2.11, and ``message`` names
    non-finite gradients in time-embedding or modulation parameters (on diffusers' Wan, torch 2.11's
    Inductor gets the ``scale_shift_table`` and time-embedding gradients wrong by up to 1.4e4x at
    S = 32,760). None otherwise."""
    inductor = config.backend == "inductor" or (config.backend == "adaptiveload" and config.inner == "inductor")
    release = tuple(int(v) for v in re.findall(r"\d+", torch_version)[:2])
    named = message.partition("non-finite gradients in ")[2]
    if not (inductor and release in INDUCTOR_GRADIENT_BUG_RELEASES and TIME_OR_MODULATION.search(named)):
        return None
    return (f"hint: torch {torch_version}'s Inductor computes wrong time-embedding and modulation gradients "
            "(pytorch/pytorch#193061); run this configuration with --backend aot_eager (for the baseline, "
            "--baseline-backend aot_eager) or another torch release")


def _fetch(batches: Iterator[Batch]) -> tuple[Optional[Batch], str]:
    """The next batch, or None and why it could not be loaded (a sample file's row and path)."""
    try:
        return next(batches), ""
    except SampleError as err:  # also when a DataLoader worker re-raised it
        return None, sample_error_message(err)
    except Exception as err:  # noqa: BLE001 - e.g. a worker process that died; reported like a failed step
        logger.exception("loading a batch failed")
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def one_step(step: TrainStep, batches: Iterator, ctx: DistContext, index: int, profile: bool,
             weight: float = 1.0) -> tuple[dict, Optional[str]]:
    """Fetch, agree on the global sample count (and that every rank has its batch), train, agree on
    the outcome. ``weight``: this rank's loss weight (0 for a padding pack, module docstring).

    Returns:
        ``(record, None)`` with the step's record (every rank's B, S, tokens and sample indices, the
        slowest rank's wall time, busy time per rank when profiled, the mean loss, ``compiled``), or
        ``({}, message)`` when the step failed on some rank (:func:`failure_message`); when a rank
        could not load its batch, no rank trains.
    """
    start = time.perf_counter()
    batch, message = _fetch(batches)
    shape = batch.latent_shape if batch is not None else (0, 0, 0)
    size = len(batch) if batch is not None and weight > 0 else 0
    seq_len = int(np.prod(shape)) // int(np.prod(step_patch(step)))
    tokens = (batch.num_tokens if isinstance(batch, PackBatch) else size * seq_len) if size else 0
    agreed = ctx.all_gather([size, tokens, float(batch is None)])
    counts = agreed[:, :2].sum(axis=0)
    status, loss, profiler = (5 if batch is None else 0), float("nan"), None
    loaded = not agreed[:, 2].any()  # else no rank trains this step
    graphs_before = compiled_graphs()
    step_args = (batch, int(counts[0])) + (() if weight == 1.0 else (weight,))  # the weight only for a padding pack
    try:
        if loaded and profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if step.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as profiler:
                loss = float(step(*step_args))
                step.synchronize()
        elif loaded:
            loss = float(step(*step_args))
            step.synchronize()
    except NonFiniteStep as err:
        status, message = 4, str(err)
    except torch.OutOfMemoryError as err:
        status, message = 1, str(err).splitlines()[0][:200]
        step.optimizer.zero_grad(set_to_none=True)
    except Exception as err:  # noqa: BLE001 - reported to every rank, then the run stops
        logger.exception("rank %d: step on latent %s with B=%d failed", ctx.rank, "x".join(map(str, shape)), size)
        text = str(err).splitlines()[0][:200] if str(err) else ""
        waited = isinstance(err, torch.distributed.DistError) or "timed out" in text.lower()
        status, message = (3 if waited else 2), f"{type(err).__name__}: {text}"
        step.optimizer.zero_grad(set_to_none=True)
    wall = time.perf_counter() - start
    busy = busy_time_s(profiler, step.device, wall) if profiler is not None and status == 0 else float("nan")
    compiled = compiled_graphs() > graphs_before
    rows = ctx.all_gather([status, wall, busy, loss, float(compiled), size, seq_len, *shape, tokens]).numpy()
    if rows[:, StepRow.status].max() > 0:
        return {}, failure_message(rows, ctx.all_gather_object(message), index)
    return {
        "global_samples": int(counts[0]), "global_tokens": int(counts[1]),
        "step_time_s": float(rows[:, StepRow.wall].max()),
        "busy_s": None if np.isnan(rows[:, StepRow.busy]).any() else rows[:, StepRow.busy].tolist(),
        "loss": float(rows[:, StepRow.loss].sum() / counts[0]),
        "compiled": bool(rows[:, StepRow.compiled].any()),  # a rank compiled a graph here (its time counts)
        "batch_sizes": rows[:, StepRow.batch_size].astype(int).tolist(),
        "seq_lens": rows[:, StepRow.seq_len].astype(int).tolist(),
        "tokens": rows[:, StepRow.tokens].astype(int).tolist(),
        "indices": ctx.all_gather_object(batch.indices.tolist() if size else []),
    }, None


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


def warm_up_packs(packing: EpochPacking, latent_shapes: np.ndarray, attention_groups: bool = False) -> list[np.ndarray]:
    """Packs that compile, before timing, every graph a packed run needs: latent shapes [n, 3] of the
    epoch's packs of fewest and of most tokens in each octave of token counts (``sum S`` in
    ``[2^k, 2^(k+1))``), and of the one-sample padding pack (distinct ones, fewest tokens first).

    The compiled blocks take every pack through the same graph code (``sum S`` and the boundaries
    are dynamic sizes, the text tokens an unbacked one): only Inductor's size thresholds on ``sum S``
    split them into graphs, one per interval between thresholds that a pack falls in. The thresholds
    seen lie at a few thousand tokens (CPU: 4,096, the reduction length from which Inductor
    accumulates in blocks; CUDA at D = 1536: 3,414 and 4,096, its mixed-order reduction fusion) and
    at 32-bit indexing (``sum S`` times the widest row reaching 2^31), at most one inside an octave:
    an octave's two ends then cover both of its intervals. Two packs per octave at most, a step each.

    With ``attention_groups`` (CUDA), also packs that hold every attention shape of the epoch: a
    pack's attention runs once per group of its samples of equal length
    (:func:`~adaptiveload.models.packed.packed_attention`), and cuDNN builds an execution plan the
    first time it sees a (group size, length), 55-70 ms each (flashinfer-ai/flashinfer#5245), four
    per group (self- and cross-attention, forward and backward). On an H200 the first pack with three
    new groups took 0.74 s longer than the same composition later in the epoch
    (``benchmarks/results/train_h200/x1_packed_head_gather.json``, steps 1 and 6). The groups not in
    the packs above go into as few packs as fit the epoch's largest pack (first fit, largest first;
    one group per length in a pack, since equal lengths would merge into one group).

    Args:
        packing: :meth:`PackingSampler.epoch_plan` of epoch 0.
        latent_shapes: int [num_samples, 3] of the corpus.
        attention_groups: also cover every (group size, length) of the epoch's packs.
    """
    latent_shapes = np.asarray(latent_shapes)
    lengths = packing.seq_lens[packing.order].astype(np.int64)  # tokens of each sample, in pack order
    tokens = np.add.reduceat(lengths, packing.pack_start)
    octave = np.floor(np.log2(tokens)).astype(np.int64)
    by_tokens = np.lexsort((tokens, octave))  # by octave, then tokens: each octave's ends are adjacent
    first = np.flatnonzero(np.r_[True, octave[by_tokens][1:] != octave[by_tokens][:-1]])
    ends = np.unique(np.concatenate([by_tokens[first], by_tokens[np.r_[first[1:], by_tokens.size] - 1]]))
    packs = [packing.order[packing.pack_start[k]:packing.pack_start[k] + packing.pack_size[k]] for k in ends.tolist()]
    packs.append(np.array([packing.padding_sample]))
    if attention_groups:
        packs += _attention_group_packs(packing, lengths, packs, int(tokens.max()))
    distinct = {tuple(map(tuple, latent_shapes[p].tolist())): latent_shapes[p] for p in packs}
    return sorted(distinct.values(), key=lambda shapes: (int(shapes.prod(axis=1).sum()), len(shapes)))


def _attention_group_packs(packing: EpochPacking, lengths: np.ndarray, chosen: list, capacity: int) -> list[np.ndarray]:
    """Sample indices of packs holding each (group size g, length S) of the epoch's packs that none
    of the ``chosen`` packs (sample indices) holds, at most ``capacity`` tokens a pack
    (:func:`warm_up_packs`); ``lengths``: tokens of each sample of ``packing.order``."""
    def groups(pack_of: np.ndarray, length: np.ndarray, sample: np.ndarray) -> np.ndarray:
        """[k, 3] rows (S, g, a sample of length S) of every (pack, S), deduplicated on (S, g)."""
        keys, first, g = np.unique(np.stack([pack_of, length]), axis=1, return_index=True, return_counts=True)
        rows = np.stack([keys[1], g, sample[first]], axis=1)
        return rows[np.unique(rows[:, :2], axis=0, return_index=True)[1]]

    pack_of = np.repeat(np.arange(packing.pack_size.size), packing.pack_size)
    needed = groups(pack_of, lengths, packing.order.astype(np.int64))
    chosen_samples = np.concatenate(chosen).astype(np.int64)
    chosen_pack = np.repeat(np.arange(len(chosen)), [len(c) for c in chosen])
    covered = {(int(s), int(g)) for s, g, _ in groups(chosen_pack, packing.seq_lens[chosen_samples], chosen_samples)}
    bins = []  # [[sample, ...], {S}, tokens]: one group per length a pack
    for s, g, sample in sorted(needed.tolist(), key=lambda row: -row[0] * row[1]):
        if (s, g) in covered:
            continue
        home = next((b for b in bins if s not in b[1] and b[2] + s * g <= capacity), None)
        if home is None:
            home = [[], set(), 0]
            bins.append(home)
        home[0] += [sample] * g
        home[1].add(s)
        home[2] += s * g
    return [np.array(b[0]) for b in bins]


def warm_up(step: TrainStep, spec, sampler: EpochBatchSampler, ctx: DistContext, progress: bool,
            latent_shapes: Optional[np.ndarray] = None) -> Optional[str]:
    """Compile before timing: one frozen-weight step per batch of :func:`warm_up_batches` (a bucket
    sampler) or per pack of :func:`warm_up_packs` (a :class:`PackingSampler`, which needs the
    corpus's ``latent_shapes``), with a progress bar when ``progress``.

    Returns:
        ``None``, or the message of a warm-up step that failed on some rank (as for a training step:
        every rank stops; out of memory names the bucket and B).
    """
    if isinstance(sampler, PackingSampler):
        plan = warm_up_packs(sampler.epoch_plan(0), latent_shapes, attention_groups=step.device.type == "cuda")
        batches = (synthetic_pack(spec, shapes, device=step.device) for shapes in plan)
    else:
        plan = warm_up_batches(sampler.bucket_keys, sampler.batch_kinds())
        batches = (synthetic_batch(spec, batch_size, shape, device=step.device) for batch_size, shape in plan)
    with step.frozen_weights(), tqdm(total=len(plan), desc="warm-up (compile)", unit="step",
                                     disable=not progress, leave=False) as bar:
        for index in range(len(plan)):
            _, failure = one_step(step, batches, ctx, index, profile=False)
            if failure is not None:
                return f"warm-up {failure}"
            bar.update(1)
    return None


@dataclass
class LoopOptions:
    """How :func:`train_steps` runs: steps in all, evaluation, profiling and checkpoint periods (in
    steps; 0 turns profiling or checkpoints off), DataLoader workers, and the progress bar."""

    total_steps: int
    eval_every: int
    profile_every: int
    checkpoint_every: int
    workers: int
    progress: bool
    name: str


def train_steps(step: TrainStep, sampler: EpochBatchSampler, dataset, ctx: DistContext, state: RunState,
                options: LoopOptions, *, evaluate: Callable[[], float], on_eval: Callable[[], None],
                save_checkpoint: Callable[[], None]) -> None:
    """Train from ``state`` (a fresh or resumed run) up to ``options.total_steps`` global steps,
    epoch after epoch, updating ``state`` after every step.

    ``evaluate()`` returns the loss of the fixed evaluation set; it runs every ``eval_every`` steps
    and at the last step, and ``on_eval()`` follows it on every rank (it may run collectives).
    ``save_checkpoint()`` runs every ``checkpoint_every`` steps and at the last step. A
    :class:`PackingSampler`'s steps are packs (:func:`~adaptiveload.train.data.collate_pack`), each
    weighted by its :meth:`~PackingSampler.loss_weight`.

    Raises:
        StepFailed: a step failed on some rank; ``state`` holds the steps before it.
    """
    steps_per_epoch = sampler.steps_per_epoch()
    packed = isinstance(sampler, PackingSampler)
    collate_fn = (functools.partial(collate_pack, patch_size=dataset.spec.patch_size, text_len=dataset.spec.text_len)
                  if packed else functools.partial(collate, text_len=dataset.spec.text_len))
    loader_kwargs = {"num_workers": options.workers, "collate_fn": collate_fn,
                     # batches made on the CPU (worker processes, sample files) go to the GPU from pinned memory
                     "pin_memory": ctx.device.type == "cuda" and dataset.device.type == "cpu"}
    bar = tqdm(total=options.total_steps, initial=state.step, desc=options.name, unit="step",
               disable=not options.progress, leave=False)
    try:
        while state.step < options.total_steps:
            sampler.set_epoch(state.epoch)
            dataset.set_epoch(state.epoch)
            if sampler.resume_step >= steps_per_epoch:  # resumed exactly at the end of an epoch
                state.epoch, state.consumed_in_epoch = state.epoch + 1, 0
                continue
            state.consumed_in_epoch = sampler.resume_step
            batches = iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **loader_kwargs))
            while state.step < options.total_steps and state.consumed_in_epoch < steps_per_epoch:
                profile = options.profile_every > 0 and state.step % options.profile_every == 0
                weight = sampler.loss_weight(state.consumed_in_epoch) if packed else 1.0
                record, failure = one_step(step, batches, ctx, state.step, profile=profile, weight=weight)
                if failure is not None:
                    raise StepFailed(failure)
                record["step"] = state.step
                state.history.append(record)
                state.train_wall_s += record["step_time_s"]
                state.step += 1
                state.consumed_in_epoch += 1
                bar.update(1)
                bar.set_postfix_str(f"loss {record['loss']:.4f}")
                last = state.step == options.total_steps
                if state.step % options.eval_every == 0 or last:
                    state.evals.append([state.step, evaluate()])
                    on_eval()
                if options.checkpoint_every and (state.step % options.checkpoint_every == 0 or last):
                    save_checkpoint()
            del batches
            if state.consumed_in_epoch >= steps_per_epoch:
                state.epoch, state.consumed_in_epoch = state.epoch + 1, 0
    finally:
        bar.close()
