"""``adaptiveload plan`` and ``adaptiveload simulate``.

Both take ``--manifest`` (a CSV / JSONL / Parquet file, or ``reference`` for the built-in reference
mix of ANCHORS section 3) and ``--calibration`` (a calibration JSON from ``adaptiveload calibrate``,
or a built-in: ``anchors-wan1.3b`` -- the Wan-1.3B H200 measurements of ANCHORS section 2, quadratic
model -- or ``anchors-wan1.3b-power``), so both run without a GPU::

    adaptiveload plan --manifest reference --calibration anchors-wan1.3b --world-size 8 --m-mem 151200
    adaptiveload simulate --calibration anchors-wan1.3b --world-size 2 8 1024 --m-mem 151200
"""
from __future__ import annotations

import argparse
import json

from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.cost_model import fit_cost_model
from adaptiveload.sched.manifest import Manifest, load_manifest, reference_mix
from adaptiveload.sched.plan import make_plan
from adaptiveload.sched.presets import PRESETS, load_calibration
from adaptiveload.sched.simulate import SIM_POLICIES, format_results, simulate

REFERENCE = "reference"
FIT_KINDS = ("power", "quadratic")


def _manifest(args) -> Manifest:
    if args.manifest in (None, REFERENCE):
        return reference_mix(args.num_samples, seed=args.seed)
    return load_manifest(args.manifest)


def _memory_kwargs(args) -> dict:
    budget = None if args.memory_budget_gb is None else args.memory_budget_gb * 2**30
    return {"memory_budget_bytes": budget, "m_mem": args.m_mem, "drop_oversized": args.drop_oversized}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", default=REFERENCE,
                   help="manifest file (.csv/.jsonl/.parquet with num_frames,height,width or seq_len columns), or "
                        "'reference' for the built-in reference mix (default)")
    p.add_argument("--num-samples", type=int, default=1_000_000, help="samples of the reference mix (default 1,000,000)")
    p.add_argument("--calibration", required=True,
                   help=f"calibration JSON from 'adaptiveload calibrate', or a built-in: {', '.join(PRESETS)} "
                        "(step time and peak memory of a Wan-1.3B-shaped model, 10 of 30 layers, bf16 eager + AdamW, measured on one H200; see adaptiveload/sched/presets.py)")
    p.add_argument("--memory-budget-gb", type=float, default=None,
                   help="device memory for training in GiB; with the calibration's memory model gives the M_mem limit")
    p.add_argument("--m-mem", type=int, default=None, help="fixed memory budget in tokens per batch (overrides the memory model)")
    p.add_argument("--drop-oversized", action="store_true", help="drop buckets whose one sample exceeds the memory limit")
    p.add_argument("--seed", type=int, default=0, help="seed of the reference mix and of the sampler")


def _run_plan(args) -> int:
    calibration = load_calibration(args.calibration)  # first: a bad path fails before the manifest is read
    manifest = _manifest(args)
    plan = make_plan(manifest, calibration, args.world_size, policy=args.policy, **_memory_kwargs(args))
    print(calibration.describe())
    print(f"manifest: {manifest.source} ({len(manifest):,} samples)")
    print(plan.format_table())
    if args.out:
        plan.save(args.out)
        print(f"wrote {args.out}")
    return 0


def _truth_model(args, calibration: Calibration):
    if args.truth == "plan":
        return calibration.cost_model
    if args.truth in FIT_KINDS:  # the calibration's measured points, fitted with the named model family
        timed = [p for p in calibration.points if p["status"] == "ok" and p["step_time_s"] is not None]
        return fit_cost_model([p["batch_size"] for p in timed], [p["seq_len"] for p in timed],
                              [p["step_time_s"] for p in timed], kind=args.truth)
    return load_calibration(args.truth).cost_model


def _run_simulate(args) -> int:
    calibration = load_calibration(args.calibration)
    manifest = _manifest(args)
    truth = _truth_model(args, calibration)
    policies = SIM_POLICIES if "all" in args.policy else tuple(args.policy)
    print(calibration.describe())
    print(f"manifest: {manifest.source} ({len(manifest):,} samples); truth: {args.truth} "
          f"({truth.describe()}) x (1 + {args.truth_noise} N(0,1))")
    results = []
    for w in args.world_size:
        results += simulate(manifest, calibration, w, policies=policies, truth_model=truth, truth_noise=args.truth_noise,
                            epochs=args.epochs, seed=args.seed, **_memory_kwargs(args))
    print(format_results(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([r.to_json() for r in results], f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_commands(subparsers) -> None:
    """Add ``plan`` and ``simulate`` to the ``adaptiveload`` command line."""
    p = subparsers.add_parser("plan", help="choose per-bucket batch sizes for a manifest, calibration and world size",
                              description="Search the memory and compute budgets that maximise predicted tokens/s; print "
                                          "the bucket table next to the equal-token table; write a plan JSON.")
    _add_common(p)
    p.add_argument("--world-size", type=_positive_int, required=True, help="data-parallel ranks")
    p.add_argument("--policy", choices=("random", "cost_grouped"), default="random", help="the sampler's step policy")
    p.add_argument("--out", default=None, help="write the plan JSON here (for DualConstraintBucketSampler.from_plan)")
    p.set_defaults(func=_run_plan)

    s = subparsers.add_parser("simulate", help="replay epoch plans on a simulated cluster: load balance and tokens/s",
                              description="Plan each policy with the calibration's cost model and score it against a "
                                          "separate truth: compute-load CV, idle fraction, tokens/s, step-time variation.")
    _add_common(s)
    s.add_argument("--world-size", type=_positive_int, nargs="+", required=True, help="one or more world sizes")
    s.add_argument("--policy", nargs="+", choices=(*SIM_POLICIES, "all"), default=["all"],
                   type=lambda name: name.replace("_", "-"),  # also the sampler's spelling, e.g. cost_grouped
                   help="policies to simulate")
    s.add_argument("--truth", default="plan",
                   help="cost model to score against: 'plan' (the calibration's own model, default); 'power' or "
                        "'quadratic' (the calibration's measured points refitted with that model); another "
                        "calibration JSON; or a built-in calibration name")
    s.add_argument("--truth-noise", type=float, default=0.05,
                   help="sigma of multiplicative Gaussian noise on every truth cost (default 0.05)")
    s.add_argument("--epochs", type=_positive_int, default=1, help="epochs replayed per policy")
    s.add_argument("--json", default=None, help="also write the results as JSON here")
    s.set_defaults(func=_run_simulate)
