"""Speed, determinism and accuracy of the residual norm-site ops (``residual_adaln_modulate``,
``residual_rms_norm_modulate``) on one GPU.

For each variant of :data:`VARIANTS` (the prologue, norm and modulation of a model's residual site;
bf16 x and y; per-sample gate, scale and shift as .chunk() views of one [B, 6D] embedding, a per-token
gate as its own [B, N, D] tensor) and each shape:

* op GPU time (triton.testing.do_bench median, ms) of the forward op and of the backward op (dout and
  dr both given), and their fraction of speed-of-light (SoL): the bytes that must move over the
  device-to-device copy bandwidth measured in the same run. Bytes count each x-sized tensor in its own
  dtype: forward reads x, y and writes r, out (4 moves; + a read of each per-token gate, scale or
  shift); backward reads dout, dr, r (+ y with a gate) and writes dx (+ dy with a gate): 6 moves
  gated, 4 plain (+ a read and a write of each per-token gate, scale or shift: the tensor and its
  gradient). Per-row statistics and per-sample rows are not counted.
* determinism: the backward run 3 times, every output bit-identical to the first.
* ``--stages``: each row timed again with the kernels' row staging forced to each value (the private
  ``_tuning.override(fwd_stages=, bwd_stages=)``; 0 = loads at use / the register prefetch, ``auto``
  = the launcher's choice), to pick the automatic setting.
* ``--max-threads``: each row timed again with the kernels' threads-a-block cap forced to each value
  (the private override's ``max_threads``: fewer threads, more 16-byte chunks a thread), to pick the
  automatic shape.
* ``--compare``: forward + backward through autograd (ms) of the fused op against the chain it
  replaces in a compiled model: the residual add compiled by Inductor, then the norm op
  (``adaptiveload.functional``; a plain norm: Inductor's ``F.layer_norm`` / ``F.rms_norm``), and against
  Inductor compiling the whole chain.
* accuracy against float64 (||out - ref|| / ||ref||) of r, out and every gradient, beside Inductor's
  (torch.compile of the same chain written in PyTorch: the sum in float32 rounded once to x's dtype,
  the norm of r as rounded, the modulation in float32, out rounded once), on ``--acc-N`` tokens.

Writes ``<out>/residual_<tag>.json`` and ``.md`` with the GPU, torch version, date and exact command.
Usage: python benchmarks/bench_residual.py [--B 1] [--N 65536] [--D 1536 3072 5120] [--tag h200]
       [--stages auto 0 2 4] [--max-threads auto 192 512] [--compare]
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from op_bench import finish, op_arguments, rel_err, start

EPS = 1e-6
FWD_TARGET, BWD_TARGET = 0.85, 0.75
# name -> the site: norm, gate layout (None: x + y), modulation, modulation dtype, affine norm
VARIANTS = {
    "wan-gated": dict(norm="layer_norm", gate="per-sample", modulation="scale+shift", mod_dtype=torch.float32,
                      affine=False),  # Wan's norm3 / next norm1: fp32 modulation from the time embedding
    "flux-gated": dict(norm="layer_norm", gate="per-sample", modulation="scale+shift", mod_dtype=torch.bfloat16,
                       affine=False),  # Flux / SD3: x + gate * y in bf16, then the modulated norm
    "plain-affine": dict(norm="layer_norm", gate=None, modulation="none", mod_dtype=None,
                         affine=True),  # Wan's cross-attention norm2 behind x + y
    "rms-gated-scale": dict(norm="rms_norm", gate="per-sample", modulation="scale", mod_dtype=torch.bfloat16,
                            affine=True),  # an RMSNorm site, scale-only (Lumina2-style)
    "per-token-gate": dict(norm="layer_norm", gate="per-token", modulation="scale+shift", mod_dtype=torch.bfloat16,
                           affine=False),  # a per-token gate, per-sample scale and shift
    "plain-rms": dict(norm="rms_norm", gate=None, modulation="none", mod_dtype=None,
                      affine=True),  # an RMSNorm with weight behind x + y
    "per-token-all": dict(norm="layer_norm", gate="per-token", modulation="scale+shift", mod_dtype=torch.bfloat16,
                          affine=False, per_token_mod=True),  # per-token timesteps (Wan 2.2): all per token
}
OPS = {"layer_norm": (torch.ops.adaptiveload.residual_adaln_modulate,
                      torch.ops.adaptiveload.residual_adaln_modulate_backward),
       "rms_norm": (torch.ops.adaptiveload.residual_rms_norm_modulate,
                    torch.ops.adaptiveload.residual_rms_norm_modulate_backward)}


def make_inputs(B, N, D, v, gen, dtype=torch.bfloat16) -> dict:
    """The site's tensors by name (None for absent ones), on the GPU."""
    def randn(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(dt)

    t = {"x": randn(B, N, D), "y": randn(B, N, D), "gate": None, "weight": None, "bias": None, "scale": None,
         "shift": None}
    if v["mod_dtype"] is not None:
        shift, scale, gate, *_ = randn(B, 6 * D, scale=0.3, dt=v["mod_dtype"]).chunk(6, dim=-1)
        if v["modulation"] != "none":
            if v.get("per_token_mod"):
                scale, shift = (randn(B, N, D, scale=0.3, dt=v["mod_dtype"]) for _ in range(2))
            else:
                scale, shift = scale.unsqueeze(1), shift.unsqueeze(1)
            t["scale"] = scale
            t["shift"] = shift if v["modulation"] == "scale+shift" else None
        if v["gate"] == "per-sample":
            t["gate"] = gate.unsqueeze(1)
        elif v["gate"] == "per-token":
            t["gate"] = randn(B, N, D, scale=0.3, dt=v["mod_dtype"])
    if v["affine"]:
        t["weight"] = (1 + randn(D, scale=0.1, dt=torch.float32)).to(dtype)
        t["bias"] = randn(D, scale=0.1) if v["norm"] == "layer_norm" else None
    return t


def forward(v, t, r_dtype, out_dtype):
    op = OPS[v["norm"]][0]
    norm_args = (t["weight"], t["bias"]) if v["norm"] == "layer_norm" else (t["weight"],)
    return op(t["x"], t["y"], t["gate"], *norm_args, t["scale"], t["shift"], EPS, r_dtype, out_dtype)


def backward_args(v, t, dout, dr, r, stats) -> tuple:
    norm_args = (t["weight"], t["bias"]) if v["norm"] == "layer_norm" else (t["weight"],)
    y = t["y"] if t["gate"] is not None else None
    return (dout, dr, r, y, t["gate"], *norm_args, t["scale"], t["shift"], *stats, t["x"].dtype)


def sol_bytes(v, t) -> tuple[int, int]:
    """Bytes the forward and the backward must move (the module doc's count)."""
    x = t["x"]
    n = x.numel()
    size = x.element_size()
    fwd = 4 * n * size
    gated = t["gate"] is not None
    bwd = (6 if gated else 4) * n * size
    for name in ("gate", "scale", "shift"):  # each per-token row tensor: read forward, read + written backward
        m = t[name]
        if m is not None and m.dim() == 3 and m.shape[1] == x.shape[1] > 1:
            fwd += n * m.element_size()
            bwd += 2 * n * m.element_size()
    return fwd, bwd


def chain(v, x, y, gate, weight, bias, scale, shift):
    """The site written in PyTorch (what Inductor compiles): ``(r, out)``."""
    branch = y.float() if gate is None else y.float() * gate.float()
    r = (x.float() + branch).to(x.dtype)
    w = None if weight is None else weight.float()
    if v["norm"] == "layer_norm":
        n = F.layer_norm(r.float(), (r.shape[-1],), w, None if bias is None else bias.float(), EPS)
    else:
        n = F.rms_norm(r.float(), (r.shape[-1],), w, EPS)
    if scale is not None:
        n = n * (1 + scale.float())
        n = n if shift is None else n + shift.float()
    return r, n.to(x.dtype)



NAMES = ("x", "y", "gate", "weight", "bias", "scale", "shift")


def leaves_of(t) -> tuple[dict, list]:
    """``({id: base tensor}, [gradient labels])``: one leaf per distinct tensor of the site (the
    embedding's chunks share one), and the name of each leaf's gradient."""
    bases, labels = {}, []
    for k in NAMES:
        if t[k] is None:
            continue
        base = t[k]._base if t[k]._base is not None else t[k]
        if id(base) not in bases:
            bases[id(base)] = base
            labels.append("d(emb)" if t[k]._base is not None else f"d{k}")
    return bases, labels


def with_leaves(t, bases, cast=None) -> tuple[dict, list]:
    """``(the site's tensors by name as views of fresh leaves requiring grad, the leaves)``."""
    leaves = {i: b.detach().to(cast or b.dtype).requires_grad_() for i, b in bases.items()}
    views = {}
    for k in NAMES:
        if t[k] is None:
            views[k] = None
            continue
        base = t[k]._base if t[k]._base is not None else t[k]
        leaf = leaves[id(base)]
        views[k] = leaf if t[k]._base is None else leaf.as_strided(t[k].shape, t[k].stride(), t[k].storage_offset())
    return views, list(leaves.values())


def fused_site(v):
    """The site as the fused op: ``(x, y, gate, weight, bias, scale, shift) -> (r, out)``."""
    def fused(x, y, gate, weight, bias, scale, shift):
        tt = {"x": x, "y": y, "gate": gate, "weight": weight, "bias": bias, "scale": scale, "shift": shift}
        return tuple(forward(v, tt, x.dtype, x.dtype)[:2])
    return fused


def unfused_site(v):
    """The site as a compiled model runs it without the residual fold: Inductor's add, then the norm
    op (a plain norm: Inductor's)."""
    import adaptiveload.functional as AF  # (after start(): the kernels required)

    def site(x, y, gate, weight, bias, scale, shift):
        branch = y.float() if gate is None else y.float() * gate.float()
        r = (x.float() + branch).to(x.dtype)
        if scale is None:
            return chain(v, x, y, gate, weight, bias, scale, shift)
        if v["norm"] == "layer_norm":
            return r, AF.adaln_modulate(r, scale, shift, weight=weight, bias=bias, eps=EPS)
        return r, AF.rms_norm_modulate(r, scale, shift, weight=weight, eps=EPS)
    return site


def accuracy(B, N, D, v, gen) -> dict:
    """Relative error vs float64 of r, out and every gradient, for the op and for Inductor."""
    t = make_inputs(B, N, D, v, gen)
    probes = [torch.randn(t["x"].shape, device="cuda", generator=gen, dtype=torch.float64) for _ in range(2)]
    bases, labels = leaves_of(t)
    labels = ["r", "out", *labels]

    def run(fn, cast):
        views, leaves = with_leaves(t, bases, cast)
        r, out = fn(*(views[k] for k in NAMES))
        loss = (r.double() * probes[0]).sum() + (out.double() * probes[1]).sum()
        grads = torch.autograd.grad(loss, leaves)
        return [r.detach(), out.detach(), *grads]

    fused = fused_site(v)
    ref = run(lambda *a: chain(v, *a), torch.float64)
    got = run(fused, None)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: chain(v, *a), dynamic=False)
    inductor = run(compiled, None)
    return {name: {"fused": rel_err(g, r), "inductor": rel_err(i, r)}
            for name, g, i, r in zip(labels, got, inductor, ref)}


