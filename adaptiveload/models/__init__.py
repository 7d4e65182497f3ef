"""The reference model: a Wan 2.1-style video DiT with random init (nothing is downloaded).

    from adaptiveload.models import build_model, make_inputs
    model = build_model("tiny")
    out = model(*make_inputs("tiny", batch_size=2, latent_shape=(3, 8, 8)))   # [2, 4, 3, 8, 8]

Presets (``PRESETS``): ``"tiny"`` (CPU, milliseconds per step), ``"wan2.1-1.3b"``, ``"wan2.1-14b"``.
"""
from adaptiveload.models.config import PRESETS, WanConfig
from adaptiveload.models.wan import WanDiT, build_model, make_inputs

__all__ = ["PRESETS", "WanConfig", "WanDiT", "build_model", "make_inputs"]
