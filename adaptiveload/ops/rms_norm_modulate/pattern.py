"""The FX pattern ``rms_norm_modulate``: ``rms_norm(x, weight?) * (1 + scale) [+ shift]`` in any of
the forms :mod:`adaptiveload.fxfuse.modulate` recognises, after any RMSNorm form
:func:`adaptiveload.fxfuse.nodes.norm_site` finds (``F.rms_norm``, ``torch.rms_norm``,
``nn.RMSNorm``, ``aten.rms_norm``, ``aten._fused_rms_norm``, and diffusers' hand-written
``x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)`` [``* weight``]), rewritten into
``rms_norm_modulate(x, weight, scale, shift, eps, out_dtype)``, or into ``rms_norm_modulate_segmented``
where the modulation is gathered to a pack's tokens (``m[segment_ids]``). Registered with the fusion
pass on import."""
from adaptiveload.fxfuse.modulate import NormModulatePattern
from adaptiveload.fxfuse.registry import register_pattern
from adaptiveload.ops.rms_norm_modulate.op import rms_norm_modulate, rms_norm_modulate_segmented

PATTERN = NormModulatePattern(name="rms_norm_modulate", family="rms_norm", op=rms_norm_modulate.default,
                              has_bias=False, segmented_op=rms_norm_modulate_segmented.default)
register_pattern(PATTERN.name, PATTERN.match, PATTERN.check, PATTERN.replace)
