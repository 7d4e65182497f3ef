"""The LayerNorm→modulate op family: ``torch.ops.adaptiveload.adaln_modulate`` and its backward, and
``adaln_modulate_segmented`` (and its backward), the same op for packed sequences: scale/shift [n, D],
one row per segment, and ``segment_ids`` [T], the segment of each row of x
(:mod:`adaptiveload.ops.segmented`).

* ``op.py`` -- schemas and registrations (reference, fake, autograd, CUDA; the segmented ops'), input checks;
* ``reference.py`` -- the plain-PyTorch math (CPU implementation, and the tests' reference);
* ``pattern.py`` -- the FX pattern ``adaln_modulate`` of the ``adaptiveload`` compile backend
  (registered when :mod:`adaptiveload.fxfuse` first lists its patterns).
"""
from adaptiveload.ops.adaln_modulate.op import (adaln_modulate, adaln_modulate_backward, adaln_modulate_segmented,
                                                adaln_modulate_segmented_backward)

__all__ = ["adaln_modulate", "adaln_modulate_backward", "adaln_modulate_segmented", "adaln_modulate_segmented_backward"]
