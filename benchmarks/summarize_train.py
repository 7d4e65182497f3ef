"""Side-by-side table of `adaptiveload train` runs (results.json files), with the simulator's prediction.

    R=benchmarks/results/train_h200
    python benchmarks/summarize_train.py $R/x1_inductor_equal.json $R/x1_adaptiveload_equal.json \
        $R/x2_baseline.json $R/x2_dual.json $R/x2_cost_grouped.json \
        --simulate $R/simulate_w2_128.json --stem train_h200

Each run is compared with the first run of the same world size given (give the baseline first).
Prints a markdown table and writes it with a JSON summary (per run: device, torch version, date, the
exact `adaptiveload train` command rebuilt from the run's config, and the numbers) to
``<out-dir>/<stem>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from adaptiveload.jsonfile import check_header
from adaptiveload.train.job import RESULTS_FORMAT, RESULTS_VERSION
from results_file import run_context, write_json_and_markdown

GIB = 2**30
# flags of `adaptiveload train` rebuilt into each run's command, in this order (config key, flag)
FLAGS = (("preset", "--preset"), ("num_layers", "--num-layers"), ("samples", "--samples"), ("seed", "--seed"),
         ("calibration", "--calibration"), ("memory_budget_gb", "--memory-budget-gb"), ("m_mem", "--m-mem"),
         ("drop_oversized", "--drop-oversized"), ("backend", "--backend"), ("sampler", "--sampler"),
         ("policy", "--policy"))


def train_command(doc: dict) -> str:
    """The `adaptiveload train` command line of a results file (torchrun for several ranks)."""
    cfg = doc["config"]
    world = doc["world_size"]
    head = (f"torchrun --nproc-per-node {world} -m adaptiveload train" if world > 1 else "adaptiveload train")
    args = [flag if cfg[key] is True else f"{flag} {cfg[key]}"
            for key, flag in FLAGS if cfg.get(key) is not None and cfg[key] is not False]
    return " ".join([head, *args])


def summarize(path: str) -> dict:
    """One row per run of a results file."""
    with open(path) as f:
        doc = json.load(f)
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
            "sampler": run["sampler"] + (f" ({run['policy']})" if run["sampler"] == "dual" else ""),
            "status": run["status"], "steps": run["steps"], "samples": run["samples"], "tokens": run["tokens"],
            "tokens_per_s": run["tokens_per_s"], "predicted_tokens_per_s": _predicted(run),
            "compute_load_cv": run["compute_load_cv"], "idle_fraction": run["idle_fraction"],
            "peak_memory_gib": max(peaks) / GIB if peaks else None,
            "eval_loss_first": run["eval_loss"][0][1] if run.get("eval_loss") else None,
            "eval_loss_last": run.get("final_eval_loss"), "error": run.get("error"),
            "fused_chains": run.get("fused_chains"), "compiled_graphs_in_training": run.get("compiled_graphs_in_training"),
            "plan_m_mem": run["plan"]["m_mem"],
        })
    return rows


def _predicted(run: dict):
    predicted = (run.get("plan") or {}).get("predicted") or {}
    return predicted.get("tokens_per_s") if run["sampler"] == "dual" else predicted.get("equal_token_tokens_per_s")


def table(rows: list[dict], simulated: dict) -> str:
    lines = ["| W | run | backend | sampler | status | tokens/s | vs baseline | simulated tokens/s (vs eq-tok) | "
             "compute-load CV (simulated) | idle fraction | peak GiB | eval loss first → last | compiles in timed steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    baseline = {}
    for r in rows:
        base = baseline.setdefault(r["world_size"], r["tokens_per_s"])
        sim = simulated.get((r["world_size"], _policy(r)))
        sim_text = f"{sim['tokens_per_s']:,.0f} ({sim['speedup']:.2f}×)" if sim else "-"
        cv_text = f"{r['compute_load_cv']:.3f}" + (f" ({sim['cv']:.3f})" if sim else "")
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        loss = " → ".join("-" if v is None else f"{v:.4f}" for v in (r["eval_loss_first"], r["eval_loss_last"]))
        lines.append(
            f"| {r['world_size']} | {r['name']} | {r['backend']} | {r['sampler']} | {r['status']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base:.3f}× | {sim_text} | {cv_text} | {r['idle_fraction']:.3f} | "
            f"{peak} | {loss} | {r['compiled_graphs_in_training']} |")
    return "\n".join(lines)


def _policy(row: dict) -> str:
    if row["sampler"].startswith("equal"):
        return "equal-token"
    return "cost-grouped" if "cost_grouped" in row["sampler"] else "dual-constraint"


def load_simulation(path: str | None) -> dict:
    """``{(world size, policy): {"tokens_per_s", "speedup", "cv", "idle"}}`` (scored against the
    simulation's truth) from `adaptiveload simulate --json`."""
    if not path:
        return {}
    with open(path) as f:
        doc = json.load(f)
    equal = {row["world_size"]: row["truth"]["tokens_per_s"] for row in doc if row["policy"] == "equal-token"}
    return {(row["world_size"], row["policy"]): {
        "tokens_per_s": row["truth"]["tokens_per_s"], "speedup": row["truth"]["tokens_per_s"] / equal[row["world_size"]],
        "cv": row["truth"]["cv"], "idle": row["truth"]["idle"]} for row in doc}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results.json files of `adaptiveload train`, baseline first per world size")
    p.add_argument("--simulate", default=None, help="JSON of `adaptiveload simulate` for the same corpus and plan")
    p.add_argument("--stem", default="train_h200", help="output file stem under --out-dir")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="where <stem>.md and <stem>.json go (default benchmarks/results/, overwriting a committed table)")
    args = p.parse_args(argv)
    rows = [row for path in args.results for row in summarize(path)]
    simulated = load_simulation(args.simulate)
    text = table(rows, simulated)
    print(text)
    doc = {"context": run_context(__file__, argv), "runs": rows,
           "simulated": [{"world_size": w, "policy": p, **v} for (w, p), v in simulated.items()]}
    write_json_and_markdown(args.out_dir, args.stem, doc, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
