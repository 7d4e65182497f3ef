"""Time and memory to plan an epoch of a large manifest (issue 4 target: 10M samples in <= 10 s, <= 2 GB).

Measures, on the reference mix (ANCHORS section 3):

* ``sampler init`` -- ``DualConstraintBucketSampler(latent_shapes, ...)``: bucket grouping and batch sizes;
* ``epoch plan`` -- ``sampler.epoch_plan(epoch)``: shuffle, cut into batches, assign to steps (what every
  rank computes at the start of each epoch);
* ``first batch`` -- ``next(iter(sampler))`` (includes the epoch plan);
* ``make_plan`` -- the budget search of ``adaptiveload plan``.

Peak memory of each phase is the numpy/Python allocation peak (``tracemalloc``, which numpy reports to)
above what was allocated before the phase, plus the process's peak RSS at the end.

    python benchmarks/bench_planner.py                       # 10M samples, W = 8
    python benchmarks/bench_planner.py --num-samples 1000000 --world-size 1024
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

from adaptiveload.sched import DualConstraintBucketSampler, make_plan, reference_mix
from adaptiveload.sched.presets import load_calibration
from results_file import run_context, write_json_and_markdown

POLICIES = ("random", "cost_grouped")


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
    ap.add_argument("--m-mem", type=int, default=151_200, help="tokens per batch (ANCHORS section 3)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    manifest = reference_mix(args.num_samples, seed=0)
    gen_s = time.perf_counter() - t0
    shapes = manifest.latent_shapes
    cal = load_calibration("anchors-wan1.3b")
    rows = []
    for policy in POLICIES:
        kw = dict(m_mem=args.m_mem, num_replicas=args.world_size, rank=0, policy=policy, cost_model=cal.cost_model)
        init, sampler = measure(lambda: DualConstraintBucketSampler(shapes, **kw), args.repeats)
        epoch, plan = measure(lambda: sampler.epoch_plan(1), args.repeats)
        first, _ = measure(lambda: next(iter(sampler)), args.repeats)
        rows += [{"phase": "sampler init", "policy": policy, **init},
                 {"phase": "epoch plan", "policy": policy, **epoch, "steps": plan.num_steps},
                 {"phase": "first batch", "policy": policy, **first}]
        del plan
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
    per_epoch = max(by[("sampler init", p)]["median_s"] + by[("epoch plan", p)]["median_s"] for p in POLICIES)
    lines += ["", f"Sampler init + epoch plan: {per_epoch:.2f} s (median, slower policy; target <= 10 s); "
              f"process peak RSS {peak_rss / 2**30:.2f} GiB (target <= 2 GB)."]
    lines += ["", f"Process peak RSS {peak_rss / 2**20:.0f} MiB (includes the manifest arrays, "
              f"{context['manifest_bytes'] / 2**20:.0f} MiB, and the Python/torch runtime); reference-mix generation "
              f"{gen_s:.2f} s."]
    text = "\n".join(lines)
    print(text)
    write_json_and_markdown(args.out_dir, f"planner_{args.num_samples}_w{args.world_size}",
                            {"context": context, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