def compare(tt, B, N, D, v, gen) -> dict:
    """Forward + backward (ms, autograd, dout and dr both given) of the fused op, of the unfused
    site (:func:`unfused_site`) and of Inductor's compiled chain. Gate, scale and shift are leaves of
    their own here, not ``.chunk()`` views of one embedding: torch 2.11's Inductor raises in the
    backward of the plain chain compiled with such aliased inputs on CUDA (pytorch/pytorch#178080)."""
    t = {k: (None if a is None else a.clone()) for k, a in make_inputs(B, N, D, v, gen).items()}
    bases, _ = leaves_of(t)
    dout, dr = torch.randn_like(t["x"]), torch.randn_like(t["x"])
    sites = {"fused": lambda: fused_site(v), "unfused": lambda: torch.compile(unfused_site(v), dynamic=False),
             "inductor": lambda: torch.compile(lambda *a: chain(v, *a), dynamic=False)}
    times = {}
    for label, make in sites.items():
        torch._dynamo.reset()
        site = make()
        views, leaves = with_leaves(t, bases)  # fresh leaves for each site

        def step():
            r, out = site(*(views[k] for k in NAMES))
            torch.autograd.backward((r, out), (dr, dout))
        try:
            times[f"{label}_ms"] = tt.do_bench(step, warmup=25, rep=150, grad_to_none=leaves, return_mode="median")
        except RuntimeError as e:  # a failed compile loses this cell, not the run
            print(f"compare: {label} failed at B={B} N={N} D={D}: {e}", flush=True)
            times[f"{label}_ms"] = float("nan")
    return times


