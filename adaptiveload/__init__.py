"""AdaptiveLoad: faster training of video diffusion transformers on mixed image/video data.

Two pieces, usable alone or together:

* ``adaptiveload.fxfuse`` -- the ``torch.compile(model, backend="adaptiveload")`` backend, which
  rewrites every adaptive-LayerNorm modulate chain ``LayerNorm(x) * (1 + scale) + shift`` into
  the fused op ``torch.ops.adaptiveload.adaln_modulate`` and hands the graph to Inductor.
* ``adaptiveload.sched`` -- a dual-constraint bucket sampler whose per-bucket batch sizes come
  from a step-time model calibrated on the live model.

Importing the package registers the custom ops. The backend name is registered through the
``torch_dynamo_backends`` entry point, so ``torch.compile(backend="adaptiveload")`` works without
any import.
"""
import logging

from adaptiveload import ops  # noqa: F401  (registers torch.ops.adaptiveload.*)

__version__ = "0.1.0"

logger = logging.getLogger("adaptiveload")

__all__ = ["__version__", "logger", "ops"]
