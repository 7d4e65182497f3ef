"""Benchmark of the fused LayerNorm -> modulate op against eager PyTorch and Inductor, on one GPU.

For each shape: median (and p20/p80) forward, backward and forward+backward times of
  * eager:    F.layer_norm(x) * (1 + scale) + shift
  * inductor: torch.compile(the same expression, dynamic=False), default mode
  * fused:    torch.ops.adaptiveload.adaln_modulate (the csrc/ kernels), called eagerly
  * backend:  torch.compile(the unfused expression, backend="adaptiveload", dynamic=False): the
              backend rewrites the chain into the fused op and Inductor compiles the rest (the
              Linear); what a compiled model runs, without the op's eager autograd layer
where, for per-sample modulation, every implementation computes scale and shift in the graph from a
Linear -> chunk -> unsqueeze (torch 2.11 Inductor fails backward with B = 1 leaf modulation: the
op's own test of it is tests/ops/test_adaln_modulate.py::test_batch1_leaf_modulation_grads_keep_their_shape_and_values),
and per-token scale and shift are the two halves (.chunk) of one [B, N, 2D]
leaf. The fused op also gets "op only" rows: the forward kernel alone and the backward op alone
(one-pass, and the two-kernel reference design), which the speed-of-light (SoL) fractions use.

SoL = bytes that must move / measured copy bandwidth (bytes read + written), with e the element size
of x: per-sample forward 2*B*N*D*e, backward 3*B*N*D*e; per-token forward 4*B*N*D*e, backward
6*B*N*D*e. Timing: triton.testing.do_bench (CUDA events, warm-up, L2 flushed before every run) over
input sets rotated so that together they exceed 3x the L2 cache.

Writes benchmarks/results/adaln_<tag>.json and .md (GPU, torch, date, command) and prints the table.
Usage:
    python benchmarks/bench_adaln.py                         # the full grid below
    python benchmarks/bench_adaln.py --preset session        # the subset measured in one GPU session
    python benchmarks/bench_adaln.py --B 1 --N 65536 --D 1536 3072 5120 --layouts per-sample
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from adaptiveload.fxfuse import backend as fusion_backend
from results_file import run_context, write_json_and_markdown

# The grid of the issue: B x N x D x modulation layout x dtype pattern.
DEFAULT_B = (1, 2)
DEFAULT_N = (4096, 16384, 65536)
DEFAULT_D = (1536, 3072, 5120)
DEFAULT_LAYOUTS = ("per-sample", "per-token")
# "bf16": bf16 x, modulation and output; "wan": bf16 x, fp32 modulation, bf16 output (Wan 2.1's
# chain: LayerNorm(x.float()) * (1 + scale) + shift, then .type_as(x))
DEFAULT_PATTERNS = ("bf16", "wan")
# Named shape lists (B, N, D, layout, pattern): "grid" is the product above; "session" the subset
# one lent-GPU session affords (every per-sample bf16 shape, per-token and Wan at long sequences).
PRESETS = {
    "grid": None,
    "session": [(B, N, D, "per-sample", "bf16") for B in DEFAULT_B for N in DEFAULT_N for D in DEFAULT_D]
    + [(1, N, D, "per-token", "bf16") for N in (16384, 65536) for D in DEFAULT_D]
    + [(B, 65536, D, "per-sample", "wan") for B in DEFAULT_B for D in DEFAULT_D],
    # the targets' shapes only (N = 65536), for a short session
    "long": [(B, 65536, D, "per-sample", "bf16") for B in DEFAULT_B for D in DEFAULT_D]
    + [(1, 65536, D, "per-token", "bf16") for D in DEFAULT_D]
    + [(B, 65536, D, "per-sample", "wan") for B in DEFAULT_B for D in DEFAULT_D],
}
IMPLS = ("eager", "inductor", "fused", "backend")
EPS = 1e-6
EMB_DIM = 256  # width of the embedding the per-sample Linear maps to [B, 2 * D]
COPY_BYTES = 1 << 30  # 1 GiB device-to-device copy for the bandwidth ceiling


def copy_bandwidth(tt) -> float:
    """Measured device-to-device copy bandwidth, bytes read + written per second."""
    a = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * COPY_BYTES / (ms * 1e-3)


def stats(times: list[float]) -> dict:
    t = torch.tensor(times, dtype=torch.float64)
    return {"median": t.median().item(), "p20": t.quantile(0.2).item(), "p80": t.quantile(0.8).item(), "n": len(times)}


def bench(tt, fn, grad_to_none=None) -> dict:
    return stats(tt.do_bench(fn, warmup=25, rep=150, grad_to_none=grad_to_none, return_mode="all"))


def chain(x, scale, shift, out_dtype):
    """The unfused expression. Wan pattern: x is normalized in fp32 and the result cast back."""
    if out_dtype is not None:
        y = F.layer_norm(x.float(), (x.shape[-1],), eps=EPS) * (1 + scale) + shift
        return y.to(out_dtype)
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale) + shift


def fused(x, scale, shift, out_dtype):
    return torch.ops.adaptiveload.adaln_modulate(x, None, None, scale, shift, EPS, out_dtype or x.dtype)[0]


def make_expr(impl, layout, pattern):
    """fn(x, mod_input, linear) -> y for one implementation; mod_input is the [B, EMB_DIM] embedding
    (per-sample, through `linear`) or the [B, N, 2D] per-token leaf."""
    body = fused if impl == "fused" else chain  # the backend rewrites the chain into the op
    out_dtype = torch.bfloat16 if pattern == "wan" else None

    def fn(x, mod_input, linear):
        if layout == "per-sample":
            scale, shift = (m.unsqueeze(1) for m in linear(mod_input).chunk(2, dim=-1))
        else:
            scale, shift = mod_input.chunk(2, dim=-1)
        return body(x, scale, shift, out_dtype)

    if impl == "inductor":
        return torch.compile(fn, dynamic=False)
    if impl == "backend":
        return torch.compile(fn, backend="adaptiveload", dynamic=False)
    return fn


def make_inputs(B, N, D, layout, pattern, n_sets, gen):
    mdt = torch.float32 if pattern == "wan" else torch.bfloat16
    sets = []
    for _ in range(n_sets):
        x = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        if layout == "per-sample":
            mod = torch.randn(B, EMB_DIM, device="cuda", dtype=mdt, generator=gen)
        else:
            mod = 0.1 * torch.randn(B, N, 2 * D, device="cuda", dtype=mdt, generator=gen)
        sets.append((x, mod, dy))
    linear = torch.nn.Linear(EMB_DIM, 2 * D, device="cuda", dtype=mdt)
    with torch.no_grad():
        linear.weight.mul_(0.1)
    return sets, linear


class Rotating:
    """Calls fn on the next input set each time (so repeated runs do not hit in L2)."""

    def __init__(self, sets):
        self.sets, self.i = sets, 0

    def next(self):
        self.i = (self.i + 1) % len(self.sets)
        return self.sets[self.i]


def saved_bytes(fn, x, mod, linear) -> int:
    """Bytes of the tensors autograd saves for backward, beyond the inputs x, mod and the Linear's
    parameters (which are alive anyway)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, mod, linear)
    for t in (x, mod, *linear.parameters()):
        seen.pop(t.untyped_storage().data_ptr(), None)
    del y
    return sum(seen.values())


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_shape(tt, B, N, D, layout, pattern, bw, l2_bytes, gen) -> dict:
    e = 2  # bf16 x
    bytes_x = B * N * D * e
    k = 1 if layout == "per-sample" else 2
    sol_f = 2 * k * bytes_x / bw * 1e3
    sol_b = 3 * k * bytes_x / bw * 1e3
    per_set = bytes_x * (2 + (2 if layout == "per-token" else 0))
    n_sets = max(1, min(4, math.ceil(3 * l2_bytes / per_set)))
    sets, linear = make_inputs(B, N, D, layout, pattern, n_sets, gen)
    row = {"B": B, "N": N, "D": D, "layout": layout, "pattern": pattern, "input_sets": n_sets,
           "sol_fwd_ms": sol_f, "sol_bwd_ms": sol_b, "sol_fwdbwd_ms": sol_f + sol_b, "impl": {}}
    x0, m0, dy0 = sets[0]
    with torch.no_grad():
        if layout == "per-sample":
            s0, h0 = (m.unsqueeze(1).double() for m in linear(m0).chunk(2, dim=-1))
        else:
            s0, h0 = (m.double() for m in m0.chunk(2, dim=-1))
        ref = F.layer_norm(x0.double(), (D,), eps=EPS) * (1 + s0) + h0
    params = list(linear.parameters())
    for impl in IMPLS:
        fn = make_expr(impl, layout, pattern)
        rot = Rotating(sets)
        res = {}
        try:
            with torch.no_grad(), fusion_backend.collect_reports() as reports:
                res["rel_err_vs_fp64"] = rel_err(fn(x0, m0, linear), ref)
            with torch.no_grad():
                if impl == "backend" and sum(r.fused for r in reports) != 1:
                    raise RuntimeError("the adaptiveload backend did not fuse the chain (exactly one expected)")

                def fwd():
                    x, m, _ = rot.next()
                    fn(x, m, linear)

                res["fwd"] = bench(tt, fwd)
            leaves = [(x.detach().requires_grad_(True), m.detach().requires_grad_(True), dy) for x, m, dy in sets]
            rot_g = Rotating(leaves)

            def fwdbwd():
                x, m, dy = rot_g.next()
                fn(x, m, linear).backward(dy)

            fwdbwd()
            res["fwdbwd"] = bench(tt, fwdbwd, grad_to_none=[t for s in leaves for t in s[:2]] + params)
            # backward alone: one graph per input set, replayed with retain_graph
            graphs = [(fn(x, m, linear), dy) for x, m, dy in leaves]
            rot_y = Rotating(graphs)

            def bwd():
                y, dy = rot_y.next()
                y.backward(dy, retain_graph=True)

            try:
                bwd()
                res["bwd"] = bench(tt, bwd, grad_to_none=[t for s in leaves for t in s[:2]] + params)
            except RuntimeError as err:  # a compiled graph that cannot be replayed: fwd+bwd - fwd
                res["bwd"] = {"median": res["fwdbwd"]["median"] - res["fwd"]["median"], "estimated": True,
                              "why": str(err).splitlines()[0][:160]}
            del graphs
            res["saved_bytes"] = saved_bytes(fn, *leaves[0][:2], linear)
            try:
                res["fwdbwd_gpu"] = gpu_time(fwdbwd, [t for s in leaves for t in s[:2]] + params)
            except Exception as err:  # noqa: BLE001 - e.g. CUPTI held by another profiler: the other columns stand
                res["fwdbwd_gpu"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
                print(f"  {impl}: no GPU time ({res['fwdbwd_gpu']['error']})", flush=True)
        except Exception as err:  # noqa: BLE001 - record and go on (e.g. an Inductor failure)
            res["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            print(f"  {impl} failed at B={B} N={N} D={D} {layout} {pattern}: {res['error']}", flush=True)
        row["impl"][impl] = res
        fn = None  # frees the compiled graphs (the closures above share this cell) before the next implementation
        torch.cuda.empty_cache()
    row["fused_op"] = op_only(tt, sets, linear, layout, pattern)
    return row


def gpu_time(fn, grads, calls: int = 20) -> dict:
    """GPU time of one call of fn: the summed durations of the kernels and copies it launches (the
    profiler's CUDA activity) over `calls` calls, divided by `calls`. Where the GPU waits for the
    host between kernels is not in it: in a whole model's step the host runs ahead of the GPU and
    such gaps are filled, so this is what the expression costs there. `grads` are reset to None
    before each call, as in the timed loops (no accumulation kernels). The profiler adds a little
    to each kernel (about 1-2% of a GPU-bound call), so an implementation that launches more
    kernels reads slightly slower here than on the wall clock.

    Raises:
        RuntimeError: the profiler recorded no CUDA activity (CUPTI unavailable or held by another
            profiler such as ncu or nsys).
    """
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for t in grads:
                t.grad = None
            fn()
        torch.cuda.synchronize()
    us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    if us <= 0:
        raise RuntimeError("the profiler recorded no CUDA activity")
    return {"mean": us / calls / 1e3, "calls": calls}


def host_time_us(gen, calls: int = 300) -> dict:
    """Host time (µs) of one forward+backward call of each implementation on a tiny shape (B = 1,
    N = 16, D = 1536, per-sample bf16), where the GPU work is a few µs: wall time of `calls` calls
    without a sync between them, then one sync. What a call costs before the GPU is the bottleneck."""
    sets, linear = make_inputs(1, 16, 1536, "per-sample", "bf16", 1, gen)
    x, m, dy = (t.detach().requires_grad_(t is not sets[0][2]) for t in sets[0])
    out = {}
    for impl in IMPLS:
        fn = make_expr(impl, "per-sample", "bf16")
        for _ in range(20):
            fn(x, m, linear).backward(dy)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x, m, linear).backward(dy)
        torch.cuda.synchronize()
        out[impl] = (time.perf_counter() - t0) / calls * 1e6
    return out


def op_only(tt, sets, linear, layout, pattern) -> dict:
    """The op's own kernels: forward, and backward in both designs (modulation precomputed)."""
    from adaptiveload.ops import _tuning  # (here: kernel_stages.py imports this file with older builds too)

    out_dtype = torch.bfloat16
    prepared = []
    with torch.no_grad():
        for x, m, dy in sets:
            if layout == "per-sample":
                scale, shift = (t.unsqueeze(1) for t in linear(m).chunk(2, dim=-1))
            else:
                scale, shift = m.chunk(2, dim=-1)
            y, mean, rstd = torch.ops.adaptiveload.adaln_modulate(x, None, None, scale, shift, EPS, out_dtype)
            prepared.append((x, scale, shift, dy, mean, rstd))
    rot = Rotating(prepared)
    res = {}

    def fwd():
        x, s, h, _, _, _ = rot.next()
        torch.ops.adaptiveload.adaln_modulate(x, None, None, s, h, EPS, out_dtype)

    def bwd():
        x, s, h, dy, mean, rstd = rot.next()
        torch.ops.adaptiveload.adaln_modulate_backward(dy, x, None, None, s, h, mean, rstd)

    res["fwd"] = bench(tt, fwd)
    res["bwd_one_pass"] = bench(tt, bwd)  # the kernels' choice: one pass up to 16 elements a thread
    with _tuning.override(two_kernel=True):
        res["bwd_two_kernel"] = bench(tt, bwd)
    return res


def summarize(row: dict) -> dict:
    """Derived numbers: SoL fractions and speedups (medians)."""
    imp, op = row["impl"], row["fused_op"]

    def med(impl, mode):
        cell = imp.get(impl, {}).get(mode, {})
        return cell.get("median", cell.get("mean", float("nan")))

    def ratio(num, den):
        return num / den if den > 0 else float("nan")

    out = {
        "op_fwd_frac_sol": row["sol_fwd_ms"] / op["fwd"]["median"],
        "op_bwd_frac_sol": row["sol_bwd_ms"] / op["bwd_one_pass"]["median"],
        "op_bwd_two_kernel_frac_sol": row["sol_bwd_ms"] / op["bwd_two_kernel"]["median"],
    }
    for mode in ("fwd", "bwd", "fwdbwd"):
        for other in ("eager", "inductor"):
            out[f"speedup_{mode}_vs_{other}"] = med(other, mode) / med("fused", mode)
            out[f"backend_speedup_{mode}_vs_{other}"] = med(other, mode) / med("backend", mode)
        out[f"inductor_{mode}_frac_sol"] = row[f"sol_{mode}_ms"] / med("inductor", mode)
    out["fused_fwdbwd_frac_sol"] = row["sol_fwdbwd_ms"] / med("fused", "fwdbwd")
    for impl in ("fused", "backend"):
        out[f"{impl}_gpu_speedup_fwdbwd_vs_inductor"] = ratio(med("inductor", "fwdbwd_gpu"), med(impl, "fwdbwd_gpu"))
    return out


def markdown(doc: dict) -> str:
    lines = [
        f"# LayerNorm -> modulate: fused op vs eager vs Inductor ({doc['gpu']})",
        "",
        f"- date: {doc['date']}; torch {doc['torch']}; CUDA {doc['cuda']}; triton {doc['triton']}",
        f"- command: `{doc['command']}`",
        f"- measured copy bandwidth (read + write): {doc['copy_TBps']:.2f} TB/s; times are medians in ms "
        "(p20-p80 in the JSON); SoL = bytes that must move / copy bandwidth",
        "- eager / Inductor / fused / backend columns: the whole expression (per-sample: Linear -> chunk -> "
        "unsqueeze -> chain); fused: the op called eagerly; backend: torch.compile(backend=\"adaptiveload\"); "
        "'op' columns: the fused op's kernels alone (forward; backward one-pass and two-kernel)",
        "- GPU columns: GPU time of one forward+backward, the summed durations of its kernels (torch.profiler, "
        "mean of 20 calls): time where the GPU waits for the host is not in it, as in a whole model's step "
        "where the host runs ahead",
        "- host time of one forward+backward call (µs; B = 1, N = 16, D = 1536, per-sample bf16, no sync "
        "between calls): " + ", ".join(f"{k} {v:.0f}" for k, v in doc.get("host_us_per_fwdbwd_call", {}).items()),
        "",
        "| B | N | D | layout | dtypes | SoL fwd | eager fwd | Inductor fwd | fused fwd | op fwd (% SoL) "
        "| SoL bwd | eager bwd | Inductor bwd | fused bwd | op bwd 1-pass (% SoL) | op bwd 2-kernel (% SoL) "
        "| eager fwd+bwd | Inductor fwd+bwd | fused fwd+bwd | fwd+bwd vs eager | fwd+bwd vs Inductor "
        "| backend fwd | backend fwd+bwd | backend fwd+bwd vs Inductor "
        "| GPU fwd+bwd eager / Inductor / fused / backend | GPU fwd+bwd fused / backend vs Inductor "
        "| saved MiB eager / Inductor / fused / backend | rel err eager / Inductor / fused / backend |",
        "|" + "---|" * 28,
    ]

    def m(row, impl, mode):
        r = row["impl"].get(impl, {})
        if "error" in r:
            return "error"
        cell = r.get(mode, {})
        if "error" in cell:
            return "fail"
        v = cell.get("median", cell.get("mean"))
        return "–" if v is None else f"{v:.3f}" + ("*" if cell.get("estimated") else "")

    for row in doc["rows"]:
        s, op = row["summary"], row["fused_op"]
        saved = " / ".join(
            f"{row['impl'][i].get('saved_bytes', float('nan')) / 2**20:.1f}" if "saved_bytes" in row["impl"][i] else "–"
            for i in IMPLS)
        errs = " / ".join(
            f"{row['impl'][i]['rel_err_vs_fp64']:.1e}" if "rel_err_vs_fp64" in row["impl"][i] else "–"
            for i in IMPLS)
        lines.append(
            f"| {row['B']} | {row['N']} | {row['D']} | {row['layout']} | {row['pattern']} | {row['sol_fwd_ms']:.3f} "
            f"| {m(row, 'eager', 'fwd')} | {m(row, 'inductor', 'fwd')} | {m(row, 'fused', 'fwd')} "
            f"| {op['fwd']['median']:.3f} ({100 * s['op_fwd_frac_sol']:.0f}%) | {row['sol_bwd_ms']:.3f} "
            f"| {m(row, 'eager', 'bwd')} | {m(row, 'inductor', 'bwd')} | {m(row, 'fused', 'bwd')} "
            f"| {op['bwd_one_pass']['median']:.3f} ({100 * s['op_bwd_frac_sol']:.0f}%) "
            f"| {op['bwd_two_kernel']['median']:.3f} ({100 * s['op_bwd_two_kernel_frac_sol']:.0f}%) "
            f"| {m(row, 'eager', 'fwdbwd')} | {m(row, 'inductor', 'fwdbwd')} | {m(row, 'fused', 'fwdbwd')} "
            f"| {s['speedup_fwdbwd_vs_eager']:.2f}x | {s['speedup_fwdbwd_vs_inductor']:.2f}x "
            f"| {m(row, 'backend', 'fwd')} | {m(row, 'backend', 'fwdbwd')} "
            f"| {s['backend_speedup_fwdbwd_vs_inductor']:.2f}x "
            f"| {' / '.join(m(row, i, 'fwdbwd_gpu') for i in IMPLS)} "
            f"| {s['fused_gpu_speedup_fwdbwd_vs_inductor']:.2f}x / {s['backend_gpu_speedup_fwdbwd_vs_inductor']:.2f}x "
            f"| {saved} | {errs} |"
        )
    lines += ["", "`*` backward estimated as fwd+bwd − fwd (the compiled graph could not be replayed)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, nargs="+", default=list(DEFAULT_B))
    parser.add_argument("--N", type=int, nargs="+", default=list(DEFAULT_N))
    parser.add_argument("--D", type=int, nargs="+", default=list(DEFAULT_D))
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), choices=DEFAULT_LAYOUTS)
    parser.add_argument("--patterns", nargs="+", default=list(DEFAULT_PATTERNS), choices=DEFAULT_PATTERNS)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="grid",
                        help="a named shape list (default: the product of --B --N --D --layouts --patterns)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--tag", default="h200", help="results file name: adaln_<tag>.json / .md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_adaln: needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton.testing as tt

    import adaptiveload  # noqa: F401
    from adaptiveload.ops import extension

    os.environ["ADAPTIVELOAD_REQUIRE_KERNEL"] = "1"
    extension.kernels()
    torch._dynamo.config.cache_size_limit = 256
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 * 2**20)
    bw = copy_bandwidth(tt)
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s, L2 {l2 / 2**20:.0f} MiB", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    host_us = host_time_us(gen)
    print("host time of one fwd+bwd call (µs, B=1 N=16 D=1536): "
          + ", ".join(f"{k} {v:.0f}" for k, v in host_us.items()), flush=True)
    rows, md = [], ""
    t0 = time.time()
    shapes = PRESETS[args.preset] or [
        (B, N, D, layout, pattern)
        for pattern, layout, B, N, D in itertools.product(args.patterns, args.layouts, args.B, args.N, args.D)
    ]
    for B, N, D, layout, pattern in shapes:
        row = run_shape(tt, B, N, D, layout, pattern, bw, l2, gen)
        row["summary"] = summarize(row)
        rows.append(row)
        s, op = row["summary"], row["fused_op"]
        print(
            f"B={B} N={N} D={D} {layout} {pattern}: op fwd {op['fwd']['median']:.3f} ms "
            f"({100 * s['op_fwd_frac_sol']:.0f}% SoL), bwd {op['bwd_one_pass']['median']:.3f} "
            f"({100 * s['op_bwd_frac_sol']:.0f}%), 2-kernel {op['bwd_two_kernel']['median']:.3f} "
            f"({100 * s['op_bwd_two_kernel_frac_sol']:.0f}%); fwd+bwd vs eager {s['speedup_fwdbwd_vs_eager']:.2f}x, "
            f"vs Inductor {s['speedup_fwdbwd_vs_inductor']:.2f}x (backend {s['backend_speedup_fwdbwd_vs_inductor']:.2f}x), "
            f"fwd vs Inductor {s['speedup_fwd_vs_inductor']:.2f}x; GPU time fwd+bwd vs Inductor "
            f"{s['fused_gpu_speedup_fwdbwd_vs_inductor']:.2f}x (backend {s['backend_gpu_speedup_fwdbwd_vs_inductor']:.2f}x) "
            f"[{time.time() - t0:.0f}s]",
            flush=True,
        )
        torch.cuda.empty_cache()
        md = write_results(args, props, bw, host_us, rows)  # after every shape: a cut-short run keeps its rows
    print(md)
    return 0


def write_results(args, props, bw, host_us, rows) -> str:
    import triton

    doc = {**run_context(__file__, None), "gpu": props.name, "cuda": torch.version.cuda,
           "triton": triton.__version__, "copy_TBps": bw / 1e12, "host_us_per_fwdbwd_call": host_us, "rows": rows}
    md = markdown(doc)
    write_json_and_markdown(str(args.out), f"adaln_{args.tag}", doc, md.rstrip("\n"))
    return md


if __name__ == "__main__":
    raise SystemExit(main())
