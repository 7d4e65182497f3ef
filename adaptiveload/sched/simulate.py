"""Cluster simulation: replay the sampler's epoch plans and measure load balance and throughput.

Each policy's batches are planned with the calibration's cost model and then scored twice: with
that same model ("plan" columns) and with a separate truth ("truth" columns) -- another cost model
(a different calibration, or the same measurements fitted with the other model family) times
multiplicative noise ``max(0.05, 1 + sigma * N(0, 1))`` drawn per rank and step -- so balance is not
graded only by the model that produced it.

Metrics, per policy, from per-rank step costs ``c[s, r]`` (seconds) of every step s:

* compute-load CV: ``std_r(c) / mean_r(c)`` (population std), averaged over steps;
* idle fraction: ``1 - mean_r(c) / max_r(c)``, averaged over steps;
* tokens/s: all tokens trained / sum over steps of ``max_r(c)`` (a step ends with its slowest rank);
* step time: mean, coefficient of variation across steps, p50 and p95 of ``max_r(c)``.

Policies (:mod:`adaptiveload.sched.policies`), each planned by :func:`make_plan` with that policy and
replayed by :meth:`DualConstraintBucketSampler.from_plan`:

* ``equal_token`` -- ``B = floor(M_mem_limit / S)``, ranks draw batches independently;
* ``dual`` -- the plan's budgets, ranks draw independently;
* ``cost_grouped`` -- the plan's budgets for W batches of similar cost per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.cost_model import CostModel
from adaptiveload.sched.manifest import Manifest
from adaptiveload.sched.plan import make_plan
from adaptiveload.sched.policies import POLICIES, policy_name
from adaptiveload.sched.sampler import DualConstraintBucketSampler

NOISE_FLOOR = 0.05  # multiplicative noise is clipped here so a truth cost never goes non-positive


def load_metrics(costs: np.ndarray, tokens: np.ndarray) -> dict:
    """Balance and throughput of per-rank step costs.

    Args:
        costs: float [steps, world_size], seconds each rank computes in each step.
        tokens: [steps, world_size], tokens each rank trains in each step.

    Returns:
        dict: ``cv``, ``idle``, ``tokens_per_s``, ``step_time_mean_s``, ``step_time_cv``,
        ``step_time_p50_s``, ``step_time_p95_s``, ``steps`` (formulas in the module docstring).

    Raises:
        ValueError: ``costs`` not [steps, world_size] with at least one step.

    Example::

        >>> m = load_metrics([[1.0, 3.0], [2.0, 2.0]], [[10, 30], [20, 20]])
        >>> m["cv"], m["tokens_per_s"], m["step_time_mean_s"], m["steps"]
        (0.25, 16.0, 2.5, 2)
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 2 or costs.shape[0] == 0:
        raise ValueError(f"costs must be [steps, world_size] with at least one step, got shape {list(costs.shape)}")
    mean, top = costs.mean(axis=1), costs.max(axis=1)
    return {
        "cv": float(np.mean(costs.std(axis=1) / mean)),
        "idle": float(np.mean(1.0 - mean / top)),
        "tokens_per_s": float(np.sum(tokens) / np.sum(top)),
        "step_time_mean_s": float(top.mean()),
        "step_time_cv": float(top.std() / top.mean()),
        "step_time_p50_s": float(np.percentile(top, 50)),
        "step_time_p95_s": float(np.percentile(top, 95)),
        "steps": int(costs.shape[0]),
    }


@dataclass
class PolicyResult:
    """Simulation of one policy (a name of :data:`~adaptiveload.sched.policies.POLICIES`): its rule
    (``m_mem`` tokens, ``step_budget_s`` seconds or ``None``), and metrics under the plan model and the truth."""

    policy: str
    world_size: int
    m_mem: int
    step_budget_s: float | None
    plan_metrics: dict
    truth_metrics: dict

    def to_json(self) -> dict:
        """``policy``, ``world_size``, ``m_mem``, ``step_budget_s``, and the metrics as ``plan`` and ``truth``."""
        return {"policy": self.policy, "world_size": self.world_size, "m_mem": self.m_mem,
                "step_budget_s": self.step_budget_s, "plan": self.plan_metrics, "truth": self.truth_metrics}


