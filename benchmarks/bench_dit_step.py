"""One training step of a diffusers DiT (bf16) in eager mode, with each transformer block compiled by
Inductor, or by the ``adaptiveload`` backend: step time, peak memory, the norm sites' GPU time, and
every parameter gradient against an fp32 eager reference.

Models (``--model``; the defaults of the other flags depend on it):

* ``ltx``: ``LTXVideoTransformer3DModel``, hidden 2048 (32 heads x 64), 4 layers, 128 latent channels,
  caption channels 256 (64 text tokens). Its RMSNorm -> modulate sites are the blocks' norm1 and norm2
  (weightless RMSNorm, per-token scale and shift from ``scale_shift_table + temb``), the head's a
  LayerNorm one outside the compiled blocks. S = frames x height x width tokens; the grid is
  ``ltx_grid``'s. Defaults: ``--shapes 1x6144 8x384``, ``--steps 5``, ``--backends inductor
  adaptiveload``. Writes ``ltx_step_<tag>.json`` / ``.md``, as the LTX-only script it replaced did.
* ``wan``: ``WanTransformer3DModel`` at the Wan-2.1-1.3B shape: hidden 1536 (12 heads x 128), FFN
  8960, text_dim 4096, freq_dim 256, patch (1, 2, 2), 16 latent channels, cross_attn_norm, eps 1e-6,
  cut to ``--layers`` (default 10) blocks; the text is 512 random tokens of text_dim. S = T x H x W / 4
  tokens of a latent grid T x H x W (H, W even); ``wan_grid`` picks it: 12x1560 is 1 latent frame of
  480x832 video (1 x 60 x 104), 1x32760 81 frames at 480x832 (21 x 60 x 104), 1x46800 49 frames at
  720x1280 (13 x 90 x 160). Defaults: ``--shapes 12x1560 1x32760 1x46800``, ``--steps 10``,
  ``--backends eager inductor adaptiveload``. Writes ``wan_step_<tag>.json`` / ``.md``.

Both are built with ``torch.manual_seed(0)`` and cast whole to bf16 (``_keep_in_fp32_modules`` is not
applied; Wan's blocks compute their LayerNorms and modulation in fp32 anyway). The timestep is
random per sample. Each block of the model's ``_repeated_blocks`` is compiled (``nn.Module.compile``;
the blocks share one compiled graph), the rest of the model runs eagerly; ``--compile model``
compiles the whole model instead (one graph: the residual site that ends a block and the next
block's norm are then in one region).

For each (B, S) of ``--shapes``:

* the chains the backend fused (``collect_reports``; per compiled graph, so per block, or for the whole
  model with ``--compile model``);
* step time: median of ``--rounds`` x ``--steps`` timed steps (forward, an MSE loss against a random
  target, backward; wall clock between device synchronizations) after ``--warmup`` steps (the first
  compiles), the backends alternated round by round (the order rotated every round), the median of
  each round (their spread), and the peak memory the timed steps allocate above what was allocated
  before them (``torch.cuda.max_memory_allocated``; all models stay resident), in GiB; Python's
  garbage collector runs before each round and is off inside it (a collection in a host-bound step
  would land on whichever backend was timed then);
  ratios: each backend's median step time over Inductor's (eager / Inductor is eager's), and the
  paired ratio: the median over rounds of the backend's round median over Inductor's in the same
  round, with its range. Rounds run back to back, so a drift of the machine (clocks, host load) moves
  both members of a pair alike; many short rounds (``--rounds 21 --steps 5``) give the steadiest
  paired ratio for host-bound shapes;
* ``--profile`` (CUDA only; skipped on a CPU): one more step of each backend under ``torch.profiler``:
  GPU time (ms) of all its device activities (kernels, copies, memsets; GPU user-annotation ranges
  excluded, they span the kernels they annotate) and of the norm-site kernels, each backend's over
  Inductor's, and the ops by self device time, the norm-site kernels by name and the ops by self CPU
  (host) time, in ``<model>_profile_<tag>_<B>x<S>_<backend>.txt``.
  A norm-site kernel is one whose name contains one of ``NORM_SITE_KERNELS``: ``adaln`` (the C++
  namespace of all of this library's kernels, csrc/: fwd_kernel, bwd_row_kernel, bwd_col_kernel,
  bwd_reduce_kernel, res_*), ``res_fwd`` / ``res_bwd`` / ``res_reduce`` (the residual kernels), and
  ``layer_norm`` / ``rms_norm`` (ATen's ``native_layer_norm`` / ``_fused_rms_norm`` kernels and their
  backward, and Inductor's kernels that contain these ops: Inductor names a fused kernel after the
  ATen ops in it, so a kernel that fuses a norm with the modulate around it is counted whole, and so
  are Inductor's kernels named after this library's ops, e.g. ``..._rms_norm_modulate_backward_...``).
  A heuristic: a norm written out as pow / mean / rsqrt is not counted, and a kernel fusing a norm
  with unrelated work counts that work too. The q/k RMSNorms are counted for every backend.
* gradients: for every parameter the relative error ||g - g_ref|| / ||g_ref|| of its gradient (one
  step, fixed inputs) against the same model in fp32 eager (by absolute norm where the true gradient
  is ~0, see ``grad_errors``); the report gives the largest error and how many parameters are within
  5%, for every backend.

Writes ``<out>/<model>_step_<tag>.json`` and ``.md`` with the GPU, torch version, date and exact command,
rewritten after each shape.
Usage: python benchmarks/bench_dit_step.py --model ltx|wan [--layers N] [--shapes BxS ...] [--backends ...]
       [--compile blocks|model] [--profile] [--tag h200]
A check that it runs on a CPU (no profile): ``--device cpu --inner aot_eager --hidden 64 --heads 2
--layers 1 --shapes 1x48`` (with ``--model wan`` also ``--text-dim 32 --ffn 128``).
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from adaptiveload.fxfuse import collect_reports
from results_file import run_context, write_json_and_markdown

BACKENDS = ("eager", "inductor", "adaptiveload")
SCOPES = {"blocks": "each block", "model": "the whole model"}  # --compile: what is compiled
NORM_SITE_KERNELS = ("adaln", "res_fwd", "res_bwd", "res_reduce", "layer_norm", "rms_norm")
WAN_TEXT_TOKENS = 512
WAN_FRAMES = ((90, 160), (60, 104))  # latent H x W of 720x1280 and 480x832 video, tried in this order


@dataclasses.dataclass(frozen=True)
class Model:
    """What differs between the benchmarked models."""
    title: str
    construct: Callable  # (args) -> the diffusers model, fp32 on the CPU
    grid: Callable  # S -> the latent grid of S tokens (3 ints)
    inputs: Callable  # (B, S, args, gen) -> the forward's keyword arguments, floats fp32, on args.device
    output_shape: Callable  # (B, S, args) -> the shape of the model's output
    defaults: dict


def ltx_grid(S: int) -> tuple[int, int, int]:
    """A (frames, height, width) token grid of S tokens: frames the largest divisor of S up to 8
    with a square of (S / frames) tokens left, else (1, 1, S)."""
    for f in range(8, 0, -1):
        side = int(round((S // f) ** 0.5))
        if S % f == 0 and side * side == S // f:
            return f, side, side
    return 1, 1, S


def ltx_construct(args):
    import diffusers

    return diffusers.LTXVideoTransformer3DModel(
        in_channels=128, out_channels=128, num_attention_heads=args.heads, attention_head_dim=args.hidden // args.heads,
        cross_attention_dim=args.hidden, num_layers=args.layers, caption_channels=args.text_dim)


def ltx_inputs(B, S, args, gen) -> dict:
    """Latent tokens [B, S, 128], 64 text tokens [B, 64, text_dim] with an all-ones mask, timesteps [B]."""
    F_, H, W = ltx_grid(S)
    dev = args.device
    return dict(hidden_states=torch.randn(B, S, 128, generator=gen).to(dev),
                encoder_hidden_states=torch.randn(B, 64, args.text_dim, generator=gen).to(dev),
                timestep=torch.randint(0, 1000, (B,), generator=gen).to(dev),
                encoder_attention_mask=torch.ones(B, 64, device=dev), num_frames=F_, height=H, width=W)


def wan_grid(S: int) -> tuple[int, int, int]:
    """A latent grid (T, H, W) of S = T x H x W / 4 tokens (patch 1 x 2 x 2): the frames of
    ``WAN_FRAMES`` (720p first) whose tokens divide S, else one frame of 2h x 2w with h x w = S and
    h the largest divisor of S up to sqrt(S)."""
    for H, W in WAN_FRAMES:
        if S % (H * W // 4) == 0:
            return S // (H * W // 4), H, W
    h = max(d for d in range(1, int(S**0.5) + 1) if S % d == 0)
    return 1, 2 * h, 2 * (S // h)


def wan_construct(args):
    import diffusers

    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=args.hidden // args.heads,
        in_channels=16, out_channels=16, text_dim=args.text_dim, freq_dim=256, ffn_dim=args.ffn,
        num_layers=args.layers, cross_attn_norm=True, eps=1e-6)


def wan_inputs(B, S, args, gen) -> dict:
    """Latents [B, 16, T, H, W] (``wan_grid``), timesteps [B], 512 text tokens [B, 512, text_dim]."""
    T, H, W = wan_grid(S)
    dev = args.device
    return dict(hidden_states=torch.randn(B, 16, T, H, W, generator=gen).to(dev),
                timestep=torch.randint(0, 1000, (B,), generator=gen).to(dev),
                encoder_hidden_states=torch.randn(B, WAN_TEXT_TOKENS, args.text_dim, generator=gen).to(dev))


MODELS = {
    "ltx": Model("LTX-Video", ltx_construct, ltx_grid, ltx_inputs, lambda B, S, args: (B, S, 128),
                 dict(hidden=2048, heads=32, layers=4, text_dim=256, shapes=["1x6144", "8x384"], steps=5,
                      backends=["inductor", "adaptiveload"])),
    "wan": Model("Wan 2.1", wan_construct, wan_grid, wan_inputs, lambda B, S, args: (B, 16, *wan_grid(S)),
                 dict(hidden=1536, heads=12, layers=10, text_dim=4096, ffn=8960,
                      shapes=["12x1560", "1x32760", "1x46800"], steps=10, backends=list(BACKENDS))),
}


def build(model: Model, args, dtype) -> torch.nn.Module:
    """The model from seed 0, on ``args.device`` in ``dtype``, in train mode."""
    torch.manual_seed(0)
    return model.construct(args).to(args.device, dtype).train()


def cast(inputs: dict, dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def step(model, inputs, target) -> None:
    out = model(**inputs, return_dict=False)[0]
    torch.nn.functional.mse_loss(out.float(), target).backward()


def compiled(model, backend: str, inner: str, scope: str = "blocks"):
    """A copy of ``model``, each of its ``_repeated_blocks`` compiled (``nn.Module.compile``; scope
    ``"model"``: the whole model) with ``backend`` (``inductor`` means ``inner``, as the backend's
    inner compiler), none for ``eager``."""
    model = copy.deepcopy(model)
    blocks = ([model] if scope == "model" else
              [m for m in model.modules() if type(m).__name__ in model._repeated_blocks])
    for block in blocks:
        if backend == "adaptiveload":
            block.compile(backend="adaptiveload", options={"inner": inner})
        elif backend == "inductor":
            block.compile(backend=inner)
    return model


def grads_of(model, inputs, target) -> dict:
    model.zero_grad(set_to_none=True)
    step(model, inputs, target)
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_grads(model, inputs32, target) -> dict:
    """The gradients of an fp32 copy of ``model``, eager, one step on the fp32 inputs."""
    ref_model = copy.deepcopy(model).float()
    return grads_of(ref_model, inputs32, target)


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


def grad_report(model, inputs, target, ref: dict) -> dict:
    """The gradient errors of one step of ``model`` (``grad_errors``): all, the largest, and how many
    parameters are within 5%."""
    errors = grad_errors(grads_of(model, inputs, target), ref)
    worst = max(errors, key=errors.get)
    return dict(grad_rel_err_max=errors[worst], grad_rel_err_worst_param=worst, grad_rel_err=errors,
                params_within_5pct=sum(e <= 0.05 for e in errors.values()), params=len(errors))


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def warm_up(model, inputs, target, args) -> int:
    """``args.warmup`` steps (the first compiles); returns the number of chains the backend fused."""
    with collect_reports() as reports:
        for _ in range(args.warmup):
            model.zero_grad(set_to_none=True)
            step(model, inputs, target)
        sync(args)
    return sum(r.fused for r in reports)


def time_steps(model, inputs, target, args) -> tuple[list[float], float]:
    """Wall ms of ``args.steps`` steps, and the peak memory (GiB) they allocate above what was
    allocated before them (all models stay resident, so the absolute peak would count the others)."""
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


def time_rounds(models: dict, cells: dict, inputs, target, args) -> None:
    """``args.rounds`` rounds of ``time_steps`` of every model, the order rotated by one every round;
    appends to ``cells[name]["step_ms_all"]`` and raises ``peak_step_gib`` to each round's peak."""
    names = list(models)
    for r in range(args.rounds):
        k = r % len(names)
        gc.collect()
        gc.disable()
        try:
            for name in names[k:] + names[:k]:
                times, peak = time_steps(models[name], inputs, target, args)
                cells[name]["step_ms_all"] += times
                cells[name]["peak_step_gib"] = max(cells[name]["peak_step_gib"], peak)
        finally:
            gc.enable()


