"""Speed, determinism and accuracy of ``torch.ops.adaptiveload.rms_norm_modulate`` on one GPU.

For each shape (bf16 x [B, N, D], bf16 modulation; per-sample scale/shift as .chunk() views of one
[B, 2D] tensor, per-token as .chunk() views of one [B, N, 2D] tensor; with shift, or scale-only):

* op GPU time (triton.testing.do_bench median, ms) of the forward op and of the backward op
  (``rms_norm_modulate_backward``), and their fraction of speed-of-light (SoL): the bytes that must
  move over the device-to-device copy bandwidth measured in the same run. x-sized tensors counted in
  their own dtypes: per-sample forward 2 (x, y), backward 3 (dy, x, dx); per-token forward +1 for each
  of scale and shift, backward +1 read of scale and +1 write each for dscale and dshift.
* determinism: the backward run 5 times, every output bit-identical to the first.
* accuracy against float64 (||out - ref|| / ||ref||) of y and of every gradient, beside Inductor's
  (torch.compile of the eager chain ``F.rms_norm(x, (D,), w, eps) * (1 + scale) [+ shift]``) on a
  shorter sequence (``--acc-N``) at ``--acc-D``.

Writes ``<out>/rms_norm_<tag>.json`` and ``.md`` with the GPU, torch version, date and exact command.
Usage: python benchmarks/bench_rms_norm.py [--B 1] [--N 65536] [--D 2048 3072 4096] [--tag h200]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from op_bench import finish, op_arguments, rel_err, start

EPS = 1e-6
FWD_TARGET, BWD_TARGET = 0.85, 0.75


def make_inputs(B, N, D, layout, gen):
    x = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16)
    rows = (B, 2 * D) if layout == "per-sample" else (B, N, 2 * D)
    s, h = (0.1 * torch.randn(*rows, device="cuda", generator=gen)).to(torch.bfloat16).chunk(2, -1)
    if layout == "per-sample":
        s, h = s.unsqueeze(1), h.unsqueeze(1)
    return x, w, s, h


def sol_tensors(layout: str, shift: bool) -> tuple[int, int]:
    """x-sized tensors the forward and the backward must move (see the module doc)."""
    fwd, bwd = 2, 3
    if layout == "per-token":
        fwd += 1 + int(shift)
        bwd += 2 + int(shift)
    return fwd, bwd


def eager_chain(x, w, s, h):
    y = F.rms_norm(x, (x.shape[-1],), w, EPS) * (1 + s)
    return y if h is None else y + h



def accuracy(B, N, D, layout, shift, gen) -> dict:
    """Relative error vs float64 of y and each gradient, for the op and for Inductor."""
    x, w, s, h = make_inputs(B, N, D, layout, gen)
    h = h if shift else None
    dy = torch.randn_like(x)

    def run(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (x, w, s, h) if t is not None]
        args = leaves + [None] * (4 - len(leaves))
        out = fn(*args)
        return [out.detach(), *torch.autograd.grad(out, leaves, dy.to(cast))]

    op = torch.ops.adaptiveload.rms_norm_modulate
    ref = run(eager_chain, torch.float64)
    fused = run(lambda *a: op(*a, EPS, torch.bfloat16)[0], torch.bfloat16)
    torch._dynamo.reset()
    inductor = run(torch.compile(eager_chain, dynamic=False), torch.bfloat16)
    names = ["y", "dx", "dweight", "dscale"] + (["dshift"] if shift else [])
    return {n: {"fused": rel_err(f, r), "inductor": rel_err(i, r)} for n, f, i, r in zip(names, fused, inductor, ref)}


def run_shape(tt, B, N, D, layout, shift, bw, gen) -> dict:
    op, bwd = torch.ops.adaptiveload.rms_norm_modulate, torch.ops.adaptiveload.rms_norm_modulate_backward
    x, w, s, h = make_inputs(B, N, D, layout, gen)
    h = h if shift else None
    dy = torch.randn_like(x)
    y, rstd = op(x, w, s, h, EPS, torch.bfloat16)
    fwd_ms = tt.do_bench(lambda: op(x, w, s, h, EPS, torch.bfloat16), warmup=25, rep=150, return_mode="median")
    bwd_ms = tt.do_bench(lambda: bwd(dy, x, w, s, h, rstd), warmup=25, rep=150, return_mode="median")
    first = bwd(dy, x, w, s, h, rstd)
    identical = all(all(torch.equal(a, b) for a, b in zip(first, bwd(dy, x, w, s, h, rstd))) for _ in range(4))
    tf, tb = sol_tensors(layout, shift)
    x_bytes = x.numel() * x.element_size()
    sol_f, sol_b = tf * x_bytes / bw * 1e3, tb * x_bytes / bw * 1e3
    return {"B": B, "N": N, "D": D, "layout": layout, "shift": shift, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
            "fwd_sol": sol_f / fwd_ms, "bwd_sol": sol_b / bwd_ms, "sol_tensors": [tf, tb],
            "backward_bit_identical_5_runs": identical}


def markdown(doc: dict) -> str:
    lines = [f"# rms_norm_modulate on {doc['gpu']} (torch {doc['torch']}, {doc['date']})", "",
             f"Command: `{doc['command']}`", "",
             f"Copy bandwidth (read + write): {doc['copy_tb_s']:.2f} TB/s. Targets: forward >= "
             f"{FWD_TARGET:.0%}, backward >= {BWD_TARGET:.0%} of SoL.", "",
             "| B | N | D | modulation | shift | fwd ms | fwd SoL | bwd ms | bwd SoL | bwd bit-identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['B']} | {r['N']} | {r['D']} | {r['layout']} | {'yes' if r['shift'] else 'no'} | "
                     f"{r['fwd_ms']:.3f} | {r['fwd_sol']:.1%} | {r['bwd_ms']:.3f} | {r['bwd_sol']:.1%} | "
                     f"{r['backward_bit_identical_5_runs']} |")
    lines += ["", f"Accuracy vs float64 (rel. error), N = {doc['acc_N']}: fused op / Inductor", "",
              "| D | modulation | shift | " + " | ".join(("y", "dx", "dweight", "dscale", "dshift")) + " |",
              "|---|---|---|---|---|---|---|---|"]
    for a in doc["accuracy"]:
        cells = [f"{a['errors'][n]['fused']:.2e} / {a['errors'][n]['inductor']:.2e}" if n in a["errors"] else "-"
                 for n in ("y", "dx", "dweight", "dscale", "dshift")]
        lines.append(f"| {a['D']} | {a['layout']} | {'yes' if a['shift'] else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = op_arguments(__doc__.splitlines()[0], [2048, 3072, 4096], "rms_norm")
    args = parser.parse_args(argv)
    setup = start("bench_rms_norm")
    if setup is None:
        return 1
    tt, gen, bw = setup
    rows = []
    for B in args.B:
        for D in args.D:
            for layout in ("per-sample", "per-token"):
                for shift in (True, False):
                    row = run_shape(tt, B, args.N, D, layout, shift, bw, gen)
                    rows.append(row)
                    print(f"B={B} N={args.N} D={D} {layout} shift={shift}: fwd {row['fwd_ms']:.3f} ms "
                          f"({row['fwd_sol']:.1%} SoL), bwd {row['bwd_ms']:.3f} ms ({row['bwd_sol']:.1%}), "
                          f"bit-identical {row['backward_bit_identical_5_runs']}", flush=True)
                    torch.cuda.empty_cache()
    acc = []
    if not args.no_accuracy:
        for D in args.acc_D:
            for layout in ("per-sample", "per-token"):
                for shift in (True, False):
                    errors = accuracy(1, args.acc_N, D, layout, shift, gen)
                    acc.append({"D": D, "layout": layout, "shift": shift, "errors": errors})
                    print(f"accuracy D={D} {layout} shift={shift}: " + ", ".join(
                        f"{k} {v['fused']:.2e}/{v['inductor']:.2e}" for k, v in errors.items()), flush=True)
    finish(__file__, argv, args, "rms_norm", bw, rows, acc, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
