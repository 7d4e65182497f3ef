"""Planning a training run (adaptiveload/train/planning.py)."""
import logging
import os

import numpy as np


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
    """A full-resolution plan (what an H200 job plans) against the CPU job's corpus, downscaled by 8:
    none of its buckets are planned (the job once trained it with batch sizes up to 6,505)."""
    import pytest

    from adaptiveload.sched.manifest import reference_mix
    from adaptiveload.train.planning import check_plan_fits

    full = reference_mix(64, 0)
    cpu = reference_mix(64, 0, vae_stride=(4, 64, 64))
    check_plan_fits(_plan(full), "plan.json", full, downscale=1)  # its own corpus fits
    check_plan_fits(_plan(full), "plan.json", full.head(10), downscale=1)  # and a part of it
    with pytest.raises(ValueError) as info:
        check_plan_fits(_plan(full), "plan.json", cpu, downscale=8)
    text = str(info.value)
    buckets = len(np.unique(cpu.latent_shapes, axis=0))
    assert f"plan.json was planned for another corpus: {buckets} of the {buckets} buckets of reference_mix" in text
    # the shortest CPU bucket: a 480x832 image at stride 64 -> latent 1 x (480//128*2) x (832//128*2) = 1x6x12, S = 18
    assert "e.g. latent 1x6x12 (S=18)" in text and "(downscale 8)" in text
    assert "the plan's S spans 1,560..75,600, this corpus's 18..1,050" in text
    assert "--vae-stride 4,64,64 --patch-size 1,2,2" in text


def test_a_plan_of_another_patch_or_token_counts():
    import dataclasses

    import pytest

    from adaptiveload.sched.manifest import Manifest, reference_mix
    from adaptiveload.train.planning import check_plan_fits

    corpus = reference_mix(32, 0)
    plan = _plan(corpus)
    with pytest.raises(ValueError, match="planned for patch size 1,2,2, but this job's model has 1,1,1"):
        check_plan_fits(plan, "p.json", dataclasses.replace(corpus, patch_size=(1, 1, 1)), downscale=1)
    by_tokens = _plan(Manifest.from_seq_lens(corpus.seq_lens))  # a plan of seq_len rows: compared by S
    check_plan_fits(by_tokens, "p.json", corpus, downscale=1)
    with pytest.raises(ValueError, match=r"1 of the 2 buckets of .* e\.g\. S=7,800"):
        check_plan_fits(by_tokens, "p.json", Manifest.from_pixels([1, 1], [480, 480], [832, 4160]), downscale=1)
    if hasattr(plan, "vae_stride"):  # plans that record the VAE stride
        ltx = Manifest.from_pixels(*corpus.pixel_shapes.T, vae_stride=(8, 32, 32))
        with pytest.raises(ValueError, match="planned for VAE stride 4,8,8, but this job's corpus uses 8,32,32"):
            check_plan_fits(plan, "p.json", ltx, downscale=1)
