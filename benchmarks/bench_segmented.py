"""The segmented modulation layout of ``adaln_modulate`` on one GPU: a pack's T tokens of n samples,
scale and shift one row a sample ([n, D], float32, ``.chunk()`` views as in Wan) with ``segment_ids``
[T], against the same op with per-sample modulation (one sample of T tokens, the bytes speed-of-light
counts) and with the modulation gathered to every token beforehand ([1, T, D], what packed training
passed before the segmented layout).

For each D and number of segments (their lengths a seeded random split of T):

* op GPU time of forward and backward (triton.testing.do_bench median, ms), each a fraction of the
  per-sample layout's speed-of-light: x-sized bf16 tensors forward 2 (x, y), backward 3 (dy, x, dx),
  over the copy bandwidth measured in the same run;
* the bytes autograd keeps for backward beyond x and the statistics (saved_tensors_hooks): the per-token
  layout keeps the gathered scale [T, D], the segmented one only [n, D] rows;
* determinism: the backward 5 times, every output bit-identical to the first;
* accuracy of y and of every gradient against float64 (``--acc-N`` tokens, ``--acc-D`` widths; each
  number of segments);
* ``--stages``: the segmented layout timed again with its ring's slots forced to each value (forward and
  backward alike; the private ``_tuning.override``), to pick the automatic setting.

``--op residual`` times the Wan gated residual site instead (``residual_adaln_modulate``: r = x + gate·y,
out = LayerNorm(r)·(1 + scale) + shift, gate, scale and shift one row a segment; backward with a
gradient arriving at r too), against the same op per-sample and per-token: SoL counts 4 x-sized
tensors forward (x, y, r, out) and 6 backward (dout, dr, r, y, dx, dy); no kept-bytes or accuracy
columns (tests/ops/test_residual_segmented.py checks the values).

Writes ``<out>/segmented_<tag>.json`` and ``.md`` with the GPU, torch version, date and exact command.
Usage: python benchmarks/bench_segmented.py [--op adaln|residual] [--N 65536] [--D 1536 3072]
[--segments 1 12 42] [--stages 2 3 6] [--tag h200]
"""
from __future__ import annotations

import sys

import torch

from op_bench import finish, op_arguments, rel_err, start

EPS = 1e-6
OP = torch.ops.adaptiveload


def make_inputs(T, D, n, gen):
    """x bf16 [1, T, D], scale/shift fp32 [n, D] (chunk views of [n, 2D]), segment_ids int32 [T]."""
    x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    s, h = (0.1 * torch.randn(n, 2 * D, device="cuda", generator=gen)).chunk(2, -1)
    cuts = torch.sort(torch.randperm(T - 1, device="cuda", generator=gen)[: n - 1] + 1).values
    lengths = torch.diff(torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), T)]))
    ids = torch.repeat_interleave(torch.arange(n, device="cuda"), lengths).to(torch.int32)
    return x, s, h, ids


def layouts(x, s, h, ids):
    """name -> (forward(x, s, h) -> outputs, backward(dy, outputs) -> grads), on the same inputs."""
    st, ht = s[ids.long()][None], h[ids.long()][None]  # per-token, gathered beforehand
    s1, h1 = s[:1, None], h[:1, None]  # per-sample: one sample of T tokens

    def seg_fwd():
        return OP.adaln_modulate_segmented(x, None, None, s, h, ids, EPS, torch.bfloat16)

    def seg_bwd(dy, out):
        return OP.adaln_modulate_segmented_backward(dy, x, None, None, s, h, ids, out[1], out[2])

    def plain(scale, shift):
        def fwd():
            return OP.adaln_modulate(x, None, None, scale, shift, EPS, torch.bfloat16)

        def bwd(dy, out):
            return OP.adaln_modulate_backward(dy, x, None, None, scale, shift, out[1], out[2])
        return fwd, bwd

    return {"per-sample": plain(s1, h1), "segmented": (seg_fwd, seg_bwd), "per-token": plain(st, ht)}


