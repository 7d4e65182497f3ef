"""AdaptiveLoad: faster training of video diffusion transformers on mixed image/video data.

Two pieces, usable alone or together, and the fused ops on their own:

* ``adaptiveload.fxfuse`` -- the ``torch.compile(model, backend="adaptiveload")`` backend, which
  rewrites every adaptive-LayerNorm modulate chain ``LayerNorm(x) * (1 + scale) + shift`` into
  the fused op ``torch.ops.adaptiveload.adaln_modulate`` and hands the graph to Inductor.
* ``adaptiveload.sched`` -- a dual-constraint bucket sampler whose per-bucket batch sizes come
  from a step-time model calibrated on the live model.
* ``adaptiveload.functional`` / ``adaptiveload.nn`` -- the fused ops without the backend, as
  functions (``adaln_modulate``, ``rms_norm_modulate``) and modules (``AdaLNModulate``,
  ``RMSNormModulate``) returning y in x's dtype; ``adaptiveload.ops`` stays the raw-op namespace.

Importing the package registers the custom ops. The backend name is registered through the
``torch_dynamo_backends`` entry point, so ``torch.compile(backend="adaptiveload")`` works without
any import.
"""
import logging

from adaptiveload import ops  # noqa: F401  (registers torch.ops.adaptiveload.*)
from adaptiveload import functional, nn

__version__ = "0.1.0"

logger = logging.getLogger("adaptiveload")

__all__ = ["__version__", "functional", "logger", "nn", "ops"]
