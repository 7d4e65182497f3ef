"""What calibrate and train share (adaptiveload/train/setup.py)."""
import pytest
import torch

from adaptiveload.train.setup import CPU_THREADS, set_cpu_threads


def test_cpu_jobs_use_one_thread_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        set_cpu_threads(torch.device("cpu"))
        assert torch.get_num_threads() == 2  # the user's setting stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        set_cpu_threads(torch.device("cuda"))
        assert torch.get_num_threads() == 2  # a GPU job keeps torch's default
        set_cpu_threads(torch.device("cpu"))
        assert torch.get_num_threads() == CPU_THREADS == 1
    finally:
        torch.set_num_threads(before)


def _manifest(tmp_path, text):
    path = tmp_path / "m.csv"
    path.write_text(text)
    return str(path)


def test_token_geometry_of_an_ltx_and_a_cogvideox_corpus(tmp_path):
    """--vae-stride and the patch give each pixel size its own token count (by hand: T = (F-1)//st + 1
    floored to pt, H = H_px//(sh*ph)*ph, W likewise, S = T/pt * H/ph * W/pw)."""
    from adaptiveload.train.setup import load_corpus

    path = _manifest(tmp_path, "num_frames,height,width\n121,512,768\n17,256,384\n")
    cpu = torch.device("cpu")
    ltx, k = load_corpus(path, None, 0, 1, cpu, vae_stride=(8, 32, 32), patch_size=(1, 1, 1))
    assert k == 1 and ltx.latent_shapes.tolist() == [[16, 16, 24], [3, 8, 12]]
    assert ltx.seq_lens.tolist() == [16 * 16 * 24, 3 * 8 * 12]
    cog, _ = load_corpus(path, None, 0, 1, cpu, vae_stride=(4, 8, 8), patch_size=(2, 2, 2))
    # T = 120//4 + 1 = 31 -> 30 (whole patches of 2); 16//4 + 1 = 5 -> 4
    assert cog.latent_shapes.tolist() == [[30, 64, 96], [4, 32, 48]]
    assert cog.seq_lens.tolist() == [15 * 32 * 48, 2 * 16 * 24]
    wan, k = load_corpus(path, None, 0, None, cpu)  # CPU default: downscale 8, stride 4,64,64
    assert k == 8 and wan.latent_shapes.tolist() == [[31, 8, 12], [5, 4, 6]] and wan.seq_lens.tolist() == [744, 30]
    mix, k = load_corpus(None, 16, 0, None, torch.device("cuda"), vae_stride=(8, 32, 32), patch_size=(1, 1, 1))
    assert k == 1 and set(mix.seq_lens.tolist()) <= {15 * 26, 11 * 15 * 26, 22 * 40, 11 * 22 * 40,
                                                     3 * 15 * 26, 5 * 15 * 26, 7 * 15 * 26, 9 * 15 * 26,
                                                     3 * 22 * 40, 5 * 22 * 40, 7 * 22 * 40, 9 * 22 * 40}


def test_latent_sizes_and_sample_files_fix_the_shapes(tmp_path):
    """A manifest of latent sizes or sample files is not downscaled (also on CPU); asking for it is an error."""
    from adaptiveload.train.setup import load_corpus

    cpu = torch.device("cpu")
    latents = _manifest(tmp_path, "latent_t,latent_h,latent_w\n3,6,8\n")
    corpus, k = load_corpus(latents, None, 0, None, cpu)
    assert k == 1 and corpus.latent_shapes.tolist() == [[3, 6, 8]] and corpus.seq_lens.tolist() == [36]
    with pytest.raises(ValueError, match="--downscale 8: .* gives latent sizes, whose shapes are fixed"):
        load_corpus(latents, None, 0, 8, cpu)
    files = _manifest(tmp_path, "num_frames,height,width,latent_path,text_path\n81,480,832,a.pt,b.pt\n")
    corpus, k = load_corpus(files, None, 0, None, cpu)
    assert k == 1 and corpus.latent_shapes.tolist() == [[21, 60, 104]]
    with pytest.raises(ValueError, match="gives sample files, whose shapes are fixed"):
        load_corpus(files, None, 0, 2, cpu)
    with pytest.raises(ValueError, match="seq_len alone gives no tensor shape"):
        load_corpus(_manifest(tmp_path, "seq_len\n5\n"), None, 0, None, cpu)


def test_model_source_builds_once_for_its_spec_and_then_the_same_weights():
    from adaptiveload.train.setup import ModelSource

    source = ModelSource(preset="tiny", factory=None, patch_size=(2, 2, 2), seed=3)
    assert source.spec().patch_size == (2, 2, 2)
    first, second = source.build(), source.build()
    assert first is not second
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
