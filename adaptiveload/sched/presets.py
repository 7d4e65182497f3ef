"""Built-in calibrations, so ``plan`` and ``simulate`` run without a GPU.

``anchors-wan1.3b`` holds these measurements of a Wan 2.1 1.3B-shaped DiT
(diffusers ``WanTransformer3DModel``, random init, 10 of 30 layers), eager bf16 with the AdamW step,
on one NVIDIA H200 (torch 2.11.0+cu130, measured 2026-11-30). The five (B, S) points of that table
are stored as points; the cost models are the published fits over all 15 measured points (not a
refit of the five):

* ``anchors-wan1.3b`` -- quadratic ``t = 18.75 ms + 7.16e-3 ms*B*S + 3.957e-7 ms*B*S^2`` (R^2 0.998);
* ``anchors-wan1.3b-power`` -- power ``t = 29.3 ms + 2.706e-4 ms*B*S^1.41`` (p +- 0.04, R^2 0.987).

The memory model is fitted to the five points' peak memory: 5.07 GiB + 1.052 MiB per token, measured
up to B·S = 32,760 tokens. A 120 GiB budget extrapolates it to ~100k tokens per batch, which the
compiled training step of the project's model fits (88–90 GiB peak on an H200) but eager PyTorch
does not (it keeps more activations): plan eager training with a smaller budget.
"""
from __future__ import annotations

import os

from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.cost_model import FitStats, PowerCostModel, QuadraticCostModel
from adaptiveload.sched.memory_model import MemoryModel

_GIB = 2**30
# (B, S, step ms, peak GiB) of the five stored points.
_WAN_H200_POINTS = (
    (16, 1560, 213.8, 30.8),
    (8, 4680, 362.8, 43.8),
    (4, 9360, 428.0, 43.6),
    (2, 18720, 566.6, 43.5),
    (1, 32760, 678.6, 38.4),
)
# latent (T, H, W) of each point's sample: 480x832 at 1, 9, 21, 45 and 81 frames
_WAN_H200_LATENT = {1560: [1, 60, 104], 4680: [3, 60, 104], 9360: [6, 60, 104], 18720: [12, 60, 104], 32760: [21, 60, 104]}
_WAN_H200_SETTINGS = {
    "model": "Wan 2.1 1.3B-shaped DiT (diffusers WanTransformer3DModel, random init, 10 of 30 layers)",
    "dtype": "bfloat16",
    "compile": "eager",
    "optimizer": "AdamW",
    "source": "Wan-1.3B H200 measurements (published fits over 15 points; 5 points stored)",
    # the H200's memory as nvidia-smi reports it (143,771 MiB): plans default to the memory model at
    # this budget, so the long clips of the reference mix (S <= 75,600) fit one per batch
    "device_memory_bytes": 143771 * 2**20,
}


def _wan_h200(kind: str) -> Calibration:
    points = [
        {"batch_size": b, "seq_len": s, "latent_shape": _WAN_H200_LATENT[s], "status": "ok",
         "step_time_s": ms / 1e3, "peak_memory_bytes": int(gib * _GIB)}
        for b, s, ms, gib in _WAN_H200_POINTS
    ]
    if kind == "quadratic":
        cost = QuadraticCostModel(18.75e-3, 7.16e-6, 3.957e-10, fit=FitStats(15, 0.998, float("nan"), float("nan")))
    else:
        cost = PowerCostModel(29.3e-3, 2.706e-7, 1.41, fit=FitStats(15, 0.987, float("nan"), float("nan"), {"p": 0.04}))
    memory = MemoryModel.fit([p["batch_size"] for p in points], [p["seq_len"] for p in points],
                             [p["peak_memory_bytes"] for p in points])
    return Calibration(points, cost, memory, dict(_WAN_H200_SETTINGS), "NVIDIA H200", "2.11.0+cu130", "2026-11-30")


PRESETS = {
    "anchors-wan1.3b": lambda: _wan_h200("quadratic"),
    "anchors-wan1.3b-power": lambda: _wan_h200("power"),
}


def load_calibration(name_or_path: str) -> Calibration:
    """A built-in calibration by name (see :data:`PRESETS`), else :meth:`Calibration.load` of a file.

    Raises:
        FileNotFoundError: neither a preset name nor an existing file (the message lists the presets).
        ValueError: as :meth:`Calibration.load`.

    Example::

        >>> cal = load_calibration("anchors-wan1.3b")
        >>> cal.cost_model.kind, round(float(cal.cost_model.predict(1, 32760)) * 1e3, 1), len(cal.points)  # ms; measured 678.6
        ('quadratic', 678.0, 5)
    """
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    if not os.path.exists(name_or_path):
        raise FileNotFoundError(f"calibration not found: {name_or_path} (built-in: {', '.join(PRESETS)})")
    return Calibration.load(name_or_path)
