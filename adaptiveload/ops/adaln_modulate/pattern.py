"""The FX pattern ``adaln_modulate``: ``LayerNorm(x) * (1 + scale) [+ shift]`` in any of the forms
:mod:`adaptiveload.fxfuse.modulate` recognises (``F.layer_norm``, ``nn.LayerNorm``, ``aten.layer_norm``,
``aten.native_layer_norm``), rewritten into ``adaln_modulate(x, weight, bias, scale, shift, eps,
out_dtype)``, or into ``adaln_modulate_segmented`` where scale and shift are gathered to a pack's
tokens (``m[segment_ids]``). Registered with the fusion pass on import."""
from adaptiveload.fxfuse.modulate import NormModulatePattern
from adaptiveload.fxfuse.registry import register_pattern
from adaptiveload.ops.adaln_modulate.op import adaln_modulate, adaln_modulate_segmented

PATTERN = NormModulatePattern(name="adaln_modulate", family="layer_norm", op=adaln_modulate.default, has_bias=True,
                              segmented_op=adaln_modulate_segmented.default)
register_pattern(PATTERN.name, PATTERN.match, PATTERN.check, PATTERN.replace)
