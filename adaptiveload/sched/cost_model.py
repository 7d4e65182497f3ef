"""Step-time models ``t(B, S)`` fitted to measured training steps, and their fit.

Three families, all affine in the batch size B (``t = intercept(S) + B * per_sample(S)``):

* :class:`PowerCostModel` -- ``t = a + b * B * S^p`` (the dual-constraint paper's ``B*S^p`` cost);
* :class:`QuadraticCostModel` -- ``t = c0 + c1*B*S + c2*B*S^2`` (linear layers + attention);
* :class:`LinearCostModel` -- ``t = c0 + c1*B*S`` (time linear in tokens): the fallback of
  ``fit_cost_model(kind="auto")`` when neither family above fits the measurements.

Times are in seconds, S in tokens. :func:`fit_cost_model` fits one family (or picks the better by
held-out error) from ``(B, S, t)`` points.

Packs: a pack holds samples of different lengths, and attention runs per sample, so its time is
``t = intercept + sum_i per_sample(S_i)`` (:meth:`CostModel.predict_packs`) -- for the quadratic
model ``c0 + c1*sum_i S_i + c2*sum_i S_i^2``: the sum of squares, not the square of the sum. A batch
of B samples of one length is the pack of B equal samples, so a calibration fitted on batches gives
the packed model directly; :func:`fit_packed_cost_model` fits the same families to measured packs
of mixed lengths. On the Wan-1.3B H200 measurements of the built-in
calibrations (adaptiveload/sched/presets.py) the power fit gives ``p = 1.41 +- 0.04, R^2 = 0.987`` and
the quadratic ``R^2 = 0.998``.

A poor fit -- the times do not grow with the work (``b = 0``, ``c1 + c2 = 0``), ``p`` pinned at a bound
of :data:`P_BOUNDS`, or ``R^2 <`` :data:`R2_MIN` -- is what a quick calibration measures while other
processes hold the cores. ``kind="auto"`` then falls back to the linear model and says why in one
line (:attr:`CostModel.warning`).
"""
from __future__ import annotations

import json
import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit, nnls

# Range of the power-law exponent p: below 0.5 or above 3 a "fit" is an artefact of too few points
# (dense layers give p = 1, full attention p = 2).
P_BOUNDS = (0.5, 3.0)
# A p within this distance of a bound is "pinned": the data wanted a p outside P_BOUNDS.
P_BOUND_TOL = 1e-3
# Below this R^2 a fit is poor: more than a fifth of the variance of the measured step times is not
# explained. The built-in H200 fits reach 0.987 (power) and 0.998 (quadratic); a loaded CPU
# calibration that planned 5x too high a throughput had 0.50. With that much unexplained time the
# curvature (p, c2) that decides how B shrinks with S is not measured, and a model linear in tokens
# (which makes the compute budget a token budget, like the equal-token rule) is the safer plan.
R2_MIN = 0.8
# A B-dependent term below this fraction of every measured step time is zero: the times do not grow with the work.
MIN_SLOPE_SHARE = 1e-6
# At most this many cross-validation folds (leave-one-out below it).
MAX_FOLDS = 10


