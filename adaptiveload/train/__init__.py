"""Training: the shared training step, shape benchmarking (``adaptiveload calibrate``) and the
``adaptiveload train`` job.

* :mod:`~adaptiveload.train.step` -- :class:`TrainStep`: model placement, FSDP2, compile, AdamW,
  bf16 autocast, the flow-matching loss normalised by the global sample count;
* :mod:`~adaptiveload.train.data` -- :class:`LatentDataset` and :func:`collate`;
* :mod:`~adaptiveload.train.distributed` -- process groups and the control group ranks agree through;
* :mod:`~adaptiveload.train.calibrate` -- timing the step over a (B, S) grid;
* :mod:`~adaptiveload.train.metrics` -- busy time, compute-load CV, idle fraction;
* :mod:`~adaptiveload.train.checkpoint` -- DCP checkpoint and resume;
* :mod:`~adaptiveload.train.setup` -- corpus and step construction shared by the commands;
* :mod:`~adaptiveload.train.job` -- the train job, in pieces: :mod:`~adaptiveload.train.planning`
  (calibration, plan, sampler), :mod:`~adaptiveload.train.loop` (warm-up, steps, failures),
  :mod:`~adaptiveload.train.results` (measurements, ``results.json``), :mod:`~adaptiveload.train.report`
  (the printed report and plot);
* :mod:`~adaptiveload.train.diffusers_wan` -- diffusers' ``WanTransformer3DModel`` as a ``--model`` factory;
* :mod:`~adaptiveload.train.cli` -- the two subcommands.
"""
from adaptiveload.train.data import Batch, LatentDataset, collate
from adaptiveload.train.distributed import DistContext, init_distributed
from adaptiveload.train.step import InputSpec, StepConfig, TrainStep, flow_matching_loss, load_model

__all__ = ["Batch", "DistContext", "InputSpec", "LatentDataset", "StepConfig", "TrainStep", "collate",
           "flow_matching_loss", "init_distributed", "load_model"]
