"""``adaptiveload plan`` / ``simulate`` (adaptiveload/sched/cli.py), run through their own argparse parser."""
import argparse
import json
import re

import numpy as np
import pytest

from adaptiveload.cliargs import HelpFormatter
from adaptiveload.sched import Plan, reference_mix, write_manifest
from adaptiveload.sched.cli import add_commands
from adaptiveload.sched.plan import rule_batch_sizes


def _parser():
    parser = argparse.ArgumentParser(prog="adaptiveload")
    add_commands(parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser))
    return parser


def _run(argv):
    args = _parser().parse_args(argv)
    return args.func(args)


def _help(command):
    parser = argparse.ArgumentParser(prog="adaptiveload")
    subparsers = parser.add_subparsers(dest="command")
    add_commands(subparsers)
    sub = subparsers.choices[command]
    sub.formatter_class = HelpFormatter
    return " ".join(sub.format_help().split())


def test_plan_reference_and_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert _run(["plan", "--calibration", "anchors-wan1.3b", "--world-size", "8", "--m-mem", "151200",
                 "--samples", "20000", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "21x90x160" in text and "eq-tok B" in text and "speedup" in text
    assert "reference_mix(num_samples=20000, seed=0) (20,000 samples)" in text
    plan = Plan.load(out)
    assert plan.world_size == 8 and plan.m_mem == 151200 and plan.predicted["speedup"] > 1.2
    assert plan.policy == "dual"


def test_plan_equal_token_policy_has_the_equal_token_batch_sizes(tmp_path):
    out = tmp_path / "plan.json"
    assert _run(["plan", "--calibration", "anchors-wan1.3b", "--world-size", "8", "--m-mem", "151200",
                 "--samples", "5000", "--policy", "equal_token", "--out", str(out)]) == 0
    plan = Plan.load(out)
    seq = np.array([r["seq_len"] for r in plan.buckets])
    assert plan.policy == "equal_token" and plan.step_budget_s is None and plan.m_mem == 151200
    assert [r["batch_size"] for r in plan.buckets] == (151200 // seq).tolist()
    assert plan.predicted["speedup"] == 1.0


def test_plan_manifest_file_and_memory_budget(tmp_path, capsys):
    path = tmp_path / "m.csv"
    write_manifest(reference_mix(2000, seed=1), path)
    with pytest.raises(ValueError, match="--drop-oversized"):
        _run(["plan", "--manifest", str(path), "--calibration", "anchors-wan1.3b", "--world-size", "2",
              "--memory-budget-gb", "48"])
    assert _run(["plan", "--manifest", str(path), "--calibration", "anchors-wan1.3b", "--world-size", "2",
                 "--memory-budget-gb", "48", "--drop-oversized"]) == 0
    assert "dropped (S > memory limit)" in capsys.readouterr().out


def test_samples_takes_the_first_rows_of_a_manifest(tmp_path, capsys):
    path = tmp_path / "m.csv"
    corpus = reference_mix(2000, seed=1)
    write_manifest(corpus, path)
    out = tmp_path / "plan.json"
    base = ["plan", "--manifest", str(path), "--calibration", "anchors-wan1.3b", "--world-size", "2",
            "--m-mem", "151200", "--out", str(out)]
    assert _run([*base, "--samples", "500"]) == 0
    captured = capsys.readouterr()
    assert f"manifest: {path} (first 500 rows) (500 samples)" in captured.out and captured.err == ""
    # the plan's bucket counts are those of the first 500 rows
    keys, counts = np.unique(corpus.latent_shapes[:500], axis=0, return_counts=True)
    expected = {tuple(k): int(c) for k, c in zip(keys.tolist(), counts)}
    assert {tuple(r["key"]): r["num_samples"] for r in Plan.load(out).buckets} == expected
    # more than the file has: all rows, and a note
    assert _run([*base, "--samples", "5000"]) == 0
    captured = capsys.readouterr()
    assert f"manifest: {path} (2,000 samples)" in captured.out
    assert captured.err == (f"adaptiveload: note: --samples 5,000 is more than the 2,000 rows of {path}: "
                            "using all of them\n")
    assert sum(r["num_samples"] for r in Plan.load(out).buckets) == 2000


def test_simulate_out(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert _run(["simulate", "--calibration", "anchors-wan1.3b-power", "--truth", "anchors-wan1.3b",
                 "--world-size", "2", "8", "--m-mem", "151200", "--samples", "20000", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("equal_token") == 2 and "CV true" in text
    rows = json.loads(out.read_text())
    assert [(r["world_size"], r["policy"]) for r in rows] == [
        (w, p) for w in (2, 8) for p in ("equal_token", "dual", "cost_grouped", "packed")]
    # every row has the balance, noise-floor and composition fields at the row level
    for r in rows:
        assert (r["compute_load_cv_plan"], r["compute_load_cv_truth"]) == (r["plan"]["cv"], r["truth"]["cv"])
        assert (r["idle_fraction_plan"], r["idle_fraction_truth"]) == (r["plan"]["idle"], r["truth"]["idle"])
        assert 0 < r["noise_floor_cv"] < 0.06 and 0 < r["noise_floor_idle"] < 0.08
        assert 0 < r["composition_ks"] < 1 and -1 <= r["composition_lag1_corr"] <= 1
    # the equal_token row's rule is B = M_mem / S with no step budget
    assert [(r["m_mem"], r["step_budget_s"]) for r in rows if r["policy"] == "equal_token"] == [(151200, None)] * 2
    assert _run(["simulate", "--calibration", "anchors-wan1.3b", "--truth", "power", "--policy", "cost_grouped",
                 "--world-size", "4", "--m-mem", "151200", "--samples", "5000"]) == 0


SIM = ["simulate", "--calibration", "anchors-wan1.3b", "--world-size", "2", "--m-mem", "151200"]
PLAN = ["plan", "--calibration", "anchors-wan1.3b", "--world-size", "2", "--m-mem", "151200", "--samples", "3000"]


@pytest.mark.parametrize("old, new, note", [
    ([*PLAN, "--policy", "random"], [*PLAN, "--policy", "dual"], "--policy random is deprecated"),
    ([*PLAN, "--policy", "cost-grouped"], [*PLAN, "--policy", "cost_grouped"], "--policy cost-grouped is deprecated"),
    ([*PLAN, "--policy", "equal-token"], [*PLAN, "--policy", "equal_token"], "--policy equal-token is deprecated"),
    ([*PLAN, "--policy", "dual-constraint"], [*PLAN, "--policy", "dual"], "--policy dual-constraint is deprecated"),
    ([*SIM, "--samples", "2000", "--policy", "equal-token"], [*SIM, "--samples", "2000", "--policy", "equal_token"],
     "--policy equal-token is deprecated"),
    ([*SIM, "--samples", "2000", "--policy", "dual-constraint"], [*SIM, "--samples", "2000", "--policy", "dual"],
     "--policy dual-constraint is deprecated"),
    ([*SIM, "--samples", "2000", "--policy", "random"], [*SIM, "--samples", "2000", "--policy", "dual"],
     "--policy random is deprecated"),
    ([*SIM, "--samples", "2000", "--policy", "cost-grouped"], [*SIM, "--samples", "2000", "--policy", "cost_grouped"],
     "--policy cost-grouped is deprecated"),
    ([*SIM, "--num-samples", "2000"], [*SIM, "--samples", "2000"], "--num-samples is deprecated"),
    ([*PLAN[:-2], "--num-samples", "3000"], PLAN, "--num-samples is deprecated"),
])
def test_old_spellings_work_with_one_note(old, new, note, capsys):
    assert _run(new) == 0
    expected = capsys.readouterr()
    assert expected.err == ""
    assert _run(old) == 0
    got = capsys.readouterr()
    assert got.out == expected.out
    assert got.err.count("\n") == 1 and got.err.startswith(f"adaptiveload: note: {note}")


def test_old_json_flag_writes_the_same_file(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert _run([*SIM, "--samples", "2000", "--out", str(out)]) == 0
    expected, expected_json = capsys.readouterr(), out.read_text()
    out.unlink()
    assert _run([*SIM, "--samples", "2000", "--json", str(out)]) == 0
    got = capsys.readouterr()
    assert (got.out, out.read_text()) == (expected.out, expected_json)
    assert got.err == "adaptiveload: note: --json is deprecated and will be removed in the next release; use --out\n"


@pytest.mark.parametrize("argv, message", [
    ([*SIM, "--truth-noise", "-1"], "argument --truth-noise: must be a finite number >= 0, got -1"),
    ([*SIM, "--truth-noise", "nan"], "argument --truth-noise: must be a finite number >= 0, got nan"),
    ([*SIM, "--epochs", "0"], "argument --epochs: must be an integer >= 1, got 0"),
    ([*SIM[:-4], "--world-size", "2", "0"], "argument --world-size: must be an integer >= 1, got 0"),
    ([*PLAN, "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    ([*PLAN, "--samples", "0"], "argument --samples: must be an integer >= 1, got 0"),
    ([*PLAN, "--m-mem", "1.5"], "argument --m-mem: must be an integer, got '1.5'"),
    ([*PLAN, "--memory-budget-gb", "0"], "argument --memory-budget-gb: must be a finite number > 0, got 0"),
    ([*PLAN, "--policy", "fast"],
     "argument --policy: invalid choice 'fast' (choose from equal_token, dual, cost_grouped, packed)"),
    ([*SIM, "--policy", "all", "fast"],
     "argument --policy: invalid choice 'fast' (choose from equal_token, dual, cost_grouped, packed, all)"),
    ([*PLAN, "--vae-stride", "4,8"], "argument --vae-stride: expected three comma-separated integers T,H,W, got 2 in '4,8'"),
    ([*SIM, "--patch-size", "1,0,2"], "argument --patch-size: expected integers T,H,W >= 1, got '1,0,2'"),
])
def test_bad_values_are_rejected_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(message)


def test_help_shows_every_default_once():
    plan, sim = _help("plan"), _help("simulate")
    assert "--policy {equal_token,dual,cost_grouped,packed}" in plan and "(default: dual)" in plan
    assert "--vae-stride T,H,W" in plan and "(default: 4,8,8)" in plan and "(default: 1,2,2)" in sim
    assert "(default: all)" in sim and "(default: 0.05)" in sim and "(default: plan)" in sim
    for text in (plan, sim):
        assert "--seed SEED seed of the reference mix and of the sampler (default: 0)" in text
        assert "(default: reference)" in text and "(default: 1,000,000)" in text
        assert "--num-samples" not in text and "--json" not in text  # deprecated: hidden
        assert "(default " not in text  # no hand-written duplicate


def test_missing_calibration_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="calibration not found: nope.json"):
        _run(["simulate", "--calibration", "nope.json", "--world-size", "2"])


def test_plan_rule_matches_the_cli_table(tmp_path):
    """The plan written by the CLI follows the sampler's rule for its budgets."""
    out = tmp_path / "plan.json"
    assert _run([*PLAN, "--world-size", "4", "--out", str(out)]) == 0
    plan = Plan.load(out)
    seq = np.array([r["seq_len"] for r in plan.buckets])
    expected = rule_batch_sizes(plan.cost_model, seq, plan.m_mem, plan.step_budget_s)
    assert [r["batch_size"] for r in plan.buckets] == expected.tolist()


@pytest.mark.parametrize("text, expected", [("4,8,8", (4, 8, 8)), (" 8, 32,32 ", (8, 32, 32)), ("2,2,2", (2, 2, 2))])
def test_int_triple_parses_t_h_w(text, expected):
    from adaptiveload.cliargs import int_triple
    assert int_triple(text) == expected


@pytest.mark.parametrize("text, message", [
    ("4,8", "expected three comma-separated integers T,H,W, got 2 in '4,8'"),
    ("4,8,8,1", "got 4 in '4,8,8,1'"),
    ("4,8,0", "expected integers T,H,W >= 1, got '4,8,0'"),
    ("4,x,8", "expected three comma-separated integers T,H,W, got '4,x,8'"),
    ("4.5,8,8", "got '4.5,8,8'"),
])
def test_int_triple_rejects_bad_values(text, message):
    from adaptiveload.cliargs import int_triple
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        int_triple(text)


def test_vae_stride_and_patch_size_reach_the_plan(tmp_path, capsys):
    """An LTX-Video-like corpus (VAE 8x32x32, patch 1x1x1) gets its own token counts, recorded in the plan."""
    path = tmp_path / "m.csv"
    path.write_text("num_frames,height,width\n1,480,832\n81,480,832\n")
    out = tmp_path / "plan.json"
    assert _run(["plan", "--manifest", str(path), "--calibration", "anchors-wan1.3b", "--world-size", "1",
                 "--m-mem", "20000", "--vae-stride", "8,32,32", "--patch-size", "1,1,1", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert (plan.vae_stride, plan.patch_size) == ((8, 32, 32), (1, 1, 1))
    assert {tuple(r["key"]): r["seq_len"] for r in plan.buckets} == {(1, 15, 26): 390, (11, 15, 26): 4290}
    # the same rows in Wan's units are other buckets
    assert _run(["plan", "--manifest", str(path), "--calibration", "anchors-wan1.3b", "--world-size", "1",
                 "--m-mem", "40000", "--out", str(out)]) == 0
    assert [r["seq_len"] for r in Plan.load(out).buckets] == [1560, 32760] and Plan.load(out).vae_stride == (4, 8, 8)
    # CogVideoX 1.5's 2x2x2 patches: latent frames floored to an even number, half as many tokens per frame
    path.write_text("num_frames,height,width\n17,480,832\n81,480,832\n81,480,832\n")
    assert _run(["plan", "--manifest", str(path), "--calibration", "anchors-wan1.3b", "--world-size", "1",
                 "--m-mem", "40000", "--patch-size", "2,2,2", "--policy", "packed", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert {tuple(r["key"]): r["seq_len"] for r in plan.buckets} == {(4, 60, 104): 2 * 30 * 52, (20, 60, 104): 10 * 30 * 52}
    assert plan.patch_size == (2, 2, 2)
    capsys.readouterr()


def test_plan_says_which_memory_budget_it_assumed(capsys):
    base = ["plan", "--calibration", "anchors-wan1.3b", "--world-size", "8", "--samples", "3000"]
    assert _run(base) == 0
    captured = capsys.readouterr()
    assert "memory budget: 140.4 GiB (from calibration device NVIDIA H200); at most 118,040 tokens per batch" in captured.out
    assert captured.err.startswith("adaptiveload: warning: --calibration anchors-wan1.3b is a built-in calibration "
                                   "measured on an NVIDIA H200: the plan assumes its 140.4 GiB")
    assert captured.err.count("\n") == 1 and "--memory-budget-gb (e.g. 80 for an 80 GB GPU)" in captured.err
    assert _run([*base, "--memory-budget-gb", "80", "--drop-oversized"]) == 0
    captured = capsys.readouterr()
    assert "memory budget: 80.0 GiB (from --memory-budget-gb)" in captured.out and captured.err == ""
    assert _run([*base, "--m-mem", "151200"]) == 0
    captured = capsys.readouterr()
    assert "memory budget: 178.3 GiB (from --m-mem 151,200 tokens: the memory model's peak / its safety factor)" \
        in captured.out and captured.err == ""


def test_plan_names_the_policy_that_would_gain(tmp_path, capsys):
    """At the H200's budget the dual rule is the equal-token rule on the reference mix (1.00x): plan
    says which policy predicts the most instead."""
    argv = ["plan", "--calibration", "anchors-wan1.3b", "--world-size", "2", "--samples", "3000", "--memory-budget-gb",
            "140.4"]
    assert _run(argv) == 0
    text = capsys.readouterr().out
    assert "speedup 1.00x" in text
    speedups = {}
    for policy in ("cost_grouped", "packed"):
        out = tmp_path / f"{policy}.json"
        assert _run([*argv, "--policy", policy, "--out", str(out)]) == 0
        speedups[policy] = Plan.load(out).predicted
    best = max(speedups, key=lambda p: speedups[p]["speedup"])
    assert (f"policy dual predicts no gain over equal-token (1.00x); policy {best} predicts "
            f"{speedups[best]['speedup']:.2f}x ({speedups[best]['tokens_per_s']:,.0f} tokens/s): --policy {best}") in text


def test_plan_and_simulate_packed_end_to_end(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert _run([*PLAN, "--policy", "packed", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "policy packed: M_mem = 151,200 tokens per rank (pack)" in text and "sample ms" in text
    plan = Plan.load(out)
    assert plan.policy == "packed" and plan.step_budget_s > 0 and plan.predicted["speedup"] > 1.0
    sim = tmp_path / "sim.json"
    assert _run([*SIM, "--samples", "3000", "--policy", "packed", "dual", "--out", str(sim)]) == 0
    rows = {r["policy"]: r for r in json.loads(sim.read_text())}
    assert list(rows) == ["packed", "dual"]
    assert rows["packed"]["idle_fraction_plan"] < rows["dual"]["idle_fraction_plan"]
    assert rows["packed"]["composition_ks"] < rows["dual"]["composition_ks"]
