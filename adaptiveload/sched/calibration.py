"""A calibration: measured (B, S) training-step points plus the step-time and memory models fitted to them.

``adaptiveload calibrate`` (in :mod:`adaptiveload.train.calibrate`) measures the points and calls
:meth:`Calibration.from_points`; ``adaptiveload plan`` / ``simulate`` read the saved JSON.

A point is a dict::

    {"batch_size": int, "seq_len": int, "latent_shape": [T, H, W],
     "status": "ok" | "oom" | "error", "step_time_s": float | None, "peak_memory_bytes": int | None}

Only ``"ok"`` points with a step time enter the cost fit, and only those with a peak memory enter the
memory fit; ``"oom"`` points mark the memory limit (:attr:`Calibration.smallest_oom_tokens`).
"""
from __future__ import annotations

import datetime
import logging
import math
import numbers
import os
from dataclasses import dataclass, field

import numpy as np

from adaptiveload.jsonfile import check_header, read_json, write_json_atomic
from adaptiveload.sched.cost_model import CostModel, fit_cost_model
from adaptiveload.sched.memory_model import MemoryModel

logger = logging.getLogger("adaptiveload.sched")

FORMAT = "adaptiveload.calibration"
FORMAT_VERSION = 1
STATUSES = ("ok", "oom", "error")


def _check_point(i: int, point) -> dict:
    if not isinstance(point, dict):
        raise ValueError(f"calibration point {i}: expected a dict, got {type(point).__name__}")
    for key in ("batch_size", "seq_len", "status"):
        if key not in point:
            raise ValueError(f"calibration point {i}: missing field '{key}'")
    if point["status"] not in STATUSES:
        raise ValueError(f"calibration point {i}: status {point['status']!r} is not one of {STATUSES}")
    for key in ("batch_size", "seq_len"):
        v = point[key]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"calibration point {i}: field '{key}' = {v!r} must be a positive integer")
    if point["status"] == "ok":
        t = point.get("step_time_s")
        if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t > 0)):
            raise ValueError(f"calibration point {i}: field 'step_time_s' = {t!r} must be a positive number or None")
    mem = point.get("peak_memory_bytes")
    if mem is not None and (isinstance(mem, bool) or not isinstance(mem, numbers.Real) or not mem > 0):
        raise ValueError(f"calibration point {i}: field 'peak_memory_bytes' = {mem!r} must be a positive number or None")
    return {"latent_shape": None, "step_time_s": None, "peak_memory_bytes": None, **point}


