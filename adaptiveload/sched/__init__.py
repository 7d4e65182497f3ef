"""Cost-balanced bucket sampling and packing for video DiT training on mixed image/video data.

Modules, one job each:

* :mod:`~adaptiveload.sched.shapes` -- pixel / latent / token units and the sequence length S;
* :mod:`~adaptiveload.sched.batch_size` -- the equal-token and dual-constraint batch-size rules;
* :mod:`~adaptiveload.sched.policies` -- the batching policies' names (``equal_token``, ``dual``, ``cost_grouped``,
  ``packed``);
* :mod:`~adaptiveload.sched.cost_model` -- step-time models ``t(B, S)`` and of packs, their fits and warnings;
* :mod:`~adaptiveload.sched.memory_model` -- peak memory ``m0 + m1*B*S (+ m2*B*S^2)`` and M_mem;
* :mod:`~adaptiveload.sched.calibration` -- measured points + fitted models, saved as JSON;
* :mod:`~adaptiveload.sched.presets` -- built-in calibrations (``anchors-wan1.3b``);
* :mod:`~adaptiveload.sched.manifest` -- CSV / JSONL / Parquet manifests and the reference mix;
* :mod:`~adaptiveload.sched.plan` -- choosing the budgets that maximise predicted tokens/s;
* :mod:`~adaptiveload.sched.sampler` -- :class:`DualConstraintBucketSampler`;
* :mod:`~adaptiveload.sched.packing` -- :class:`PackingSampler`, :func:`collate_packed`, :func:`sampler_from_plan`;
* :mod:`~adaptiveload.sched.metrics` -- compute-load CV, idle fraction, noise floor, step composition;
* :mod:`~adaptiveload.sched.simulate` -- replaying epoch plans on a simulated cluster;
* :mod:`~adaptiveload.sched.cli` -- ``adaptiveload plan`` and ``adaptiveload simulate``.
"""
from adaptiveload.sched.batch_size import dual_constraint_batch_size, equal_token_batch_size
from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.cost_model import (CostModel, LinearCostModel, PowerCostModel, QuadraticCostModel, fit_cost_model,
                                          fit_packed_cost_model)
from adaptiveload.sched.manifest import Manifest, load_manifest, reference_mix, write_manifest
from adaptiveload.sched.memory_model import MemoryModel
from adaptiveload.sched.packing import EpochPacking, PackedBatch, PackingSampler, collate_packed, sampler_from_plan
from adaptiveload.sched.plan import Plan, make_plan
from adaptiveload.sched.presets import load_calibration
from adaptiveload.sched.sampler import DualConstraintBucketSampler, EpochPlan
from adaptiveload.sched.shapes import latent_shape, sequence_length, tokens_from_latent

__all__ = [
    "Calibration", "CostModel", "DualConstraintBucketSampler", "EpochPacking", "EpochPlan", "LinearCostModel", "Manifest",
    "MemoryModel", "PackedBatch", "PackingSampler", "Plan", "PowerCostModel", "QuadraticCostModel", "collate_packed",
    "dual_constraint_batch_size", "equal_token_batch_size", "fit_cost_model", "fit_packed_cost_model", "latent_shape",
    "load_calibration", "load_manifest", "make_plan", "reference_mix", "sampler_from_plan", "sequence_length", "tokens_from_latent",
    "write_manifest",
]
