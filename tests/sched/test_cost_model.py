"""Cost-model fits (adaptiveload/sched/cost_model.py): parameter recovery, JSON round trip, errors."""
import json

import numpy as np
import pytest

from adaptiveload.sched import fit_cost_model, fit_packed_cost_model
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
        CostModel.from_json({"kind": "cubic"})
    with pytest.raises(ValueError, match=r"missing parameter\(s\) \['p'\]"):
        CostModel.from_json({"kind": "power", "a": 0.0, "b": 1.0})


# ------------------------------------------------------------------ noisy calibrations never raise under "auto"

from hypothesis import given, strategies as st  # noqa: E402

# a quick calibration's grid: 3 batch sizes x 3 sequence lengths (the tiny model's buckets)
B9 = np.array([1, 2, 4] * 3)
S9 = np.repeat([64, 256, 1024], 3)
GRID_B, GRID_S = np.meshgrid([1, 3, 64, 1e4], [1, 7, 4096, 1e6])


def _check_usable(model):
    """No exception got here; predictions finite and >= 0 on a grid of B, S >= 1 (huge ones included),
    and a warning exactly when the linear fallback was taken."""
    pred = model.predict(GRID_B, GRID_S)
    assert np.all(np.isfinite(pred)) and np.all(pred >= 0)
    assert np.all(model.max_batch_size(GRID_S.ravel(), 1.0) >= 0)
    if model.kind == "linear":
        assert len(model.fit.warnings) == 1 and "\n" not in model.warning
        assert "R^2" in model.warning and "linear" in model.warning
    else:
        assert model.fit.warnings == [] and model.warning is None
        assert not (np.isfinite(model.r2) and model.r2 < 0.8)
        if model.kind == "power":
            assert 0.5 + 1e-3 < model.p < 3.0 - 1e-3
    back = CostModel.from_json(json.loads(json.dumps(model.to_json())))
    assert back.fit.warnings == model.fit.warnings and back.params() == model.params()


def _shaped(kind, level, spike_at, factor):
    t = np.full(B9.size, level)
    if kind == "decreasing":
        t = level * np.linspace(2.0, 1.0, B9.size)
    elif kind == "outlier":  # one slow first point (warm-up), the rest flat
        t[0] *= factor
    elif kind == "spike":  # 10x on one point, the rest linear in tokens
        t = level * (1 + B9 * S9 / 4096)
        t[spike_at] *= 10
    return t


@given(kind=st.sampled_from(["flat", "decreasing", "outlier", "spike"]),
       level=st.floats(1e-4, 10.0), spike_at=st.integers(0, B9.size - 1), factor=st.floats(1.5, 20.0))
def test_auto_never_raises_on_shaped_noise(kind, level, spike_at, factor):
    _check_usable(fit_cost_model(B9, S9, _shaped(kind, level, spike_at, factor), kind="auto"))


@given(st.lists(st.floats(1e-5, 1e3, allow_nan=False, allow_infinity=False), min_size=9, max_size=9),
       st.lists(st.integers(1, 64), min_size=9, max_size=9), st.lists(st.integers(1, 10**5), min_size=9, max_size=9))
def test_auto_never_raises_on_random_positive_times(times, batch_sizes, seq_lens):
    _check_usable(fit_cost_model(batch_sizes, seq_lens, times, kind="auto"))


@pytest.mark.parametrize("kind", ["flat", "decreasing", "outlier"])
def test_times_that_do_not_grow_fall_back_to_linear(kind):
    t = _shaped(kind, 0.05, 0, 10.0)
    m = fit_cost_model(B9, S9, t, kind="auto")
    assert m.kind == "linear"
    assert "power: b = 0" in m.warning and "quadratic: c1 + c2 = 0" in m.warning
    with pytest.raises(ValueError, match="b = 0"):
        fit_cost_model(B9, S9, t, kind="power")
    with pytest.raises(ValueError, match=r"c1 \+ c2 = 0"):
        fit_cost_model(B9, S9, t, kind="quadratic")


