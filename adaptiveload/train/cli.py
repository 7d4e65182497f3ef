"""``adaptiveload train`` and ``adaptiveload calibrate``.

    adaptiveload train                                   # tiny model, reference mix, CPU, < 1 minute
    adaptiveload train --preset wan2.1-1.3b --baseline   # one GPU, adaptiveload vs Inductor + equal_token
    torchrun --nproc-per-node 2 -m adaptiveload train --preset wan2.1-1.3b --num-layers 10
    adaptiveload train --manifest data/manifest.csv --model my_dit.py:build   # your latents, your model
    adaptiveload calibrate --preset tiny --out calibration.json
"""
from __future__ import annotations

import argparse
import logging
import os

from adaptiveload.cliargs import (choice, deprecated_flag, int_list, int_triple, non_negative_int, positive_float,
                                   positive_int)
from adaptiveload.sched.policies import DEPRECATED_NAMES, POLICIES
from adaptiveload.sched.shapes import WAN_VAE_STRIDE
from adaptiveload.train.distributed import init_distributed

logger = logging.getLogger("adaptiveload.train")

DATA_NOTE = ("Data: SYNTHETIC by default -- random latents and text embeddings of each sample's shape, for "
             "throughput benchmarks; a --manifest with latent_path,text_path columns trains on your own files.")
MODEL_CONTRACT = (
    "Your model (--model): FILE.py:FACTORY or MODULE:FACTORY (the current directory is importable) names a "
    "function of no arguments returning an nn.Module called as model(latents [B, C, T, H, W], timestep [B] "
    "(0..1000), context [B, L, text_dim]) -> prediction [B, C, T, H, W] (the flow-matching velocity). It needs "
    ".config (an object or a dict) with in_channels, text_dim, patch_size (pt, ph, pw) -- three ints: the "
    "token geometry -- and text_len (default 512; shorter text embeddings are zero-padded to it), plus dim and "
    "num_layers for --activation-checkpointing auto; its repeated transformer blocks in .blocks (an "
    "nn.ModuleList: each block is compiled and FSDP2-sharded on its own; else the longest ModuleList is "
    "used), and without such blocks a set_activation_checkpointing(bool) method. Leave its own activation "
    "checkpointing off: the step checkpoints inside each block. For --policy packed it also needs "
    "forward_packed(tokens [sum S, C*pt*ph*pw], timestep [n], context [n, L, text_dim], grid [n, 3], cu_seqlens "
    "int32 [n + 1]) -> tokens of the same layout, the reference model's contract (adaptiveload.models.packed). "
    "A model whose config.patch_size is an int "
    "(diffusers' Flux, HunyuanVideo, CogVideoX) needs a wrapper that takes and returns [B, C, T, H, W] and "
    "has a (pt, ph, pw) patch_size: adaptiveload/train/diffusers_wan.py is one, for diffusers' Wan.")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    from adaptiveload.train.setup import CHECKPOINT_MODES
    from adaptiveload.train.step import BACKENDS, INNER_COMPILERS

    group = p.add_argument_group("model and compile")
    group.add_argument("--preset", default=None, help="reference model preset: tiny (default), wan2.1-1.3b, wan2.1-14b")
    group.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                       help="your model: FILE.py:FACTORY or MODULE:FACTORY, a function returning an nn.Module "
                            "called as model(latents, timestep, context) (the contract is below); diffusers' "
                            "Wan: adaptiveload.train.diffusers_wan:wan_1_3b")
    group.add_argument("--num-layers", type=positive_int, default=None, help="keep only this many blocks of a preset")
    group.add_argument("--patch-size", type=int_triple, default=None, metavar="T,H,W",
                       help="a preset's DiT patch (pt,ph,pw), e.g. 2,2,2 for CogVideoX 1.5's token counts "
                            "(default: the preset's, 1,2,2); a --model's own config.patch_size wins")
    group.add_argument("--backend", choices=BACKENDS, default="adaptiveload", help="compile backend")
    group.add_argument("--inner", choices=INNER_COMPILERS, default=None,
                       help="compiler behind the adaptiveload backend (default: inductor on GPU, eager on CPU)")
    group.add_argument("--activation-checkpointing", choices=CHECKPOINT_MODES, default="auto",
                       help="on: recompute every transformer block in backward (the step checkpoints "
                            "inside each block's compiled region and turns the model's own switch off; do "
                            "not enable checkpointing in your --model yourself); auto (default): on when "
                            "the longest sample's activations would not fit in the device's memory "
                            "(not --memory-budget-gb), off on CPU; off")
    group.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    group.add_argument("--dist-timeout", type=positive_float, default=300.0,
                       help="seconds a collective waits for a failed peer before the ranks give up (torchrun)")
    data = p.add_argument_group("data")
    data.add_argument("--manifest", default=None,
                      help="CSV / JSONL / Parquet, a row per sample: its size (num_frames,height,width in pixels, or "
                           "latent_t,latent_h,latent_w) and, to train on your own data, latent_path,text_path: a "
                           "latent [C,T,H,W] and a text embedding [L,text_dim] per sample, .safetensors or .pt, "
                           "relative to the manifest's folder (default: the reference mix, synthetic data)")
    data.add_argument("--vae-stride", type=int_triple, default=WAN_VAE_STRIDE, metavar="T,H,W",
                      help="the VAE's compression from pixels to latents, e.g. 8,32,32 for LTX-Video")
    data.add_argument("--samples", type=positive_int, default=None,
                      help="samples: size of the reference mix (default 256), or the first rows of --manifest")
    data.add_argument("--downscale", type=positive_int, default=None,
                      help="divide pixel heights and widths by this factor (default 8 on CPU, 1 on GPU; 1 for a "
                           "manifest of latent sizes or sample files)")
    data.add_argument("--seed", type=non_negative_int, default=0,
                      help="seed of the corpus, the model's initial weights, the data and the sampler")