@dataclass
class Calibration:
    """Measured points and the models fitted to them.

    Attributes:
        points: list of point dicts (see the module docstring), in measurement order.
        cost_model: step time in seconds, :class:`~adaptiveload.sched.cost_model.CostModel`.
        memory_model: peak bytes, :class:`~adaptiveload.sched.memory_model.MemoryModel`, or ``None``
            when no peak memory was measured (CPU).
        settings: how the points were measured (model, dtype, compile, checkpointing, world size ...);
            :func:`adaptiveload.sched.plan.make_plan` reads ``settings["device_memory_bytes"]`` when
            present as the default memory budget.
        device: device name, e.g. ``"NVIDIA H200"`` or ``"cpu"``.
        torch_version: ``torch.__version__`` at measurement time.
        date: ISO-8601 timestamp (UTC).
    """

    points: list
    cost_model: CostModel
    memory_model: MemoryModel | None = None
    settings: dict = field(default_factory=dict)
    device: str = ""
    torch_version: str = ""
    date: str = ""

    @classmethod
    def from_points(cls, points, *, settings: dict, device: str, kind: str = "auto") -> "Calibration":
        """Validate points and fit the cost model (``kind``: see :func:`fit_cost_model`) and the memory model.

        With ``kind="auto"`` noisy step times (measured under load) do not raise: the cost model falls
        back to the linear one and ``cost_model.warning`` says why in one line (also in :meth:`describe`).

        Raises:
            ValueError: a malformed point (named by index), too few ``"ok"`` points for the fit, or
                (``kind="power"`` / ``"quadratic"`` only) a fit with a zero slope or p at a bound.

        Example::

            >>> pts = [{"batch_size": b, "seq_len": s, "status": "ok", "step_time_s": 0.01 + 1e-6 * b * s}
            ...        for b in (1, 2, 4) for s in (256, 1024)]
            >>> cal = Calibration.from_points(pts, settings={}, device="cpu")
            >>> round(float(cal.cost_model.predict(2, 1000)), 9), cal.cost_model.warning, cal.memory_model
            (0.012, None, None)
        """
        import torch

        pts = [_check_point(i, p) for i, p in enumerate(points)]
        timed = [p for p in pts if p["status"] == "ok" and p["step_time_s"] is not None]
        if len(timed) < 3:
            raise ValueError(
                f"calibration: {len(timed)} point(s) ran with a step time (status 'ok'); at least 3 are needed "
                f"to fit a cost model ({sum(p['status'] == 'oom' for p in pts)} out of memory, "
                f"{sum(p['status'] == 'error' for p in pts)} failed)"
            )
        cost = fit_cost_model([p["batch_size"] for p in timed], [p["seq_len"] for p in timed],
                              [p["step_time_s"] for p in timed], kind=kind)
        with_mem = [p for p in pts if p["status"] == "ok" and p["peak_memory_bytes"] is not None]
        memory = None
        if len(with_mem) >= 2:
            memory = MemoryModel.fit([p["batch_size"] for p in with_mem], [p["seq_len"] for p in with_mem],
                                     [p["peak_memory_bytes"] for p in with_mem])
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(pts, cost, memory, dict(settings), str(device), torch.__version__, now)

    # ------------------------------------------------------------------------------ derived limits

    @property
    def largest_ok_tokens(self) -> int | None:
        """Largest ``B*S`` that ran (status ``"ok"``): a batch size known to fit, or ``None``."""
        ok = [p["batch_size"] * p["seq_len"] for p in self.points if p["status"] == "ok"]
        return max(ok) if ok else None

    @property
    def smallest_oom_tokens(self) -> int | None:
        """Smallest ``B*S`` that ran out of memory, or ``None``."""
        oom = [p["batch_size"] * p["seq_len"] for p in self.points if p["status"] == "oom"]
        return min(oom) if oom else None

    # ----------------------------------------------------------------------------------- save/load

    def to_json(self) -> dict:
        """The calibration file's content: header, device, settings, both models and the points."""
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "date": self.date,
            "device": self.device,
            "torch_version": self.torch_version,
            "settings": self.settings,
            "cost_model": self.cost_model.to_json(),
            "memory_model": self.memory_model.to_json() if self.memory_model else None,
            "points": [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in p.items()} for p in self.points],
        }

    def save(self, path) -> None:
        """Write the calibration as JSON to ``path``."""
        write_json_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, d: dict, *, where: str = "calibration") -> "Calibration":
        """Rebuild from :meth:`to_json` output; ``where`` (a path) starts every error message.

        Raises:
            ValueError: not a calibration, an unsupported version, or a bad field or point.
        """
        check_header(d, fmt=FORMAT, version=FORMAT_VERSION, what="calibration", where=where,
                     required=("cost_model", "points"))
        try:
            points = [_check_point(i, p) for i, p in enumerate(d["points"])]
            cost = CostModel.from_json(d["cost_model"])
            memory = MemoryModel.from_json(d["memory_model"]) if d.get("memory_model") else None
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        return cls(points, cost, memory, dict(d.get("settings") or {}), str(d.get("device", "")),
                   str(d.get("torch_version", "")), str(d.get("date", "")))

    @classmethod
    def load(cls, path) -> "Calibration":
        """Read a calibration JSON written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not valid JSON, not a calibration, an unsupported version, or a bad field
                (the message starts with the path).
        """
        path = os.fspath(path)
        return cls.from_json(read_json(path, "calibration"), where=path)

    # ---------------------------------------------------------------------------------------- plot

    def plot(self, path) -> str | None:
        """Save a PNG of measured vs predicted step time (left) and time vs S per batch size (right).

        Returns:
            ``path`` when written; ``None`` (and a log message) when matplotlib is not installed.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError:
            logger.info("matplotlib is not installed: no calibration plot (pip install adaptiveload[plot])")
            return None
        timed = [p for p in self.points if p["status"] == "ok" and p["step_time_s"] is not None]
        b = np.array([p["batch_size"] for p in timed], dtype=np.float64)
        s = np.array([p["seq_len"] for p in timed], dtype=np.float64)
        t = np.array([p["step_time_s"] for p in timed]) * 1e3
        pred = self.cost_model.predict(b, s) * 1e3
        fig = Figure(figsize=(11, 4.5))
        ax1, ax2 = fig.subplots(1, 2)
        ax1.scatter(t, pred, s=18)
        lim = [0, max(t.max(), pred.max()) * 1.05] if t.size else [0, 1]
        ax1.plot(lim, lim, color="grey", lw=1, ls="--")
        ax1.set(xlabel="measured step time (ms)", ylabel="predicted (ms)")
        ax1.set_title(self.cost_model.describe(), fontsize=7)
        for batch in np.unique(b):
            sel = b == batch
            order = np.argsort(s[sel])
            line = ax2.plot(s[sel][order], t[sel][order], "o", label=f"B={int(batch)}")[0]
            grid = np.linspace(s[sel].min(), s[sel].max(), 100)  # the model over this B's measured S range
            ax2.plot(grid, self.cost_model.predict(batch, grid) * 1e3, color=line.get_color(), lw=1)
        oom = [p for p in self.points if p["status"] == "oom"]
        if oom:
            ax2.plot([p["seq_len"] for p in oom], [0] * len(oom), "x", color="red", label="out of memory")
        ax2.set(xlabel="sequence length S (tokens)", ylabel="step time (ms)")
        ax2.set_title(f"measured (points) and predicted (lines): {self.device}, torch {self.torch_version}", fontsize=8)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return os.fspath(path)

    def describe(self) -> str:
        """Lines: the points measured, the cost model, ``  warning: ...`` when its fit is poor
        (:attr:`CostModel.warning`), and the memory model."""
        n = len(self.points)
        lines = [f"calibration: {n} measured points stored, from {self.device or '?'} (torch {self.torch_version or '?'}, "
                 f"{self.date or '?'})", f"  cost:   {self.cost_model.describe()}"]
        fit = self.cost_model.fit
        if fit is not None and fit.n_points > n:  # e.g. a preset: the published fit over more steps than it stores
            lines[0] += f"; the cost model was fitted on {fit.n_points} measured steps, {n} of them stored here"
        elif fit is not None and fit.n_points < n:  # points the fit did not use (out of memory, not timed)
            lines[0] += f"; the cost model was fitted on {fit.n_points} of them"
        if self.cost_model.warning:
            lines.append(f"  warning: {self.cost_model.warning}")
        if self.memory_model:
            lines.append(f"  memory: {self.memory_model.describe()}")
        return "\n".join(lines)

