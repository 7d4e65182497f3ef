"""The RMSNorm→modulate op family: ``torch.ops.adaptiveload.rms_norm_modulate`` and its backward, and
``rms_norm_modulate_segmented`` (and its backward), the same op for packed sequences: scale/shift
[n, D], one row per segment, and ``segment_ids`` [T], the segment of each row of x
(:mod:`adaptiveload.ops.segmented`).

* ``op.py`` -- schemas and registrations (reference, fake, autograd, CUDA; the segmented ops'), input checks;
* ``reference.py`` -- the plain-PyTorch math (CPU implementation, and the tests' reference);
* ``pattern.py`` -- the FX pattern ``rms_norm_modulate`` of the ``adaptiveload`` compile backend
  (registered when :mod:`adaptiveload.fxfuse` first lists its patterns).
"""
from adaptiveload.ops.rms_norm_modulate.op import (rms_norm_modulate, rms_norm_modulate_backward,
                                                   rms_norm_modulate_segmented, rms_norm_modulate_segmented_backward)

__all__ = ["rms_norm_modulate", "rms_norm_modulate_backward", "rms_norm_modulate_segmented",
           "rms_norm_modulate_segmented_backward"]
