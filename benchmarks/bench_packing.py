"""Balanced packing against the bucket policies on a simulated cluster: balance, noise floor, randomness
of each step's samples, tokens/s -- every policy at W = 2, 8, 64, 1024, at M_mem = 151,200 tokens and
at the H200's memory budget.

Plans with the built-in ``anchors-wan1.3b`` calibration (Wan-1.3B measured on an H200, quadratic
model; adaptiveload/sched/presets.py) on the reference mix, and scores against the truth = the same
model x (1 + 0.05 N(0, 1)) per rank and step (``adaptiveload simulate``'s default). W = 64 and 1024
replay several epochs so that the lag-1 correlation rests on at least 4000 steps (its standard error,
about 1/sqrt(steps), is then a third of the 0.05 target). About 3 minutes on 2 CPU cores.

    python benchmarks/bench_packing.py
    python benchmarks/bench_packing.py --samples 200000 --world-sizes 2 8
"""
from __future__ import annotations

import argparse
import math
import os
import time

from adaptiveload.sched import reference_mix
from adaptiveload.sched.cli import REFERENCE_SAMPLES
from adaptiveload.sched.plan import memory_limit
from adaptiveload.sched.presets import load_calibration
from adaptiveload.sched.simulate import simulate
from results_file import run_context, write_json_and_markdown

CALIBRATION = "anchors-wan1.3b"
M_MEM = 151_200  # two 720p 81-frame clips (S = 75,600 each)
STEPS_FOR_CORRELATION = 4000  # steps replayed at least (more epochs at large W): lag-1 is then known to +-0.016 (1 sd)
SAMPLES_PER_PACK = 5  # about, on the reference mix: steps per epoch ~ samples / (W * 5)


def check_targets(rows):
    """The packed policy's targets, per budget and W: (name, value, limit, met)."""
    checks = []
    for (budget, w), by in sorted(_by_budget_and_w(rows).items()):
        p, where = by["packed"], f"{budget}, W = {w}"
        checks += [(f"{where}: packed CV (plan) <= 0.03", p["compute_load_cv_plan"], 0.03),
                   (f"{where}: packed idle (plan) <= 0.03", p["idle_fraction_plan"], 0.03),
                   (f"{where}: packed CV (truth) - noise floor <= 0.01", p["compute_load_cv_truth"] - p["noise_floor_cv"], 0.01),
                   (f"{where}: packed idle (truth) - noise floor <= 0.01",
                    p["idle_fraction_truth"] - p["noise_floor_idle"], 0.01),
                   (f"{where}: packed KS / dual KS <= 1.1", p["composition_ks"] / by["dual"]["composition_ks"], 1.1),
                   (f"{where}: |packed lag-1 correlation| <= 0.05", abs(p["composition_lag1_corr"]), 0.05)]
        if w == 8 and budget == f"M_mem {M_MEM:,}":
            checks += [(f"{where}: packed / cost_grouped tokens/s (truth) >= 0.98",
                        p["truth"]["tokens_per_s"] / by["cost_grouped"]["truth"]["tokens_per_s"], -0.98),
                       (f"{where}: packed / equal_token tokens/s (truth) >= 1.5",
                        p["truth"]["tokens_per_s"] / by["equal_token"]["truth"]["tokens_per_s"], -1.5)]
    # a negative limit is a lower bound
    return [(name, value, abs(limit), value <= limit if limit > 0 else value >= -limit) for name, value, limit in checks]


def _by_budget_and_w(rows):
    out = {}
    for r in rows:
        out.setdefault((r["budget"], r["world_size"]), {})[r["policy"]] = r
    return out


