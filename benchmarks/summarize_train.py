"""Side-by-side table of `adaptiveload train` runs (results.json files), with the simulator's prediction.

    R=benchmarks/results/train_h200
    python benchmarks/summarize_train.py $R/x1_inductor_equal.json $R/x1_adaptiveload_equal.json \
        $R/x2_baseline.json $R/x2_dual.json $R/x2_cost_grouped.json \
        --simulate $R/simulate_w2_128.json --stem train_h200

Each run is compared with the first run of the same world size given that trained at least one
step (give the baseline first).
Prints a markdown table and writes it with a JSON summary (per run: device, torch version, date, the
exact `adaptiveload train` command rebuilt from the run's config, and the numbers) to
``<out-dir>/<stem>.md`` and ``.json``.

A second table checks each run's steps against its calibration's cost model (when the calibration
file the run names can be read): the step of every rank predicted as ``cost_model.predict(B, S)``, a
step's prediction the slowest rank's. It lists the measured and simulated median step time, the
steps that took over ``--slow-factor`` times their prediction and at least ``--slow-min-s`` seconds
more (a compile, or a first run of a shape), and tokens/s with those steps at their predicted time:
an estimate, labelled as one. A run whose calibration file cannot be read here (e.g. a quick
calibration saved on the GPU machine) has no row in it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from adaptiveload.jsonfile import check_header
from adaptiveload.sched.policies import policy_name
from adaptiveload.sched.presets import load_calibration
from adaptiveload.train.results import RESULTS_FORMAT, RESULTS_VERSION
from results_file import run_context, write_json_and_markdown

GIB = 2**30
# flags of `adaptiveload train` rebuilt into each run's command, in this order (config key, flag)
FLAGS = (("preset", "--preset"), ("num_layers", "--num-layers"), ("samples", "--samples"), ("seed", "--seed"),
         ("calibration", "--calibration"), ("memory_budget_gb", "--memory-budget-gb"), ("m_mem", "--m-mem"),
         ("drop_oversized", "--drop-oversized"), ("activation_checkpointing", "--activation-checkpointing"),
         ("backend", "--backend"), ("policy", "--policy"))


def train_command(doc: dict) -> str:
    """The `adaptiveload train` command line of a results file (torchrun for several ranks)."""
    cfg = doc["config"]
    world = doc["world_size"]
    head = (f"torchrun --nproc-per-node {world} -m adaptiveload train" if world > 1 else "adaptiveload train")
    args = [flag if cfg[key] is True else f"{flag} {cfg[key]}"
            for key, flag in FLAGS if cfg.get(key) is not None and cfg[key] is not False]
    return " ".join([head, *args])


def _run_policy(sampler: str, policy: str) -> str:
    """A version-1 run's batching policy from its "sampler" (dual, equal) and "policy" (random, cost_grouped)."""
    return "equal_token" if sampler == "equal" else policy_name(policy)


def upgrade(doc: dict) -> dict:
    """A results file of version 1 in the current version's terms (runs and config name the batching
    policy in "policy"); anything else unchanged."""
    if not isinstance(doc, dict) or doc.get("format") != RESULTS_FORMAT or doc.get("version") != 1:
        return doc
    config = dict(doc["config"])
    config["policy"] = _run_policy(config.pop("sampler", "dual"), config.get("policy", "random"))
    runs = [{**{k: v for k, v in run.items() if k != "sampler"}, "policy": _run_policy(run["sampler"], run["policy"])}
            for run in doc["runs"]]
    return {**doc, "version": RESULTS_VERSION, "config": config, "runs": runs}


