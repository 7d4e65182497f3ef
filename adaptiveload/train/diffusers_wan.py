"""diffusers' ``WanTransformer3DModel`` as a ``--model`` factory (needs ``pip install diffusers``).

    adaptiveload train --model adaptiveload.train.diffusers_wan:wan_1_3b
    adaptiveload calibrate --model adaptiveload.train.diffusers_wan:wan_1_3b_10_layers   # the first 10 layers

The wrapper gives the diffusers model the interface the train job expects: ``model(latents,
timestep, context)`` returning the prediction tensor, a ``config`` with ``in_channels``,
``text_len``, ``text_dim``, ``patch_size``, ``dim``, ``num_layers``, the ``blocks`` FSDP2 shards,
and ``set_activation_checkpointing`` (diffusers' gradient checkpointing). Weights are random
(diffusers' init); nothing is downloaded.
"""
from __future__ import annotations

from types import SimpleNamespace

from torch import Tensor, nn

# Wan 2.1 T2V 1.3B (the released checkpoint's config): 12 heads x 128 = 1536 channels.
WAN_1_3B = {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30,
            "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "patch_size": (1, 2, 2)}
TEXT_LEN = 512  # Wan pads prompts to 512 umT5 tokens


class DiffusersWan(nn.Module):
    """``WanTransformer3DModel`` behind the ``(latents, timestep, context) -> prediction`` interface.

    Args:
        **config: ``WanTransformer3DModel`` arguments (defaults: Wan 2.1 1.3B).

    Raises:
        ValueError: diffusers is not installed.
    """

    def __init__(self, **config):
        super().__init__()
        try:
            from diffusers import WanTransformer3DModel
        except ImportError:
            raise ValueError("this model needs diffusers (pip install diffusers)") from None
        merged = {**WAN_1_3B, **config}
        self.inner = WanTransformer3DModel(**merged)
        self.blocks = self.inner.blocks
        self.config = SimpleNamespace(
            in_channels=merged["in_channels"], text_len=TEXT_LEN, text_dim=merged["text_dim"],
            patch_size=tuple(merged["patch_size"]), num_layers=merged["num_layers"],
            dim=merged["num_attention_heads"] * merged["attention_head_dim"],
        )

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """diffusers' gradient checkpointing of every block."""
        if enabled:
            self.inner.enable_gradient_checkpointing()
        else:
            self.inner.disable_gradient_checkpointing()

    def forward(self, latents: Tensor, timestep: Tensor, context: Tensor) -> Tensor:
        """latents [B, C, T, H, W], timestep [B] (0..1000), context [B, L, text_dim] -> [B, C, T, H, W]."""
        return self.inner(latents, timestep, context, return_dict=False)[0]


def wan_1_3b() -> DiffusersWan:
    """Wan 2.1 1.3B, 30 layers."""
    return DiffusersWan()


def wan_1_3b_10_layers() -> DiffusersWan:
    """The first 10 of Wan 2.1 1.3B's 30 layers: the depth of the reference model's H200 runs
    (``--preset wan2.1-1.3b --num-layers 10``, benchmarks/results/train_h200/)."""
    return DiffusersWan(num_layers=10)
