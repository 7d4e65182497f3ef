r"""Where a training step's GPU time goes, per compile backend: kernel time by category for one batch.

    python benchmarks/profile_train_step.py --backend adaptiveload inductor --num-layers 10 \
        --batch-size 1 --latent 21 60 104 --check 1x1x60x104 30x1x60x104 1x13x90x160

Needs a CUDA GPU. For each backend (one after the other, on the same GPU, same seed and weights):
build the training step of ``adaptiveload train`` (regional compilation, bf16 autocast, AdamW); run
each ``--check`` batch (B x T x H x W) once with frozen weights and record its loss, or that the
step was refused for a non-finite loss or gradient (``TrainStep.check_finite``: the weights stay
finite); then, after two warm-up steps, time ``--repeats`` steps of the profiled batch (wall time,
and the host's share: the time until forward+backward has been queued, which has no host sync, plus
the optimizer step's, queued after the finite check has waited for the device; while the host runs
ahead of the GPU these sum to the host time a step costs) and profile one more with ``torch.profiler``, summing kernel time by category: attention (cuDNN/flash SDPA),
GEMM (cuBLAS nvjet/cutlass), the fused op's kernels (adaln::), optimizer (AdamW's multi-tensor
kernels), Triton (every Inductor-generated kernel, the LayerNorm/modulate fusions among them),
other. Prints one table (a row per backend) and writes ``<out>/profile_train_step_<tag>.json`` and
``.md`` with the GPU, torch version, date and command.

With ``--pack``, each backend also profiles a pack (policy ``packed``: the model's ``forward_packed``
over the samples as one token sequence) after the batch, a row each, so a pack's cost can be set
beside that of a batch of its largest samples; the pack is warmed up (compiled) the same way::

    python benchmarks/profile_train_step.py --backend adaptiveload --latent 21 90 160 \
        --pack 1x21x90x160 1x1x60x104 --tag h200_pack
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time

import torch

from adaptiveload.train.data import synthetic_batch, synthetic_pack
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.setup import ModelSource, build_step
from adaptiveload.train.step import NonFiniteStep, StepConfig
from results_file import run_context, write_json_and_markdown

CATEGORIES = (  # (category, substrings of a kernel name, lower case), first match wins
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "matmul")),
    ("adaln kernels", ("adaln",)),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("triton", ("triton",)),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "other")


def shape_arg(text: str) -> tuple[int, tuple[int, int, int]]:
    """'BxTxHxW' -> (B, (T, H, W))."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected BxTxHxW with positive integers, got {text!r}")
    b, t, h, w = map(int, parts)
    return b, (t, h, w)


def profile_backend(args, backend: str, device: torch.device) -> list[dict]:
    """Checks, step times and the kernel-time profile of one backend (module docstring): a row for
    the batch, and one for the pack with ``--pack``."""
    models = ModelSource(preset=args.preset, factory=None, num_layers=args.num_layers, seed=args.seed)
    step, spec, _ = build_step(DistContext(device=device), models=models,
                               step_config=StepConfig(backend=backend, inner="inductor", learning_rate=1e-4),
                               activation_checkpointing="off", max_seq_len=0)
    checks = []
    with step.frozen_weights():
        for b, shape in args.check:
            batch = synthetic_batch(spec, b, shape, device=step.device)
            try:
                loss, error = float(step(batch, b)) / b, None
            except NonFiniteStep as err:
                loss, error = None, str(err)
            checks.append({"batch_size": b, "latent": list(shape), "loss_per_sample": loss, "non_finite": error})
            print(f"{backend}: check B={b} latent={shape}: " + (error or f"loss/sample {loss:.4f}"), flush=True)
    rows = [time_and_profile(step, "batch", synthetic_batch(spec, args.batch_size, tuple(args.latent),
                                                            device=step.device), spec, args)]
    if args.pack:
        shapes = [shape for b, shape in args.pack for _ in range(b)]
        rows.append(time_and_profile(step, "pack", synthetic_pack(spec, shapes, device=step.device), spec, args))
    for row in rows:
        row.update(backend=backend, checks=checks)
    return rows