@dataclass
class FitStats:
    """Quality of a fit. ``cv_rel_rmse``: root-mean-square relative error on held-out points
    (k-fold, ``k = min(n, 10)``; NaN when there are too few points or a fold's fit is degenerate);
    ``param_std``: one-sigma uncertainty of each parameter from the fit covariance (NaN when not
    estimable); ``warnings``: one-line messages on a poor fit (empty when the fit is good)."""

    n_points: int
    r2: float
    rmse_s: float
    cv_rel_rmse: float
    param_std: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)

    def to_json(self) -> dict:
        """A JSON-serialisable dict of the fields (non-finite floats as ``None``)."""
        return {
            "n_points": self.n_points,
            "r2": _json_float(self.r2),
            "rmse_s": _json_float(self.rmse_s),
            "cv_rel_rmse": _json_float(self.cv_rel_rmse),
            "param_std": {k: _json_float(v) for k, v in self.param_std.items()},
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_json(cls, d: dict) -> "FitStats":
        """Rebuild from :meth:`to_json` output (``None`` floats as NaN; ``warnings`` optional, for older files)."""
        return cls(
            n_points=int(d["n_points"]),
            r2=_float(d.get("r2")),
            rmse_s=_float(d.get("rmse_s")),
            cv_rel_rmse=_float(d.get("cv_rel_rmse")),
            param_std={k: _float(v) for k, v in d.get("param_std", {}).items()},
            warnings=[str(w) for w in d.get("warnings", [])],
        )


def _json_float(x):
    return None if x is None or not math.isfinite(x) else float(x)


def _float(x) -> float:
    return float("nan") if x is None else float(x)


class CostModel(ABC):
    """A step-time model affine in the batch size: ``t(B, S) = intercept(S) + B * per_sample(S)`` seconds."""

    kind: str
    fit: FitStats | None

    @abstractmethod
    def intercept(self, seq_lens) -> np.ndarray:
        """Per-step fixed time (seconds) at sequence lengths ``seq_lens`` (array [n])."""

    @abstractmethod
    def per_sample(self, seq_lens) -> np.ndarray:
        """Time (seconds) each sample of length S adds to a step (array [n])."""

    @abstractmethod
    def params(self) -> dict:
        """The model parameters by name (SI units: seconds, tokens)."""

    def predict(self, batch_sizes, seq_lens) -> np.ndarray:
        """Predicted step time in seconds.

        Args:
            batch_sizes: int or array [n], samples per batch B.
            seq_lens: int or array [n], tokens per sample S (broadcast against ``batch_sizes``).

        Returns:
            float64 array of the broadcast shape, seconds.
        """
        b = np.asarray(batch_sizes, dtype=np.float64)
        s = np.asarray(seq_lens, dtype=np.float64)
        return self.intercept(s) + b * self.per_sample(s)

    def predict_packs(self, seq_lens, pack_sizes) -> np.ndarray:
        """Predicted step time in seconds of packs of samples of different lengths:
        ``t = intercept + sum_i per_sample(S_i)`` over each pack's samples (the intercept of every
        family here does not depend on S).

        Args:
            seq_lens: int array [sum(pack_sizes)], tokens of every sample, pack after pack.
            pack_sizes: int array [m], samples in each pack (0 gives the intercept alone).

        Returns:
            float64 array [m], seconds.

        Raises:
            ValueError: ``pack_sizes`` negative or not summing to ``len(seq_lens)``.

        Example::

            >>> q = QuadraticCostModel(0.02, 1e-6, 1e-10)
            >>> [round(float(t), 9) for t in q.predict_packs([1000, 3000, 2000, 2000], [2, 2])]  # equal sum of S
            [0.025, 0.0248]
        """
        s = np.asarray(seq_lens, dtype=np.float64).reshape(-1)
        sizes = np.asarray(pack_sizes, dtype=np.int64).reshape(-1)
        if np.any(sizes < 0) or int(sizes.sum()) != s.size:
            raise ValueError(f"pack_sizes must be >= 0 and sum to the {s.size} sequence lengths, got sum "
                             f"{int(sizes.sum())} (smallest {int(sizes.min(initial=0))})")
        pack = np.repeat(np.arange(sizes.size), sizes)
        return self.intercept(np.zeros(sizes.size)) + np.bincount(pack, weights=self.per_sample(s), minlength=sizes.size)

    def max_batch_size(self, seq_lens, budget_s: float) -> np.ndarray:
        """Largest B with ``predict(B, S) <= budget_s`` (may be 0 when one sample exceeds the budget).

        Args:
            seq_lens: int array [n], tokens.
            budget_s: step-time budget in seconds; ``inf`` means no compute limit.

        Returns:
            int64 array [n] (values capped at 2**62 for an infinite budget).
        """
        s = np.asarray(seq_lens, dtype=np.float64)
        if math.isinf(budget_s):
            return np.full(s.shape, 2**62, dtype=np.int64)
        room = (budget_s - self.intercept(s)) / self.per_sample(s)
        return np.clip(np.floor(room), 0, 2**62).astype(np.int64)

    @property
    def r2(self) -> float:
        """R^2 of the fit on its own points (NaN for a model not fitted here)."""
        return self.fit.r2 if self.fit else float("nan")

    @property
    def warning(self) -> str | None:
        """The fit's warnings as one line (R^2, the bound hit, the model used), or ``None`` for a good fit."""
        return "; ".join(self.fit.warnings) if self.fit and self.fit.warnings else None

    def to_json(self) -> dict:
        """A JSON-serialisable dict: ``{"kind", <params>, "fit": {...} | None}``."""
        return {"kind": self.kind, **self.params(), "fit": self.fit.to_json() if self.fit else None}

    @staticmethod
    def from_json(data) -> "CostModel":
        """Rebuild a model from :meth:`to_json` output (a dict or a JSON string).

        Raises:
            ValueError: unknown ``kind`` or a missing parameter.
        """
        d = json.loads(data) if isinstance(data, str) else dict(data)
        kinds = {"power": PowerCostModel, "quadratic": QuadraticCostModel, "linear": LinearCostModel}
        cls = kinds.get(d.get("kind"))
        if cls is None:
            raise ValueError(f"cost model: unknown kind {d.get('kind')!r}, expected one of {sorted(kinds)}")
        names = cls._PARAMS
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"cost model ({d['kind']}): missing parameter(s) {missing}")
        fit = FitStats.from_json(d["fit"]) if d.get("fit") else None
        return cls(*(float(d[n]) for n in names), fit=fit)

    def describe(self) -> str:
        """One line: formula with fitted values and fit quality (the warning, if any, is :attr:`warning`)."""
        text = self._formula()
        if self.fit:
            parts = [f"R^2 {self.fit.r2:.3f}" if math.isfinite(self.fit.r2) else None,
                     f"held-out rel. RMSE {self.fit.cv_rel_rmse:.3f}" if math.isfinite(self.fit.cv_rel_rmse) else None,
                     f"n={self.fit.n_points}"]
            text += f"  ({', '.join(p for p in parts if p)})"
        return text

    @abstractmethod
    def _formula(self) -> str: ...


