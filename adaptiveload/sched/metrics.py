"""Load-balance and step-composition metrics of an epoch plan, shared by the planner and the simulator.

From per-rank step costs ``c[s, r]`` (seconds) of every step s (:func:`load_metrics`):

* compute-load CV: ``std_r(c) / mean_r(c)`` (population std), averaged over steps;
* idle fraction: ``1 - mean_r(c) / max_r(c)``, averaged over steps;
* tokens/s: all tokens trained / sum over steps of ``max_r(c)`` (a step ends with its slowest rank);
* step time: mean, coefficient of variation across steps, p50 and p95 of ``max_r(c)``.

:func:`noise_floor`: the CV and idle fraction that multiplicative noise ``max(0.05, 1 + sigma N(0, 1))``
per rank and step alone gives a plan whose ranks are exactly balanced -- what no sampler can beat
when step times vary that much.

:func:`composition`: ``composition_ks``, the mean over steps of the two-sample Kolmogorov-Smirnov
statistic between the sequence lengths of all samples of the step (all ranks) and those of the
corpus, and ``composition_lag1_corr``, the Pearson correlation of consecutive steps' mean sequence
length. Steps of random samples have a small KS (about ``0.87 / sqrt(n)`` for n samples of a
continuous distribution, less for a few distinct lengths) and no correlation; steps that group
samples by cost have a large KS.
"""
from __future__ import annotations

import numpy as np

NOISE_CLIP = 0.05  # multiplicative noise is clipped here so a cost never goes non-positive
NOISE_FLOOR_DRAWS = 1 << 20  # noise draws (steps x ranks) that estimate the noise floor


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


def multiplicative_noise(rng: np.random.Generator, shape, sigma: float):
    """Multiplicative noise ``max(NOISE_CLIP, 1 + sigma * N(0, 1))``: float64 array of ``shape``
    (the scalar 1.0 when sigma is 0)."""
    return np.maximum(NOISE_CLIP, 1.0 + sigma * rng.standard_normal(shape)) if sigma > 0 else 1.0


def noise_floor(world_size: int, sigma: float, *, seed: int = 0) -> tuple[float, float]:
    """Compute-load CV and idle fraction of an exactly balanced plan under the truth's noise alone.

    Every rank costs the same before the noise, so the metrics are those of ``W`` draws of
    ``max(0.05, 1 + sigma * N(0, 1))`` per step, averaged over :data:`NOISE_FLOOR_DRAWS` draws
    (at least 64 steps).

    Args:
        world_size: ranks W; sigma: the noise's standard deviation (0: no noise).
        seed: seed of the draws.

    Returns:
        ``(cv, idle)``, as :func:`load_metrics` (0, 0 for ``sigma = 0``).

    Example::

        >>> [round(v, 3) for v in noise_floor(2, 0.05)]  # E|Z1 - Z2| / 2 * sigma = sigma / sqrt(pi) = 0.028
        [0.028, 0.027]
    """
    if sigma == 0:
        return 0.0, 0.0
    steps = max(64, NOISE_FLOOR_DRAWS // world_size)
    draws = multiplicative_noise(np.random.default_rng(seed), (steps, world_size), sigma)
    metrics = load_metrics(draws, np.ones_like(draws))
    return metrics["cv"], metrics["idle"]


def composition(step, sample, seq_lens) -> tuple[float, float]:
    """How far each step's samples are from random samples of the corpus.

    Args:
        step: int array [m], the global step of every trained sample (steps numbered 0..k-1, each
            with at least one sample); sample: int array [m], its index.
        seq_lens: int array [n], sequence length of every sample of the corpus.

    Returns:
        ``(ks, lag1)``: the mean over steps of the two-sample KS statistic ``sup_x |F_step(x) -
        F_corpus(x)|`` between the step's sequence lengths and the corpus's, and the Pearson
        correlation of consecutive steps' mean sequence length (NaN with fewer than 3 steps or
        constant means).

    Raises:
        ValueError: ``step`` and ``sample`` of different lengths, or a step without samples.

    Example::

        >>> composition([0, 0, 1, 1], [0, 1, 2, 3], [1, 1, 2, 2])  # each step holds one of the two lengths
        (0.5, nan)
    """
    step = np.asarray(step, dtype=np.int64).reshape(-1)
    corpus = np.sort(np.asarray(seq_lens, dtype=np.int64).reshape(-1))
    values = np.asarray(seq_lens, dtype=np.int64)[np.asarray(sample, dtype=np.int64).reshape(-1)]
    if values.size != step.size:
        raise ValueError(f"step and sample must have equal lengths, got {step.size} and {values.size}")
    counts = np.bincount(step)
    if counts.size == 0 or counts.min() == 0:
        raise ValueError("every step from 0 to the last must hold at least one sample")
    # The KS statistic of a step is reached at one of its own values v: |F_step(v) - F_corpus(v)| or
    # the same just below v (both CDFs are flat elsewhere between the step's values, where only
    # F_corpus moves, up to the next value's left limit).
    order = np.lexsort((values, step))
    step, values = step[order], values[order]
    key = step * (int(corpus[-1]) + 1) + values
    n = counts[step].astype(np.float64)
    start = np.cumsum(counts) - counts
    below = (np.searchsorted(key, key, side="left") - start[step]) / n  # F_step(v-)
    upto = (np.searchsorted(key, key, side="right") - start[step]) / n  # F_step(v)
    c_below = np.searchsorted(corpus, values, side="left") / corpus.size
    c_upto = np.searchsorted(corpus, values, side="right") / corpus.size
    gap = np.maximum(np.abs(upto - c_upto), np.abs(below - c_below))
    ks = float(np.maximum.reduceat(gap, start).mean())
    means = np.bincount(step, weights=values) / counts
    lag1 = float("nan")
    if means.size >= 3 and np.std(means[:-1]) > 0 and np.std(means[1:]) > 0:
        lag1 = float(np.corrcoef(means[:-1], means[1:])[0, 1])
    return ks, lag1
