"""One training step of diffusers' ``LTXVideoTransformer3DModel`` (bf16), each transformer block
compiled with Inductor or with the ``adaptiveload`` backend: step time, peak memory, and every
parameter gradient against an fp32 eager reference.

For each (B, S) of ``--shapes`` (S = frames x height x width tokens of 128 latent channels):

* the chains the backend fused (``collect_reports``: norm1 and norm2 of a block; the blocks share one
  compiled graph, so 2);
* step time: median of ``--rounds`` x ``--steps`` timed steps (forward, an MSE loss, backward; wall
  clock between device synchronizations) after ``--warmup`` steps (the first compiles), the two
  compiled models alternated round by round, and the peak memory the timed steps allocate above what
  was allocated before them (``torch.cuda.max_memory_allocated``; both models stay resident);
* gradients: for every parameter the relative error ||g - g_ref|| / ||g_ref|| of its gradient (one
  step, fixed inputs) against the same model in fp32 eager (by absolute norm where the true gradient
  is ~0, see ``grad_errors``); the report gives the largest error and
  how many parameters are within 5%, for the backend and for Inductor.

The model is hidden size 2048 (32 heads x 64), ``--layers`` blocks, bf16 weights; its RMSNorm ->
modulate sites are the blocks' norm1 and norm2 (weightless RMSNorm, per-token scale and shift from
``scale_shift_table + temb``), the head's a LayerNorm one outside the compiled blocks.
Writes ``<out>/ltx_step_<tag>.json`` and ``.md`` with the GPU, torch version, date and exact command.
Usage: python benchmarks/bench_ltx_step.py [--layers 4] [--shapes 1x6144 8x384] [--tag h200]
(``--device cpu --hidden 64 --heads 2 --layers 1 --shapes 1x48 --inner aot_eager`` checks it runs on a CPU.)
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

from adaptiveload.fxfuse import collect_reports
from results_file import run_context, write_json_and_markdown


def build(args, dtype) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(0)
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=128, out_channels=128, num_attention_heads=args.heads, attention_head_dim=args.hidden // args.heads,
        cross_attention_dim=args.hidden, num_layers=args.layers, caption_channels=args.caption_channels)
    return model.to(args.device, dtype).train()


def frames_hw(S: int) -> tuple[int, int, int]:
    """A (frames, height, width) latent grid of S tokens: frames the largest divisor of S up to 8
    with a square of (S / frames) tokens left, else (1, 1, S)."""
    for f in range(8, 0, -1):
        side = int(round((S // f) ** 0.5))
        if S % f == 0 and side * side == S // f:
            return f, side, side
    return 1, 1, S


def make_inputs(B, S, args, gen) -> dict:
    F_, H, W = frames_hw(S)
    dev = args.device
    return dict(hidden_states=torch.randn(B, S, 128, generator=gen).to(dev),
                encoder_hidden_states=torch.randn(B, 64, args.caption_channels, generator=gen).to(dev),
                timestep=torch.randint(0, 1000, (B,), generator=gen).to(dev),
                encoder_attention_mask=torch.ones(B, 64, device=dev), num_frames=F_, height=H, width=W)


def cast(inputs: dict, dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def step(model, inputs, target) -> None:
    out = model(**inputs, return_dict=False)[0]
    torch.nn.functional.mse_loss(out.float(), target).backward()


def compiled(model, backend: str, inner: str):
    """A copy of ``model`` with each transformer block compiled (``nn.Module.compile``)."""
    model = copy.deepcopy(model)
    for block in model.transformer_blocks:
        if backend == "adaptiveload":
            block.compile(backend="adaptiveload", options={"inner": inner})
        else:
            block.compile(backend=inner)
    return model


def grads_of(model, inputs, target) -> dict:
    model.zero_grad(set_to_none=True)
    step(model, inputs, target)
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_errors(grads: dict, ref: dict) -> dict:
    """||g - g_ref|| / ||g_ref|| per parameter. A parameter whose true gradient is zero is compared by
    absolute norm, over the median parameter's gradient norm instead: the attention key biases
    (``to_k.bias``: softmax ignores a constant added to all of a query's logits, so the fp32 reference
    holds rounding noise only) and any whose ||g_ref|| is under 1e-4 of that median."""
    norms = {n: r.norm().item() for n, r in ref.items()}
    median = statistics.median(norms.values())

    def scale(n: str) -> float:
        return median if n.endswith("to_k.bias") or norms[n] < 1e-4 * median else norms[n]

    return {n: ((g - ref[n]).norm() / scale(n)).item() for n, g in grads.items()}


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def warm_up(model, inputs, target, args) -> None:
    for _ in range(args.warmup):
        model.zero_grad(set_to_none=True)
        step(model, inputs, target)
    sync(args)


def time_steps(model, inputs, target, args) -> tuple[list[float], float]:
    """Wall ms of ``args.steps`` steps, and the peak memory (GiB) they allocate above what was
    allocated before them (both models stay resident, so the absolute peak would count the other)."""
    sync(args)
    base = 0
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        sync(args)
        t0 = time.perf_counter()
        step(model, inputs, target)
        sync(args)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if args.device == "cuda" else float("nan")
    return times, peak


def profile_step(model, inputs, target, args, stem: str) -> dict:
    """One step under torch.profiler (CPU and CUDA): the GPU time of its kernels against its wall
    time, and the ops by self device time in ``<out>/ltx_profile_<tag>_<stem>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    sync(args)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step(model, inputs, target)
        sync(args)
        wall_ms = (time.perf_counter() - t0) * 1e3
    kernel_ms = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
    path = args.out / f"ltx_profile_{args.tag}_{stem}.txt"
    path.write_text(f"# one step: wall {wall_ms:.2f} ms (profiled), device time {kernel_ms:.2f} ms\n{table}\n")
    return {"wall_ms_profiled": wall_ms, "device_ms": kernel_ms}


