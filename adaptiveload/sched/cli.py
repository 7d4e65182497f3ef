"""``adaptiveload plan`` and ``adaptiveload simulate``.

Both take ``--manifest`` (a CSV / JSONL / Parquet file, or ``reference`` for the built-in reference
mix of :func:`~adaptiveload.sched.manifest.reference_mix`) and ``--calibration`` (a calibration JSON
from ``adaptiveload calibrate``, or a built-in of adaptiveload/sched/presets.py: ``anchors-wan1.3b``
-- Wan-1.3B measured on an H200, quadratic model -- or ``anchors-wan1.3b-power``), so both run
without a GPU::

    adaptiveload plan --manifest reference --calibration anchors-wan1.3b --world-size 8 --m-mem 151200
    adaptiveload simulate --calibration anchors-wan1.3b --world-size 2 8 1024 --m-mem 151200

Both name the batching policies as :mod:`adaptiveload.sched.policies` does (``--policy equal_token``,
``dual``, ``cost_grouped``, ``packed``), write every file to ``--out``, take ``--samples N`` (the
reference mix's size, or the first N rows of a manifest file) and the model's ``--vae-stride T,H,W``
and ``--patch-size T,H,W`` (Wan 2.1's 4,8,8 and 1,2,2 by default; LTX-Video's VAE is 8,32,32,
CogVideoX 1.5's patch 2,2,2), which turn pixel sizes into tokens. Older spellings -- ``equal-token``,
``dual-constraint``, ``cost-grouped``, ``random``, ``--num-samples``, ``--json`` -- still work and print a
one-line deprecation note on stderr.

``plan`` prints the memory budget it planned for and where it came from; with a built-in
calibration and neither ``--memory-budget-gb`` nor ``--m-mem`` it warns that it assumed the H200's
memory. When the chosen policy predicts no gain over equal-token (1.00x), it names the policy that
would gain most.
"""
from __future__ import annotations

import sys

from adaptiveload.cliargs import (choice, deprecated_flag, int_triple, non_negative_float, non_negative_int, note,
                                  positive_float, positive_int)
from adaptiveload.jsonfile import write_json_atomic
from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.cost_model import FIT_KINDS, fit_cost_model
from adaptiveload.sched.manifest import Manifest, load_manifest, reference_mix
from adaptiveload.sched.plan import Plan, make_plan
from adaptiveload.sched.policies import DEPRECATED_NAMES, POLICIES
from adaptiveload.sched.presets import PRESETS, load_calibration
from adaptiveload.sched.shapes import WAN_PATCH_SIZE, WAN_VAE_STRIDE
from adaptiveload.sched.simulate import format_results, simulate

REFERENCE = "reference"
REFERENCE_SAMPLES = 1_000_000  # size of the reference mix without --samples


def _manifest(args) -> Manifest:
    units = {"vae_stride": args.vae_stride, "patch_size": args.patch_size}
    if args.manifest == REFERENCE:
        return reference_mix(args.samples or REFERENCE_SAMPLES, seed=args.seed, **units)
    manifest = load_manifest(args.manifest, **units)
    if args.samples is None:
        return manifest
    if args.samples > len(manifest):
        note(f"--samples {args.samples:,} is more than the {len(manifest):,} rows of {args.manifest}: using all of them")
    return manifest.head(args.samples)


def _memory_kwargs(args) -> dict:
    budget = None if args.memory_budget_gb is None else args.memory_budget_gb * 2**30
    return {"memory_budget_bytes": budget, "m_mem": args.m_mem, "drop_oversized": args.drop_oversized}