class PowerCostModel(CostModel):
    """``t = a + b * B * S^p`` seconds (a >= 0, b > 0). ``.p_std``: one-sigma uncertainty of p."""

    kind = "power"
    _PARAMS = ("a", "b", "p")

    def __init__(self, a: float, b: float, p: float, *, fit: FitStats | None = None):
        if not (a >= 0 and b > 0 and p > 0):
            raise ValueError(f"power cost model needs a >= 0, b > 0, p > 0; got a={a}, b={b}, p={p}")
        self.a, self.b, self.p, self.fit = float(a), float(b), float(p), fit

    def intercept(self, seq_lens):
        return np.full(np.shape(seq_lens), self.a)

    def per_sample(self, seq_lens):
        return self.b * np.power(np.asarray(seq_lens, dtype=np.float64), self.p)

    def params(self):
        return {"a": self.a, "b": self.b, "p": self.p}

    @property
    def p_std(self) -> float:
        """One-sigma uncertainty of p from the fit (NaN when not estimated)."""
        return self.fit.param_std.get("p", float("nan")) if self.fit else float("nan")

    def m_comp(self, budget_s: float) -> float:
        """The paper's compute budget ``M_comp = (C - a) / b`` (units of ``S^p``) for a step budget C seconds."""
        return (budget_s - self.a) / self.b

    def _formula(self):
        p_std = f" +- {self.p_std:.3f}" if math.isfinite(self.p_std) else ""
        return f"t = {self.a * 1e3:.3g} ms + {self.b * 1e3:.4g} ms * B * S^({self.p:.3f}{p_std})"


