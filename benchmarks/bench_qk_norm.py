"""Where the attention's q/k RMSNorm + RoPE time goes under Inductor, on one GPU: the norm sites the
backend leaves to Inductor in Wan-style attention.

diffusers' ``WanAttnProcessor`` normalises the query and key projections with ``nn.RMSNorm`` over all
heads (``qk_norm="rms_norm_across_heads"``: [B, S, H·Dh], a weight of H·Dh), splits the heads and
rotates each head's interleaved pairs (its ``apply_rotary_emb``: ``x1, x2 = x.unflatten(-1, (-1,
2)).unbind(-1)``, even outputs ``x1·cos − x2·sin``, odd outputs ``x1·sin + x2·cos``, with cos and sin
[1, S, 1, Dh] taken at the even and odd positions). This script times that code and its two halves,
in bf16 (cos, sin and the weights too, as in a model cast whole to bf16), for q and k together:

* ``norm+rope``: both RMSNorms, the head split and both rotations (what a block runs);
* ``norm``: the two RMSNorms alone;
* ``rope``: the two rotations alone, of given [B, S, H, Dh] tensors;

each eager and compiled by Inductor (``torch.compile``), and ``norm+rope`` also as the fused op
``torch.ops.adaptiveload.rms_norm_rope`` (``op``: called directly, q and k one call each) and compiled
with ``backend="adaptiveload"`` (``adaptiveload``: the pass folds each site into that op, Inductor
compiles the rest), forward alone and forward + backward
(``torch.autograd.grad`` of every input that a model trains: q, k and the weights), GPU time as
triton.testing.do_bench's median in ms, and as a fraction of speed-of-light: the x-sized bf16
tensors that must move over the copy bandwidth measured in the same run. Forward: read q and k, write
both (4). Forward + backward: 4, then read the two incoming gradients and q and k, write their
gradients (6) for ``norm+rope`` and ``norm``; ``rope``'s backward reads the two gradients and writes
two (4). Weights, cos, sin and per-row statistics are not counted.

Writes ``<out>/qk_norm_<tag>.json`` and ``.md`` with the GPU, torch version, date and exact command.
Usage: python benchmarks/bench_qk_norm.py [--shapes 12x1560 1x32760] [--chains norm+rope norm rope]
       [--heads 12] [--head-dim 128] [--tag h200]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import adaptiveload  # noqa: F401  (the "adaptiveload" backend and torch.ops.adaptiveload.*)
from op_bench import finish, start

EPS = 1e-6
# chain -> (x-sized moves forward, forward + backward)
MOVES = {"norm+rope": (4, 10), "norm": (4, 10), "rope": (4, 8)}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotation of x [B, S, H, Dh] by cos, sin [1, S, 1, Dh] (pairs (2i, 2i + 1))."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


def norm(q, k, wq, wk):
    return F.rms_norm(q, q.shape[-1:], wq, EPS), F.rms_norm(k, k.shape[-1:], wk, EPS)


def norm_rope(q, k, wq, wk, cos, sin, heads):
    qn, kn = norm(q, k, wq, wk)
    return rope(qn.unflatten(2, (heads, -1)), cos, sin), rope(kn.unflatten(2, (heads, -1)), cos, sin)


def fused(q, k, wq, wk, cos, sin, heads):
    """norm_rope as the fused op: one call each for q and k (cos and sin at the pairs' positions)."""
    c, s = cos[..., 0::2], sin[..., 1::2]
    op = torch.ops.adaptiveload.rms_norm_rope
    return (op(q, wq, c, s, heads, EPS, q.dtype)[0], op(k, wk, c, s, heads, EPS, k.dtype)[0])


def implementations(chain: str, fn, heads: int) -> list:
    """(name, callable) of each implementation timed for the chain."""
    impls = [("eager", fn), ("inductor", torch.compile(fn))]
    if chain == "norm+rope":
        impls += [("adaptiveload", torch.compile(fn, backend="adaptiveload")), ("op", lambda *a: fused(*a, heads))]
    return impls


def inputs(B: int, S: int, heads: int, head_dim: int, chain: str, gen: torch.Generator) -> tuple:
    """The chain's arguments (bf16, CUDA; the trained ones requiring grad) and the function."""
    def randn(*shape, scale=1.0, grad=True):
        t = (scale * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16)
        return t.requires_grad_(grad)

    inner = heads * head_dim
    angles = torch.rand(1, S, 1, head_dim, device="cuda", generator=gen) * 6.3
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    if chain == "rope":
        def fn(q, k, cos, sin):
            return rope(q, cos, sin), rope(k, cos, sin)
        return fn, (randn(B, S, heads, head_dim), randn(B, S, heads, head_dim), cos, sin)
    weights = tuple((1 + randn(inner, scale=0.1, grad=False)).requires_grad_() for _ in range(2))
    if chain == "norm":
        return norm, (randn(B, S, inner), randn(B, S, inner), *weights)

    def fn(q, k, wq, wk, cos, sin):
        return norm_rope(q, k, wq, wk, cos, sin, heads)
    return fn, (randn(B, S, inner), randn(B, S, inner), *weights, cos, sin)


def time_chain(tt, fn, args: tuple) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of fn on args."""
    trained = [a for a in args if a.requires_grad]
    outs = fn(*args)
    grads = [torch.randn_like(o) for o in outs]

    def forward():
        with torch.no_grad():
            fn(*args)

    def both():
        torch.autograd.grad(fn(*args), trained, grads)

    return tt.do_bench(forward), tt.do_bench(both)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["12x1560", "1x32760"], help="BxS")
    parser.add_argument("--chains", nargs="+", default=list(MOVES), choices=list(MOVES))
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--tag", default="h200", help="results file name: qk_norm_<tag>.json / .md")
    parser.set_defaults(acc_N=None)  # (finish records the accuracy rows' length: there are none)
    args = parser.parse_args(argv)
    ready = start("bench_qk_norm.py")
    if ready is None:
        return 1
    tt, gen, bw = ready
    rows = []
    for shape in args.shapes:
        B, S = (int(v) for v in shape.lower().split("x"))
        x_bytes = B * S * args.heads * args.head_dim * 2
        for chain in args.chains:
            m_fwd, m_both = MOVES[chain]
            fn, chain_args = inputs(B, S, args.heads, args.head_dim, chain, gen)
            for impl, f in implementations(chain, fn, args.heads):
                torch._dynamo.reset()
                counters.clear()
                fwd_ms, both_ms = time_chain(tt, f, chain_args)
                if impl == "adaptiveload" and counters["adaptiveload"]["rms_norm_rope.fused"] < 2:
                    print(f"the backend folded {dict(counters['adaptiveload'])} rms_norm_rope sites, not 2 a compile",
                          file=sys.stderr)
                    return 1
                row = {"B": B, "S": S, "heads": args.heads, "head_dim": args.head_dim, "chain": chain, "impl": impl,
                       "fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms,
                       "fwd_frac_sol": m_fwd * x_bytes / bw * 1e3 / fwd_ms,
                       "fwd_bwd_frac_sol": m_both * x_bytes / bw * 1e3 / both_ms}
                rows.append(row)
                print(f"{shape} {chain} {impl}: forward {fwd_ms:.3f} ms ({row['fwd_frac_sol']:.0%} of SoL), "
                      f"forward + backward {both_ms:.3f} ms ({row['fwd_bwd_frac_sol']:.0%})", flush=True)
    finish("bench_qk_norm.py", argv if argv is not None else sys.argv[1:], args, "qk_norm", bw, rows, [], markdown)
    return 0


def markdown(doc: dict) -> str:
    lines = [f"# q/k RMSNorm + RoPE (Wan attention) on {doc['gpu']} (torch {doc['torch']}, {doc['date']})", "",
             f"Command: `{doc['command']}`", "",
             f"bf16; q and k together; SoL: x-sized moves (forward 4; forward + backward 10, RoPE alone 8) over the "
             f"copy bandwidth {doc['copy_tb_s']:.2f} TB/s.", "",
             "| B | S | heads × dim | chain | impl | forward ms (SoL) | forward + backward ms (SoL) |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['B']} | {r['S']} | {r['heads']} × {r['head_dim']} | {r['chain']} | {r['impl']} | "
                     f"{r['fwd_ms']:.3f} ({100 * r['fwd_frac_sol']:.0f}%) | "
                     f"{r['fwd_bwd_ms']:.3f} ({100 * r['fwd_bwd_frac_sol']:.0f}%) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
