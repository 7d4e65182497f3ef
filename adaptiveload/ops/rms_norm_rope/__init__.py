"""The RMSNorm→RoPE op family (an attention projection's q/k norm across heads and its rotary
embedding): ``torch.ops.adaptiveload.rms_norm_rope`` and its backward.

* ``op.py`` -- schemas and registrations (reference, fake, autograd, the CUDA path), input checks;
* ``reference.py`` -- the plain-PyTorch math (CPU, float64, the tables' gradients; the tests' reference);
* ``pattern.py`` -- the FX pattern ``rms_norm_rope`` of the ``adaptiveload`` compile backend.

The CUDA kernels: ``csrc/rms_norm_rope/``.
"""
from adaptiveload.ops.rms_norm_rope.op import rms_norm_rope, rms_norm_rope_backward

__all__ = ["rms_norm_rope", "rms_norm_rope_backward"]