class QuadraticCostModel(CostModel):
    """``t = c0 + c1*B*S + c2*B*S^2`` seconds (all coefficients >= 0)."""

    kind = "quadratic"
    _PARAMS = ("c0", "c1", "c2")

    def __init__(self, c0: float, c1: float, c2: float, *, fit: FitStats | None = None):
        if min(c0, c1, c2) < 0 or c1 + c2 <= 0:
            raise ValueError(f"quadratic cost model needs c0, c1, c2 >= 0 and c1 + c2 > 0; got {c0}, {c1}, {c2}")
        self.c0, self.c1, self.c2, self.fit = float(c0), float(c1), float(c2), fit

    def intercept(self, seq_lens):
        return np.full(np.shape(seq_lens), self.c0)

    def per_sample(self, seq_lens):
        s = np.asarray(seq_lens, dtype=np.float64)
        return self.c1 * s + self.c2 * s * s

    def params(self):
        return {"c0": self.c0, "c1": self.c1, "c2": self.c2}

    def _formula(self):
        return f"t = {self.c0 * 1e3:.4g} ms + {self.c1 * 1e3:.4g} ms * B*S + {self.c2 * 1e3:.4g} ms * B*S^2"


class LinearCostModel(CostModel):
    """``t = c0 + c1*B*S`` seconds (c0 >= 0, c1 > 0): step time linear in the tokens of the batch."""

    kind = "linear"
    _PARAMS = ("c0", "c1")

    def __init__(self, c0: float, c1: float, *, fit: FitStats | None = None):
        if not (c0 >= 0 and c1 > 0):
            raise ValueError(f"linear cost model needs c0 >= 0 and c1 > 0; got c0={c0}, c1={c1}")
        self.c0, self.c1, self.fit = float(c0), float(c1), fit

    def intercept(self, seq_lens):
        return np.full(np.shape(seq_lens), self.c0)

    def per_sample(self, seq_lens):
        return self.c1 * np.asarray(seq_lens, dtype=np.float64)

    def params(self):
        return {"c0": self.c0, "c1": self.c1}

    def _formula(self):
        return f"t = {self.c0 * 1e3:.4g} ms + {self.c1 * 1e3:.4g} ms * B*S"


# ----------------------------------------------------------------------------------------- fitting


@dataclass(frozen=True)
class _Work:
    """Measured steps as the samples they trained: step k ran ``mult[i]`` samples of ``s[i]`` tokens
    for every i with ``point[i] == k`` (a batch of B samples of length S is one entry, a pack one
    entry per sample), so every family's B-dependent term is a per-step sum (:meth:`total`)."""

    s: np.ndarray  # float64 [m], tokens
    mult: np.ndarray  # float64 [m], samples
    point: np.ndarray  # int64 [m], measured step of each entry
    n: int  # measured steps

    @classmethod
    def of_batches(cls, b, s) -> "_Work":
        return cls(s, b, np.arange(s.size), int(s.size))

    @classmethod
    def of_packs(cls, s, sizes) -> "_Work":
        return cls(s, np.ones_like(s), np.repeat(np.arange(sizes.size), sizes), int(sizes.size))

    def total(self, per_sample) -> np.ndarray:
        """float64 [n]: sum over each step's samples of ``per_sample`` (float64 [m], one value per entry)."""
        return np.bincount(self.point, weights=self.mult * per_sample, minlength=self.n)

    def subset(self, keep) -> "_Work":
        """The steps where ``keep`` (bool [n]) is True."""
        entries = keep[self.point]
        renumber = np.cumsum(keep) - 1
        return _Work(self.s[entries], self.mult[entries], renumber[self.point[entries]], int(np.sum(keep)))


def _positive(name: str, v: np.ndarray) -> None:
    bad = np.flatnonzero(~(np.isfinite(v) & (v > 0)))
    if bad.size:
        raise ValueError(f"{name}[{int(bad[0])}] = {float(v[bad[0]])}: must be a positive finite number")


