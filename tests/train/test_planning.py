"""Planning a training run (adaptiveload/train/planning.py)."""
import logging
import os



def test_a_calibration_of_another_setup_is_warned_about(caplog):
    """A loaded calibration whose model, depth or checkpointing differ from the run's: one warning
    naming each difference; the built-in calibrations (prose settings) are not compared."""
    from adaptiveload.sched.presets import load_calibration
    from adaptiveload.train.planning import warn_if_calibrated_otherwise

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    calibration = load_calibration(os.path.join(repo, "benchmarks/results/train_h200/calib_ckpt.json"))
    run = {"model": "tiny", "num_layers": 2, "activation_checkpointing": False}
    with caplog.at_level(logging.WARNING, logger="adaptiveload.train"):
        warn_if_calibrated_otherwise(calibration, run)
    (record,) = caplog.records
    for text in ("model: calibrated 'wan2.1-1.3b', this run 'tiny'", "num_layers: calibrated 10, this run 2",
                 "activation_checkpointing: calibrated True, this run False"):
        assert text in record.getMessage()
    caplog.clear()
    warn_if_calibrated_otherwise(calibration, dict(calibration.settings))  # the same setup: silent
    warn_if_calibrated_otherwise(load_calibration("anchors-wan1.3b"), run)  # built-in
    assert not caplog.records


def _plan(manifest, world_size=1):
    from adaptiveload.sched.plan import make_plan
    from adaptiveload.sched.presets import load_calibration

    return make_plan(manifest, load_calibration("anchors-wan1.3b"), world_size, m_mem=151200)


def test_a_plan_made_for_another_corpus_is_refused():
    """A full-resolution plan (what an H200 job plans) against the CPU job's corpus, downscaled by 8
    (the job once trained it with batch sizes up to 6,505): refused by its VAE stride where the plan
    records one, else by its buckets; either way naming the geometry to re-plan with."""
    import pytest

    from adaptiveload.sched.manifest import reference_mix
    from adaptiveload.train.planning import check_plan_fits

    full = reference_mix(64, 0)
    check_plan_fits(_plan(full), "plan.json", full, downscale=1)  # its own corpus fits
    check_plan_fits(_plan(full), "plan.json", full.head(10), downscale=1)  # and a part of it
    with pytest.raises(ValueError) as info:
        check_plan_fits(_plan(full), "plan.json", reference_mix(64, 0, vae_stride=(4, 64, 64)), downscale=8)
    text = str(info.value)
    assert text.startswith("plan.json was planned for ") and "downscale 8" in text
    assert text.endswith("--vae-stride 4,64,64 --patch-size 1,2,2) or omit --plan")


def test_buckets_missing_from_the_plan_are_named():
    """The same VAE stride and patch, another resolution: the buckets the plan lacks (by hand:
    81x544x960 -> latent 21 x 544/8 x 960/8 = 21x68x120, S = 21*34*60 = 42,840)."""
    import pytest

    from adaptiveload.sched.manifest import Manifest, reference_mix
    from adaptiveload.train.planning import check_plan_fits

    plan = _plan(reference_mix(64, 0))
    other = Manifest.from_pixels([1, 81], [480, 544], [832, 960], source="other.csv")
    with pytest.raises(ValueError) as info:
        check_plan_fits(plan, "plan.json", other, downscale=1)
    assert str(info.value).startswith("plan.json was planned for another corpus: 1 of the 2 buckets of other.csv "
                                      "(downscale 1) are not in it, e.g. latent 21x68x120 (S=42,840); the plan's "
                                      "S spans 1,560..75,600, this corpus's 1,560..42,840")


def test_a_plan_of_another_patch_stride_or_token_counts():
    import dataclasses
    from types import SimpleNamespace

    import pytest

    from adaptiveload.sched.manifest import Manifest, reference_mix
    from adaptiveload.train.planning import check_plan_fits

    corpus = reference_mix(32, 0)
    plan = _plan(corpus)
    with pytest.raises(ValueError, match="planned for patch size 1,2,2, but this job's model has 1,1,1"):
        check_plan_fits(plan, "p.json", dataclasses.replace(corpus, patch_size=(1, 1, 1)), downscale=1)
    by_tokens = _plan(Manifest.from_seq_lens(corpus.seq_lens))  # a plan of seq_len rows: compared by S
    check_plan_fits(by_tokens, "p.json", corpus, downscale=1)
    with pytest.raises(ValueError, match=r"1 of the 2 buckets of .* e\.g\. S=7,800"):  # 480x4160: 30 x 260
        check_plan_fits(by_tokens, "p.json", Manifest.from_pixels([1, 1], [480, 480], [832, 4160]), downscale=1)
    recorded = SimpleNamespace(**{**vars(plan), "vae_stride": (4, 8, 8)})  # a plan that records its stride
    check_plan_fits(recorded, "p.json", corpus, downscale=1)
    ltx = Manifest.from_pixels(*corpus.pixel_shapes.T, vae_stride=(8, 32, 32))
    with pytest.raises(ValueError, match=r"planned for VAE stride 4,8,8, but this job's corpus uses 8,32,32 "
                                         r"\(at --downscale 1\)"):
        check_plan_fits(recorded, "p.json", ltx, downscale=1)
    latents = Manifest.from_latents(*corpus.latent_shapes.T)  # latent sizes: the stride plays no part
    check_plan_fits(recorded, "p.json", dataclasses.replace(latents, vae_stride=(8, 32, 32)), downscale=1)