def residual_layouts(x, s, h, ids):
    """As :func:`layouts`, for the Wan gated residual site: y and the gate drawn here (gate one row a
    segment, as scale and shift); the backward gets dout and dr (r flows on in the model)."""
    y = torch.randn_like(x)
    g = 0.1 * torch.randn_like(s)
    ids_l = ids.long()

    def plain(gate, scale, shift):
        def fwd():
            return OP.residual_adaln_modulate(x, y, gate, None, None, scale, shift, EPS, torch.bfloat16, torch.bfloat16)

        def bwd(dy, out):
            return OP.residual_adaln_modulate_backward(dy, dy, out[0], y, gate, None, None, scale, shift, out[2],
                                                       out[3], torch.bfloat16)
        return fwd, bwd

    def seg_fwd():
        return OP.residual_adaln_modulate_segmented(x, y, g, None, None, s, h, ids, EPS, torch.bfloat16, torch.bfloat16)

    def seg_bwd(dy, out):
        return OP.residual_adaln_modulate_segmented_backward(dy, dy, out[0], y, g, None, None, s, h, ids, out[2],
                                                             out[3], torch.bfloat16)

    return {"per-sample": plain(g[:1, None], s[:1, None], h[:1, None]), "segmented": (seg_fwd, seg_bwd),
            "per-token": plain(g[ids_l][None], s[ids_l][None], h[ids_l][None])}


# op -> (layouts, x-sized tensors SoL counts forward and backward, whether the kept-bytes and
# accuracy columns are measured)
OPS = {"adaln": (layouts, (2, 3), True), "residual": (residual_layouts, (4, 6), False)}


def saved_bytes(x, s, h, ids, layout) -> int:
    """Bytes autograd keeps for backward, other than x and the per-row statistics."""
    xs, ss, hs = x.clone().requires_grad_(), s.detach().clone().requires_grad_(), h.detach().clone().requires_grad_()
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if layout == "segmented":
            OP.adaln_modulate_segmented(xs, None, None, ss, hs, ids, EPS, torch.bfloat16)
        else:  # the gather runs under autograd, as in a model
            st = ss[ids.long()][None] if layout == "per-token" else ss[:1, None]
            ht = hs[ids.long()][None] if layout == "per-token" else hs[:1, None]
            OP.adaln_modulate(xs, None, None, st, ht, EPS, torch.bfloat16)
    rows = x.shape[1]
    return sum(t.numel() * t.element_size() for t in kept
               if t.data_ptr() != xs.data_ptr() and tuple(t.shape) != (1, rows))


def accuracy(T, D, n, gen) -> dict:
    x, s, h, ids = make_inputs(T, D, n, gen)
    xs = x.double().requires_grad_()
    s64, h64 = s.double().requires_grad_(), h.double().requires_grad_()
    y64 = torch.nn.functional.layer_norm(xs, (x.shape[-1],), eps=EPS) * (1 + s64[ids.long()]) + h64[ids.long()]
    dy = torch.randn_like(x)
    ref = torch.autograd.grad(y64, (xs, s64, h64), dy.double())
    out = OP.adaln_modulate_segmented(x, None, None, s, h, ids, EPS, torch.bfloat16)
    dx, _, _, ds, dh, _ = OP.adaln_modulate_segmented_backward(dy, x, None, None, s, h, ids, out[1], out[2])
    return {"T": T, "D": D, "segments": n, "y": rel_err(out[0], y64), "dx": rel_err(dx, ref[0]), "dscale": rel_err(ds, ref[1]),
            "dshift": rel_err(dh, ref[2])}


