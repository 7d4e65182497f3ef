"""Peak-memory model ``peak = m0 + m1*B*S (+ m2*B*S^2)`` bytes, and the token budget M_mem it implies."""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import nnls

# The B*S^2 term (attention scores materialised, e.g. without flash attention) is kept only when it
# lowers the held-out relative error by at least this factor: a linear model extrapolates safely.
QUADRATIC_GAIN_REQUIRED = 0.8


class MemoryModel:
    """Peak training memory in bytes: ``m0 + m1*B*S + m2*B*S^2``.

    ``m0``: weights, gradients, optimizer state and workspace (bytes); ``m1``: activation bytes per
    token; ``m2``: bytes per token^2 per sample (0 unless the measurements demand it).
    """

    def __init__(self, m0: float, m1: float, m2: float = 0.0, *, n_points: int = 0, r2: float = float("nan")):
        if not (m0 >= 0 and m1 > 0 and m2 >= 0):
            raise ValueError(f"memory model needs m0 >= 0, m1 > 0, m2 >= 0; got m0={m0}, m1={m1}, m2={m2}")
        self.m0, self.m1, self.m2 = float(m0), float(m1), float(m2)
        self.n_points, self.r2 = int(n_points), float(r2)

    def predict(self, batch_sizes, seq_lens) -> np.ndarray:
        """Predicted peak bytes for batches of ``batch_sizes`` samples of ``seq_lens`` tokens (arrays, broadcast)."""
        tokens = np.asarray(batch_sizes, dtype=np.float64) * np.asarray(seq_lens, dtype=np.float64)
        return self.m0 + self.m1 * tokens + self.m2 * tokens * np.asarray(seq_lens, dtype=np.float64)

    def max_tokens(self, budget_bytes: float, safety: float = 0.9, seq_len: int | None = None) -> int:
        """Largest tokens per batch M_mem with predicted peak ``<= safety * budget_bytes``.

        Args:
            budget_bytes: device memory available to training, bytes.
            safety: fraction of the budget to plan for (fragmentation, allocator caching).
            seq_len: tokens per sample; needed only when the model has an ``m2`` term (then the bound
                depends on S; pass the longest sequence for one bound valid for all buckets).

        Returns:
            M_mem in tokens (int).

        Raises:
            ValueError: ``safety`` outside (0, 1], the fixed part ``m0`` already exceeds the budget, or
                ``seq_len`` missing while ``m2 > 0``.
        """
        if not 0 < safety <= 1:
            raise ValueError(f"safety must be in (0, 1], got {safety}")
        usable = safety * float(budget_bytes) - self.m0
        if usable <= 0:
            raise ValueError(
                f"memory budget {budget_bytes / 2**30:.2f} GiB x safety {safety} leaves nothing for activations: "
                f"the fixed part m0 is {self.m0 / 2**30:.2f} GiB"
            )
        per_token = self.m1
        if self.m2 > 0:
            if seq_len is None:
                raise ValueError("the memory model has a B*S^2 term: pass seq_len (the longest sequence gives one safe bound)")
            per_token += self.m2 * float(seq_len)
        return int(math.floor(usable / per_token))

    def to_json(self) -> dict:
        """A JSON-serialisable dict: ``m0``, ``m1``, ``m2`` (bytes), ``n_points``, ``r2`` (``None`` when NaN)."""
        return {"m0": self.m0, "m1": self.m1, "m2": self.m2, "n_points": self.n_points,
                "r2": None if not math.isfinite(self.r2) else self.r2}

    @classmethod
    def from_json(cls, d: dict) -> "MemoryModel":
        """Rebuild from :meth:`to_json` output. Raises ValueError: ``m0`` or ``m1`` missing, or invalid values."""
        missing = [k for k in ("m0", "m1") if k not in d]
        if missing:
            raise ValueError(f"memory model: missing field(s) {missing}")
        r2 = d.get("r2")
        return cls(float(d["m0"]), float(d["m1"]), float(d.get("m2", 0.0)), n_points=int(d.get("n_points", 0)),
                   r2=float("nan") if r2 is None else float(r2))

    def describe(self) -> str:
        """One line: the formula in GiB / MiB per token, and R^2 when fitted."""
        text = f"peak = {self.m0 / 2**30:.2f} GiB + {self.m1 / 2**20:.3f} MiB * B*S"
        if self.m2 > 0:
            text += f" + {self.m2:.3g} B * B*S^2"
        return text + (f"  (R^2 {self.r2:.3f}, n={self.n_points})" if math.isfinite(self.r2) else "")

    @classmethod
    def fit(cls, batch_sizes, seq_lens, peak_bytes) -> "MemoryModel":
        """Fit by non-negative least squares on relative residuals.

        Args:
            batch_sizes, seq_lens: arrays [n] of the measured points.
            peak_bytes: array [n], measured peak allocated bytes.

        Returns:
            A :class:`MemoryModel`; the ``m2`` term is kept only with >= 5 points and a held-out error
            at least 20% lower than the linear model's.

        Raises:
            ValueError: fewer than 2 points, or a non-positive value.

        Example::

            >>> m = MemoryModel.fit([1, 2, 4], [1000, 1000, 1000], [5e9 + 1e6 * t for t in (1000, 2000, 4000)])
            >>> round(m.m0 / 1e9, 6), round(m.m1 / 1e6, 6), m.m2
            (5.0, 1.0, 0.0)
        """
        b = np.asarray(batch_sizes, dtype=np.float64).reshape(-1)
        s = np.asarray(seq_lens, dtype=np.float64).reshape(-1)
        y = np.asarray(peak_bytes, dtype=np.float64).reshape(-1)
        if not b.size == s.size == y.size:
            raise ValueError(f"batch_sizes, seq_lens, peak_bytes must have equal lengths, got {b.size}, {s.size}, {y.size}")
        if y.size < 2:
            raise ValueError(f"need at least 2 points with measured peak memory to fit a memory model, got {y.size}")
        for name, v in (("batch_sizes", b), ("seq_lens", s), ("peak_bytes", y)):
            bad = np.flatnonzero(~(np.isfinite(v) & (v > 0)))
            if bad.size:
                raise ValueError(f"{name}[{int(bad[0])}] = {v[bad[0]]!r}: must be a positive finite number")
        columns = np.column_stack([np.ones_like(y), b * s, b * s * s])

        def solve(cols, idx):
            scale = cols.max(axis=0)
            coef, _ = nnls(cols[idx] / scale / y[idx, None], np.ones(int(np.sum(idx))))
            return coef / scale

        def held_out(n_cols):
            errors = []
            for i in range(y.size):
                keep = np.arange(y.size) != i
                coef = solve(columns[:, :n_cols], keep)
                errors.append((columns[i, :n_cols] @ coef - y[i]) / y[i])
            return float(np.sqrt(np.mean(np.square(errors))))

        n_cols = 2
        if y.size >= 5 and held_out(3) < QUADRATIC_GAIN_REQUIRED * held_out(2):
            n_cols = 3
        coef = np.zeros(3)
        coef[:n_cols] = solve(columns[:, :n_cols], np.ones(y.size, dtype=bool))
        if coef[1] <= 0:  # peak independent of B*S in the data: cannot extrapolate a budget
            raise ValueError("measured peak memory does not grow with B*S: cannot fit a memory model")
        pred = columns @ coef
        ss_tot = float(np.sum((y - y.mean()) ** 2))
        r2 = 1 - float(np.sum((pred - y) ** 2)) / ss_tot if ss_tot > 0 else float("nan")
        return cls(*coef, n_points=int(y.size), r2=r2)
