"""Calibration (adaptiveload/sched/calibration.py) and the built-in presets (presets.py)."""
import json

import numpy as np
import pytest

from adaptiveload.sched import Calibration
from adaptiveload.sched.presets import PRESETS, load_calibration

GIB = 2**30


def _points(seed=0):
    rng = np.random.default_rng(seed)
    pts = []
    for b in (1, 2, 4, 8):
        for s in (1560, 4680, 9360, 18720, 32760):
            t = (0.01875 + 7.16e-6 * b * s + 3.957e-10 * b * s * s) * (1 + 0.02 * rng.standard_normal())
            mem = 5 * GIB + 2**20 * b * s
            if b * s > 80_000:
                pts.append({"batch_size": b, "seq_len": s, "latent_shape": [s // 1560, 60, 104], "status": "oom",
                            "step_time_s": None, "peak_memory_bytes": None})
            else:
                pts.append({"batch_size": b, "seq_len": s, "latent_shape": [s // 1560, 60, 104], "status": "ok",
                            "step_time_s": t, "peak_memory_bytes": mem})
    return pts


def test_from_points_fits_both_models(tmp_path):
    cal = Calibration.from_points(_points(), settings={"model": "toy", "device_memory_bytes": 80 * GIB}, device="cpu")
    assert cal.cost_model.kind == "quadratic"  # auto: the data are quadratic
    assert cal.cost_model.c2 == pytest.approx(3.957e-10, rel=0.2)
    assert cal.memory_model.m1 == pytest.approx(2**20, rel=1e-6)
    grid = [b * s for b in (1, 2, 4, 8) for s in (1560, 4680, 9360, 18720, 32760)]
    assert cal.largest_ok_tokens == max(t for t in grid if t <= 80_000) == 74880
    assert cal.smallest_oom_tokens == min(t for t in grid if t > 80_000) == 4 * 32760
    path = tmp_path / "cal.json"
    cal.save(path)
    back = Calibration.load(path)
    assert back.points == json.loads(json.dumps(cal.points))
    assert back.cost_model.params() == cal.cost_model.params()
    assert back.memory_model.to_json() == cal.memory_model.to_json()
    assert (back.settings, back.device, back.torch_version, back.date) == (cal.settings, "cpu", cal.torch_version, cal.date)


def test_numpy_values_are_accepted():
    pts = [{**p, "batch_size": np.int64(p["batch_size"]),
            "step_time_s": None if p["step_time_s"] is None else np.float32(p["step_time_s"])} for p in _points()]
    cal = Calibration.from_points(pts, settings={}, device="cpu")
    assert cal.cost_model.kind == "quadratic"


def test_power_kind_and_no_memory():
    pts = [{**p, "peak_memory_bytes": None} for p in _points()]
    cal = Calibration.from_points(pts, settings={}, device="cpu", kind="power")
    assert cal.cost_model.kind == "power" and cal.memory_model is None


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    cal = Calibration.from_points(_points(), settings={}, device="cpu")
    out = cal.plot(tmp_path / "cal.png")
    assert out is not None and (tmp_path / "cal.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mutate, match", [
    (lambda p: p[3].pop("seq_len"), "point 3: missing field 'seq_len'"),
    (lambda p: p[2].update(status="crashed"), "point 2: status 'crashed'"),
    (lambda p: p[1].update(batch_size=0), "point 1: field 'batch_size' = 0"),
    (lambda p: p[0].update(step_time_s=-1.0), "point 0: field 'step_time_s'"),
    (lambda p: [q.update(status="error") for q in p[2:]], "2 point\\(s\\) ran with a step time"),
])
def test_bad_points(mutate, match):
    pts = _points()
    mutate(pts)
    with pytest.raises(ValueError, match=match):
        Calibration.from_points(pts, settings={}, device="cpu")


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        Calibration.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON \(line 1"):
        Calibration.load(bad)
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not an adaptiveload calibration"):
        Calibration.load(bad)
    good = Calibration.from_points(_points(), settings={}, device="cpu").to_json()
    del good["cost_model"]
    bad.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="missing field 'cost_model'"):
        Calibration.load(bad)


def test_anchors_presets_reproduce_the_published_numbers():
    cal = load_calibration("anchors-wan1.3b")
    # the stored H200 measurements (presets.py): equal-token at 32,760 tokens: ~274 ms for an image batch,
    # ~678 ms for a long video
    assert cal.cost_model.predict(21, 1560) * 1e3 == pytest.approx(274, abs=2)
    assert cal.cost_model.predict(1, 32760) * 1e3 == pytest.approx(678, abs=1)
    for p in cal.points:  # the quadratic fit is within 4% of every stored point
        assert cal.cost_model.predict(p["batch_size"], p["seq_len"]) == pytest.approx(p["step_time_s"], rel=0.04)
    power = load_calibration("anchors-wan1.3b-power").cost_model
    assert (power.a, power.b, power.p) == (29.3e-3, 2.706e-7, 1.41)
    # ~1 GiB per 1k tokens (presets.py: 1.052 MiB per token)
    assert cal.memory_model.m1 * 1000 / GIB == pytest.approx(1.0, abs=0.05)
    assert set(PRESETS) == {"anchors-wan1.3b", "anchors-wan1.3b-power"}
    # the five stored points beside the published fit over all 15 measured steps, said as such
    assert cal.describe().splitlines()[0].endswith("; the cost model was fitted on 15 measured steps, 5 of them stored here")
    with pytest.raises(FileNotFoundError, match="built-in: anchors-wan1.3b"):
        load_calibration("no-such-preset")


def test_times_measured_under_load_fall_back_with_one_warning(tmp_path):
    """A quick calibration of a tiny model on busy cores: flat times with one slow first step."""
    pts = [{**p, "step_time_s": 0.05} for p in _points() if p["status"] == "ok"]
    pts[0]["step_time_s"] = 0.5
    cal = Calibration.from_points(pts, settings={}, device="cpu")
    assert cal.cost_model.kind == "linear" and len(cal.cost_model.fit.warnings) == 1
    lines = cal.describe().splitlines()
    assert "fitted on" not in lines[0]  # (its cost model fitted on its own points)
    assert lines[2] == f"  warning: {cal.cost_model.warning}"
    assert cal.cost_model.warning.startswith("poor step-time fit (power: ")
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path).cost_model.warning == cal.cost_model.warning
    with pytest.raises(ValueError, match="power cost fit: "):
        Calibration.from_points(pts, settings={}, device="cpu", kind="power")
