"""The reference model: a Wan 2.1-style video DiT with random init (nothing is downloaded).

    from adaptiveload.models import build_model, make_inputs
    model = build_model("tiny")
    out = model(*make_inputs("tiny", batch_size=2, latent_shape=(3, 8, 8)))   # [2, 4, 3, 8, 8]

Presets (``PRESETS``): ``"tiny"`` (CPU, milliseconds per step), ``"wan2.1-1.3b"``, ``"wan2.1-14b"``.

Packs of samples of different shapes (:mod:`adaptiveload.models.packed`)::

    tokens, grid, cu_seqlens = patchify_packed([x0, x1], model.config.patch_size)   # x_i [C, T_i, H_i, W_i]
    out = model.forward_packed(tokens, timestep, context, grid, cu_seqlens)       # [S_0 + S_1, C * 4]
    y0, y1 = unpatchify_packed(out, grid, model.config.patch_size)
"""
from adaptiveload.models.config import PRESETS, WanConfig
from adaptiveload.models.packed import packed_attention, patchify_packed, unpatchify_packed
from adaptiveload.models.wan import WanDiT, build_model, make_inputs

__all__ = ["PRESETS", "WanConfig", "WanDiT", "build_model", "make_inputs", "packed_attention", "patchify_packed",
           "unpatchify_packed"]
