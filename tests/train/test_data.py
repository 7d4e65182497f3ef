"""LatentDataset and collate: shapes, per-sample determinism, σ schedules, loader checks, errors."""
import numpy as np
import pytest
import torch

from adaptiveload.train.data import LatentDataset, collate, sample_sigma, synthetic_batch
from adaptiveload.train.step import InputSpec

SPEC = InputSpec(in_channels=4, text_len=8, text_dim=32, patch_size=(1, 2, 2))


def test_items_have_their_sample_shape_and_do_not_depend_on_order():
    ds = LatentDataset([[1, 6, 12], [5, 10, 20], [1, 6, 12]], SPEC, seed=3)
    item = ds[1]
    assert item["index"] == 1
    assert item["latents"].shape == item["noise"].shape == (4, 5, 10, 20)
    assert item["context"].shape == (8, 32) and item["sigma"].shape == () and 0 < item["sigma"] < 1
    again = LatentDataset([[1, 6, 12], [5, 10, 20], [1, 6, 12]], SPEC, seed=3)
    _ = again[2]  # another order of access, another dataset object
    for key in ("latents", "context", "noise", "sigma"):
        assert torch.equal(again[1][key], item[key])
    assert not torch.equal(ds[0]["latents"], ds[2]["latents"])  # same shape, different samples


def test_new_epoch_draws_new_noise_and_keeps_the_clean_latents():
    ds = LatentDataset([[1, 6, 12]], SPEC, seed=0)
    first = ds[0]
    ds.set_epoch(1)
    second = ds[0]
    assert torch.equal(first["latents"], second["latents"]) and torch.equal(first["context"], second["context"])
    assert not torch.equal(first["noise"], second["noise"])


def test_sigma_schedules():
    gen = torch.Generator().manual_seed(0)
    logit_normal = sample_sigma(gen, 20000, "logit_normal")
    # logit(sigma) ~ N(0, 1): check its moments
    z = torch.log(logit_normal / (1 - logit_normal))
    assert abs(z.mean().item()) < 0.03 and abs(z.std().item() - 1) < 0.03
    uniform = sample_sigma(gen, 20000, "uniform")
    assert uniform.min() >= 0 and uniform.max() < 1 and abs(uniform.mean().item() - 0.5) < 0.01
    with pytest.raises(ValueError, match="unknown sigma sampling 'beta'"):
        sample_sigma(gen, 1, "beta")


def test_collate_stacks_one_shape_and_rejects_mixed_shapes():
    ds = LatentDataset([[1, 6, 12], [1, 6, 12], [5, 10, 20]], SPEC)
    batch = collate([ds[0], ds[1]])
    assert batch.indices.tolist() == [0, 1] and batch.latents.shape == (2, 4, 1, 6, 12)
    assert batch.context.shape == (2, 8, 32) and batch.sigma.shape == (2,) and batch.latent_shape == (1, 6, 12)
    assert torch.equal(batch.noise[1], ds[1]["noise"])
    with pytest.raises(ValueError, match=r"one latent shape, got samples 0: \[1, 6, 12\], 2: \[5, 10, 20\]"):
        collate([ds[0], ds[2]])


def test_user_loader_and_its_shape_check():
    def loader(index, shape):
        return torch.full((4, *shape), float(index)), torch.zeros(8, 32)

    ds = LatentDataset([[1, 2, 2], [3, 2, 2]], SPEC, loader=loader)
    assert torch.equal(ds[1]["latents"], torch.ones(4, 3, 2, 2))
    bad = LatentDataset([[1, 2, 2]], SPEC, loader=lambda i, s: (torch.zeros(4, 1, 2, 3), torch.zeros(8, 32)))
    with pytest.raises(ValueError, match=r"latents of sample 0 has shape \[4, 1, 2, 3\], expected \[4, 1, 2, 2\]"):
        bad[0]


def test_bad_shapes_and_indices():
    with pytest.raises(ValueError, match=r"\[n, 3\]"):
        LatentDataset(np.array([[1, 2]]), SPEC)
    with pytest.raises(IndexError, match="out of range"):
        LatentDataset([[1, 2, 2]], SPEC)[1]
    assert len(synthetic_batch(SPEC, 3, (1, 2, 2))) == 3


@pytest.mark.cuda
def test_draws_on_the_gpu_are_per_sample_deterministic_and_stay_there():
    shapes = [[1, 6, 12], [5, 10, 20], [1, 6, 12]]
    ds = LatentDataset(shapes, SPEC, seed=3, device="cuda")
    item = ds[1]
    assert all(item[k].device.type == "cuda" for k in ("latents", "context", "noise", "sigma"))
    assert item["latents"].shape == (4, 5, 10, 20) and 0 < item["sigma"] < 1
    again = LatentDataset(shapes, SPEC, seed=3, device="cuda")
    _ = again[2]
    for key in ("latents", "context", "noise", "sigma"):
        assert torch.equal(again[1][key], item[key])
    assert not torch.equal(ds[0]["latents"], ds[2]["latents"])
    # N(0, 1) draws: moments of the 8x32 text embedding and 4x5x10x20 latents
    assert abs(item["latents"].mean().item()) < 0.1 and abs(item["latents"].std().item() - 1) < 0.1
    batch = synthetic_batch(SPEC, 2, (1, 2, 2), device="cuda")
    assert batch.latents.device.type == "cuda" and batch.latents.shape == (2, 4, 1, 2, 2)