def summarize(path: str, slow_factor: float, slow_min_s: float) -> dict:
    """One row per run of a results file (version 1 files are read through :func:`upgrade`)."""
    with open(path) as f:
        doc = upgrade(json.load(f))
    try:
        check_header(doc, fmt=RESULTS_FORMAT, version=RESULTS_VERSION, what="train results", where=path,
                     required=("runs",))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    rows = []
    for run in doc["runs"]:
        peaks = run.get("peak_memory_bytes_per_rank") or []
        rows.append({
            "file": os.path.basename(path), "name": run["name"], "command": train_command(doc),
            "device": doc["device"], "torch": doc["torch_version"], "date": doc["date"],
            "world_size": run["world_size"], "backend": run["backend"],
            "policy": run["policy"],
            "status": run["status"], "steps": run["steps"], "samples": run["samples"], "tokens": run["tokens"],
            "tokens_per_s": run["tokens_per_s"], "predicted_tokens_per_s": _predicted(run),
            "compute_load_cv": run["compute_load_cv"], "idle_fraction": run["idle_fraction"],
            "peak_memory_gib": max(peaks) / GIB if peaks else None,
            "eval_loss_first": run["eval_loss"][0][1] if run.get("eval_loss") else None,
            "eval_loss_last": run.get("final_eval_loss"), "error": run.get("error"),
            "fused_chains": run.get("fused_chains"), "compiled_graphs_in_training": run.get("compiled_graphs_in_training"),
            "plan_m_mem": run["plan"]["m_mem"], "step_time_median_s": (run.get("step_time_s") or {}).get("median"),
            "compile_steps": run.get("compile_steps"),
            # a run that failed mid-way has no top-level calibration yet: the one its command named
            **_step_check(run, doc.get("calibration") or doc["config"].get("calibration"), slow_factor, slow_min_s),
        })
    return rows


def _step_check(run: dict, calibration, slow_factor: float, slow_min_s: float) -> dict:
    """Steps over ``slow_factor`` times the calibration's prediction and ``slow_min_s`` above it, and
    tokens/s with them at the prediction; empty when the run's calibration file cannot be read."""
    try:
        cost_model = load_calibration(calibration).cost_model
    except (FileNotFoundError, ValueError, TypeError):
        return {}
    history = run.get("history") or []
    slow, wall = [], 0.0
    for h in history:
        predicted = float(max(cost_model.predict(h["batch_sizes"], h["seq_lens"])))
        if h["step_time_s"] > max(slow_factor * predicted, predicted + slow_min_s):
            slow.append({"step": h["step"], "measured_s": h["step_time_s"], "predicted_s": predicted})
            wall += predicted
        else:
            wall += h["step_time_s"]
    tokens = sum(h["global_tokens"] for h in history)
    return {"slow_steps": slow, "tokens_per_s_slow_steps_at_model": tokens / wall if wall > 0 else None}


def _predicted(run: dict):
    predicted = (run.get("plan") or {}).get("predicted") or {}
    return predicted.get("equal_token_tokens_per_s") if run["policy"] == "equal_token" else predicted.get("tokens_per_s")


