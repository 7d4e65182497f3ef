"""Shape benchmarking: the grid, ``adaptiveload calibrate`` on CPU, out-of-memory points, and a
failure on one rank under torchrun that must not hang the others."""
import time

import numpy as np
import pytest

from adaptiveload.sched.calibration import Calibration
from adaptiveload.train.calibrate import calibration_grid

SHAPES = np.array([[1, 6, 12], [21, 10, 20], [5, 6, 12], [9, 10, 20], [1, 6, 12]])  # S = 18, 1050, 90, 450


def test_grid_spreads_shapes_and_caps_tokens():
    grid = calibration_grid(SHAPES, num_shapes=3, batch_sizes=(1, 2, 4), max_tokens=1800)
    shapes = [s for _, s in grid]
    assert shapes[0] == (1, 6, 12) and shapes[-1] == (21, 10, 20)  # shortest and longest kept
    assert len(set(shapes)) == 3
    seq = {(1, 6, 12): 18, (5, 6, 12): 90, (9, 10, 20): 450, (21, 10, 20): 1050}
    assert all(b * seq[s] <= 1800 for b, s in grid)
    assert [(b, s) for b, s in grid if s == (21, 10, 20)] == [(1, (21, 10, 20))]
    assert len([1 for _, s in grid if s == (1, 6, 12)]) == 3


def test_grid_rejects_bad_input():
    with pytest.raises(ValueError, match="no latent shapes"):
        calibration_grid(np.zeros((0, 3)))
    with pytest.raises(ValueError, match="must be >= 1"):
        calibration_grid(SHAPES, batch_sizes=(0, 1))


def _calibrate_args(out, *extra):
    return ("calibrate", "--preset", "tiny", "--backend", "eager", "--shapes", "3", "--batch-sizes", "1,2,4",
            "--warmup", "1", "--repeats", "2", "--out", out, *extra)


@pytest.mark.slow
def test_calibrate_cli_writes_a_valid_calibration(tmp_path, run_cli):
    out = tmp_path / "cal" / "calibration.json"
    proc = run_cli(*_calibrate_args(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cal = Calibration.load(out)
    assert len(cal.points) == 9 and all(p["status"] == "ok" and p["step_time_s"] > 0 for p in cal.points)
    assert {tuple(p["latent_shape"]) for p in cal.points} == {(1, 6, 12), (9, 6, 12), (21, 10, 20)}
    assert all(p["seq_len"] == int(np.prod(p["latent_shape"])) // 4 for p in cal.points)
    assert cal.settings["model"] == "tiny" and cal.settings["backend"] == "eager" and cal.device == "cpu"
    assert cal.cost_model.predict(4, 1050) > cal.cost_model.predict(1, 18) > 0
    assert (tmp_path / "cal" / "calibration.png").is_file()
    assert "wrote" in proc.stdout


@pytest.mark.slow
def test_calibrate_records_out_of_memory_and_continues(tmp_path, run_cli):
    out = tmp_path / "calibration.json"
    proc = run_cli("calibrate", "--model", "faulty_model:oom_over_1000_tokens", "--backend", "eager", "--shapes", "3",
                   "--batch-sizes", "1,2,4", "--warmup", "0", "--repeats", "1", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = Calibration.load(out).points
    status = {(p["batch_size"], p["seq_len"]): p["status"] for p in points}
    assert status[(1, 1050)] == "oom"  # recorded as the limit ...
    assert (2, 1050) not in status and (4, 1050) not in status  # ... larger batches of that shape skipped
    assert status[(4, 162)] == "ok" and status[(1, 18)] == "ok"  # the sweep went on around it


@pytest.mark.slow
def test_failure_on_one_rank_does_not_hang_the_others(tmp_path, run_cli):
    """Rank 1 fails at the second shape while rank 0 waits in an FSDP2 all-gather: rank 0 times out,
    both ranks agree on the failure, stop the sweep and exit; nothing hangs."""
    out = tmp_path / "calibration.json"
    start = time.monotonic()
    proc = run_cli("calibrate", "--model", "faulty_model:error_on_rank1_after_first_shape", "--backend", "eager",
                   "--shapes", "3", "--batch-sizes", "1,2,4", "--warmup", "0", "--repeats", "1",
                   "--dist-timeout", "10", "--out", out, nproc=2, timeout=150)
    assert time.monotonic() - start < 150
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "rank 1: RuntimeError: simulated: device lost" in text
    assert "sweep stopped early" in text
    points = Calibration.load(out).points  # what was measured before the failure is kept
    assert [(p["batch_size"], p["seq_len"], p["status"]) for p in points] == [
        (1, 18, "ok"), (2, 18, "ok"), (4, 18, "ok"), (1, 162, "error")]
