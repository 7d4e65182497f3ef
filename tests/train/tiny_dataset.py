"""A small on-disk dataset in the layout ``adaptiveload train --manifest`` reads: one latent file
[C, T, H, W] and one text-embedding file [L, text_dim] per sample (alternately ``.safetensors`` and
``.pt``, text lengths 1..text_len), and ``manifest.csv`` naming them relative to its folder with the
latent sizes ``latent_t,latent_h,latent_w``.

    python tests/train/tiny_dataset.py DIR --channels 16 --text-dim 4096 --text-len 512 \\
        --shapes 21x60x104,1x60x104 --samples 24
"""
import argparse
import csv
import os

import torch


def write_tiny_dataset(folder, shapes, samples: int, *, channels: int = 4, text_dim: int = 32, text_len: int = 8,
                       seed: int = 0) -> str:
    """Write ``samples`` samples cycling through ``shapes`` ((T, H, W) latent sizes) under ``folder``;
    return the manifest's path. Sample i's latents are N(0, 1) from ``seed + i``; its text has
    ``1 + i % text_len`` tokens."""
    from safetensors.torch import save_file

    os.makedirs(os.path.join(folder, "latents"), exist_ok=True)
    os.makedirs(os.path.join(folder, "text"), exist_ok=True)
    rows = []
    for i in range(samples):
        shape = tuple(shapes[i % len(shapes)])
        gen = torch.Generator().manual_seed(seed + i)
        latent = torch.randn(channels, *shape, generator=gen)
        text = torch.randn(1 + i % text_len, text_dim, generator=gen)
        ext = ".safetensors" if i % 2 == 0 else ".pt"
        paths = (os.path.join("latents", f"{i}{ext}"), os.path.join("text", f"{i}{ext}"))
        for tensor, path in zip((latent, text), paths):
            if ext == ".pt":
                torch.save(tensor, os.path.join(folder, path))
            else:
                save_file({"tensor": tensor.contiguous()}, os.path.join(folder, path))
        rows.append([*shape, *paths])
    manifest = os.path.join(folder, "manifest.csv")
    with open(manifest, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["latent_t", "latent_h", "latent_w", "latent_path", "text_path"])
        writer.writerows(rows)
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--shapes", default="1x4x6,3x4x6,2x6x8", help="latent sizes TxHxW, comma-separated")
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--text-dim", type=int, default=32)
    parser.add_argument("--text-len", type=int, default=8)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(write_tiny_dataset(args.folder, shapes, args.samples, channels=args.channels, text_dim=args.text_dim,
                             text_len=args.text_len))


if __name__ == "__main__":
    main()
