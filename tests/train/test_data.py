"""LatentDataset and collate: shapes, per-sample determinism, σ schedules, loader checks, sample
files (every layout, every bad file named by row and path), text padding, errors."""
import re

import numpy as np
import pytest
import torch

from adaptiveload.train.data import (LatentDataset, SampleError, SampleFiles, collate, sample_error_message,
                                     sample_sigma, synthetic_batch)
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
        return torch.full((4, *shape), float(index)), torch.zeros(3, 32)  # text shorter than text_len: allowed

    ds = LatentDataset([[1, 2, 2], [3, 2, 2]], SPEC, loader=loader)
    assert torch.equal(ds[1]["latents"], torch.ones(4, 3, 2, 2)) and ds[1]["context"].shape == (3, 32)
    bad = LatentDataset([[1, 2, 2]], SPEC, loader=lambda i, s: (torch.zeros(4, 1, 2, 3), torch.zeros(8, 32)))
    with pytest.raises(ValueError, match=r"latents of sample 0: shape \[4, 1, 2, 3\], expected \[C, T, H, W\] = \[4, 1, 2, 2\]"):
        bad[0]
    long_text = LatentDataset([[1, 2, 2]], SPEC, loader=lambda i, s: (torch.zeros(4, 1, 2, 2), torch.zeros(9, 32)))
    with pytest.raises(ValueError, match=r"context of sample 0: shape \[9, 32\], expected \[L, 32\] with 1 <= L <= 8"):
        long_text[0]


def test_collate_zero_pads_text_to_the_model_length():
    """Wan's padding: each text embedding [L, D] gets zero rows up to text_len; its own rows unchanged."""
    lengths = {0: 3, 1: 5}
    ds = LatentDataset([[1, 2, 2], [1, 2, 2]], SPEC,
                       loader=lambda i, s: (torch.zeros(4, *s), torch.arange(lengths[i] * 32.0).view(lengths[i], 32) + 1))
    batch = collate([ds[0], ds[1]], text_len=8)
    assert batch.context.shape == (2, 8, 32)
    for row, length in ((0, 3), (1, 5)):
        expected = torch.cat([torch.arange(length * 32.0).view(length, 32) + 1, torch.zeros(8 - length, 32)])
        assert torch.equal(batch.context[row], expected)
    assert collate([ds[0], ds[1]]).context.shape == (2, 5, 32)  # default: the batch's longest
    with pytest.raises(ValueError, match=r"text embeddings of samples \[1\] are longer than 4 tokens"):
        collate([ds[0], ds[1]], text_len=4)