def main(argv=None) -> int:
    parser = op_arguments(__doc__.splitlines()[0], [1536, 3072], "segmented")
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 12, 42])
    parser.add_argument("--op", choices=list(OPS), default="adaln")
    parser.add_argument("--stages", type=int, nargs="+", default=[], choices=[0, *range(2, 9)],
                        help="also time the segmented layout with its ring forced to these slots (0: no ring, which "
                             "the segmented kernels need: the composite they fall back to)")
    args = parser.parse_args(argv)
    make_layouts, (k_fwd, k_bwd), extras = OPS[args.op]
    ready = start("bench_segmented.py")
    if ready is None:
        return 1
    from adaptiveload.ops import _tuning

    tt, gen, bw = ready
    rows = []
    for D in args.D:
        for n in args.segments:
            x, s, h, ids = make_inputs(args.N, D, n, gen)
            row = {"T": args.N, "D": D, "segments": n}
            sol_fwd, sol_bwd = (k * x.numel() * x.element_size() / bw * 1e3 for k in (k_fwd, k_bwd))
            layouts = make_layouts(x, s, h, ids)
            runs = [(name, name, {}) for name in layouts]
            runs += [(f"segmented, {k} slots", "segmented", {"fwd_stages": k, "bwd_stages": k}) for k in args.stages]
            for label, name, forced in runs:
                fwd, bwd = layouts[name]
                with _tuning.override(**forced):
                    out = fwd()
                    dy = torch.randn_like(x)
                    f_ms, b_ms = tt.do_bench(fwd), tt.do_bench(lambda: bwd(dy, out))
                    first = bwd(dy, out)
                    same = all(all(torch.equal(a, b) for a, b in zip(first, bwd(dy, out))) for _ in range(4))
                row[label] = {"fwd_ms": f_ms, "bwd_ms": b_ms, "fwd_frac_sol": sol_fwd / f_ms,
                              "bwd_frac_sol": sol_bwd / b_ms, "bit_identical_bwd": same,
                              "saved_bytes_beyond_x": saved_bytes(x, s, h, ids, name) if extras and not forced
                              else None}
            rows.append(row)
            seg = row["segmented"]
            print(f"D={D} n={n}: segmented fwd {seg['fwd_ms']:.3f} ms ({100 * seg['fwd_frac_sol']:.0f}% SoL), "
                  f"bwd {seg['bwd_ms']:.3f} ms ({100 * seg['bwd_frac_sol']:.0f}%); per-sample "
                  f"{row['per-sample']['fwd_ms']:.3f} / {row['per-sample']['bwd_ms']:.3f}; per-token "
                  f"{row['per-token']['fwd_ms']:.3f} / {row['per-token']['bwd_ms']:.3f}", flush=True)
    acc = [] if args.no_accuracy or not extras else [accuracy(args.acc_N, D, n, gen) for D in args.acc_D
                                                         for n in args.segments]
    finish("bench_segmented.py", argv if argv is not None else sys.argv[1:], args, "segmented", bw, rows, acc,
           markdown)
    return 0


def markdown(doc: dict) -> str:
    residual = "residual" in doc["command"]
    op, counts = ("residual_adaln_modulate (Wan gated site)", "4, backward 6") if residual else ("adaln_modulate",
                                                                                                "2, backward 3")
    lines = [f"## {op}, segmented modulation layout ({doc['gpu']}, torch {doc['torch']}, {doc['date']})",
             "", f"Command: `{doc['command']}`", "",
             f"bf16 x [1, T, D], float32 modulation; SoL: per-sample bytes (forward {counts} x-sized "
             f"tensors) over the copy bandwidth {doc['copy_tb_s']:.2f} TB/s. Kept: bytes autograd keeps "
             "for backward beyond x and the statistics.", "",
             "| T | D | segments | layout | fwd ms (SoL) | bwd ms (SoL) | kept MiB | bit-identical bwd |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        for name in (k for k, c in r.items() if isinstance(c, dict)):  # the layouts, then forced slots
            c = r[name]
            kept = "-" if c["saved_bytes_beyond_x"] is None else f"{c['saved_bytes_beyond_x'] / 2**20:.1f}"
            lines.append(f"| {r['T']} | {r['D']} | {r['segments']} | {name} | {c['fwd_ms']:.3f} "
                         f"({100 * c['fwd_frac_sol']:.0f}%) | {c['bwd_ms']:.3f} ({100 * c['bwd_frac_sol']:.0f}%) | "
                         f"{kept} | {c['bit_identical_bwd']} |")
    if doc["accuracy"]:
        lines += ["", "Segmented accuracy vs float64 (||out - ref|| / ||ref||):", "",
                  "| T | D | segments | y | dx | dscale | dshift |", "|---|---|---|---|---|---|---|"]
    for a in doc["accuracy"]:
        lines.append(f"| {a['T']} | {a['D']} | {a['segments']} | {a['y']:.2e} | {a['dx']:.2e} | {a['dscale']:.2e} | "
                     f"{a['dshift']:.2e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