def is_norm_site(kernel: str) -> bool:
    """Whether a kernel's name marks it as a norm site's (the rule of ``NORM_SITE_KERNELS``)."""
    name = kernel.lower()
    return any(part in name for part in NORM_SITE_KERNELS)


def device_ms(prof) -> tuple[float, float, dict]:
    """GPU ms of a profile's device activities (GPU user-annotation ranges excluded): all, norm
    sites, and the norm sites' by kernel name (largest first)."""
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    total = sum(e.device_time_total for e in events) / 1e3
    by_kernel = collections.Counter()
    for e in events:
        if is_norm_site(e.name):
            by_kernel[e.name] += e.device_time_total / 1e3
    return total, sum(by_kernel.values()), dict(by_kernel.most_common())


def profile_step(model, inputs, target, args, path: Path) -> dict:
    """One step under torch.profiler (CPU and CUDA): its wall ms, the GPU ms of all its device
    activities (``kernel_ms``) and of the norm sites' kernels (``norm_site_ms``); the ops by self
    device time, then by self CPU time, go to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    sync(args)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step(model, inputs, target)
        sync(args)
        wall_ms = (time.perf_counter() - t0) * 1e3
    kernel_ms, norm_ms, norm_kernels = device_ms(prof)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_device_time_total", row_limit=40)
    table += "\n\n# norm-site kernels, GPU ms in the step\n" + "\n".join(
        f"{ms:9.3f}  {name}" for name, ms in norm_kernels.items())
    table += "\n\n# the same step by host (self CPU) time\n" + averages.table(sort_by="self_cpu_time_total",
                                                                               row_limit=40)
    path.write_text(f"# one step: wall {wall_ms:.2f} ms (profiled), kernels {kernel_ms:.2f} ms, "
                    f"norm-site kernels {norm_ms:.2f} ms\n{table}\n")
    return {"wall_ms_profiled": wall_ms, "kernel_ms": kernel_ms, "norm_site_ms": norm_ms}


def summarize(cell: dict, steps: int) -> None:
    """The median step ms of a cell's timed steps, and of each round's ``steps``."""
    times = cell["step_ms_all"]
    rounds = [statistics.median(times[i:i + steps]) for i in range(0, len(times), steps)]
    cell.update(step_ms=statistics.median(times), step_ms_round_medians=rounds)


def add_ratios(row: dict, names: list[str]) -> None:
    """Each backend's step ms (and profiled norm-site ms) over Inductor's; ``time_ratio``, Inductor's
    step ms over the adaptiveload backend's (the field of the older ltx_step results), where both ran."""
    if "inductor" not in names:
        return
    ind = row["inductor"]
    for name in names:
        cell = row[name]
        cell["step_ms_over_inductor"] = cell["step_ms"] / ind["step_ms"]
        pairs = [t / i for t, i in zip(cell["step_ms_round_medians"], ind["step_ms_round_medians"])]
        cell["step_ms_over_inductor_paired"] = statistics.median(pairs)
        cell["step_ms_over_inductor_paired_range"] = [min(pairs), max(pairs)]
        if "profile" in cell:
            cell["profile"]["norm_site_ms_over_inductor"] = (
                cell["profile"]["norm_site_ms"] / ind["profile"]["norm_site_ms"]
                if ind["profile"]["norm_site_ms"] > 0 else float("nan"))
    if "adaptiveload" in names:
        row["time_ratio"] = ind["step_ms"] / row["adaptiveload"]["step_ms"]