def _add_common(p) -> None:
    p.add_argument("--manifest", default=REFERENCE,
                   help="manifest file (.csv/.jsonl/.parquet with num_frames,height,width or seq_len columns), or "
                        f"'{REFERENCE}' for the built-in reference mix")
    p.add_argument("--samples", type=positive_int, default=None, metavar="N",
                   help=f"samples: the size of the reference mix (default: {REFERENCE_SAMPLES:,}), or the first N rows "
                        "of a manifest file (default: all; all of them too when N is larger, with a note)")
    p.add_argument("--num-samples", dest="samples", type=positive_int, action=deprecated_flag("--samples"))
    p.add_argument("--calibration", required=True,
                   help=f"calibration JSON from 'adaptiveload calibrate', or a built-in: {', '.join(PRESETS)} "
                        "(step time and peak memory of a Wan-1.3B-shaped model, 10 of 30 layers, bf16 eager + AdamW, "
                        "measured on one H200; see adaptiveload/sched/presets.py)")
    p.add_argument("--memory-budget-gb", type=positive_float, default=None, metavar="GIB",
                   help="device memory for training in GiB; with the calibration's memory model gives the M_mem limit "
                        "(default: the calibration's device memory, else the largest B*S it ran)")
    p.add_argument("--m-mem", type=positive_int, default=None, metavar="TOKENS",
                   help="fixed memory budget in tokens per batch (overrides the memory model)")
    p.add_argument("--drop-oversized", action="store_true", help="drop buckets whose one sample exceeds the memory limit")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the reference mix and of the sampler")
    p.add_argument("--vae-stride", type=int_triple, default=WAN_VAE_STRIDE, metavar="T,H,W",
                   help="the VAE's compression of frames, height and width (pixels to latent; Wan 2.1: 4,8,8, "
                        "LTX-Video: 8,32,32)")
    p.add_argument("--patch-size", type=int_triple, default=WAN_PATCH_SIZE, metavar="T,H,W",
                   help="the DiT's patch (latent to tokens; Wan 2.1: 1,2,2, CogVideoX 1.5: 2,2,2)")


def _policy_type(choices):
    """``--policy``'s argparse type and metavar: the current names, old spellings mapped with a note."""
    return {"type": choice("--policy", choices, DEPRECATED_NAMES), "metavar": "{" + ",".join(choices) + "}"}


MEMORY_FROM = {"m_mem": "--m-mem", "memory_budget": "--memory-budget-gb", "device": "calibration device",
               "largest_batch": "the largest batch the calibration ran"}


def _memory_line(plan: Plan, calibration: Calibration) -> str:
    """``memory budget: X GiB (from ...)``: the device memory the plan assumes and where it came from."""
    budget = "unknown" if plan.memory_budget_gib is None else f"{plan.memory_budget_gib:.1f} GiB"
    source = MEMORY_FROM[plan.memory_source]
    if plan.memory_source == "device":
        source += f" {calibration.device}"
    elif plan.memory_source == "m_mem" and plan.memory_budget_gib is not None:
        source += f" {plan.m_mem_limit:,} tokens: the memory model's peak / its safety factor"
    return f"memory budget: {budget} (from {source}); at most {plan.m_mem_limit:,} tokens per batch"


def _better_policy(plan: Plan, manifest: Manifest, calibration: Calibration, args) -> str:
    """One line naming the policy that predicts the most over equal-token when the plan's predicts 1.00x."""
    others = [make_plan(manifest, calibration, args.world_size, policy=policy, **_memory_kwargs(args))
              for policy in POLICIES if policy not in (plan.policy, "equal_token")]
    best = max(others, key=lambda other: other.predicted["speedup"])
    if best.predicted["speedup"] < 1.005:
        return f"policy {plan.policy} predicts no gain over equal-token (1.00x), nor does any other policy here"
    return (f"policy {plan.policy} predicts no gain over equal-token (1.00x); policy {best.policy} predicts "
            f"{best.predicted['speedup']:.2f}x ({best.predicted['tokens_per_s']:,.0f} tokens/s): --policy {best.policy}")