def _validate_points(batch_sizes, seq_lens, step_times) -> tuple[_Work, np.ndarray]:
    b = np.asarray(batch_sizes, dtype=np.float64).reshape(-1)
    s = np.asarray(seq_lens, dtype=np.float64).reshape(-1)
    t = np.asarray(step_times, dtype=np.float64).reshape(-1)
    if not (b.size == s.size == t.size):
        raise ValueError(f"batch_sizes, seq_lens, step_times must have equal lengths, got {b.size}, {s.size}, {t.size}")
    for name, v in (("batch_sizes", b), ("seq_lens", s), ("step_times", t)):
        _positive(name, v)
    return _Work.of_batches(b, s), t


def _validate_packs(packs, step_times) -> tuple[_Work, np.ndarray]:
    lists = [np.asarray(p, dtype=np.float64).reshape(-1) for p in packs]
    t = np.asarray(step_times, dtype=np.float64).reshape(-1)
    if len(lists) != t.size:
        raise ValueError(f"packs and step_times must have equal lengths, got {len(lists)}, {t.size}")
    for k, pack in enumerate(lists):
        if pack.size == 0:
            raise ValueError(f"packs[{k}] is empty: a measured pack holds at least one sample")
        _positive(f"packs[{k}]", pack)
    _positive("step_times", t)
    sizes = np.array([p.size for p in lists], dtype=np.int64)
    return _Work.of_packs(np.concatenate(lists) if lists else np.zeros(0), sizes), t


class _Degenerate(ValueError):
    """A fit whose B-dependent term is zero: the step times do not grow with the work."""


def _grows(term, t) -> bool:
    """Whether the B-dependent part ``term`` of a fit (array [n], seconds) reaches MIN_SLOPE_SHARE of
    some measured time ``t`` (array [n], seconds)."""
    return bool(np.max(term / t) >= MIN_SLOPE_SHARE)


def _fit_power(work: _Work, t):
    """Weighted (relative-residual) least squares of ``t = a + beta * sum (S/s0)^p`` (the sum over a
    step's samples: ``B * (S/s0)^p`` for a batch).

    A grid over p with non-negative least squares for (a, beta) finds the basin, then
    ``scipy.optimize.curve_fit`` (bounds a >= 0, beta > 0, p in P_BOUNDS) refines and gives the covariance.

    Raises:
        _Degenerate: ``b = 0`` (the times do not grow with ``B*S^p``).
    """
    s0 = float(np.exp(np.mean(np.log(work.s))))  # scale S to ~1 so the parameters are well conditioned
    x = work.s / s0
    best = None
    for p in np.linspace(*P_BOUNDS, 251):
        design = np.column_stack([np.ones_like(t), work.total(x**p)]) / t[:, None]
        coef, residual = nnls(design, np.ones_like(t))
        if best is None or residual < best[0]:
            best = (residual, coef[0], coef[1], p)
    _, a0, beta0, p0 = best
    params, std = np.array([a0, beta0, p0]), np.full(3, np.nan)

    def model(_, a, beta, p):
        return a + beta * work.total(x**p)

    scale = float(np.mean(t))
    start = [max(a0, 1e-6 * scale), max(beta0, 1e-6 * scale), float(np.clip(p0, P_BOUNDS[0] + 1e-6, P_BOUNDS[1] - 1e-6))]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            popt, pcov = curve_fit(
                model, np.arange(t.size), t, p0=start, sigma=t,
                bounds=([0.0, 1e-12 * scale, P_BOUNDS[0]], [np.inf, np.inf, P_BOUNDS[1]]),
            )
        if np.sum(((model(None, *popt) - t) / t) ** 2) <= best[0] ** 2 * (1 + 1e-9):
            params = popt
            if t.size > 3:
                std = np.sqrt(np.clip(np.diag(pcov), 0, None))
    except (RuntimeError, ValueError):  # curve_fit did not converge: keep the grid optimum
        pass
    a, beta, p = (float(v) for v in params)
    b_coef = beta / s0**p
    if not _grows(b_coef * work.total(work.s**p), t):
        raise _Degenerate("b = 0, the step times do not grow with B*S^p")
    p_std = float(std[2])
    b_std = float(std[1] / s0**p) if math.isfinite(std[1]) else float("nan")
    return PowerCostModel(a, b_coef, p), {"a": float(std[0]), "b": b_std, "p": p_std}