def run_shape(tt, B, N, D, name, v, bw, gen) -> dict:
    t = make_inputs(B, N, D, v, gen)
    dtype = t["x"].dtype
    r, out, *stats = forward(v, t, dtype, dtype)
    dout, dr = torch.randn_like(out), torch.randn_like(r)
    args = backward_args(v, t, dout, dr, r, stats)
    bwd = OPS[v["norm"]][1]
    fwd_ms = tt.do_bench(lambda: forward(v, t, dtype, dtype), warmup=25, rep=150, return_mode="median")
    bwd_ms = tt.do_bench(lambda: bwd(*args), warmup=25, rep=150, return_mode="median")
    first = bwd(*args)
    identical = all(all(torch.equal(a, b) for a, b in zip(first, bwd(*args))) for _ in range(2))
    fb, bb = sol_bytes(v, t)
    sol_f, sol_b = fb / bw * 1e3, bb / bw * 1e3
    return {"variant": name, "B": B, "N": N, "D": D, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_sol": sol_f / fwd_ms,
            "bwd_sol": sol_b / bwd_ms, "fwd_bytes": fb, "bwd_bytes": bb, "backward_bit_identical_3_runs": identical}


def markdown(doc: dict) -> str:
    lines = [f"# residual norm-site ops on {doc['gpu']} (torch {doc['torch']}, {doc['date']})", "",
             f"Command: `{doc['command']}`", "",
             f"Copy bandwidth (read + write): {doc['copy_tb_s']:.2f} TB/s. Targets: forward >= "
             f"{FWD_TARGET:.0%}, backward >= {BWD_TARGET:.0%} of SoL.", "",
             "| variant | B | N | D | stages | threads cap | fwd ms | fwd SoL | bwd ms | bwd SoL | fwd / bwd MB "
             "| bwd bit-identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['variant']} | {r['B']} | {r['N']} | {r['D']} | {r.get('stages', 'auto')} | "
                     f"{r.get('max_threads', 'auto')} | "
                     f"{r['fwd_ms']:.3f} | {r['fwd_sol']:.1%} | {r['bwd_ms']:.3f} | {r['bwd_sol']:.1%} | "
                     f"{r['fwd_bytes'] / 1e6:.0f} / {r['bwd_bytes'] / 1e6:.0f} | "
                     f"{r['backward_bit_identical_3_runs']} |")
    compared = [r for r in doc["rows"] if "fused_ms" in r]
    if compared:
        lines += ["", "Forward + backward through autograd (ms): the fused op, the unfused site (Inductor's add, then "
                  "the norm op) and Inductor's whole chain", "",
                  "| variant | B | N | D | fused | unfused | Inductor | unfused / fused |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in compared:
            lines.append(f"| {r['variant']} | {r['B']} | {r['N']} | {r['D']} | {r['fused_ms']:.3f} | "
                         f"{r['unfused_ms']:.3f} | {r['inductor_ms']:.3f} | {r['unfused_ms'] / r['fused_ms']:.2f}x |")
    lines += ["", f"Accuracy vs float64 (rel. error), N = {doc['acc_N']}: fused op / Inductor", ""]
    for a in doc["accuracy"]:
        cells = ", ".join(f"{k} {e['fused']:.2e} / {e['inductor']:.2e}" for k, e in a["errors"].items())
        lines.append(f"- {a['variant']}, D = {a['D']}: {cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = op_arguments(__doc__.splitlines()[0], [1536, 3072, 5120], "residual")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--stages", nargs="+", default=["auto"],
                        help="row staging to time each row with: auto (the kernels' choice), 0, 2..8")
    parser.add_argument("--max-threads", nargs="+", default=["auto"],
                        help="threads-a-block caps to time each row with: auto (the kernels' choice), 32..512")
    parser.add_argument("--compare", action="store_true",
                        help="also time forward + backward against the unfused site and Inductor's chain")
    args = parser.parse_args(argv)
    setup = start("bench_residual")
    if setup is None:
        return 1
    from adaptiveload.ops import _tuning

    tt, gen, bw = setup
    rows = []
    for B in args.B:
        for D in args.D:
            for name in args.variants:
                for stages, cap in itertools.product(args.stages, args.max_threads):
                    value = stages if stages == "auto" else int(stages)
                    with _tuning.override(fwd_stages=value, bwd_stages=value,
                                          max_threads=cap if cap == "auto" else int(cap)):
                        row = run_shape(tt, B, args.N, D, name, VARIANTS[name], bw, gen)
                    row["stages"], row["max_threads"] = stages, cap
                    if args.compare and (stages, cap) == (args.stages[0], args.max_threads[0]):
                        row.update(compare(tt, B, args.N, D, VARIANTS[name], gen))
                    rows.append(row)
                    print(f"{name} B={B} N={args.N} D={D} stages {stages} threads {cap}: fwd {row['fwd_ms']:.3f} ms "
                          f"({row['fwd_sol']:.1%} SoL), bwd {row['bwd_ms']:.3f} ms ({row['bwd_sol']:.1%}), "
                          f"bit-identical {row['backward_bit_identical_3_runs']}"
                          + (f", fwd+bwd fused {row['fused_ms']:.3f} / unfused {row['unfused_ms']:.3f} / "
                             f"Inductor {row['inductor_ms']:.3f} ms" if "fused_ms" in row else ""), flush=True)
                    torch.cuda.empty_cache()
    acc = []
    if not args.no_accuracy:
        for D in args.acc_D:
            for name in args.variants:
                errors = accuracy(1, args.acc_N, D, VARIANTS[name], gen)
                acc.append({"variant": name, "D": D, "errors": errors})
                print(f"accuracy {name} D={D}: " + ", ".join(
                    f"{k} {e['fused']:.2e}/{e['inductor']:.2e}" for k, e in errors.items()), flush=True)
    finish(__file__, argv, args, "residual", bw, rows, acc, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
