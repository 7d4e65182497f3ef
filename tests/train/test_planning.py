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