def table(rows: list[dict], simulated: dict) -> str:
    lines = ["| W | run | backend | policy | status | tokens/s | vs baseline | simulated tokens/s (vs eq-tok) | "
             "compute-load CV (simulated) | idle fraction | peak GiB | eval loss first → last | compiles in timed steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    baseline = {}  # per world size: the first run given that trained a step
    for r in rows:
        if r["steps"] > 0:
            baseline.setdefault(r["world_size"], r["tokens_per_s"])
    for r in rows:
        base = baseline.get(r["world_size"], math.nan)
        sim = simulated.get((r["world_size"], r["policy"]))
        sim_text = f"{sim['tokens_per_s']:,.0f} ({sim['speedup']:.2f}×)" if sim else "-"
        cv_text = f"{r['compute_load_cv']:.3f}" + (f" ({sim['cv']:.3f})" if sim else "")
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        loss = " → ".join("-" if v is None else f"{v:.4f}" for v in (r["eval_loss_first"], r["eval_loss_last"]))
        measured = r["steps"] > 0  # a run that failed in warm-up has no step to report
        lines.append(
            f"| {r['world_size']} | {r['name']} | {r['backend']} | {r['policy']} | {r['status']} | "
            + (f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.3f}× | " if measured else "- | - | ")
            + f"{sim_text} | " + (f"{cv_text} | {r['idle_fraction']:.3f} | " if measured else "- | - | ")
            + f"{peak} | {loss} | {r['compiled_graphs_in_training']} |")
    return "\n".join(lines)


def step_table(rows: list[dict], simulated: dict, slow_factor: float, slow_min_s: float) -> str:
    """Measured against the cost model, per run (see the module docstring)."""
    lines = ["| W | run | step ms median (simulated) | steps that compiled | steps over "
             f"{slow_factor:g}× and {slow_min_s:g} s over the model: measured s / model s | "
             "tokens/s with those at the model's time (estimate) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "slow_steps" not in r:
            continue
        sim = simulated.get((r["world_size"], r["policy"]))
        median = r["step_time_median_s"]
        median = "-" if median is None or math.isnan(median) else f"{1000 * median:,.0f}"
        median += f" ({1000 * sim['step_time_p50_s']:,.0f})" if sim else ""
        compiled = ("not recorded" if r["compile_steps"] is None  # results written before the per-step record
                    else ", ".join(map(str, r["compile_steps"])) or "none")
        slow = ", ".join(f"{s['step']}: {s['measured_s']:.1f} / {s['predicted_s']:.1f}" for s in r["slow_steps"]) or "none"
        estimate = r["tokens_per_s_slow_steps_at_model"]
        lines.append(f"| {r['world_size']} | {r['name']} | {median} | {compiled} | {slow} | "
                     f"{'-' if estimate is None else f'{estimate:,.0f}'} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def load_simulation(path: str | None) -> dict:
    """``{(world size, policy): {"tokens_per_s", "speedup", "cv", "idle", "step_time_p50_s"}}`` (scored
    against the simulation's truth) from `adaptiveload simulate --out` (older files' policy names are mapped)."""
    if not path:
        return {}
    with open(path) as f:
        doc = json.load(f)
    for row in doc:
        row["policy"] = policy_name(row["policy"])
    equal = {row["world_size"]: row["truth"]["tokens_per_s"] for row in doc if row["policy"] == "equal_token"}
    return {(row["world_size"], row["policy"]): {
        "tokens_per_s": row["truth"]["tokens_per_s"], "speedup": row["truth"]["tokens_per_s"] / equal[row["world_size"]],
        "cv": row["truth"]["cv"], "idle": row["truth"]["idle"], "step_time_p50_s": row["truth"]["step_time_p50_s"]}
        for row in doc}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results.json files of `adaptiveload train`, baseline first per world size")
    p.add_argument("--simulate", default=None, help="JSON of `adaptiveload simulate` for the same corpus and plan")
    p.add_argument("--stem", default="train_h200", help="output file stem under --out-dir")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="where <stem>.md and <stem>.json go (default benchmarks/results/, overwriting a committed table)")
    p.add_argument("--slow-factor", type=float, default=2.0,
                   help="list steps that took over this many times the cost model's prediction (default 2)")
    p.add_argument("--slow-min-s", type=float, default=5.0,
                   help="... and at least this many seconds more than it (default 5)")
    args = p.parse_args(argv)
    rows = [row for path in args.results for row in summarize(path, args.slow_factor, args.slow_min_s)]
    simulated = load_simulation(args.simulate)
    text = "\n\n".join(t for t in (table(rows, simulated), step_table(rows, simulated, args.slow_factor, args.slow_min_s)) if t)
    print(text)
    doc = {"context": run_context(__file__, argv), "runs": rows,
           "simulated": [{"world_size": w, "policy": p, **v} for (w, p), v in simulated.items()]}
    write_json_and_markdown(args.out_dir, args.stem, doc, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
