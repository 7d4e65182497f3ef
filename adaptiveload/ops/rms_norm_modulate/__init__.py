"""The RMSNorm→modulate op family: ``torch.ops.adaptiveload.rms_norm_modulate`` and its backward.

* ``op.py`` -- schemas and registrations (reference, fake, autograd, CUDA), input checks;
* ``reference.py`` -- the plain-PyTorch math (CPU implementation, and the tests' reference);
* ``pattern.py`` -- the FX pattern ``rms_norm_modulate`` of the ``adaptiveload`` compile backend
  (registered when :mod:`adaptiveload.fxfuse` first lists its patterns).
"""
from adaptiveload.ops.rms_norm_modulate.op import rms_norm_modulate, rms_norm_modulate_backward

__all__ = ["rms_norm_modulate", "rms_norm_modulate_backward"]