def test_flat_times_give_the_proportional_model_by_hand():
    # t does not grow with x = B*S: nnls gives c1 = 0, so the fallback is t = c1*x with
    # c1 = argmin sum(((c1 x - t) / t)^2) = sum(x/t) / sum((x/t)^2)
    t = np.full(B9.size, 0.05)
    x = (B9 * S9).astype(np.float64)
    m = fit_cost_model(B9, S9, t, kind="auto")
    assert (m.c0, m.c1) == (0.0, pytest.approx(np.sum(x / t) / np.sum((x / t) ** 2), rel=1e-12))
    assert m.warning.startswith("poor step-time fit (power: b = 0")


def test_p_pinned_at_a_bound_falls_back_and_names_it():
    # t grows like S^4, steeper than P_BOUNDS allows: the power fit pins p at 3, the quadratic fits well
    t = 0.01 + 1e-12 * B9 * (S9 / 64.0) ** 4.0
    with pytest.raises(ValueError, match=r"p = 3.000 at its upper bound 3.0"):
        fit_cost_model(B9, S9, t, kind="power")
    m = fit_cost_model(B9, S9, t, kind="auto")
    assert m.kind == "quadratic" and m.r2 > 0.99 and m.warning is None
    # like S^6: p pinned again, and neither family reaches R^2 0.8
    t = 0.01 + 1e-3 * B9 * (S9 / 64.0) ** 6.0
    m = fit_cost_model(B9, S9, t, kind="auto")
    assert m.kind == "linear"
    assert m.warning.startswith("poor step-time fit (power: R^2 ")
    assert "< 0.8, p = 3.000 at its upper bound 3.0; quadratic: R^2 " in m.warning
    assert f"using the linear model {m._formula()} (R^2 {m.r2:.2f})" in m.warning


def test_exact_linear_data_recovers_c0_c1():
    t = 0.02 + 3e-6 * B9 * S9
    m = fit_cost_model(B9, S9, t, kind="linear")
    np.testing.assert_allclose([m.c0, m.c1], [0.02, 3e-6], rtol=1e-9)
    assert m.r2 == pytest.approx(1.0) and m.fit.warnings == []
    assert m.predict(10, 1000) == pytest.approx(0.02 + 3e-6 * 1e4)
    # the largest B with 0.02 + B * 3e-6 * 1000 <= 0.05 is 10
    assert m.max_batch_size([1000], 0.05 + 1e-12).tolist() == [10]
    auto = fit_cost_model(B9, S9, t, kind="auto")  # a special case of both families: no fallback
    assert auto.fit.warnings == [] and auto.kind in ("power", "quadratic")
    np.testing.assert_allclose(auto.predict(B9, S9), t, rtol=1e-6)


def test_exact_power_data_has_no_warning():
    b, s = _grid()
    t = 0.02 + 1e-6 * b * s**1.3
    m = fit_cost_model(b, s, t, kind="auto")
    assert m.kind == "power" and m.fit.warnings == [] and m.warning is None
    np.testing.assert_allclose([m.a, m.b, m.p], [0.02, 1e-6, 1.3], rtol=1e-4)


def test_low_r2_warns_with_an_explicit_kind():
    # a 10x spike on one point of linear data: the quadratic follows the others, R^2 stays low
    t = 0.02 + 3e-6 * B9 * S9
    t[4] *= 10
    q = fit_cost_model(B9, S9, t, kind="quadratic")
    assert q.r2 < 0.8
    assert q.warning == (f"poor step-time fit: R^2 {q.r2:.2f} < 0.8 for the quadratic model {q._formula()}; "
                         "the times were probably measured under load, or the shapes were too few or too small to "
                         "time: recalibrate on an idle machine with more bucket shapes, or give a calibration")


def test_warnings_round_trip_and_old_json_loads():
    m = fit_cost_model(B9, S9, np.full(B9.size, 0.05))
    d = m.to_json()
    assert d["kind"] == "linear" and d["fit"]["warnings"] == m.fit.warnings
    del d["fit"]["warnings"]  # written before warnings existed
    assert CostModel.from_json(d).fit.warnings == []
    assert "\n" not in m.describe()


def _packs(rng, count):
    """Packs of 1 to 8 samples drawn from the reference mix's sequence lengths (single images too,
    so the intercept shows)."""
    lengths = np.array([1560, 3600, 7800, 14040, 20280, 26520, 32760, 46800, 61200, 75600])
    return [rng.choice(lengths, size=rng.integers(1, 9)) for _ in range(count)]