def print_cell(B: int, S: int, name: str, cell: dict) -> None:
    rounds = ", ".join(f"{t:.2f}" for t in cell["step_ms_round_medians"])
    ratio = (f", {cell['step_ms_over_inductor']:.3f}x Inductor (paired {cell['step_ms_over_inductor_paired']:.3f})"
             if "step_ms_over_inductor" in cell else "")
    print(f"B={B} S={S} {name}: {cell['chains_fused']} chains fused, {cell['step_ms']:.2f} ms{ratio} "
          f"(round medians {rounds}), step peak {cell['peak_step_gib']:.2f} GiB, grad err max "
          f"{cell['grad_rel_err_max']:.2e} ({cell['grad_rel_err_worst_param']}), within 5%: "
          f"{cell['params_within_5pct']}/{cell['params']}", flush=True)


def run_shape(B: int, S: int, model: Model, args) -> dict:
    """Every backend's model side by side: warmed up (compiled) in turn, ``args.rounds`` rounds of
    ``args.steps`` timed steps (``time_rounds``), one profiled step each with ``--profile``, then
    each one's gradients against the fp32 eager reference."""
    gen = torch.Generator().manual_seed(1)
    base = build(model, args, torch.bfloat16)
    inputs32 = model.inputs(B, S, args, gen)
    target = torch.randn(*model.output_shape(B, S, args), generator=gen).to(args.device)
    ref = reference_grads(base, inputs32, target)
    inputs = cast(inputs32, torch.bfloat16)
    row = {"B": B, "S": S, "grid": model.grid(S)}
    torch._dynamo.reset()
    models = {name: compiled(base, name, args.inner, args.compile) for name in args.backends}
    for name in args.backends:
        row[name] = {"chains_fused": warm_up(models[name], inputs, target, args), "step_ms_all": [],
                     "peak_step_gib": 0.0}
    time_rounds(models, row, inputs, target, args)
    if args.profile:
        for name in args.backends:
            path = args.out / f"{args.model}_profile_{args.tag}_{B}x{S}_{name}.txt"
            row[name]["profile"] = profile_step(models[name], inputs, target, args, path)
    for name in args.backends:
        summarize(row[name], args.steps)
        row[name].update(grad_report(models[name], inputs, target, ref))
    add_ratios(row, args.backends)
    for name in args.backends:
        print_cell(B, S, name, row[name])
    return row


