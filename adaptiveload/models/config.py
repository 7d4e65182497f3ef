"""``WanConfig`` and the named presets of the reference Wan 2.1-style video DiT."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WanConfig:
    """Hyper-parameters of :class:`adaptiveload.models.WanDiT`.

    Attributes:
        dim: hidden size D of the token stream.
        num_layers: number of transformer blocks.
        num_heads: attention heads; ``dim // num_heads`` is the head dim (must be even, for RoPE).
        ffn_dim: hidden size of the feed-forward network.
        in_channels, out_channels: latent channels in and out.
        text_dim: channels of the text-encoder states (``context``); Wan 2.1 uses umT5-XXL, 4096.
        text_len: number of text tokens :func:`make_inputs` produces (Wan pads prompts to 512).
        freq_dim: size of the sinusoidal timestep embedding.
        patch_size: (t, h, w) patch of the Conv3d patch embedding.
        eps: epsilon of every LayerNorm and RMSNorm.

    Raises:
        ValueError: a non-positive size, ``dim`` not divisible by ``num_heads``, or an odd head dim or one below 6.
    """

    dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6

    def __post_init__(self):
        names = ("dim", "num_layers", "num_heads", "ffn_dim", "in_channels", "out_channels", "text_dim",
                 "text_len", "freq_dim")
        sizes = {name: getattr(self, name) for name in names}
        bad = {name: value for name, value in sizes.items() if not isinstance(value, int) or value <= 0}
        if bad:
            raise ValueError(f"WanConfig: sizes must be positive ints, got {bad}")
        if len(self.patch_size) != 3 or any(not isinstance(p, int) or p <= 0 for p in self.patch_size):
            raise ValueError(f"WanConfig: patch_size must be three positive ints (t, h, w), got {self.patch_size}")
        object.__setattr__(self, "patch_size", tuple(self.patch_size))
        if self.dim % self.num_heads:
            raise ValueError(f"WanConfig: dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(
                f"WanConfig: head dim {self.head_dim} (dim / num_heads) must be even and at least 6 for 3D RoPE"
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head, ``dim // num_heads``."""
        return self.dim // self.num_heads

    @property
    def patch_volume(self) -> int:
        """Latent voxels per token, ``prod(patch_size)``."""
        t, h, w = self.patch_size
        return t * h * w


# Sizes of the released Wan 2.1 text-to-video models (the 1.3B and 14B checkpoints' configs) and
# a tiny CPU model with the same structure.
PRESETS: dict[str, WanConfig] = {
    "tiny": WanConfig(
        dim=64, num_layers=2, num_heads=4, ffn_dim=128, in_channels=4, out_channels=4,
        text_dim=32, text_len=8, freq_dim=32,
    ),
    "wan2.1-1.3b": WanConfig(dim=1536, num_layers=30, num_heads=12, ffn_dim=8960),
    "wan2.1-14b": WanConfig(dim=5120, num_layers=40, num_heads=40, ffn_dim=13824),
}


def resolve_config(config: str | WanConfig) -> WanConfig:
    """Return ``config`` itself or the preset it names.

    Raises:
        ValueError: an unknown preset name (the message lists the presets).
        TypeError: neither a ``str`` nor a ``WanConfig``.
    """
    if isinstance(config, WanConfig):
        return config
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"unknown model preset {config!r}; available presets: {', '.join(PRESETS)}")
        return PRESETS[config]
    raise TypeError(f"expected a preset name or a WanConfig, got {type(config).__name__}")