def run_shape(B, S, args) -> dict:
    """Both compiled models side by side: warmed up (compiled) in turn, then ``args.rounds`` rounds
    of ``args.steps`` timed steps each, the two alternated (the order swapped every round)."""
    gen = torch.Generator().manual_seed(1)
    base = build(args, torch.bfloat16)
    inputs32 = make_inputs(B, S, args, gen)
    target = torch.randn(B, S, 128, generator=gen).to(args.device)
    ref_model = copy.deepcopy(base).float()
    ref = grads_of(ref_model, inputs32, target)
    del ref_model
    inputs = cast(inputs32, torch.bfloat16)
    row = {"B": B, "S": S, "grid": frames_hw(S)}
    torch._dynamo.reset()
    names = ("inductor", "adaptiveload")
    models = {name: compiled(base, name, args.inner) for name in names}
    for name in names:
        with collect_reports() as reports:
            warm_up(models[name], inputs, target, args)
        row[name] = {"chains_fused": sum(r.fused for r in reports), "step_ms_all": [], "peak_step_gib": 0.0}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times, peak = time_steps(models[name], inputs, target, args)
            row[name]["step_ms_all"] += times
            row[name]["peak_step_gib"] = max(row[name]["peak_step_gib"], peak)
    if args.profile:
        for name in names:
            row[name]["profile"] = profile_step(models[name], inputs, target, args, f"{B}x{S}_{name}")
    for name in names:
        cell = row[name]
        rounds = [statistics.median(cell["step_ms_all"][i:i + args.steps])
                  for i in range(0, len(cell["step_ms_all"]), args.steps)]
        cell.update(step_ms=statistics.median(cell["step_ms_all"]), step_ms_round_medians=rounds)
        errors = grad_errors(grads_of(models[name], inputs, target), ref)
        worst = max(errors, key=errors.get)
        cell.update(grad_rel_err_max=errors[worst], grad_rel_err_worst_param=worst, grad_rel_err=errors,
                    params_within_5pct=sum(e <= 0.05 for e in errors.values()), params=len(errors))
        print(f"B={B} S={S} {name}: {cell['chains_fused']} chains fused, {cell['step_ms']:.2f} ms "
              f"(round medians {', '.join(f'{t:.2f}' for t in rounds)}), step peak {cell['peak_step_gib']:.2f} GiB, "
              f"grad err max {errors[worst]:.2e} ({worst}), within 5%: {cell['params_within_5pct']}/{len(errors)}",
              flush=True)
    row["time_ratio"] = row["inductor"]["step_ms"] / row["adaptiveload"]["step_ms"]
    return row


def markdown(doc: dict) -> str:
    lines = [f"# LTX-Video training step on {doc['device']} (torch {doc['torch']}, {doc['date']})", "",
             f"Command: `{doc['command']}`", "",
             f"hidden {doc['hidden']}, {doc['layers']} layers, bf16, each block compiled; gradients against fp32 eager.",
             "", "| B | S | chains fused | backend ms | Inductor ms | Inductor / backend | step peak GiB backend / Inductor | "
             "grad err max backend / Inductor | params within 5% backend / Inductor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        a, i = r["adaptiveload"], r["inductor"]
        lines.append(f"| {r['B']} | {r['S']} | {a['chains_fused']} | {a['step_ms']:.2f} | {i['step_ms']:.2f} | {r['time_ratio']:.3f} | "
                     f"{a['peak_step_gib']:.2f} / {i['peak_step_gib']:.2f} | {a['grad_rel_err_max']:.2e} / "
                     f"{i['grad_rel_err_max']:.2e} | {a['params_within_5pct']}/{a['params']} / "
                     f"{i['params_within_5pct']}/{i['params']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--caption-channels", type=int, default=256)
    parser.add_argument("--shapes", nargs="+", default=["1x6144", "8x384"], help="BxS, S = frames x height x width")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the two compiled models alternated")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each (device time vs wall; ltx_profile_<tag>_*.txt)")
    parser.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"),
                        help="the compiler after the backend's rewrite, and the baseline's")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--tag", default="h200", help="results file name: ltx_step_<tag>.json / .md")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_ltx_step: no CUDA GPU (use --device cpu for a check that it runs)", file=sys.stderr)
        return 1
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    rows = [run_shape(B, S, args) for B, S in shapes]
    doc = {**run_context(__file__, argv), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "hidden": args.hidden, "layers": args.layers, "rows": rows}
    text = markdown(doc)
    write_json_and_markdown(str(args.out), f"ltx_step_{args.tag}", doc, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