def _run_plan(args) -> int:
    calibration = load_calibration(args.calibration)  # first: a bad path fails before the manifest is read
    manifest = _manifest(args)
    plan = make_plan(manifest, calibration, args.world_size, policy=args.policy, **_memory_kwargs(args))
    print(calibration.describe())
    print(f"manifest: {manifest.source} ({len(manifest):,} samples)")
    if args.calibration in PRESETS and plan.memory_source == "device":
        print(f"adaptiveload: warning: --calibration {args.calibration} is a built-in calibration measured on an "
              f"{calibration.device}: the plan assumes its {plan.memory_budget_gib:.1f} GiB; on a GPU with less memory "
              f"give --memory-budget-gb (e.g. 80 for an 80 GB GPU) or --m-mem, or training runs out of memory",
              file=sys.stderr, flush=True)
    print(_memory_line(plan, calibration))
    print(plan.format_table())
    if args.policy != "equal_token" and round(plan.predicted["speedup"], 2) == 1.0:
        print(_better_policy(plan, manifest, calibration, args))
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
    policies = POLICIES if "all" in args.policy else tuple(args.policy)
    print(calibration.describe())
    print(f"manifest: {manifest.source} ({len(manifest):,} samples); truth: {args.truth} "
          f"({truth.describe()}) x (1 + {args.truth_noise} N(0,1))")
    results = []
    for w in args.world_size:
        results += simulate(manifest, calibration, w, policies=policies, truth_model=truth, truth_noise=args.truth_noise,
                            epochs=args.epochs, seed=args.seed, **_memory_kwargs(args))
    print(format_results(results))
    if args.out:
        write_json_atomic(args.out, [r.to_json() for r in results])
        print(f"wrote {args.out}")
    return 0


def add_commands(subparsers) -> None:
    """Add ``plan`` and ``simulate`` to the ``adaptiveload`` command line (``subparsers``: an
    ``argparse`` sub-parsers action).

    Example::

        >>> import argparse
        >>> parser = argparse.ArgumentParser(prog="adaptiveload")
        >>> add_commands(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["plan", "--calibration", "anchors-wan1.3b", "--world-size", "8"])
        >>> args.policy, args.manifest, args.samples, args.out
        ('dual', 'reference', None, None)
    """
    p = subparsers.add_parser("plan", help="choose per-bucket batch sizes for a manifest, calibration and world size",
                              description="Search the memory and compute budgets that maximise predicted tokens/s; print "
                                          "the bucket table next to the equal-token table; write a plan JSON.")
    _add_common(p)
    p.add_argument("--world-size", type=positive_int, required=True, help="data-parallel ranks")
    p.add_argument("--policy", default="dual", **_policy_type(POLICIES),
                   help="batching policy: equal_token (B = M_mem/S, no search), dual (the dual-constraint rule), "
                        "cost_grouped (dual, and each step takes W batches of similar cost), packed (each rank a "
                        "pack of samples of any length, balanced by predicted time)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="write the plan JSON here (for adaptiveload.sched.sampler_from_plan and 'adaptiveload train --plan')")
    p.set_defaults(func=_run_plan)

    s = subparsers.add_parser("simulate", help="replay epoch plans on a simulated cluster: load balance and tokens/s",
                              description="Plan each policy with the calibration's cost model and score it against a "
                                          "separate truth: compute-load CV, idle fraction, tokens/s, step-time variation.")
    _add_common(s)
    s.add_argument("--world-size", type=positive_int, nargs="+", required=True, help="one or more world sizes")
    s.add_argument("--policy", nargs="+", default=["all"], **_policy_type((*POLICIES, "all")),
                   help="policies to simulate")
    s.add_argument("--truth", default="plan",
                   help="cost model to score against: 'plan' (the calibration's own model); "
                        f"{', '.join(repr(k) for k in FIT_KINDS)} (the calibration's measured points refitted with "
                        "that model); another calibration JSON; or a built-in calibration name")
    s.add_argument("--truth-noise", type=non_negative_float, default=0.05, metavar="SIGMA",
                   help="sigma of multiplicative Gaussian noise on every truth cost")
    s.add_argument("--epochs", type=positive_int, default=1, help="epochs replayed per policy")
    s.add_argument("--out", default=None, metavar="PATH", help="also write the results as JSON here")
    s.add_argument("--json", dest="out", action=deprecated_flag("--out"))
    s.set_defaults(func=_run_simulate)