@pytest.mark.parametrize("seed", range(5))
def test_packed_fit_recovers_c0_c1_c2_from_noisy_packs(seed):
    rng = np.random.default_rng(seed)
    packs = _packs(rng, 80)
    c0, c1, c2 = 18.75e-3, 7.16e-6, 3.957e-10
    exact = np.array([c0 + c1 * p.sum() + c2 * np.sum(p.astype(float) ** 2) for p in packs])  # sum of squares
    t = exact * (1 + 0.02 * rng.standard_normal(exact.size))
    m = fit_packed_cost_model(packs, t, kind="quadratic")
    assert isinstance(m, QuadraticCostModel)
    np.testing.assert_allclose([m.c1, m.c2], [c1, c2], rtol=0.08)
    assert m.c0 == pytest.approx(c0, rel=0.25)
    assert m.r2 > 0.99 and m.fit.n_points == 80 and 0.005 < m.fit.cv_rel_rmse < 0.05
    # auto keeps the quadratic family on these packs
    assert fit_packed_cost_model(packs, t).kind == "quadratic"


def test_packed_fit_exact_data_and_the_square_of_the_sum_is_wrong():
    packs = _packs(np.random.default_rng(7), 30)
    t = [0.02 + 7e-6 * p.sum() + 4e-10 * np.sum(p.astype(float) ** 2) for p in packs]
    m = fit_packed_cost_model(packs, t, kind="quadratic")
    np.testing.assert_allclose([m.c0, m.c1, m.c2], [0.02, 7e-6, 4e-10], rtol=1e-6)
    np.testing.assert_allclose(m.predict_packs(np.concatenate(packs), [len(p) for p in packs]), t, rtol=1e-6)
    # the same times as if attention ran over the whole pack (square of the sum) fit worse
    t_square = [0.02 + 7e-6 * p.sum() + 4e-10 * float(p.sum()) ** 2 for p in packs]
    assert fit_packed_cost_model(packs, t_square, kind="quadratic").r2 < 0.999


@pytest.mark.parametrize("kind", ["quadratic", "power", "linear"])
def test_a_batch_is_a_pack_of_equal_samples(kind):
    """fit_cost_model on (B, S) points and fit_packed_cost_model on packs of B samples of S agree."""
    rng = np.random.default_rng(3)
    b, s = _grid()
    t = (0.03 + 2.7e-7 * b * s**1.41) * (1 + 0.03 * rng.standard_normal(s.size))
    batches = fit_cost_model(b, s, t, kind=kind)
    packs = fit_packed_cost_model([np.full(bb, ss) for bb, ss in zip(b, s)], t, kind=kind)
    np.testing.assert_allclose(list(packs.params().values()), list(batches.params().values()), rtol=1e-6)
    assert packs.fit.r2 == pytest.approx(batches.fit.r2, rel=1e-9)


def test_predict_packs_by_hand():
    q = QuadraticCostModel(0.01, 1e-6, 1e-10)
    got = q.predict_packs([1000, 2000, 4000, 500], [3, 0, 1])
    assert got.tolist() == pytest.approx([0.01 + 1e-6 * 7000 + 1e-10 * (1e6 + 4e6 + 16e6), 0.01, 0.01 + 1e-6 * 500 + 1e-10 * 25e4])
    p = PowerCostModel(0.03, 1e-6, 1.5)
    assert p.predict_packs([100, 400], [2]).tolist() == pytest.approx([0.03 + 1e-6 * (1000 + 8000)])
    with pytest.raises(ValueError, match="pack_sizes must be >= 0 and sum to the 2 sequence lengths, got sum 3"):
        q.predict_packs([1, 2], [1, 2])


@pytest.mark.parametrize("packs, times, match", [
    ([[100], [200]], [1, 1, 1], "packs and step_times must have equal lengths, got 2, 3"),
    ([[100], [], [300]], [1, 1, 1], r"packs\[1\] is empty"),
    ([[100], [200, -5], [300]], [1, 1, 1], r"packs\[1\]\[1\] = -5.0: must be a positive finite number"),
    ([[100], [200], [300]], [1, 0, 1], r"step_times\[1\] = 0.0"),
    ([[100], [200]], [1, 1], "at least 3"),
])
def test_packed_fit_errors(packs, times, match):
    with pytest.raises(ValueError, match=match):
        fit_packed_cost_model(packs, times)