def _nnls_relative(columns, t):
    """Non-negative least squares of ``t = columns @ c`` on relative residuals ``(pred - t) / t``.

    Args:
        columns: float64 [n, k], positive design columns; t: float64 [n], seconds.

    Returns:
        ``(c, std)``: float64 [k] coefficients (>= 0) and their one-sigma uncertainty (NaN when not estimable).
    """
    col_scale = columns.max(axis=0)
    design = columns / col_scale / t[:, None]
    coef, _ = nnls(design, np.ones_like(t))
    std = np.full(coef.size, np.nan)
    dof = t.size - coef.size
    if dof > 0:
        resid = design @ coef - 1.0
        try:
            cov = np.linalg.inv(design.T @ design) * float(resid @ resid) / dof
            std = np.sqrt(np.clip(np.diag(cov), 0, None)) / col_scale
        except np.linalg.LinAlgError:
            pass
    return coef / col_scale, std


def _fit_quadratic(work: _Work, t):
    """Non-negative least squares on relative residuals of ``t = c0 + c1*sum S + c2*sum S^2`` (the sums
    over a step's samples: ``B*S`` and ``B*S^2`` for a batch).

    Raises:
        _Degenerate: ``c1 + c2 = 0`` (the times do not grow with ``B*S``).
    """
    tokens, squares = work.total(work.s), work.total(work.s**2)
    c, std = _nnls_relative(np.column_stack([np.ones_like(t), tokens, squares]), t)
    if not _grows(c[1] * tokens + c[2] * squares, t):
        raise _Degenerate("c1 + c2 = 0, the step times do not grow with B*S")
    return QuadraticCostModel(*c), dict(zip(("c0", "c1", "c2"), (float(v) for v in std)))


def _fit_linear(work: _Work, t):
    """Non-negative least squares on relative residuals of ``t = c0 + c1*sum S``. When the times do not
    grow with the tokens (``c1 = 0``): the proportional ``t = c1*sum S`` (``c0 = 0``,
    ``c1 = sum(x/t) / sum((x/t)^2)`` with ``x = sum S``, always > 0) -- time per token, the equal-token rule's assumption."""
    x = work.total(work.s)
    c, std = _nnls_relative(np.column_stack([np.ones_like(t), x]), t)
    if not _grows(c[1] * x, t):
        (c1,), (c1_std,) = _nnls_relative(x[:, None], t)
        c, std = (0.0, c1), (float("nan"), c1_std)
    return LinearCostModel(*c), dict(zip(("c0", "c1"), (float(v) for v in std)))


_FITTERS = {"power": (_fit_power, 3), "quadratic": (_fit_quadratic, 3), "linear": (_fit_linear, 2)}
FIT_KINDS = tuple(_FITTERS)  # the kinds fit_cost_model takes besides "auto"
_RECALIBRATE = ("the times were probably measured under load, or the shapes were too few or too small to time: "
                "recalibrate on an idle machine with more bucket shapes, or give a calibration")


def _predict(model: CostModel, work: _Work) -> np.ndarray:
    """Predicted time (float64 [n], seconds) of each measured step of ``work``."""
    return model.intercept(np.zeros(work.n)) + work.total(model.per_sample(work.s))


def _cross_validated_rel_rmse(fitter, n_params, work: _Work, t) -> float:
    n = t.size
    k = min(n, MAX_FOLDS)
    if n - math.ceil(n / k) < n_params + 1:
        return float("nan")
    errors = np.empty(n)
    folds = np.arange(n) % k
    for fold in range(k):
        test = folds == fold
        try:
            model, _ = fitter(work.subset(~test), t[~test])
        except _Degenerate:  # the fit without this fold has no slope: no held-out error
            return float("nan")
        errors[test] = (_predict(model, work.subset(test)) - t[test]) / t[test]
    return float(np.sqrt(np.mean(errors**2)))


