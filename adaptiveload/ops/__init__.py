"""Custom ops of the ``adaptiveload`` namespace (registered on import)."""
from adaptiveload.ops.adaln_modulate import adaln_modulate, adaln_modulate_backward, modulation_layout

__all__ = ["adaln_modulate", "adaln_modulate_backward", "modulation_layout"]
