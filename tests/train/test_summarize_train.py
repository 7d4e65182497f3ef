"""benchmarks/summarize_train.py's check of measured steps against the run's calibrated cost model."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALIBRATION = os.path.join(REPO, "benchmarks/results/train_h200/calib_ckpt.json")


@pytest.fixture(scope="module")
def summarize_train():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import summarize_train
        yield summarize_train
    finally:
        sys.path.remove(os.path.join(REPO, "benchmarks"))


def _model_s(batch_size, seq_len):
    """The calibration's quadratic cost model, evaluated from its JSON coefficients."""
    with open(CALIBRATION) as f:
        c = json.load(f)["cost_model"]
    return c["c0"] + c["c1"] * batch_size * seq_len + c["c2"] * batch_size * seq_len**2


def test_slow_steps_are_those_over_the_factor_and_the_margin(summarize_train):
    long, short = 75_600, 1_560
    history = [  # two ranks; a step's prediction is its slowest rank's
        {"step": 0, "batch_sizes": [1, 2], "seq_lens": [long, short], "step_time_s": 3.6, "global_tokens": long + 2 * short},
        {"step": 1, "batch_sizes": [1, 1], "seq_lens": [long, long], "step_time_s": 20.0, "global_tokens": 2 * long},
        {"step": 2, "batch_sizes": [1, 1], "seq_lens": [short, short], "step_time_s": 1.0, "global_tokens": 2 * short},
    ]
    check = summarize_train._step_check({"history": history}, CALIBRATION, slow_factor=2.0, slow_min_s=5.0)
    # step 1: 20 s against ~3.55 s, over both 2x and +5 s; step 2: over 2x its ~0.09 s but not 5 s over it
    assert [s["step"] for s in check["slow_steps"]] == [1]
    assert check["slow_steps"][0]["predicted_s"] == pytest.approx(_model_s(1, long))
    tokens = sum(h["global_tokens"] for h in history)
    assert check["tokens_per_s_slow_steps_at_model"] == pytest.approx(tokens / (3.6 + _model_s(1, long) + 1.0))
    # a calibration that cannot be read: no check
    assert summarize_train._step_check({"history": history}, "no-such-calibration.json", 2.0, 5.0) == {}


def test_a_failed_first_run_is_not_the_baseline(summarize_train):
    """The first run that trained a step is the baseline; a run that failed in warm-up shows '-'."""
    def row(name, steps, tokens_per_s):
        return {"world_size": 2, "name": name, "backend": "b", "policy": "equal_token", "status": "ok" if steps else "failed",
                "steps": steps, "tokens_per_s": tokens_per_s, "compute_load_cv": 0.1, "idle_fraction": 0.1,
                "peak_memory_gib": None, "eval_loss_first": None, "eval_loss_last": None,
                "compiled_graphs_in_training": 0}

    text = summarize_train.table([row("failed", 0, float("nan")), row("base", 3, 100.0), row("other", 3, 150.0)], {})
    lines = text.splitlines()[2:]
    assert "| failed | b | equal_token | failed | - | - |" in lines[0]
    assert "| 100 | 1.000× |" in lines[1] and "| 150 | 1.500× |" in lines[2]


@pytest.mark.parametrize("name, policy, command", [
    ("x2_cost_grouped.json", "cost_grouped", "--policy cost_grouped"),
    ("x2_dual.json", "dual", "--policy dual"),
    ("x2_baseline.json", "equal_token", "--policy equal_token"),
])
def test_results_of_version_1_read_in_the_current_policy_names(summarize_train, name, policy, command):
    """Files written before the one policy vocabulary ("sampler" dual/equal + "policy" random/cost_grouped)."""
    path = os.path.join(REPO, "benchmarks/results/train_h200", name)
    with open(path) as f:
        assert json.load(f)["version"] == 1
    (row,) = summarize_train.summarize(path, 2.0, 5.0)
    assert row["policy"] == policy and command in row["command"] and "--sampler" not in row["command"]