def replay(sampler: DualConstraintBucketSampler, plan_model: CostModel, truth_model: CostModel, *,
           truth_noise: float = 0.05, epochs: int = 1, seed: int = 0) -> tuple[dict, dict]:
    """Replay ``epochs`` epoch plans of ``sampler`` (all ranks) and score them.

    Returns:
        ``(plan_metrics, truth_metrics)`` as :func:`load_metrics`.
    """
    rng = np.random.default_rng(seed)
    plan_costs, truth_costs, tokens = [], [], []
    for epoch in range(epochs):
        ep = sampler.epoch_plan(epoch)
        b, s = ep.step_batch_sizes(), ep.step_seq_lens()
        plan_costs.append(plan_model.predict(b, s))
        noise = np.maximum(NOISE_FLOOR, 1.0 + truth_noise * rng.standard_normal(b.shape)) if truth_noise > 0 else 1.0
        truth_costs.append(truth_model.predict(b, s) * noise)
        tokens.append(b * s)
    tokens = np.concatenate(tokens)
    return load_metrics(np.concatenate(plan_costs), tokens), load_metrics(np.concatenate(truth_costs), tokens)


def simulate(manifest: Manifest, calibration: Calibration, world_size: int, *, policies=POLICIES,
             truth_model: CostModel | None = None, truth_noise: float = 0.05, memory_budget_bytes=None,
             m_mem=None, drop_oversized: bool = False, epochs: int = 1, seed: int = 0) -> list[PolicyResult]:
    """Plan each policy for ``world_size`` ranks and replay its epochs.

    Args:
        manifest: the corpus.
        calibration: the cost model batches are planned with (and the memory model for the limit).
        world_size: ranks W.
        policies: any of :data:`~adaptiveload.sched.policies.POLICIES` (``"equal_token"``, ``"dual"``,
            ``"cost_grouped"``); older spellings are mapped by :func:`~adaptiveload.sched.policies.policy_name`.
        truth_model: the cost model to score against (default: the plan model); times ``truth_noise``.
        truth_noise: sigma of the multiplicative Gaussian noise on each truth cost.
        memory_budget_bytes, m_mem, drop_oversized: as :func:`make_plan`.
        epochs: epochs replayed per policy (each a fresh shuffle).
        seed: sampler seed and noise seed.

    Returns:
        One :class:`PolicyResult` per policy, in the order given, named by the current policy names.

    Raises:
        ValueError: an unknown policy, or as :func:`make_plan`.
    """
    names = [policy_name(p) for p in policies]  # first: an unknown name fails before any planning
    truth_model = truth_model or calibration.cost_model
    shapes = manifest.bucket_keys
    results = []
    for policy in names:
        plan = make_plan(manifest, calibration, world_size, memory_budget_bytes=memory_budget_bytes, m_mem=m_mem,
                         drop_oversized=drop_oversized, policy=policy)
        sampler = DualConstraintBucketSampler.from_plan(plan, shapes, num_replicas=world_size, rank=0, seed=seed)
        plan_m, truth_m = replay(sampler, calibration.cost_model, truth_model, truth_noise=truth_noise,
                                 epochs=epochs, seed=seed)
        results.append(PolicyResult(policy, int(world_size), plan.m_mem, plan.step_budget_s, plan_m, truth_m))
    return results


def format_results(results: list[PolicyResult]) -> str:
    """A text table: per policy, plan-model and truth metrics side by side, speedup vs equal_token (truth)."""
    base = {r.world_size: r.truth_metrics["tokens_per_s"] for r in results if r.policy == "equal_token"}
    lines = [f"{'W':>5} {'policy':<16} {'M_mem':>8} {'budget ms':>9} | {'CV plan':>7} {'CV true':>7} | "
             f"{'idle plan':>9} {'idle true':>9} | {'tok/s plan':>11} {'tok/s true':>11} {'vs eq-tok':>9} | "
             f"{'step ms':>7} {'step CV':>7} {'p95 ms':>7} {'steps':>7}"]
    for r in results:
        p, t = r.plan_metrics, r.truth_metrics
        budget = "-" if r.step_budget_s is None else f"{r.step_budget_s * 1e3:.0f}"
        speed = f"{t['tokens_per_s'] / base[r.world_size]:.2f}x" if r.world_size in base else "-"
        lines.append(f"{r.world_size:>5} {r.policy:<16} {r.m_mem:>8} {budget:>9} | {p['cv']:>7.3f} {t['cv']:>7.3f} | "
                     f"{p['idle']:>9.3f} {t['idle']:>9.3f} | {p['tokens_per_s']:>11,.0f} {t['tokens_per_s']:>11,.0f} "
                     f"{speed:>9} | {t['step_time_mean_s'] * 1e3:>7.0f} {t['step_time_cv']:>7.3f} "
                     f"{t['step_time_p95_s'] * 1e3:>7.0f} {t['steps']:>7}")
    return "\n".join(lines)
