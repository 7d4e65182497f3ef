"""Host time of one forward+backward of a norm -> modulate chain, and where it goes.

Two chains (``--chain``):

* ``wan`` (default): at B = 4, N = 4096, D = 1536, bf16 x, per-sample fp32 modulation from a Linear,
  the Wan chain of benchmarks/bench_adaln.py (LayerNorm in fp32, cast back);
* ``ltx``: LTX-Video's norm site, a weightless RMSNorm times ``1 + scale`` plus ``shift``, bf16
  everywhere, scale and shift ``[B, 1, D]`` views of ``scale_shift_table + temb`` as the diffusers
  model makes them (``--B 8 --N 384 --D 2048`` is its host-bound training shape).

The GPU work of one call is ~0.1 ms or less, so a loop of calls with no synchronisation between them
is bound by the host: wall time / calls is the host time of a call.
Three implementations, alternated in one process (the order rotated every round):

* ``inductor``: ``torch.compile(chain)``;
* ``backend``:  ``torch.compile(chain, backend="adaptiveload")`` (the chain rewritten into the op);
* ``fused``:    the op called eagerly (``adaptiveload.functional``-style, its autograd included).

Per implementation: ``--rounds`` rounds of ``--calls`` calls; the median, min and max over rounds
of wall µs a call (and of the calling thread's CPU µs a call, ``time.thread_time``). Then, for the
backend and Inductor, where the host time goes: a ``torch.profiler`` table (CPU activity, ops by
self CPU time) and a ``cProfile`` listing (Python functions by own time) of ``--profile-calls``
calls, written beside the results as ``host_profile_<tag>_<impl>.txt``.

Writes ``<out>/host_<tag>.json`` and ``.md`` (GPU, torch version, date, exact command).
Usage: python benchmarks/profile_host.py [--out benchmarks/results] [--tag h200]
(``--device cpu --N 64 --rounds 2 --calls 5`` checks that it runs on a CPU.)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import bench_adaln
from results_file import run_context, write_json_and_markdown

IMPLS = ("inductor", "backend", "fused")


def ltx_modulation(x, temb, table):
    """(shift, scale) [B, 1, D] from ``table [2, D] + temb [B, 1, 2 * D]``: unbound views, as diffusers'
    LTXVideoTransformerBlock makes them."""
    B, D = x.shape[0], x.shape[-1]
    return (table[None, None] + temb.reshape(B, 1, 2, D)).unbind(dim=2)


def ltx_chain(x, temb, table):
    """LTX-Video's norm site: a weightless RMSNorm, modulated by ltx_modulation's scale and shift."""
    shift, scale = ltx_modulation(x, temb, table)
    return F.rms_norm(x, (x.shape[-1],), None, bench_adaln.EPS) * (1 + scale) + shift


def make_ltx_calls(args):
    """{impl: call()} for the ``ltx`` chain; ``fused`` calls the op eagerly through its autograd."""
    gen = torch.Generator(device=args.device).manual_seed(0)
    dev, dt = args.device, torch.bfloat16
    x = torch.randn(args.B, args.N, args.D, device=dev, dtype=dt, generator=gen).requires_grad_()
    dy = torch.randn(args.B, args.N, args.D, device=dev, dtype=dt, generator=gen)
    temb = (0.1 * torch.randn(args.B, 1, 2 * args.D, device=dev, generator=gen)).to(dt).requires_grad_()
    table = (0.1 * torch.randn(2, args.D, device=dev, generator=gen)).to(dt).requires_grad_()

    def fused(x, temb, table):
        shift, scale = ltx_modulation(x, temb, table)
        return torch.ops.adaptiveload.rms_norm_modulate(x, None, scale, shift, bench_adaln.EPS, x.dtype)[0]

    fns = {"inductor": torch.compile(ltx_chain, dynamic=False),
           "backend": torch.compile(ltx_chain, backend="adaptiveload", dynamic=False), "fused": fused}
    return {impl: (lambda fn=fns[impl]: fn(x, temb, table).backward(dy)) for impl in IMPLS}


def make_calls(args):
    """{impl: call()} each running one forward+backward on the same inputs."""
    if args.chain == "ltx":
        return make_ltx_calls(args)
    gen = torch.Generator(device=args.device).manual_seed(0)
    dev = args.device
    mdt = torch.float32
    x = torch.randn(args.B, args.N, args.D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
    dy = torch.randn(args.B, args.N, args.D, device=dev, dtype=torch.bfloat16, generator=gen)
    emb = torch.randn(args.B, bench_adaln.EMB_DIM, device=dev, dtype=mdt, generator=gen)
    linear = torch.nn.Linear(bench_adaln.EMB_DIM, 2 * args.D, device=dev, dtype=mdt)
    calls = {}
    for impl in IMPLS:
        fn = bench_adaln.make_expr(impl, "per-sample", "wan")
        calls[impl] = (lambda fn=fn: fn(x, emb, linear).backward(dy))
    return calls


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_round(call, n: int, device: str) -> tuple[float, float]:
    """(wall µs, thread CPU µs) a call over n calls, one synchronisation at the end."""
    sync(device)
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        call()
    c1 = time.thread_time()
    sync(device)
    return (time.perf_counter() - w0) / n * 1e6, (c1 - c0) / n * 1e6


def profile(call, n: int, device: str) -> str:
    """torch.profiler (CPU activity) table and cProfile listing of n calls."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            call()
        sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        call()
    sync(device)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
    return (f"# {n} calls; torch.profiler, CPU activity, by self CPU time\n{table}\n"
            f"# cProfile of {n} calls, by own time\n{buf.getvalue()}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chain", default="wan", choices=("wan", "ltx"))
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--D", type=int, default=1536)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--profile-calls", type=int, default=100)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="h200")
    args = p.parse_args(argv)

    calls = make_calls(args)
    for impl, call in calls.items():  # compile and warm up
        for _ in range(20):
            call()
    sync(args.device)
    wall = {impl: [] for impl in IMPLS}
    cpu = {impl: [] for impl in IMPLS}
    for r in range(args.rounds):
        order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
        for impl in order:
            w, c = time_round(calls[impl], args.calls, args.device)
            wall[impl].append(w)
            cpu[impl].append(c)
    rows = {impl: {"wall_us": {"median": statistics.median(wall[impl]), "min": min(wall[impl]), "max": max(wall[impl]),
                               "rounds": wall[impl]},
                   "thread_cpu_us": {"median": statistics.median(cpu[impl]), "rounds": cpu[impl]}}
            for impl in IMPLS}
    ref = rows["inductor"]["wall_us"]["median"]
    for impl in IMPLS:
        rows[impl]["vs_inductor"] = rows[impl]["wall_us"]["median"] / ref

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for impl in ("backend", "inductor"):
        (out / f"host_profile_{args.tag}_{impl}.txt").write_text(profile(calls[impl], args.profile_calls, args.device))

    ctx = run_context(__file__, argv)
    ctx["gpu"] = torch.cuda.get_device_name() if args.device == "cuda" else None
    modulation = "fp32 per-sample" if args.chain == "wan" else "bf16 per-sample (table + temb views)"
    doc = {"context": ctx, "chain": args.chain,
           "shape": {"B": args.B, "N": args.N, "D": args.D, "x": "bf16", "modulation": modulation},
           "rounds": args.rounds, "calls": args.calls, "impls": rows}
    chain_name = "Wan chain" if args.chain == "wan" else "LTX-Video chain (RMSNorm)"
    lines = [f"## Host time of one forward+backward (B = {args.B}, N = {args.N}, D = {args.D}, bf16, {chain_name})", "",
             f"`{ctx['command']}` -- {ctx['date']}, {ctx['gpu'] or 'CPU'}, torch {ctx['torch']}; "
             f"{args.rounds} rounds of {args.calls} calls, implementations alternated.", "",
             "| impl | wall µs/call (median) | min | max | thread CPU µs/call | vs Inductor |", "|---|---|---|---|---|---|"]
    for impl in IMPLS:
        r = rows[impl]
        lines.append(f"| {impl} | {r['wall_us']['median']:.0f} | {r['wall_us']['min']:.0f} | {r['wall_us']['max']:.0f} "
                     f"| {r['thread_cpu_us']['median']:.0f} | {r['vs_inductor']:.2f}x |")
    text = "\n".join(lines)
    print(text)
    write_json_and_markdown(str(out), f"host_{args.tag}", doc, text)


if __name__ == "__main__":
    main()