def _model_source(args) -> tuple:
    if args.preset is not None and args.model is not None:
        raise ValueError("give either --preset or --model, not both")
    return (args.preset or ("tiny" if args.model is None else None)), args.model


def run_train(args) -> int:
    """``adaptiveload train``: see :mod:`adaptiveload.train.job`."""
    from adaptiveload.train.job import JobConfig, TrainingFailed, run_job
    from adaptiveload.train.report import format_report

    preset, factory = _model_source(args)
    cfg = JobConfig(
        preset=preset, model=factory, num_layers=args.num_layers, patch_size=args.patch_size,
        vae_stride=args.vae_stride, manifest=args.manifest, samples=args.samples,
        downscale=args.downscale, seed=args.seed, steps=args.steps, backend=args.backend, inner=args.inner,
        policy="equal_token" if args.sampler == "equal" else args.policy, calibration=args.calibration, plan=args.plan,
        memory_budget_gb=args.memory_budget_gb, m_mem=args.m_mem, drop_oversized=args.drop_oversized,
        activation_checkpointing=args.activation_checkpointing, learning_rate=args.lr, baseline=args.baseline,
        baseline_backend=args.baseline_backend, out=args.out, resume=args.resume, eval_every=args.eval_every,
        eval_samples=args.eval_samples, profile_every=args.profile_every, checkpoint_every=args.checkpoint_every,
        workers=args.workers, quiet=args.quiet,
    )
    ctx = init_distributed(args.device, timeout_s=args.dist_timeout)
    try:
        results = run_job(cfg, ctx)
    except TrainingFailed as err:
        if ctx.is_main:
            print(f"adaptiveload train: error: {err}\nresults so far: {os.path.join(cfg.out, 'results.json')}", flush=True)
        ctx.wait_for_all()
        return 1  # the main group may hold a timed-out collective: leave the groups to process exit
    if all(r["status"] == "ok" for r in results["runs"]):
        ctx.close()
    else:  # the baseline failed (the run asked for succeeded: exit 0); as above, leave the groups to exit
        ctx.wait_for_all()
    if ctx.is_main:
        print(format_report(results))
        print(f"results: {os.path.join(cfg.out, 'results.json')}" + (f", plot: {results['plot']}" if results.get("plot") else ""))
    return 0