def step_line(row: dict, name: str) -> str:
    """One backend's line of the step table."""
    c = row[name]
    ratio = f"{c['step_ms_over_inductor']:.3f}" if "step_ms_over_inductor" in c else "-"
    paired = (f"{c['step_ms_over_inductor_paired']:.3f} ({c['step_ms_over_inductor_paired_range'][0]:.3f}–"
              f"{c['step_ms_over_inductor_paired_range'][1]:.3f})" if "step_ms_over_inductor_paired" in c else "-")
    rounds = " / ".join(f"{t:.2f}" for t in c["step_ms_round_medians"])
    return (f"| {row['B']} | {row['S']} | {'x'.join(map(str, row['grid']))} | {name} | {c['chains_fused']} | "
            f"{c['step_ms']:.2f} | {rounds} | {ratio} | {paired} | {c['peak_step_gib']:.2f} | {c['grad_rel_err_max']:.2e} | "
            f"{c['params_within_5pct']}/{c['params']} |")


def profile_line(row: dict, name: str) -> str:
    """One backend's line of the profile table."""
    p = row[name]["profile"]
    ratio = f"{p['norm_site_ms_over_inductor']:.3f}" if "norm_site_ms_over_inductor" in p else "-"
    return (f"| {row['B']} | {row['S']} | {name} | {p['wall_ms_profiled']:.2f} | {p['kernel_ms']:.2f} | "
            f"{p['norm_site_ms']:.2f} | {ratio} |")


