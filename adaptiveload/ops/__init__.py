"""Custom ops of the ``adaptiveload`` namespace (registered on import), one folder per op family:

* ``adaln_modulate/`` -- ``LayerNorm(x) * (1 + scale) + shift``;
* ``rms_norm_modulate/`` -- ``rms_norm(x) * (1 + scale) [+ shift]``;
* ``residual_norm_modulate/`` -- ``r = x + gate * y``, then either norm→modulate of r, as one op
  (``residual_adaln_modulate``, ``residual_rms_norm_modulate``);
* ``rms_norm_rope/`` -- an attention projection's RMSNorm across heads, then its rotary embedding
  (``rms_norm_rope``: Wan's q/k norms);

each with its schema and registrations, its reference math and its FX pattern; ``common.py`` holds
what they share, ``extension.py`` builds the ``csrc/`` kernels, and the private ``_tuning.py`` forces
the kernels' own launch choices for benchmarks and tests.

Every family also takes the segmented layout of packed training (``adaln_modulate_segmented``,
``rms_norm_modulate_segmented``, ``residual_*_segmented``): x [..., D] of T rows, modulation [n, D]
with one row per segment (sample) and ``segment_ids`` [T] naming each row's; the op gathers the rows
to the tokens itself and keeps no per-token copy for backward (``segmented.py``).
"""
from adaptiveload.ops import _tuning
from adaptiveload.ops.adaln_modulate import (adaln_modulate, adaln_modulate_backward, adaln_modulate_segmented,
                                             adaln_modulate_segmented_backward)
from adaptiveload.ops.common import modulation_layout
from adaptiveload.ops.residual_norm_modulate import (residual_adaln_modulate, residual_adaln_modulate_backward,
                                                     residual_adaln_modulate_segmented, residual_rms_norm_modulate,
                                                     residual_rms_norm_modulate_backward,
                                                     residual_rms_norm_modulate_segmented)
from adaptiveload.ops.rms_norm_modulate import (rms_norm_modulate, rms_norm_modulate_backward,
                                                rms_norm_modulate_segmented, rms_norm_modulate_segmented_backward)
from adaptiveload.ops.rms_norm_rope import rms_norm_rope, rms_norm_rope_backward

__all__ = ["adaln_modulate", "adaln_modulate_backward", "rms_norm_modulate", "rms_norm_modulate_backward",
           "adaln_modulate_segmented", "adaln_modulate_segmented_backward", "rms_norm_modulate_segmented",
           "rms_norm_modulate_segmented_backward",
           "residual_adaln_modulate", "residual_adaln_modulate_backward", "residual_rms_norm_modulate",
           "residual_rms_norm_modulate_backward", "residual_adaln_modulate_segmented",
           "residual_rms_norm_modulate_segmented", "rms_norm_rope", "rms_norm_rope_backward", "modulation_layout"]

_tuning.warn_removed_variables()  # once, at import: the variables that used to set the kernels' choices
