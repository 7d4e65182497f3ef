"""The LayerNorm→modulate op family: ``torch.ops.adaptiveload.adaln_modulate`` and its backward.

* ``op.py`` -- schemas and registrations (reference, fake, autograd, CUDA), input checks;
* ``reference.py`` -- the plain-PyTorch math (CPU implementation, and the tests' reference);
* ``pattern.py`` -- the FX pattern ``adaln_modulate`` of the ``adaptiveload`` compile backend
  (registered when :mod:`adaptiveload.fxfuse` first lists its patterns).
"""
from adaptiveload.ops.adaln_modulate.op import adaln_modulate, adaln_modulate_backward

__all__ = ["adaln_modulate", "adaln_modulate_backward"]