def _fitted(kind: str, work: _Work, t) -> CostModel:
    """The ``kind`` fit with its :class:`FitStats` (no warnings). Raises _Degenerate as the fitter."""
    fitter, n_params = _FITTERS[kind]
    model, param_std = fitter(work, t)
    pred = _predict(model, work)
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((pred - t) ** 2)) / ss_tot if ss_tot > 0 else float("nan")
    rmse = float(np.sqrt(np.mean((pred - t) ** 2)))
    model.fit = FitStats(int(t.size), r2, rmse, _cross_validated_rel_rmse(fitter, n_params, work, t), param_std)
    return model


def _bound_hit(model: CostModel) -> str | None:
    """``"p = 3.000 at its upper bound 3.0"`` when a power fit's p is pinned at a bound of P_BOUNDS, else None."""
    if isinstance(model, PowerCostModel):
        for bound, side in zip(P_BOUNDS, ("lower", "upper")):
            if abs(model.p - bound) <= P_BOUND_TOL:
                return f"p = {model.p:.3f} at its {side} bound {bound}"
    return None


def fit_cost_model(batch_sizes, seq_lens, step_times, kind: str = "auto") -> CostModel:
    """Fit a step-time model to measured training steps.

    Args:
        batch_sizes: array [n], samples per batch B of each measured step.
        seq_lens: array [n], tokens per sample S.
        step_times: array [n], measured step time in seconds (median of repeats).
        kind: ``"power"`` (``t = a + b*B*S^p``, curve_fit with bounds a >= 0, b > 0,
            p in [0.5, 3]), ``"quadratic"`` (``t = c0 + c1*B*S + c2*B*S^2``, non-negative least
            squares), ``"linear"`` (``t = c0 + c1*B*S``, non-negative least squares; ``t = c1*B*S``
            when the times do not grow with ``B*S``), or ``"auto"``: fit power and quadratic and keep
            the lower held-out error (ties and too few points for cross-validation: the higher R^2)
            among the good fits; when neither is good -- ``b = 0`` / ``c1 + c2 = 0``, p within
            :data:`P_BOUND_TOL` of a bound of :data:`P_BOUNDS`, or R^2 below :data:`R2_MIN` -- the
            linear model, with one warning line in ``.fit.warnings`` naming each family's R^2 and
            bound hit and the model used. ``"auto"`` never raises on 3 or more finite positive points.

    Returns:
        A :class:`PowerCostModel`, :class:`QuadraticCostModel` or :class:`LinearCostModel` whose
        ``.fit`` holds R^2, RMSE, held-out relative RMSE, parameter uncertainties (``.p_std`` for the
        power model) and ``warnings`` (also a named kind with R^2 below :data:`R2_MIN`); its
        predictions are finite and >= 0 for every B, S >= 1.

    Raises:
        ValueError: unequal lengths, a non-positive or non-finite value (named by array and index),
            fewer than 3 points, an unknown ``kind``; for ``kind="power"`` / ``"quadratic"`` also a
            fit with ``b = 0`` / ``c1 + c2 = 0`` or p pinned at a bound (the message names it).

    .. note::
        Residuals are relative (``(pred - t) / t``): timing noise is roughly proportional to step
        time, and plain least squares would fit the long steps and ignore the short ones.

    Example::

        >>> b, s = [1, 2, 4, 1, 2, 4], [1000, 1000, 1000, 4000, 4000, 4000]
        >>> m = fit_cost_model(b, s, [0.02 + 3e-6 * x * y for x, y in zip(b, s)], kind="linear")
        >>> round(m.c0, 9), round(m.c1 * 1e6, 9), m.warning
        (0.02, 3.0, None)
        >>> flat = fit_cost_model(b, s, [0.05] * 6)  # times that do not grow with B*S (a loaded machine)
        >>> flat.kind, len(flat.fit.warnings)
        ('linear', 1)
    """
    _check_kind(kind)
    return _fit(*_validate_points(batch_sizes, seq_lens, step_times), kind)


