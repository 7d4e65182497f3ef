"""``adaptiveload plan`` / ``simulate`` (adaptiveload/sched/cli.py), run through their own argparse parser."""
import argparse
import json

import pytest

from adaptiveload.sched import Plan, reference_mix, write_manifest
from adaptiveload.sched.cli import add_commands


def _run(argv):
    parser = argparse.ArgumentParser(prog="adaptiveload")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_reference_and_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert _run(["plan", "--calibration", "anchors-wan1.3b", "--world-size", "8", "--m-mem", "151200",
                 "--num-samples", "20000", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "21x90x160" in text and "eq-tok B" in text and "speedup" in text
    plan = Plan.load(out)
    assert plan.world_size == 8 and plan.m_mem == 151200 and plan.predicted["speedup"] > 1.2


def test_plan_manifest_file_and_memory_budget(tmp_path, capsys):
    path = tmp_path / "m.csv"
    write_manifest(reference_mix(2000, seed=1), path)
    with pytest.raises(ValueError, match="--drop-oversized"):
        _run(["plan", "--manifest", str(path), "--calibration", "anchors-wan1.3b", "--world-size", "2",
              "--memory-budget-gb", "48"])
    assert _run(["plan", "--manifest", str(path), "--calibration", "anchors-wan1.3b", "--world-size", "2",
                 "--memory-budget-gb", "48", "--drop-oversized"]) == 0
    assert "dropped (S > memory limit)" in capsys.readouterr().out


def test_simulate_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert _run(["simulate", "--calibration", "anchors-wan1.3b-power", "--truth", "anchors-wan1.3b",
                 "--world-size", "2", "8", "--m-mem", "151200", "--num-samples", "20000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("equal-token") == 2 and "CV true" in text
    rows = json.loads(out.read_text())
    assert [(r["world_size"], r["policy"]) for r in rows] == [
        (w, p) for w in (2, 8) for p in ("equal-token", "dual-constraint", "cost-grouped")]
    assert _run(["simulate", "--calibration", "anchors-wan1.3b", "--truth", "power", "--policy", "cost-grouped",
                 "--world-size", "4", "--m-mem", "151200", "--num-samples", "5000"]) == 0


def test_simulate_takes_the_samplers_policy_spelling(tmp_path):
    """`train`/`plan` say cost_grouped; simulate accepts it as cost-grouped."""
    out = tmp_path / "sim.json"
    assert _run(["simulate", "--calibration", "anchors-wan1.3b", "--policy", "cost_grouped", "equal-token",
                 "--world-size", "2", "--m-mem", "151200", "--num-samples", "2000", "--json", str(out)]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())] == ["cost-grouped", "equal-token"]


def test_missing_calibration_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="calibration not found: nope.json"):
        _run(["simulate", "--calibration", "nope.json", "--world-size", "2"])
