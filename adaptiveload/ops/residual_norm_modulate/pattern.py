"""The FX patterns ``residual_adaln_modulate`` and ``residual_rms_norm_modulate``: a residual update
``x + gate * y`` (or ``x + y``) whose sum a LayerNorm / RMSNorm site reads -- modulated in any form
the plain norm→modulate patterns match, or a plain norm -- while the sum also flows on as the
residual stream (:mod:`adaptiveload.fxfuse.residual`), rewritten into the residual op. Registered
with the fusion pass on import, ``falls_through``: listed ahead of ``adaln_modulate`` and
``rms_norm_modulate`` (``BUILTIN_MODULES``), which fuse every site these reject (a device without
the op's kernel, see :data:`~adaptiveload.ops.residual_norm_modulate.op.FUSED_DEVICES`, above all).
Where the gate and modulation are gathered to a pack's tokens (``m[segment_ids]``), the segmented op
(``residual_*_segmented``) gets the per-sample rows instead."""
from adaptiveload.fxfuse.registry import register_pattern
from adaptiveload.fxfuse.residual import ResidualNormPattern
from adaptiveload.ops.residual_norm_modulate import op

LAYER_NORM_PATTERN = ResidualNormPattern(name=op.LAYER_NORM, family="layer_norm", op=op.residual_adaln_modulate.default,
                                         has_bias=True, devices=op.FUSED_DEVICES,
                                         segmented_op=op.residual_adaln_modulate_segmented.default)
RMS_NORM_PATTERN = ResidualNormPattern(name=op.RMS_NORM, family="rms_norm", op=op.residual_rms_norm_modulate.default,
                                       has_bias=False, devices=op.FUSED_DEVICES,
                                       segmented_op=op.residual_rms_norm_modulate_segmented.default)
for _pattern in (LAYER_NORM_PATTERN, RMS_NORM_PATTERN):
    register_pattern(_pattern.name, _pattern.match, _pattern.check, _pattern.replace, falls_through=True)
