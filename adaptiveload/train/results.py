"""What a train job records: ``results.json`` (every run's settings and measurements) and how a
run's measurements are summarised.

Throughput is measured over the same samples for every run: tokens/s = global tokens of all steps ÷
training wall time (data loading and the step; compile warm-up, evaluation and checkpointing
excluded). Compute-load CV and idle fraction come from the profiled steps' busy time
(:mod:`adaptiveload.train.metrics`). Step composition (every policy): ``composition_ks``, the mean
over steps of the KS statistic between the sequence lengths a step trained (all ranks) and the
corpus's, and ``composition_lag1_corr``, the correlation of consecutive steps' mean length
(:func:`~adaptiveload.sched.metrics.composition`, as ``adaptiveload simulate`` reports them).
How well the plan's cost model predicted the steps: ``step_time_rel_err_median``
(:func:`step_time_prediction`).
``results.json`` is rewritten atomically after every
evaluation and at the end, so a run that fails keeps what it measured.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from adaptiveload.jsonfile import write_json_atomic
from adaptiveload.sched.metrics import composition
from adaptiveload.sched.packing import PackingSampler
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.loop import RunState, compiled_graphs
from adaptiveload.train.metrics import load_balance, summarize

RESULTS_FORMAT = "adaptiveload.train-results"
# 2: a run names its batching policy in "policy" (equal_token, dual, cost_grouped); version 1 had
# "sampler" (dual, equal) and "policy" (random, cost_grouped)
RESULTS_VERSION = 2


def _rate(records: list) -> float:
    wall = sum(r["step_time_s"] for r in records)
    return sum(r["global_tokens"] for r in records) / wall if wall > 0 else float("nan")


def step_composition(history: list, seq_lens) -> dict:
    """``composition_ks`` and ``composition_lag1_corr`` of the steps of ``history`` (module docstring;
    NaN without steps), from each step's trained sample indices and the corpus's ``seq_lens`` [n]."""
    steps = [(k, i) for k, h in enumerate(history) for rank in h["indices"] for i in rank]
    if not steps:
        return {"composition_ks": float("nan"), "composition_lag1_corr": float("nan")}
    ks, lag1 = composition(*np.array(steps, dtype=np.int64).T, seq_lens)
    return {"composition_ks": ks, "composition_lag1_corr": lag1}


def step_time_prediction(history: list, seq_lens, cost_model) -> dict:
    """How well ``cost_model`` (the plan's, seconds) predicted the steps of ``history``: a step's
    prediction is its slowest rank's, ``cost_model.predict_packs`` over the corpus lengths
    ``seq_lens`` [n] of the samples the rank trained (a bucket of B samples of one length is a pack of
    them; a rank without samples, the intercept), against the measured step time. Only steps that
    were neither profiled nor compiled a graph count.

    Returns:
        ``step_time_rel_err_median``: median over those steps of |predicted - measured| / measured;
        ``step_time_rel_err_mean``: mean of (predicted - measured) / measured (> 0: the model predicts
        slower steps than measured); ``step_time_predicted_steps``: how many steps counted. NaN (and 0)
        without such steps or without a cost model.
    """
    steps = [h for h in history if h["busy_s"] is None and not h.get("compiled")]
    if cost_model is None or not steps:
        return {"step_time_rel_err_median": float("nan"), "step_time_rel_err_mean": float("nan"),
                "step_time_predicted_steps": 0}
    seq_lens = np.asarray(seq_lens)
    predicted = np.array([
        cost_model.predict_packs(seq_lens[np.concatenate([np.asarray(i, dtype=np.int64) for i in h["indices"]])],
                                 np.array([len(i) for i in h["indices"]])).max()
        for h in steps])
    measured = np.array([h["step_time_s"] for h in steps])
    rel = (predicted - measured) / measured
    return {"step_time_rel_err_median": float(np.median(np.abs(rel))), "step_time_rel_err_mean": float(rel.mean()),
            "step_time_predicted_steps": len(steps)}


def summarize_run(state: RunState, ctx: DistContext, peak_memory_bytes: int, total_steps: int, seq_lens,
                  cost_model=None) -> dict:
    """A run's measurements so far: steps, tokens, tokens/s (all steps, and the unprofiled ones),
    step-time statistics, busy time per rank, load balance, step composition (against the corpus's
    ``seq_lens``), how well ``cost_model`` (the plan's; None before planning) predicted the step times,
    peak memory per rank (CUDA), eval loss and the step history. A collective (peak memory is
    gathered): every rank calls it."""
    history = state.history
    tokens = sum(r["global_tokens"] for r in history)
    samples = sum(r["global_samples"] for r in history)
    busy = np.array([r["busy_s"] for r in history if r["busy_s"] is not None], dtype=np.float64).reshape(-1, ctx.world_size)
    peaks = ctx.all_gather([peak_memory_bytes])[:, 0].long().tolist()
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
        **step_composition(history, seq_lens),
        **step_time_prediction(history, seq_lens, cost_model),
        "peak_memory_bytes_per_rank": peaks if ctx.device.type == "cuda" else None,
        "eval_loss": [list(e) for e in state.evals],
        "final_eval_loss": state.evals[-1][1] if state.evals else float("nan"),
        "history": history,
    }


def fusion_summary(reports: list, regions: int) -> dict:
    """Chains the adaptiveload backend saw and fused per forward, from the reports of the graphs a
    run compiled: a graph's counts (every graph of a run holds the same chains) times the compiled
    regions one forward runs (each block, under regional compilation)."""
    return {"fusion_reports": len(reports), "fused_chains": regions * max((r.fused for r in reports), default=0),
            "seen_chains": regions * max((r.seen for r in reports), default=0)}


class RunResult:
    """One run's entry of ``results.json``: what was run (given at the start) and its measurements
    (refreshed by :meth:`update`)."""

    def __init__(self, seq_lens, **settings):
        """``seq_lens``: int [n] tokens of every corpus sample (for the step composition); ``settings``:
        the entry's first fields (name, backend, policy, ...)."""
        self.seq_lens = seq_lens
        self.cost_model = None
        self.data = {**settings, "status": "running"}
        self._graphs_at_start = compiled_graphs()
        self._graphs_warm = self._graphs_at_start

    def planned(self, plan, sampler, warmup_s: float, cost_model) -> None:
        """Record the plan and the sampler's batch sizes (None for packs), the plan's ``cost_model``
        (the steps' predicted times, :func:`step_time_prediction`), and the end of compile warm-up
        (``warmup_s`` after the run started): graphs compiled after it count as compiled in
        training."""
        self.cost_model = cost_model
        self.data.update({
            "plan": {"m_mem": plan.m_mem, "m_mem_limit": plan.m_mem_limit, "step_budget_s": plan.step_budget_s,
                     "predicted": plan.predicted},
            "batch_sizes": None if isinstance(sampler, PackingSampler) else
            {"x".join(map(str, k)): int(b) for k, b in zip(sampler.bucket_keys.tolist(), sampler.bucket_batch_sizes.tolist())},
            "steps_per_epoch": sampler.steps_per_epoch(), "warmup_s": warmup_s, "status": "running",
        })
        self._graphs_warm = compiled_graphs()

    def update(self, state: RunState, ctx: DistContext, peak_memory_bytes: int, total_steps: int, *, status: str,
               fusion: dict, error: Optional[str] = None, hint: Optional[str] = None) -> dict:
        """Refresh the measurements (collectives: every rank calls it) and return the entry: its
        ``status`` (``running``, ``ok``, ``failed``), the ``error`` that stopped it and a ``hint``
        line about that error (or None).

        ``compiled_graphs``: graphs Dynamo compiled in this process for this run (training buckets,
        evaluation, calibration: recompiles + 1), and ``compiled_graphs_in_training`` those compiled
        inside the timed loop (their time counts in tokens/s; ``compile_steps`` names the steps), the
        most on any rank."""
        self.data.update(summarize_run(state, ctx, peak_memory_bytes, total_steps, self.seq_lens, self.cost_model))
        self.data.update(status=status, error=error, hint=hint, **fusion)
        now = compiled_graphs()
        counts = ctx.all_gather([now - self._graphs_at_start, now - self._graphs_warm]).max(dim=0).values
        self.data["compiled_graphs"], self.data["compiled_graphs_in_training"] = int(counts[0]), int(counts[1])
        return self.data


class ResultsFile:
    """``results.json`` of a job: a header (format, date, torch, device, config, corpus) and the runs;
    every :meth:`put` rewrites the file atomically (rank 0 writes; other ranks keep it in memory)."""

    def __init__(self, path: str, header: dict, *, write: bool):
        self.path, self.write = path, write
        self.doc = {"format": RESULTS_FORMAT, "version": RESULTS_VERSION, **header, "runs": []}

    def put(self, run: dict) -> None:
        """Add ``run``, or replace the run of the same name; write the file."""
        self.doc["runs"] = [r for r in self.doc["runs"] if r["name"] != run["name"]] + [dict(run)]
        self.save()

    def save(self) -> None:
        if self.write:
            write_json_atomic(self.path, self.doc)