def markdown(doc: dict) -> str:
    """The step table (one line per shape and backend) and, when profiled, the GPU-time table."""
    ffn = f", FFN {doc['ffn']}" if doc.get("ffn") else ""
    lines = [f"# {doc['title']} training step on {doc['device']} (torch {doc['torch']}, {doc['date']})", "",
             f"Command: `{doc['command']}`", "",
             f"hidden {doc['hidden']} ({doc['heads']} heads), {doc['layers']} layers, text dim {doc['text_dim']}"
             f"{ffn}, bf16, {SCOPES[doc.get('compile', 'blocks')]} compiled (inner compiler {doc['inner']}); "
             "gradients against fp32 eager.", "",
             "| B | S | grid | backend | chains fused | step ms | round medians ms | / Inductor | paired / Inductor "
             "(range) | step peak GiB | grad err max | params within 5% |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [step_line(r, name) for r in doc["rows"] for name in doc["backends"]]
    if all("profile" in r[name] for r in doc["rows"] for name in doc["backends"]):
        lines += ["", "One profiled step each (GPU ms; norm sites: the kernels the script's docstring names):", "",
                  "| B | S | backend | wall ms | kernel ms | norm-site ms | norm-site / Inductor |",
                  "|---|---|---|---|---|---|---|"]
        lines += [profile_line(r, name) for r in doc["rows"] for name in doc["backends"]]
    return "\n".join(lines)


def parse_args(argv):
    """The flags; those left out take the ``--model``'s defaults (``Model.defaults``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--text-dim", "--caption-channels", dest="text_dim", type=int,
                        help="text embedding width (ltx: caption_channels, 256; wan: text_dim, 4096)")
    parser.add_argument("--ffn", type=int, help="wan only: the FFN's inner width (8960)")
    parser.add_argument("--shapes", nargs="+", help="BxS, S in latent tokens")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the backends alternated")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each backend (CUDA only; <model>_profile_<tag>_*.txt)")
    parser.add_argument("--compile", default="blocks", choices=sorted(SCOPES),
                        help="compile each of the model's repeated blocks (the train job's way) or the whole model")
    parser.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"),
                        help="the compiler after the backend's rewrite, and the baseline's")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--tag", default="h200", help="results file name: <model>_step_<tag>.json / .md")
    args = parser.parse_args(argv)
    if args.model != "wan" and args.ffn is not None:
        parser.error("--ffn applies to --model wan only")
    for key, value in MODELS[args.model].defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.backends = [name for name in BACKENDS if name in args.backends]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_dit_step: no CUDA GPU (use --device cpu for a check that it runs)", file=sys.stderr)
        return 1
    if args.profile and args.device != "cuda":
        print("bench_dit_step: --profile needs CUDA; not profiling on the CPU", file=sys.stderr)
        args.profile = False
    args.out.mkdir(parents=True, exist_ok=True)
    model = MODELS[args.model]
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    rows = []
    for B, S in shapes:  # the results file rewritten after each shape: a run cut short keeps what it measured
        rows.append(run_shape(B, S, model, args))
        doc = {**run_context(__file__, argv),
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "model": args.model, "title": model.title, "hidden": args.hidden, "heads": args.heads,
               "layers": args.layers, "text_dim": args.text_dim, "ffn": getattr(args, "ffn", None),
               "inner": args.inner, "compile": args.compile, "backends": args.backends, "rows": rows}
        text = markdown(doc)
        write_json_and_markdown(str(args.out), f"{args.model}_step_{args.tag}", doc, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