def run_calibrate(args) -> int:
    """``adaptiveload calibrate``: time training steps over a (B, S) grid; write calibration.json (+ PNG)."""
    preset, factory = _model_source(args)
    ctx = init_distributed(args.device, timeout_s=args.dist_timeout)
    status = _calibrate_and_write(args, ctx, preset, factory)
    ctx.close()  # not after an unexpected error: the groups may hold a failed collective (process exit frees them)
    return status


def _calibrate_and_write(args, ctx, preset, factory) -> int:
    """The body of :func:`run_calibrate`: sweep the grid, then (rank 0) write and print; the exit status."""
    from adaptiveload.sched.calibration import Calibration
    from adaptiveload.train.calibrate import calibrate, calibration_grid
    from adaptiveload.train.job import default_inner
    from adaptiveload.train.setup import (ModelSource, bucket_shapes, build_step, device_description, load_corpus,
                                         set_cpu_threads, step_settings)
    from adaptiveload.train.step import StepConfig

    set_cpu_threads(ctx.device)
    models = ModelSource(preset=preset, factory=factory, num_layers=args.num_layers, patch_size=args.patch_size,
                         seed=args.seed)
    corpus, downscale = load_corpus(args.manifest, args.samples, args.seed, args.downscale, ctx.device,
                                    vae_stride=args.vae_stride, patch_size=models.spec().patch_size)
    shapes = bucket_shapes(corpus)
    grid = calibration_grid(shapes, corpus.patch_size, num_shapes=args.shapes, batch_sizes=args.batch_sizes,
                            max_tokens=args.max_tokens)
    step_config = StepConfig(backend=args.backend, inner=args.inner or default_inner(ctx.device))
    step, spec, info = build_step(ctx, models=models, step_config=step_config,
                                  activation_checkpointing=args.activation_checkpointing,
                                  max_seq_len=int(corpus.seq_lens.max()))
    run = calibrate(step, spec, grid, patch_size=corpus.patch_size, warmup=args.warmup, repeats=args.repeats,
                    seed=args.seed)
    settings = {**step_settings(info, step_config, ctx, corpus, vae_stride=args.vae_stride, downscale=downscale),
                "warmup": args.warmup, "repeats": args.repeats}
    if not ctx.is_main:
        return 1 if run.aborted else 0
    ok = sum(p["status"] == "ok" for p in run.points)
    if ok < 3:
        print(f"adaptiveload calibrate: error: only {ok} point(s) ran"
              + (f" ({run.aborted})" if run.aborted else "") + "; nothing written")
        return 1
    calibration = Calibration.from_points(run.points, settings=settings, device=device_description(ctx.device))
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    calibration.save(args.out)
    png = calibration.plot(os.path.splitext(args.out)[0] + ".png")
    print(calibration.describe())  # with a warning line when the step-time fit is poor
    for p in run.points:
        time_ms = f"{p['step_time_s'] * 1e3:9.1f} ms" if p["step_time_s"] is not None else f"{p['status']:>12}"
        mem = f"{p['peak_memory_bytes'] / 2**30:7.2f} GiB" if p["peak_memory_bytes"] else ""
        print(f"  B={p['batch_size']:>3} latent {'x'.join(map(str, p['latent_shape'])):>10} S={p['seq_len']:>7,} {time_ms} {mem}")
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    if run.aborted:
        print(f"adaptiveload calibrate: error: sweep stopped early: {run.aborted} (points so far written)")
        return 1
    return 0


