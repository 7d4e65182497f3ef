"""Cluster simulation (adaptiveload/sched/simulate.py)."""
import numpy as np
import pytest

from adaptiveload.sched import reference_mix
from adaptiveload.sched.presets import load_calibration
from adaptiveload.sched.simulate import format_results, load_metrics, simulate


def test_load_metrics_by_hand():
    costs = np.array([[1.0, 3.0], [2.0, 2.0]])
    tokens = np.array([[10, 30], [20, 20]])
    m = load_metrics(costs, tokens)
    assert m["cv"] == pytest.approx((0.5 + 0.0) / 2)  # std/mean: step 1 = 1/2, step 2 = 0
    assert m["idle"] == pytest.approx(((1 - 2 / 3) + 0.0) / 2)
    assert m["tokens_per_s"] == pytest.approx(80 / (3 + 2))
    assert m["step_time_mean_s"] == pytest.approx(2.5) and m["step_time_cv"] == pytest.approx(0.5 / 2.5)
    assert m["steps"] == 2
    with pytest.raises(ValueError, match="at least one step"):
        load_metrics(np.zeros((0, 2)), np.zeros((0, 2)))


def test_noise_free_truth_equals_the_plan_model():
    m = reference_mix(5000, seed=1)
    cal = load_calibration("anchors-wan1.3b")
    for r in simulate(m, cal, 4, m_mem=151200, truth_noise=0.0):
        assert r.truth_metrics == r.plan_metrics


def test_reference_mix_targets_at_w8():
    """The targets of benchmarks/bench_simulate.py at W = 8, truth = the quadratic model with 5% noise."""
    m = reference_mix(200_000, seed=0)
    cal = load_calibration("anchors-wan1.3b")
    res = {r.policy: r for r in simulate(m, cal, 8, m_mem=151200, truth_noise=0.05)}
    assert list(res) == ["equal_token", "dual", "cost_grouped", "packed"]
    eq, dual, grouped = (res[p].truth_metrics for p in ("equal_token", "dual", "cost_grouped"))
    assert 0.34 <= eq["cv"] <= 0.40
    assert dual["cv"] <= 0.19 and dual["tokens_per_s"] >= 1.20 * eq["tokens_per_s"]
    assert grouped["cv"] <= 0.07 and grouped["tokens_per_s"] >= 1.5 * eq["tokens_per_s"]
    # the noise costs something: truth throughput is below the plan model's for the balanced policies
    assert grouped["tokens_per_s"] < res["cost_grouped"].plan_metrics["tokens_per_s"]
    # packed: balanced on the plan model, at the noise floor under the truth, as fast as cost_grouped,
    # with steps of random samples (cost_grouped's are not)
    packed = res["packed"]
    assert packed.plan_metrics["cv"] <= 0.03 and packed.plan_metrics["idle"] <= 0.03
    assert packed.truth_metrics["cv"] <= packed.noise_floor_cv + 0.01
    assert packed.truth_metrics["idle"] <= packed.noise_floor_idle + 0.01
    assert packed.truth_metrics["tokens_per_s"] >= 0.98 * grouped["tokens_per_s"]
    assert packed.truth_metrics["tokens_per_s"] >= 1.5 * eq["tokens_per_s"]
    assert packed.composition_ks <= 1.1 * res["dual"].composition_ks < res["cost_grouped"].composition_ks
    assert abs(packed.composition_lag1_corr) <= 0.05
    assert len({(r.noise_floor_cv, r.noise_floor_idle) for r in res.values()}) == 1  # one floor per W
    text = format_results(list(res.values()))
    assert "cost_grouped" in text and "vs eq-tok" in text


def test_equal_token_replay_trains_every_sample_once_by_hand():
    """Equal-token at W = 8: B_k = 151,200 // S_k, one batch per ceil(n_k / B_k), steps = ceil(batches / 8);
    every sample is trained once, plus the whole batches repeated to fill the last step."""
    m = reference_mix(20_000, seed=0)
    (r,) = simulate(m, load_calibration("anchors-wan1.3b"), 8, policies=("equal_token",), m_mem=151200, truth_noise=0.0)
    keys, counts = np.unique(m.latent_shapes, axis=0, return_counts=True)
    seq = keys[:, 0] * (keys[:, 1] // 2) * (keys[:, 2] // 2)  # 1x2x2 patches
    batches = int(np.sum(-(-counts // (151200 // seq))))
    steps = -(-batches // 8)
    metrics = r.plan_metrics
    assert metrics["steps"] == steps
    trained = metrics["tokens_per_s"] * metrics["step_time_mean_s"] * steps  # = all tokens of the replay
    manifest_tokens = float(np.sum(counts * seq))
    assert manifest_tokens * (1 - 1e-12) <= trained <= (manifest_tokens + (8 * steps - batches) * 151200) * (1 + 1e-12)
    assert (r.m_mem, r.step_budget_s) == (151200, None)


def test_truth_from_another_model_and_bad_policy():
    m = reference_mix(3000, seed=2)
    cal = load_calibration("anchors-wan1.3b-power")
    truth = load_calibration("anchors-wan1.3b").cost_model
    (r,) = simulate(m, cal, 2, policies=("dual",), truth_model=truth, truth_noise=0.0, m_mem=151200)
    assert r.truth_metrics["tokens_per_s"] != r.plan_metrics["tokens_per_s"]
    # an older spelling is the same policy, reported by its current name
    (old,) = simulate(m, cal, 2, policies=("dual-constraint",), truth_model=truth, truth_noise=0.0, m_mem=151200)
    assert old == r
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        simulate(m, cal, 2, policies=("dual", "fast"), m_mem=151200)
