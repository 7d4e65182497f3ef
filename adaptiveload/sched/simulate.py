"""Cluster simulation: replay the samplers' epoch plans and measure load balance, throughput and
the randomness of each step's samples.

Each policy's batches (or packs) are planned with the calibration's cost model and then scored
twice: with that same model ("plan" columns) and with a separate truth ("truth" columns) -- another
cost model (a different calibration, or the same measurements fitted with the other model family)
times multiplicative noise ``max(0.05, 1 + sigma * N(0, 1))`` drawn per rank and step -- so balance
is not graded only by the model that produced it.

Metrics, per policy (:mod:`adaptiveload.sched.metrics`): compute-load CV, idle fraction, tokens/s and
step times under both models; the noise floor at that W (the CV and idle fraction the truth's noise
alone gives an exactly balanced plan -- what no sampler can beat); the step composition
(``composition_ks``, ``composition_lag1_corr``: how far each step's samples are from random samples).

Policies (:mod:`adaptiveload.sched.policies`), each planned by :func:`make_plan` with that policy and
replayed by :func:`~adaptiveload.sched.packing.sampler_from_plan`:

* ``equal_token`` -- ``B = floor(M_mem_limit / S)``, ranks draw batches independently;
* ``dual`` -- the plan's budgets, ranks draw independently;
* ``cost_grouped`` -- the plan's budgets for W batches of similar cost per step;
* ``packed`` -- cost-balanced packs of samples in random order (:mod:`adaptiveload.sched.packing`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.cost_model import CostModel
from adaptiveload.sched.manifest import Manifest
from adaptiveload.sched.metrics import composition, load_metrics, multiplicative_noise, noise_floor
from adaptiveload.sched.packing import sampler_from_plan
from adaptiveload.sched.plan import make_plan
from adaptiveload.sched.policies import POLICIES, policy_name

@dataclass
class PolicyResult:
    """Simulation of one policy (a name of :data:`~adaptiveload.sched.policies.POLICIES`): its rule
    (``m_mem`` tokens, ``step_budget_s`` seconds or ``None``), metrics under the plan model and the
    truth, the noise floor at this world size and the step composition (module docstring)."""

    policy: str
    world_size: int
    m_mem: int
    step_budget_s: float | None
    plan_metrics: dict
    truth_metrics: dict
    noise_floor_cv: float = 0.0
    noise_floor_idle: float = 0.0
    composition_ks: float = float("nan")
    composition_lag1_corr: float = float("nan")

    def to_json(self) -> dict:
        """``policy``, ``world_size``, ``m_mem``, ``step_budget_s``, the metrics as ``plan`` and ``truth``,
        and at the row level ``compute_load_cv_plan`` / ``_truth``, ``idle_fraction_plan`` / ``_truth``,
        ``noise_floor_cv``, ``noise_floor_idle``, ``composition_ks``, ``composition_lag1_corr`` (NaN as ``None``)."""
        def number(v):
            return None if v is None or not np.isfinite(v) else float(v)

        return {"policy": self.policy, "world_size": self.world_size, "m_mem": self.m_mem,
                "step_budget_s": self.step_budget_s, "plan": self.plan_metrics, "truth": self.truth_metrics,
                "compute_load_cv_plan": self.plan_metrics["cv"], "compute_load_cv_truth": self.truth_metrics["cv"],
                "idle_fraction_plan": self.plan_metrics["idle"], "idle_fraction_truth": self.truth_metrics["idle"],
                "noise_floor_cv": self.noise_floor_cv, "noise_floor_idle": self.noise_floor_idle,
                "composition_ks": number(self.composition_ks),
                "composition_lag1_corr": number(self.composition_lag1_corr)}


def replay(sampler, plan_model: CostModel, truth_model: CostModel, seq_lens, *, truth_noise: float = 0.05,
           epochs: int = 1, seed: int = 0) -> tuple[dict, dict, tuple[float, float]]:
    """Replay ``epochs`` epoch plans of ``sampler`` (all ranks) and score them.

    Args:
        sampler: a :class:`~adaptiveload.sched.sampler.DualConstraintBucketSampler` or
            :class:`~adaptiveload.sched.packing.PackingSampler` (its ``epoch_plan(epoch)``).
        plan_model, truth_model: the cost models scored with; seq_lens: int [n] of the corpus.
        truth_noise, seed: sigma of the truth's noise and its seed.

    Returns:
        ``(plan_metrics, truth_metrics, (composition_ks, composition_lag1_corr))``: the metrics as
        :func:`load_metrics`, the composition as :func:`composition` over all epochs' steps in order.
    """
    rng = np.random.default_rng(seed)
    plan_costs, truth_costs, tokens, steps, samples = [], [], [], [], []
    first_step = 0
    for epoch in range(epochs):
        ep = sampler.epoch_plan(epoch)
        plan_costs.append(ep.step_costs(plan_model))
        truth = ep.step_costs(truth_model)
        truth_costs.append(truth * multiplicative_noise(rng, truth.shape, truth_noise))
        tokens.append(ep.step_tokens())
        step, sample = ep.step_samples()
        steps.append(step + first_step)
        samples.append(sample)
        first_step += truth.shape[0]
    tokens = np.concatenate(tokens)
    return (load_metrics(np.concatenate(plan_costs), tokens), load_metrics(np.concatenate(truth_costs), tokens),
            composition(np.concatenate(steps), np.concatenate(samples), seq_lens))


def simulate(manifest: Manifest, calibration: Calibration, world_size: int, *, policies=POLICIES,
             truth_model: CostModel | None = None, truth_noise: float = 0.05, memory_budget_bytes=None,
             m_mem=None, drop_oversized: bool = False, epochs: int = 1, seed: int = 0) -> list[PolicyResult]:
    """Plan each policy for ``world_size`` ranks and replay its epochs.

    Args:
        manifest: the corpus.
        calibration: the cost model batches are planned with (and the memory model for the limit).
        world_size: ranks W.
        policies: any of :data:`~adaptiveload.sched.policies.POLICIES` (``"equal_token"``, ``"dual"``,
            ``"cost_grouped"``, ``"packed"``); older spellings are mapped by
            :func:`~adaptiveload.sched.policies.policy_name`.
        truth_model: the cost model to score against (default: the plan model); times ``truth_noise``.
        truth_noise: sigma of the multiplicative Gaussian noise on each truth cost.
        memory_budget_bytes, m_mem, drop_oversized: as :func:`make_plan`.
        epochs: epochs replayed per policy (each a fresh shuffle).
        seed: sampler seed and noise seed.

    Returns:
        One :class:`PolicyResult` per policy, in the order given, named by the current policy names.

    Raises:
        ValueError: an unknown policy, or as :func:`make_plan`.

    Example::

        >>> from adaptiveload.sched.manifest import reference_mix
        >>> from adaptiveload.sched.presets import load_calibration
        >>> rows = simulate(reference_mix(20000), load_calibration("anchors-wan1.3b"), 8, m_mem=151200,
        ...                 policies=("dual", "packed"))
        >>> [(r.policy, r.plan_metrics["idle"] < 0.03, r.composition_ks < 0.3) for r in rows]
        [('dual', False, False), ('packed', True, True)]
    """
    names = [policy_name(p) for p in policies]  # first: an unknown name fails before any planning
    truth_model = truth_model or calibration.cost_model
    floor_cv, floor_idle = noise_floor(world_size, truth_noise, seed=seed)
    results = []
    for policy in names:
        plan = make_plan(manifest, calibration, world_size, memory_budget_bytes=memory_budget_bytes, m_mem=m_mem,
                         drop_oversized=drop_oversized, policy=policy)
        sampler = sampler_from_plan(plan, manifest.bucket_keys, num_replicas=world_size, rank=0, seed=seed)
        plan_m, truth_m, (ks, lag1) = replay(sampler, calibration.cost_model, truth_model, manifest.seq_lens,
                                             truth_noise=truth_noise, epochs=epochs, seed=seed)
        results.append(PolicyResult(policy, int(world_size), plan.m_mem, plan.step_budget_s, plan_m, truth_m,
                                    floor_cv, floor_idle, ks, lag1))
    return results


def format_results(results: list[PolicyResult]) -> str:
    """A text table: per policy, plan-model and truth metrics side by side with the noise floor,
    speedup vs equal_token (truth), and the step composition."""
    base = {r.world_size: r.truth_metrics["tokens_per_s"] for r in results if r.policy == "equal_token"}
    lines = [f"{'W':>5} {'policy':<13} {'M_mem':>8} {'budget ms':>9} | {'CV plan':>7} {'CV true':>7} {'floor':>5} | "
             f"{'idle plan':>9} {'idle true':>9} {'floor':>5} | {'tok/s plan':>11} {'tok/s true':>11} {'vs eq-tok':>9} | "
             f"{'step ms':>7} {'step CV':>7} {'p95 ms':>7} {'steps':>7} | {'KS':>5} {'lag1':>6}"]
    for r in results:
        p, t = r.plan_metrics, r.truth_metrics
        budget = "-" if r.step_budget_s is None else f"{r.step_budget_s * 1e3:.0f}"
        speed = f"{t['tokens_per_s'] / base[r.world_size]:.2f}x" if r.world_size in base else "-"
        lag1 = "-" if not np.isfinite(r.composition_lag1_corr) else f"{r.composition_lag1_corr:+.3f}"
        lines.append(f"{r.world_size:>5} {r.policy:<13} {r.m_mem:>8} {budget:>9} | {p['cv']:>7.3f} {t['cv']:>7.3f} "
                     f"{r.noise_floor_cv:>5.3f} | {p['idle']:>9.3f} {t['idle']:>9.3f} {r.noise_floor_idle:>5.3f} | "
                     f"{p['tokens_per_s']:>11,.0f} {t['tokens_per_s']:>11,.0f} {speed:>9} | "
                     f"{t['step_time_mean_s'] * 1e3:>7.0f} {t['step_time_cv']:>7.3f} {t['step_time_p95_s'] * 1e3:>7.0f} "
                     f"{t['steps']:>7} | {r.composition_ks:>5.3f} {lag1:>6}")
    return "\n".join(lines)