def add_commands(subparsers) -> None:
    """Add ``train`` and ``calibrate`` to the ``adaptiveload`` command line."""
    train = subparsers.add_parser(
        "train", help="train a video DiT with the fused backend and the calibrated bucket sampler",
        description="Calibrate (or load a calibration), plan, and train; print tokens/s, load balance, memory "
                    "and eval loss. With no arguments: the tiny model on the reference mix, on the CPU. "
                    + DATA_NOTE,
        epilog=MODEL_CONTRACT)
    _add_model_options(train)
    run = train.add_argument_group("run")
    run.add_argument("--steps", type=positive_int, default=None, help="global steps (default: one epoch)")
    run.add_argument("--policy", type=choice("--policy", POLICIES, DEPRECATED_NAMES), default="dual",
                     metavar="{" + ",".join(POLICIES) + "}",
                     help="batching policy: equal_token (B = M_mem/S), dual (the dual-constraint rule), cost_grouped "
                          "(dual, and each step's batches of similar cost), packed (packs of samples of different "
                          "lengths, balanced per rank; needs a model with a forward_packed method, as the "
                          "reference presets have)")
    run.add_argument("--sampler", dest="sampler", choices=("dual", "equal"), action=deprecated_flag("--policy"))
    run.add_argument("--calibration", default=None,
                     help="calibration.json or a built-in name (default: a quick calibration with the run's own step)")
    run.add_argument("--plan", default=None,
                     help="a plan JSON from `adaptiveload plan` (must match the world size, the corpus's buckets and "
                          "its token geometry)")
    run.add_argument("--memory-budget-gb", type=positive_float, default=None, help="memory budget to plan for (default: the GPU's)")
    run.add_argument("--m-mem", type=positive_int, default=None, help="fixed tokens per batch instead of planning it")
    run.add_argument("--drop-oversized", action="store_true", help="drop buckets longer than the memory limit")
    run.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate")
    run.add_argument("--baseline", action="store_true",
                     help="also run equal_token + plain torch.compile (Inductor; eager on CPU) and compare; a "
                          "failed baseline is reported beside the run (exit status 0 when the run succeeded)")
    run.add_argument("--baseline-backend", default=None, help="compile backend of the baseline run")
    run.add_argument("--out", default="adaptiveload-train", help="output folder (results.json, results.png, checkpoints)")
    run.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    run.add_argument("--checkpoint-every", type=non_negative_int, default=0, help="save a checkpoint every N steps (0: never)")
    run.add_argument("--eval-every", type=positive_int, default=10, help="evaluate the fixed batch every N steps")
    run.add_argument("--eval-samples", type=positive_int, default=4, help="samples in the fixed evaluation batch")
    run.add_argument("--profile-every", type=non_negative_int, default=5, help="profile every N-th step for busy time (0: never)")
    run.add_argument("--workers", type=non_negative_int, default=None,
                     help="DataLoader worker processes making the samples on the CPU (reading the sample files, "
                          "or drawing synthetic ones), then pinned and copied to the device; 0: in the training "
                          "process, synthetic samples drawn on the training device itself. Default: 2 for sample "
                          "files, 0 for synthetic data (CPU and GPU draws give different sample values: published "
                          "GPU runs used 0)")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    train.set_defaults(func=run_train)

    cal = subparsers.add_parser(
        "calibrate", help="time real training steps over a (B, S) grid and fit the step-time model",
        description="Writes calibration.json (points, fits, settings -- the token geometry too) and a PNG of "
                    "measured vs predicted time. Steps run on synthetic batches of the corpus's shapes.",
        epilog=MODEL_CONTRACT)
    _add_model_options(cal)
    grid = cal.add_argument_group("grid")
    grid.add_argument("--shapes", type=positive_int, default=5, help="bucket shapes to measure, spread over S")
    grid.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16], help="comma-separated, e.g. 1,2,4,8")
    grid.add_argument("--max-tokens", type=positive_int, default=None, help="skip points with B*S above this")
    grid.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps per point")
    grid.add_argument("--repeats", type=positive_int, default=5, help="timed steps per point (median)")
    grid.add_argument("--out", default="calibration.json", help="the calibration JSON to write (a PNG beside it)")
    cal.set_defaults(func=run_calibrate)
