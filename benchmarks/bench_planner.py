"""Time and memory to plan an epoch of a large manifest (target: 10M samples in <= 10 s and <= 2 GB
on 2 cores, for every policy, at W = 8 and W = 1024).

Measures, on the reference mix (adaptiveload/sched/manifest.py), with the built-in ``anchors-wan1.3b``
calibration and M_mem = 151,200 tokens (two 720p 81-frame clips):

* ``sampler init`` -- ``DualConstraintBucketSampler(latent_shapes, ...)`` (step orders ``random`` and
  ``cost_grouped``) or ``PackingSampler(latent_shapes, ...)`` (``packed``, at the step budget
  ``make_plan`` chooses): bucket grouping and batch sizes or per-sample work;
* ``epoch plan`` -- ``sampler.epoch_plan(epoch)``: what every rank computes at each ``set_epoch``
  (shuffle and cut into batches and steps, or pack);
* ``first batch`` -- ``set_epoch(e)`` and ``next(iter(sampler))`` of a new epoch (includes its plan);
* ``make_plan`` -- the budget search of ``adaptiveload plan`` (policy ``dual``, and ``packed`` when measured).

Peak memory of each phase is the numpy/Python allocation peak (``tracemalloc``, which numpy reports to)
above what was allocated before the phase, plus the process's peak RSS at the end (run one policy per
process to see its own peak).

    python benchmarks/bench_planner.py                       # 10M samples, W = 8, every policy
    python benchmarks/bench_planner.py --policies packed --world-size 1024
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
import tracemalloc

import numpy as np
import torch

from adaptiveload.sched import DualConstraintBucketSampler, PackingSampler, make_plan, reference_mix
from adaptiveload.sched.presets import load_calibration
from results_file import run_context, write_json_and_markdown

POLICIES = ("random", "cost_grouped", "packed")  # the bucket sampler's step orders, and packing


def measure(fn, repeats: int):
    """Median / min / max seconds and the tracemalloc peak (bytes above the start) of ``fn()``."""
    times, peaks, result = [], [], None
    for _ in range(repeats):
        result = None
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        peaks.append(tracemalloc.get_traced_memory()[1] - base)
        tracemalloc.stop()
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "peak_bytes": max(peaks)}, result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-samples", type=int, default=10_000_000)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--m-mem", type=int, default=151_200, help="tokens per batch (pack)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    manifest = reference_mix(args.num_samples, seed=0)
    gen_s = time.perf_counter() - t0
    shapes = manifest.latent_shapes
    cal = load_calibration("anchors-wan1.3b")
    rows = []
    for policy in args.policies:
        if policy == "packed":
            search, plan = measure(lambda: make_plan(manifest, cal, args.world_size, m_mem=args.m_mem, policy="packed"),
                                   args.repeats)
            rows.append({"phase": "make_plan", "policy": "packed", **search})
            kw = dict(num_replicas=args.world_size, rank=0)
            init, sampler = measure(lambda: PackingSampler(shapes, plan.m_mem, plan.step_budget_s, cal.cost_model, **kw),
                                    args.repeats)
        else:
            kw = dict(m_mem=args.m_mem, num_replicas=args.world_size, rank=0, policy=policy, cost_model=cal.cost_model)
            init, sampler = measure(lambda: DualConstraintBucketSampler(shapes, **kw), args.repeats)
        # a new epoch every time: the packing sampler keeps the last epoch it planned
        epochs = iter(range(1, 2 * args.repeats + 1))
        epoch, epoch_plan = measure(lambda: sampler.epoch_plan(next(epochs)), args.repeats)
        first, _ = measure(lambda: (sampler.set_epoch(next(epochs)), next(iter(sampler))), args.repeats)
        rows += [{"phase": "sampler init", "policy": policy, **init},
                 {"phase": "epoch plan", "policy": policy, **epoch, "steps": epoch_plan.num_steps},
                 {"phase": "first batch", "policy": policy, **first}]
        del epoch_plan
    if set(args.policies) & {"random", "cost_grouped"}:
        search, _ = measure(lambda: make_plan(manifest, cal, args.world_size, m_mem=args.m_mem), args.repeats)
        rows.append({"phase": "make_plan", "policy": "dual", **search})
    load = os.getloadavg()  # other processes on the machine inflate the timings
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    context = {**run_context(__file__, argv),
               "load_average_1_5_15min": list(load), "num_samples": args.num_samples, "world_size": args.world_size, "m_mem": args.m_mem,
               "num_buckets": int(len(np.unique(shapes, axis=0))), "reference_mix_generation_s": gen_s,
               "process_peak_rss_bytes": peak_rss, "manifest_bytes": int(shapes.nbytes + manifest.seq_lens.nbytes
                                                                         + manifest.pixel_shapes.nbytes)}
    lines = [f"# Epoch planning, {args.num_samples:,} samples (reference mix), W = {args.world_size}",
             "", f"`{context['command']}` -- {context['date']}, {context['cpu_count']} CPUs, numpy {np.__version__}, "
             f"torch {torch.__version__}, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)", "",
             "| phase | policy | median s | min s | max s | peak alloc MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['policy']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
                     f"{r['peak_bytes'] / 2**20:.0f} |")
    by = {(r["phase"], r["policy"]): r for r in rows}
    per_epoch = {p: by[("sampler init", p)]["median_s"] + by[("epoch plan", p)]["median_s"] for p in args.policies}
    lines += ["", "Sampler init + epoch plan (median): " + ", ".join(f"{p} {t:.2f} s" for p, t in per_epoch.items())
              + f" (target <= 10 s); process peak RSS {peak_rss / 2**30:.2f} GiB (target <= 2 GB)."]
    lines += ["", f"Process peak RSS {peak_rss / 2**20:.0f} MiB (includes the manifest arrays, "
              f"{context['manifest_bytes'] / 2**20:.0f} MiB, and the Python/torch runtime); reference-mix generation "
              f"{gen_s:.2f} s."]
    text = "\n".join(lines)
    print(text)
    suffix = "" if tuple(args.policies) == POLICIES else "_" + "_".join(args.policies)
    write_json_and_markdown(args.out_dir, f"planner_{args.num_samples}_w{args.world_size}{suffix}",
                            {"context": context, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