def time_and_profile(step, kind: str, batch, spec, args) -> dict:
    """Two warm-up steps, ``--repeats`` timed steps (wall and host time) and one profiled step of
    ``batch`` (a batch or a pack), kernel time by category (module docstring)."""
    n = len(batch)
    for _ in range(2):
        step(batch, n)
    step.synchronize()
    times, host = [], []
    for _ in range(args.repeats):  # step(batch, n), taken apart to time the host's share
        start = time.perf_counter()
        loss_sum = step.forward_backward(batch, n)
        issued = time.perf_counter()  # forward + backward queued (no host sync inside)
        step.check_finite(loss_sum)  # waits for the device
        checked = time.perf_counter()
        step.optimizer_step()
        stepped = time.perf_counter()
        step.synchronize()
        times.append(time.perf_counter() - start)
        host.append((issued - start) + (stepped - checked))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step(batch, n)
        step.synchronize()
        profiled_wall = time.perf_counter() - start
    per_kernel, calls = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.time_range.elapsed_us() / 1e3
            calls[event.name] += 1
    per_category = collections.Counter()
    for name, ms in per_kernel.items():
        per_category[category(name)] += ms
    shapes = batch.layout.latent_shapes.tolist() if kind == "pack" else [list(batch.latents.shape[2:])] * n
    tokens = sum(math.prod(size // patch for size, patch in zip(shape, spec.patch_size)) for shape in shapes)
    return {"batch": kind, "latents": shapes, "tokens": tokens,
            "step_ms_median": 1e3 * sorted(times)[len(times) // 2],
            "step_ms_all": [1e3 * t for t in times], "host_ms_median": 1e3 * sorted(host)[len(host) // 2],
            "host_ms_all": [1e3 * t for t in host], "profiled_step_ms": 1e3 * profiled_wall,
            "kernel_ms": sum(per_kernel.values()),
            "kernel_ms_by_category": dict(per_category.most_common()),
            "top_kernels": [{"name": name, "ms": ms, "calls": calls[name]}
                            for name, ms in per_kernel.most_common(args.top)]}


def table(results: list[dict]) -> str:
    cats = sorted({c for r in results for c in r["kernel_ms_by_category"]})
    head = ["backend", "batch", "tokens", "step ms (median)", "host ms (median)", "profiled step ms", "its kernel ms",
            *cats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["backend"], r["batch"], f"{r['tokens']:,}", f"{r['step_ms_median']:.1f}", f"{r['host_ms_median']:.1f}",
                 f"{r['profiled_step_ms']:.1f}", f"{r['kernel_ms']:.1f}",
                 *(f"{r['kernel_ms_by_category'].get(c, 0.0):.2f}" for c in cats)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pack_difference(results: list[dict], top: int = 10) -> str:
    """For each backend with a pack row: the kernels (among each row's listed top kernels) whose time
    grew most from the batch to the pack, a table of ms and calls; "" without a pack."""
    lines = []
    for backend in dict.fromkeys(r["backend"] for r in results):
        rows = {r["batch"]: r for r in results if r["backend"] == backend}
        if "pack" not in rows:
            continue
        batch, pack = ({k["name"]: k for k in rows[kind]["top_kernels"]} for kind in ("batch", "pack"))
        zero = {"ms": 0.0, "calls": 0}
        grown = sorted(set(batch) | set(pack), key=lambda n: batch.get(n, zero)["ms"] - pack.get(n, zero)["ms"])
        lines += [f"\n{backend}: kernels that grew most from the batch to the pack\n",
                  "| pack - batch ms | batch ms (calls) | pack ms (calls) | kernel |", "|---|---|---|---|"]
        for name in grown[:top]:
            b, p = batch.get(name, zero), pack.get(name, zero)
            lines.append(f"| {p['ms'] - b['ms']:.2f} | {b['ms']:.2f} ({b['calls']}) | {p['ms']:.2f} ({p['calls']}) | "
                         f"`{name[:120]}` |")
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    """The results file's text: GPU, torch, date and command, the table, and the pack's growth."""
    head = (f"# Training-step profile on {doc['gpu']} (torch {doc['torch']}, {doc['date']})\n\n"
            f"Command: `{doc['command']}`\n\n")
    return head + table(doc["results"]) + "\n" + pack_difference(doc["results"])


def main(argv=None) -> int:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    parser.add_argument("--backend", nargs="+", default=["adaptiveload", "inductor"],
                        help="compile backends to compare (adaptiveload, inductor, aot_eager, eager)")
    parser.add_argument("--preset", default="wan2.1-1.3b", help="model preset")
    parser.add_argument("--num-layers", type=int, default=10, help="keep this many transformer blocks")
    parser.add_argument("--batch-size", type=int, default=1, help="B of the profiled batch")
    parser.add_argument("--latent", type=int, nargs=3, default=[21, 60, 104], metavar=("T", "H", "W"),
                        help="latent shape of the profiled batch (Wan's 1x2x2 patches: S = T*H*W/4)")
    parser.add_argument("--check", type=shape_arg, nargs="*", default=[], metavar="BxTxHxW",
                        help="batches run once each (frozen weights) before profiling, checked for non-finite values")
    parser.add_argument("--pack", type=shape_arg, nargs="*", default=[], metavar="BxTxHxW",
                        help="also profile a pack of these samples (B of each latent shape) after the batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps of the profiled batch (median)")
    parser.add_argument("--top", type=int, default=20, help="kernels listed per backend in the JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder of the JSON and markdown results")
    parser.add_argument("--tag", default="h200", help="results file name: profile_train_step_<tag>.json / .md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_train_step: needs a CUDA GPU", file=sys.stderr)
        return 1
    results = []
    for backend in args.backend:
        results.extend(profile_backend(args, backend, torch.device("cuda")))
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    doc = {**run_context(__file__, argv), "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
           "batch_size": args.batch_size, "latent": args.latent,
           "pack": [[b, list(shape)] for b, shape in args.pack], "results": results}
    text = markdown(doc)
    print(text)
    write_json_and_markdown(args.out, f"profile_train_step_{args.tag}", doc, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