def _save(path, value):
    """Write ``value`` (a tensor or a dict of tensors) as .safetensors or .pt, by the file's extension."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(value if isinstance(value, dict) else {"tensor": value}, str(path))
    else:
        torch.save(value, path)
    return str(path)


def test_sample_files_read_every_layout(tmp_path):
    """One tensor per file, or several with the key latent / text; safetensors and torch.save; a
    bfloat16 file comes back as float32 of the same values."""
    pytest.importorskip("safetensors")
    gen = torch.Generator().manual_seed(0)
    lat0 = torch.randn(4, 1, 2, 2, generator=gen)
    lat1 = torch.randn(4, 3, 2, 4, generator=gen).bfloat16()
    txt0, txt1 = torch.randn(8, 32, generator=gen), torch.randn(2, 32, generator=gen)
    latent_paths = [_save(tmp_path / "a.safetensors", lat0),
                    _save(tmp_path / "b.pt", {"latent": lat1, "caption_ids": torch.arange(5)})]
    text_paths = [_save(tmp_path / "a_text.pt", txt0),
                  _save(tmp_path / "b_text.safetensors", {"text": txt1, "mask": torch.ones(2)})]
    files = SampleFiles(latent_paths, text_paths, SPEC, "m.csv")
    ds = LatentDataset([[1, 2, 2], [3, 2, 4]], SPEC, loader=files)
    assert torch.equal(ds[0]["latents"], lat0) and torch.equal(ds[0]["context"], txt0)
    assert ds[1]["latents"].dtype == torch.float32 and torch.equal(ds[1]["latents"], lat1.float())
    assert torch.equal(ds[1]["context"], txt1)
    batch = collate([ds[1]], text_len=SPEC.text_len)
    assert torch.equal(batch.context[0, :2], txt1) and not batch.context[0, 2:].any()


@pytest.mark.parametrize("name, value, message", [
    ("missing.pt", None, "no such file"),
    ("lat.npy", torch.zeros(4, 1, 2, 2), "unknown file type '.npy': expected .safetensors or .pt"),
    ("corrupt.pt", b"not a pickle", "cannot read it (UnpicklingError"),
    ("wrong.pt", torch.zeros(4, 1, 2, 4), "shape [4, 1, 2, 4], expected [C, T, H, W] = [4, 1, 2, 2]"),
    ("ints.pt", torch.zeros(4, 1, 2, 2, dtype=torch.int64), "dtype torch.int64, expected a floating-point tensor"),
    ("nan.pt", torch.zeros(4, 1, 2, 2).index_fill_(0, torch.tensor([1]), float("nan")), "4 of 16 values are not finite"),
    ("two.pt", {"x": torch.zeros(1), "y": torch.zeros(1)}, "holds 2 entries (x, y): expected one tensor or the key 'latent'"),
    ("list.pt", [torch.zeros(1)], "holds a list, not a tensor"),
])
def test_a_bad_latent_file_is_named_with_its_row_and_path(tmp_path, name, value, message):
    path = tmp_path / name
    if isinstance(value, bytes):
        path.write_bytes(value)
    elif value is not None:
        torch.save(value, path)
    text = _save(tmp_path / "t.pt", torch.zeros(8, 32))
    files = SampleFiles([_save(tmp_path / "ok.pt", torch.zeros(4, 1, 2, 2)), str(path)], [text, text], SPEC, "m.csv")
    files(0, (1, 2, 2))  # the good row reads
    with pytest.raises(SampleError) as info:
        files(1, (1, 2, 2))
    assert str(info.value).startswith(f"m.csv: row 2: latent file {path}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_files_are_found_before_any_step(tmp_path):
    """check_present names the first missing or unknown file (row, kind, path) and counts the others,
    without reading any file; a corrupt file that exists is left to the loader."""
    good = _save(tmp_path / "ok.pt", torch.zeros(4, 1, 2, 2))
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a pickle")
    SampleFiles([good, str(corrupt)], [good, good], SPEC, "m.csv").check_present()
    files = SampleFiles([good, good, str(tmp_path / "gone.pt")], [good, str(tmp_path / "t.npy"), good], SPEC, "m.csv")
    with pytest.raises(SampleError) as info:
        files.check_present()
    assert str(info.value) == (f"m.csv: row 2: text file {tmp_path / 't.npy'}: unknown file type '.npy': expected "
                               ".safetensors or .pt (and 1 more bad file(s))")


@pytest.mark.parametrize("text, message", [
    (torch.zeros(9, 32), "shape [9, 32], expected [L, 32] with 1 <= L <= 8"),
    (torch.zeros(8, 16), "shape [8, 16], expected [L, 32] with 1 <= L <= 8"),
    (torch.zeros(8), "shape [8], expected [L, 32] with 1 <= L <= 8"),
])
def test_a_bad_text_file_is_named_with_its_row_and_path(tmp_path, text, message):
    latent = _save(tmp_path / "lat.pt", torch.zeros(4, 1, 2, 2))
    path = _save(tmp_path / "text.pt", text)
    with pytest.raises(SampleError, match=re.escape(f"m.csv: row 1: text file {path}: {message}")):
        SampleFiles([latent], [path], SPEC, "m.csv")(0, (1, 2, 2))


def test_an_error_in_a_worker_process_keeps_its_one_line_message(tmp_path):
    """A DataLoader worker re-raises SampleError with its traceback in the message;
    sample_error_message recovers the line naming the row and the file."""
    latent = _save(tmp_path / "lat.pt", torch.zeros(4, 1, 2, 2))
    files = SampleFiles([latent, str(tmp_path / "gone.pt")], [latent, latent], SPEC, "m.csv")
    ds = LatentDataset([[1, 2, 2], [1, 2, 2]], SPEC, loader=files)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, sampler=[1], num_workers=1, collate_fn=collate)
    with pytest.raises(SampleError) as info:
        next(iter(loader))
    assert "Traceback" in str(info.value)  # the worker's wrapping
    assert sample_error_message(info.value) == f"m.csv: row 2: latent file {tmp_path / 'gone.pt'}: no such file"


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
