"""The README's first command under a competing load: ``adaptiveload train`` with no arguments, run
again and again while other processes keep every core busy.

Target: rc 0 in every run, each within 60 s, on a 2-core machine with both cores busy; a poor quick
calibration is warned about, never fatal. Each run gets a fresh output folder; the load is one
busy-looping process per core (``--load-procs``), started before the first run and stopped after the
last. The table and JSON (outcome, wall time, warnings and tokens/s per run) go to
``benchmarks/results/<stem>.{md,json}``.

    python benchmarks/stress_default_run.py                 # 20 runs, one busy process per core
    python benchmarks/stress_default_run.py --runs 3 --load-procs 0   # idle machine, for comparison
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time

from results_file import run_context, write_json_and_markdown

TIME_LIMIT_S = 60.0  # the target per run


def _busy_loop() -> None:
    while True:  # pure Python: holds one core, as another user's job would
        sum(i * i for i in range(10_000))


def _one_run(index: int, out_root: str, timeout_s: float) -> dict:
    out = os.path.join(out_root, f"run{index}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the job's own thread choice
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "adaptiveload", "train", "--out", out], capture_output=True,
                              text=True, timeout=timeout_s, env=env)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, stderr = None, (err.stderr or b"").decode(errors="replace")  # bytes, even with text=True
    wall = time.perf_counter() - start
    warnings = [line.strip() for line in stderr.splitlines() if "calibration:" in line]
    tokens_per_s = None
    if rc == 0:
        with open(os.path.join(out, "results.json")) as f:
            tokens_per_s = json.load(f)["runs"][0]["tokens_per_s"]
    return {"run": index, "rc": rc, "wall_s": wall, "calibration_warnings": warnings, "tokens_per_s": tokens_per_s,
            "stderr_tail": "" if rc == 0 else stderr[-2000:]}


def _row(r: dict) -> str:
    tokens_per_s = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
    warning = r["calibration_warnings"][0] if r["calibration_warnings"] else "-"
    return f"| {r['run']} | {r['rc']} | {r['wall_s']:.1f} | {tokens_per_s} | {warning} |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="runs of `adaptiveload train`")
    p.add_argument("--load-procs", type=int, default=os.cpu_count(), help="busy-looping processes beside the runs")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a run taking longer is stopped and counted failed")
    p.add_argument("--stem", default="stress_default_run", help="output file stem")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    load = [multiprocessing.Process(target=_busy_loop, daemon=True) for _ in range(args.load_procs)]
    for proc in load:
        proc.start()
    runs = []
    try:
        with tempfile.TemporaryDirectory() as out_root:
            for i in range(args.runs):
                runs.append(_one_run(i, out_root, args.timeout_s))
                print(_row(runs[-1]), flush=True)
    finally:
        for proc in load:
            proc.terminate()
    walls = [r["wall_s"] for r in runs]
    ok = sum(r["rc"] == 0 for r in runs)
    within = sum(r["rc"] == 0 and r["wall_s"] <= TIME_LIMIT_S for r in runs)
    summary = {"runs": len(runs), "rc_0": ok, f"rc_0_within_{TIME_LIMIT_S:g}_s": within,
               "wall_s_median": statistics.median(walls), "wall_s_max": max(walls),
               "warned_runs": sum(bool(r["calibration_warnings"]) for r in runs), "load_procs": args.load_procs}
    text = "\n".join([
        f"`adaptiveload train` (no arguments), {args.load_procs} busy process(es) beside it, "
        f"{os.cpu_count()} cores: rc 0 in {ok} of {len(runs)} runs, {within} within {TIME_LIMIT_S:g} s; "
        f"wall median {summary['wall_s_median']:.1f} s, max {summary['wall_s_max']:.1f} s; "
        f"calibration warned in {summary['warned_runs']}",
        "", "| run | rc | wall s | tokens/s | calibration warning |", "|---|---|---|---|---|",
        *(_row(r) for r in runs)])
    print(text)
    write_json_and_markdown(args.out_dir, args.stem, {"context": run_context(__file__, argv), "summary": summary,
                                                      "runs": runs}, text)
    return 0 if within == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