def markdown(rows, checks, context):
    lines = [f"## Balanced packing on a simulated cluster: reference mix ({context['samples']:,} samples)", "",
             f"`{context['command']}` -- {context['date']}, {context['elapsed_s']:.0f} s on {context['cpu_count']} CPUs "
             f"({context['cpu']}), torch {context['torch']}, numpy {context['numpy']}. Calibration `{CALIBRATION}` "
             f"(Wan-1.3B on an H200, quadratic model); truth = the same model x (1 + 0.05 N(0,1)) per rank and step; "
             "budgets chosen by `make_plan` for each policy and W. CV and idle: mean over steps of std/mean and "
             "1 - mean/max of the ranks' step times; floor: what the truth's noise alone gives exactly balanced "
             "ranks; KS: mean over steps of the two-sample KS statistic between the step's sequence lengths and "
             "the corpus's; lag-1: correlation of consecutive steps' mean sequence length.", ""]
    for budget in dict.fromkeys(r["budget"] for r in rows):
        lines += [f"### {budget}", "",
                  "| W | policy | M_mem | step budget ms | CV plan | CV truth | CV floor | idle plan | idle truth | "
                  "idle floor | tokens/s (truth) | vs equal_token | KS | lag-1 | steps | epochs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        base = {r["world_size"]: r["truth"]["tokens_per_s"] for r in rows
                if r["budget"] == budget and r["policy"] == "equal_token"}
        for r in (r for r in rows if r["budget"] == budget):
            step_budget = "-" if r["step_budget_s"] is None else f"{r['step_budget_s'] * 1e3:,.0f}"
            lag1 = "-" if r["composition_lag1_corr"] is None else f"{r['composition_lag1_corr']:+.3f}"
            lines.append(
                f"| {r['world_size']} | {r['policy']} | {r['m_mem']:,} | {step_budget} | {r['compute_load_cv_plan']:.3f} | "
                f"{r['compute_load_cv_truth']:.3f} | {r['noise_floor_cv']:.3f} | {r['idle_fraction_plan']:.3f} | "
                f"{r['idle_fraction_truth']:.3f} | {r['noise_floor_idle']:.3f} | {r['truth']['tokens_per_s']:,.0f} | "
                f"{r['truth']['tokens_per_s'] / base[r['world_size']]:.2f}x | {r['composition_ks']:.3f} | {lag1} | "
                f"{r['truth']['steps']:,} | {r['epochs']} |")
        lines.append("")
    met = sum(ok for *_, ok in checks)
    lines += [f"### Targets of the packed policy: {met} of {len(checks)} met", ""]
    lines += [f"- {name}: {value:.3f} -- {'met' if ok else 'NOT met'}" for name, value, _, ok in checks]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=REFERENCE_SAMPLES, help="size of the reference mix")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8, 64, 1024])
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    manifest = reference_mix(args.samples, seed=0)
    calibration = load_calibration(CALIBRATION)
    h200 = memory_limit(calibration, int(manifest.seq_lens.max()))
    budgets = [(f"M_mem {M_MEM:,}", {"m_mem": M_MEM}),
               (f"H200 memory budget ({h200[2] / 2**30:.1f} GiB x 0.9: M_mem {h200[0]:,})", {})]
    rows = []
    for budget, kwargs in budgets:
        for w in args.world_sizes:
            epochs = max(1, math.ceil(STEPS_FOR_CORRELATION * w * SAMPLES_PER_PACK / args.samples))
            for r in simulate(manifest, calibration, w, epochs=epochs, **kwargs):
                rows.append({"budget": budget, "epochs": epochs, **r.to_json()})
            print(f"{budget}, W = {w}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    checks = check_targets(rows)
    context = {**run_context(__file__, argv), "samples": args.samples, "calibration": CALIBRATION,
               "truth_noise": 0.05, "elapsed_s": time.perf_counter() - t0}
    text = markdown(rows, checks, context)
    print(text)
    write_json_and_markdown(args.out_dir, "packing_reference_mix",
                            {"context": context, "rows": rows,
                             "targets": [{"target": n, "value": v, "met": ok} for n, v, _, ok in checks]}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
