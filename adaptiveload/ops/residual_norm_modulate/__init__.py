"""The residual norm-site op family: the (gated) residual update folded into a norm→modulate site,
``r = x + gate * y; out = norm(r) * (1 + scale) + shift``, for LayerNorm
(``torch.ops.adaptiveload.residual_adaln_modulate``) and RMSNorm (``.residual_rms_norm_modulate``),
each with its backward op, and their segmented layout (``residual_adaln_modulate_segmented``,
``residual_rms_norm_modulate_segmented``: gate, scale and shift one row per packed sample with
``segment_ids``, :mod:`adaptiveload.ops.segmented`).

* ``op.py`` -- schemas (the contract the CUDA kernels in ``csrc/residual_norm_modulate/`` implement)
  and registrations (reference, fake, autograd, the Python CUDA path), input checks, and
  :data:`~adaptiveload.ops.residual_norm_modulate.op.FUSED_DEVICES`;
* ``reference.py`` -- the plain-PyTorch math (CPU implementation, and the tests' reference);
* ``pattern.py`` -- the FX patterns ``residual_adaln_modulate`` and ``residual_rms_norm_modulate`` of
  the ``adaptiveload`` compile backend (registered when :mod:`adaptiveload.fxfuse` first lists its
  patterns, ahead of the plain norm→modulate ones).
"""
from adaptiveload.ops.residual_norm_modulate.op import (residual_adaln_modulate, residual_adaln_modulate_backward,
                                                        residual_adaln_modulate_segmented, residual_rms_norm_modulate,
                                                        residual_rms_norm_modulate_backward,
                                                        residual_rms_norm_modulate_segmented)

__all__ = ["residual_adaln_modulate", "residual_adaln_modulate_backward", "residual_adaln_modulate_segmented",
           "residual_rms_norm_modulate", "residual_rms_norm_modulate_backward", "residual_rms_norm_modulate_segmented"]
