"""Cost-model fits (adaptiveload/sched/cost_model.py): parameter recovery, JSON round trip, errors."""
import json

import numpy as np
import pytest

from adaptiveload.sched import fit_cost_model
from adaptiveload.sched.cost_model import CostModel, PowerCostModel, QuadraticCostModel


def _grid():
    b = np.array([1, 2, 4, 8, 16] * 6)
    s = np.repeat([1560, 4680, 9360, 18720, 32760, 75600], 5) // np.array([1, 1, 2, 4, 8] * 6) * 1
    return b, np.maximum(s, 500)


@pytest.mark.parametrize("seed", range(5))
def test_power_fit_recovers_p_with_5pct_noise(seed):
    rng = np.random.default_rng(seed)
    b, s = _grid()
    a, coef, p = 0.03, 2.7e-7, 1.41
    t = (a + coef * b * s**p) * (1 + 0.05 * rng.standard_normal(s.size))
    model = fit_cost_model(b, s, t, kind="power")
    assert isinstance(model, PowerCostModel)
    assert abs(model.p - p) <= 0.05
    assert 0 < model.p_std < 0.05
    assert model.r2 > 0.95 and model.fit.n_points == s.size and np.isfinite(model.fit.cv_rel_rmse)


def test_exact_data_recovers_all_parameters():
    b, s = _grid()
    t = 0.02 + 1e-6 * b * s**1.3
    m = fit_cost_model(b, s, t, kind="power")
    np.testing.assert_allclose([m.a, m.b, m.p], [0.02, 1e-6, 1.3], rtol=1e-4)
    t = 0.01875 + 7.16e-6 * b * s + 3.957e-10 * b * s * s
    q = fit_cost_model(b, s, t, kind="quadratic")
    np.testing.assert_allclose([q.c0, q.c1, q.c2], [0.01875, 7.16e-6, 3.957e-10], rtol=1e-6)
    assert q.r2 == pytest.approx(1.0)


def test_auto_picks_the_true_family():
    rng = np.random.default_rng(0)
    b, s = _grid()
    t = (0.01875 + 7.16e-6 * b * s + 3.957e-10 * b * s * s) * (1 + 0.01 * rng.standard_normal(s.size))
    assert fit_cost_model(b, s, t, kind="auto").kind == "quadratic"
    t = (0.005 + 1e-4 * b * s**0.8) * (1 + 0.01 * rng.standard_normal(s.size))  # concave: no quadratic fits it
    assert fit_cost_model(b, s, t, kind="auto").kind == "power"


def test_predict_and_max_batch_size():
    m = PowerCostModel(0.03, 1e-6, 1.5)
    assert m.predict(4, 10_000) == pytest.approx(0.03 + 4e-6 * 1e6)
    assert m.predict([1, 2], [100, 100]).shape == (2,)
    # largest B with 0.03 + B * 1.0 <= 3.5 is 3
    assert m.max_batch_size([10_000], 3.5).tolist() == [3]
    assert m.max_batch_size([10_000], 0.5).tolist() == [0]
    assert m.m_comp(3.5) == pytest.approx((3.5 - 0.03) / 1e-6)
    q = QuadraticCostModel(0.01, 1e-6, 1e-10)
    per = 1e-6 * 5000 + 1e-10 * 5000**2
    assert q.max_batch_size([5000], 0.01 + 7.5 * per).tolist() == [7]


def test_json_round_trip():
    rng = np.random.default_rng(1)
    b, s = _grid()
    t = (0.03 + 2.7e-7 * b * s**1.41) * (1 + 0.03 * rng.standard_normal(s.size))
    for kind in ("power", "quadratic"):
        m = fit_cost_model(b, s, t, kind=kind)
        back = CostModel.from_json(json.dumps(m.to_json()))
        assert type(back) is type(m) and back.params() == m.params()
        assert back.fit.r2 == m.fit.r2 and back.fit.param_std.keys() == m.fit.param_std.keys()
        np.testing.assert_array_equal(back.predict(b, s), m.predict(b, s))


@pytest.mark.parametrize("args, match", [
    (([1, 2], [10, 20, 30], [1, 1, 1]), "equal lengths"),
    (([1, 2, 0], [10, 20, 30], [1, 1, 1]), r"batch_sizes\[2\]"),
    (([1, 2, 3], [10, 20, 30], [1, np.nan, 1]), r"step_times\[1\]"),
    (([1, 2], [10, 20], [1, 1]), "at least 3"),
])
def test_bad_points(args, match):
    with pytest.raises(ValueError, match=match):
        fit_cost_model(*args)


def test_bad_kind_and_json():
    with pytest.raises(ValueError, match="kind"):
        fit_cost_model([1, 2, 3], [1, 2, 3], [1, 2, 3], kind="cubic")
    with pytest.raises(ValueError, match="unknown kind"):
        CostModel.from_json({"kind": "linear"})
    with pytest.raises(ValueError, match=r"missing parameter\(s\) \['p'\]"):
        CostModel.from_json({"kind": "power", "a": 0.0, "b": 1.0})