def fit_packed_cost_model(packs, step_times, kind: str = "auto") -> CostModel:
    """Fit a step-time model to measured packs of samples of different lengths.

    The families and the choice among them are those of :func:`fit_cost_model`, with each step's
    work summed over its samples (:meth:`CostModel.predict_packs`): ``t = c0 + c1*sum S_i +
    c2*sum S_i^2`` (quadratic), ``t = a + b*sum S_i^p`` (power), ``t = c0 + c1*sum S_i`` (linear);
    ``kind="auto"`` keeps the good fit with the lower held-out error, else the linear model with a warning.

    Args:
        packs: sequence of int arrays [n_k], the sequence length (tokens) of every sample of each
            measured pack.
        step_times: array [len(packs)], measured step time of each pack in seconds.
        kind: ``"auto"``, ``"power"``, ``"quadratic"`` or ``"linear"``.

    Returns:
        A :class:`PowerCostModel`, :class:`QuadraticCostModel` or :class:`LinearCostModel` (``.fit``
        as in :func:`fit_cost_model`, over the packs).

    Raises:
        ValueError: unequal lengths, an empty pack, a non-positive or non-finite length or time (named
            by pack and position), fewer than 3 packs, an unknown ``kind``; for a named family, a
            degenerate fit or p pinned at a bound.

    Example::

        >>> packs = [[1560] * 8, [32760], [32760, 1560, 1560], [75600], [75600, 14040], [14040] * 4]
        >>> times = [0.02 + 7e-6 * sum(p) + 4e-10 * sum(x * x for x in p) for p in packs]
        >>> m = fit_packed_cost_model(packs, times, kind="quadratic")
        >>> round(m.c0, 6), round(m.c1 * 1e6, 6), round(m.c2 * 1e10, 6)
        (0.02, 7.0, 4.0)
    """
    _check_kind(kind)
    return _fit(*_validate_packs(packs, step_times), kind)


def _check_kind(kind: str) -> None:
    if kind not in ("auto", *FIT_KINDS):
        raise ValueError(f"kind must be one of 'auto', {', '.join(map(repr, FIT_KINDS))}; got {kind!r}")


def _fit(work: _Work, t, kind: str) -> CostModel:
    """:func:`fit_cost_model` on validated steps."""
    if t.size < 3:
        raise ValueError(f"need at least 3 measured points to fit a cost model, got {t.size}")
    if kind != "auto":
        try:
            model = _fitted(kind, work, t)
        except _Degenerate as err:
            raise ValueError(f"{kind} cost fit: {err}; kind='auto' falls back to a linear model") from None
        bound = _bound_hit(model)
        if bound:
            raise ValueError(f"{kind} cost fit: {bound} (R^2 {model.r2:.2f}); kind='auto' falls back to a linear model")
        if model.r2 < R2_MIN:  # NaN (all times equal) compares False
            model.fit.warnings = [f"poor step-time fit: R^2 {model.r2:.2f} < {R2_MIN} for the {kind} model "
                                  f"{model._formula()}; {_RECALIBRATE}"]
        return model
    good, notes = [], []
    for name in ("power", "quadratic"):
        try:
            model = _fitted(name, work, t)
        except _Degenerate as err:
            notes.append(f"{name}: {err}")
            continue
        bound, low = _bound_hit(model), model.r2 < R2_MIN
        if bound is None and not low:
            good.append(model)
        else:
            notes.append(f"{name}: R^2 {model.r2:.2f}{f' < {R2_MIN}' if low else ''}{f', {bound}' if bound else ''}")
    if good:
        def score(m: CostModel):
            cv = m.fit.cv_rel_rmse
            return (0, cv) if math.isfinite(cv) else (1, -m.fit.r2 if math.isfinite(m.fit.r2) else 0.0)

        return min(good, key=score)
    model = _fitted("linear", work, t)
    model.fit.warnings = [f"poor step-time fit ({'; '.join(notes)}): using the linear model {model._formula()} "
                          f"(R^2 {model.r2:.2f}); {_RECALIBRATE}"]
    return model
