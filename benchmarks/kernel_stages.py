"""Op-only timings of the fused LayerNorm -> modulate kernels (adaln_modulate), one GPU: the `sweep`, `ring`, `wide`,
`store`, `tail`, `ab`, `host` and `calls` stages of benchmarks/gpu_session.sh (which writes each stage's output to
$OUT/<stage>.log). The kernels choose every launch setting themselves; the stages that compare settings force them
with the private adaptiveload.ops._tuning.override (its keywords in parentheses below).

  sweep  forward, one-pass and two-kernel backward (two_kernel) at thread caps 256 / 512 (max_threads)
  ring   forward and backward by ring slots (fwd_stages / bwd_stages = 0, auto, 2, 3, 4, 8) at N = 65536,
         B = 1 / 2, D = 1536 / 3072 / 5120, bf16 x, fp32 per-sample modulation; the forward by how y is stored
         (store = threads / bulk, alternated three times) and the bulk store by ring slots (auto, 3, 4, 8); by
         thread cap (512, 256, 128, 64) at D = 1536 / 3072; per-token forward and backward (bf16 rows of a
         [B, N, 2D] chunk) by ring slots
  wide   forward and backward at wide rows (fp32 x D = 3072 / 5120 / 8192, bf16 D = 8192 / 12288 / 16384;
         x of 512 MiB), the kernels' own choices
  store  the forward by how y is stored, ring slots and thread cap (store / fwd_stages / max_threads), settings
         alternated three times at N = 65536, B = 1 / 2, D = 1536 / 3072 / 5120, once at B = 1,
         D = 1024 / 2048 / 2560 / 4096; bf16 x, fp32 per-sample modulation
  tail   the forward by the share of rows left to short blocks after the wave (tail = 0, 5/8, 10/8, 10/4, 15/8,
         20/16: percent / rows a block), alternated three times at the store stage's shapes (once at
         D = 1024 / 2048 / 4096)
  small  forward and backward at small row counts (LTX-Video's (8, 384) and (1, 6144) at D = 2048 with
         rms_norm_modulate, Wan's 12 x 1,560 at D = 1536 and 4 x 1,024 at D = 3072 with adaln_modulate;
         per-sample modulation) by ring slots (0: the register path), thread cap and short blocks, and
         forward + backward against Inductor's compiled chain
  columns  GPU µs of each kernel of the backwards (row, column-reduction and totals kernels) at LTX-Video's and
         Wan's norm sites (stage_columns); forces nothing, so with gpu_session.sh ab (AB_STAGE=columns) it
         compares two builds
  rope   GPU µs of the q/k RMSNorm -> RoPE op's kernels by thread cap a row (max_threads) against Inductor's
         compiled chain, at Wan's q/k shapes (stage_rope)
  addend GPU µs a call of the norm-site backward ops alone, followed by an add to dx, and with that addend
         taken as dx_addend (stage_addend)
  host   host time of one forward+backward call per implementation (bench_adaln.host_time_us)
  calls  host time (µs) of one direct call of each op's forward and backward, calls issued with no sync
         between them (the C++ dispatcher path, no autograd): rms_norm_modulate at LTX-Video's (8, 384,
         2048) bf16 site (scale and shift [8, 1, 2048] views of table + temb), adaln_modulate and the gated
         residual_adaln_modulate at the same shape with Wan's fp32 per-sample .chunk() modulation; median
         and min over 9 rounds of 1000 calls. Forces nothing: with gpu_session.sh ab (AB_STAGE=calls) it
         compares the host path of two builds
  ab     forward and backward at the rows of bench_adaln.py's long preset (N = 65536, D = 1536 / 3072 /
         5120; per-sample bf16 x with fp32 or bf16 modulation at B = 1 / 2, per-token bf16 at B = 1),
         the kernels' own choices, one line a shape: run once for each of two builds, in turn
         (gpu_session.sh ab), to compare kernel versions; forces nothing, so an older build runs it too

Times are triton.testing.do_bench medians (ms) and fractions of speed-of-light: bytes that must move
(per-sample forward 2, backward 3 x-sized tensors; per-token 4 and 6) / measured copy bandwidth.
Usage: python benchmarks/kernel_stages.py {sweep,ring,wide,ab,store,tail,small,columns,rope,addend,host,calls}
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from bench_adaln import copy_bandwidth, host_time_us

EPS = 1e-6


def per_sample(B: int, N: int, D: int, dtype: torch.dtype):
    """x [B, N, D] in dtype, scale and shift [B, 1, D] fp32 (.chunk() views of one [B, 2D] tensor)."""
    x = torch.randn(B, N, D, device="cuda", dtype=dtype)
    s, h = (0.1 * torch.randn(B, 2 * D, device="cuda")).chunk(2, -1)
    return x, s.unsqueeze(1), h.unsqueeze(1)


def per_token(B: int, N: int, D: int):
    """bf16 x [B, N, D], scale and shift [B, N, D] bf16 (.chunk() views of one [B, N, 2D] tensor)."""
    x = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)
    s, h = (0.1 * torch.randn(B, N, 2 * D, device="cuda", dtype=torch.bfloat16)).chunk(2, -1)
    return x, s, h


def cuda_randn(seed: int = 0):
    """randn(*shape, dtype=torch.bfloat16) on CUDA, every draw from one generator seeded with `seed`."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    return randn


def ltx_shift_scale(randn, B: int, D: int):
    """LTX-Video's per-sample shift and scale [B, 1, D]: views of scale_shift_table [2, D] + temb [B, 1, 2D]."""
    temb, table = randn(B, 1, 2 * D), randn(2, D)
    return (table[None, None] + temb.reshape(B, 1, 2, D)).unbind(dim=2)


def wan_chunks(randn, B: int, D: int) -> list:
    """Wan's six per-sample modulations [B, 1, D], fp32 .chunk() views of one [B, 6D] tensor: shift, scale and
    gate of the attention, then of the FFN."""
    return [c.unsqueeze(1) for c in randn(B, 6 * D, dtype=torch.float32).chunk(6, dim=-1)]


def median_ms(tt, fn) -> float:
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sol_ms(x: torch.Tensor, tensors: int, bw: float) -> float:
    """Speed-of-light time (ms) of moving `tensors` x-sized tensors at `bw` bytes/s."""
    return tensors * x.numel() * x.element_size() / bw * 1e3


def override(**settings):
    """adaptiveload.ops._tuning.override(**settings), imported on use: the ab and host stages also run
    against older builds, which set these choices otherwise."""
    from adaptiveload.ops import _tuning

    return _tuning.override(**settings)


def label(value) -> str:
    """A setting's value as the logs print it: a tail (P, R) as 'P/R'."""
    return "/".join(map(str, value)) if isinstance(value, tuple) else str(value)


def by_setting(tt, label_, fn, sol, name, values):
    """Median of fn with the kernels' setting `name` forced to each value, as 'value: ms (% SoL)' cells."""
    cells = []
    for value in values:
        with override(**{name: value}):
            ms = median_ms(tt, fn)
        cells.append(f"{label(value)}: {ms:.3f} ms ({100 * sol / ms:.0f}%)")
    print(f"{label_}: " + "; ".join(cells), flush=True)


def stage_sweep(tt, op, bwd, bw):
    for B, N, D, pt in [(1, 65536, 1536, False), (1, 65536, 3072, False), (1, 65536, 5120, False),
                        (1, 16384, 3072, True)]:
        x, s, h = per_token(B, N, D) if pt else per_sample(B, N, D, torch.bfloat16)
        dy = torch.randn_like(x)
        k = 2 if pt else 1
        solf, solb = sol_ms(x, 2 * k, bw), sol_ms(x, 3 * k, bw)
        for mt in (256, 512):
            with override(max_threads=mt):
                y, mean, rstd = op(x, None, None, s, h, EPS, torch.bfloat16)
                f = median_ms(tt, lambda: op(x, None, None, s, h, EPS, torch.bfloat16))
                g1 = median_ms(tt, lambda: bwd(dy, x, None, None, s, h, mean, rstd))
                with override(two_kernel=True):
                    g2 = median_ms(tt, lambda: bwd(dy, x, None, None, s, h, mean, rstd))
            print(f"B={B} N={N} D={D} pt={pt} max_threads={mt}: fwd {f:.3f} ms ({100 * solf / f:.0f}% SoL) "
                  f"bwd {g1:.3f} ({100 * solb / g1:.0f}%) two-kernel {g2:.3f} ({100 * solb / g2:.0f}%)", flush=True)


def stage_ring(tt, op, bwd, bw):
    for B in (1, 2):
        for D in (1536, 3072, 5120):
            x, s, h = per_sample(B, 65536, D, torch.bfloat16)
            dy = torch.randn_like(x)
            y, mean, rstd = op(x, None, None, s, h, EPS, torch.bfloat16)
            fwd = lambda: op(x, None, None, s, h, EPS, torch.bfloat16)  # noqa: E731
            back = lambda: bwd(dy, x, None, None, s, h, mean, rstd)  # noqa: E731
            sol_f, sol_b = sol_ms(x, 2, bw), sol_ms(x, 3, bw)
            copy = median_ms(tt, lambda: x.clone())  # the same 2 x-sized moves as the forward, by torch
            print(f"B={B} D={D} copy of x (clone): {copy:.3f} ms ({100 * sol_f / copy:.0f}%)", flush=True)
            stages = (0, "auto", 2, 3, 4, 8)
            by_setting(tt, f"B={B} D={D} fwd stages", fwd, sol_f, "fwd_stages", stages)
            by_setting(tt, f"B={B} D={D} bwd stages", back, sol_b, "bwd_stages", stages)
            by_setting(tt, f"B={B} D={D} fwd store, alternated", fwd, sol_f, "store", ("threads", "bulk") * 3)
            with override(store="bulk"):
                by_setting(tt, f"B={B} D={D} fwd stages, bulk store", fwd, sol_f, "fwd_stages", ("auto", 3, 4, 8))
            if D < 5120:  # fewer threads a row, more chunks a thread (the ring at auto)
                caps = (512, 256, 128, 64)
                by_setting(tt, f"B={B} D={D} fwd max_threads", fwd, sol_f, "max_threads", caps)
                by_setting(tt, f"B={B} D={D} bwd max_threads", back, sol_b, "max_threads", caps)
    for D in (1536, 3072, 5120):  # per-token scale and shift: 4 (forward) / 6 (backward) x-sized moves
        x, s, h = per_token(1, 65536, D)
        dy = torch.randn_like(x)
        y, mean, rstd = op(x, None, None, s, h, EPS, torch.bfloat16)
        by_setting(tt, f"B=1 D={D} per-token fwd stages", lambda: op(x, None, None, s, h, EPS, torch.bfloat16),
                   sol_ms(x, 4, bw), "fwd_stages", (0, "auto", 2, 3, 4))
        by_setting(tt, f"B=1 D={D} per-token bwd stages", lambda: bwd(dy, x, None, None, s, h, mean, rstd),
                   sol_ms(x, 6, bw), "bwd_stages", (0, "auto", 2, 3, 4))


def stage_wide(tt, op, bwd, bw):
    for dtype, D in ((torch.float32, 3072), (torch.float32, 5120), (torch.float32, 8192), (torch.bfloat16, 8192),
                     (torch.bfloat16, 12288), (torch.bfloat16, 16384)):
        N = (1 << 29) // (D * dtype.itemsize)  # x of 512 MiB
        x, s, h = per_sample(1, N, D, dtype)
        dy = torch.randn_like(x)
        y, mean, rstd = op(x, None, None, s, h, EPS, dtype)
        f = median_ms(tt, lambda: op(x, None, None, s, h, EPS, dtype))
        b = median_ms(tt, lambda: bwd(dy, x, None, None, s, h, mean, rstd))
        sol_f, sol_b = sol_ms(x, 2, bw), sol_ms(x, 3, bw)
        print(f"{dtype} N={N} D={D} per-sample fp32 modulation: fwd {f:.3f} ms ({100 * sol_f / f:.0f}% SoL), "
              f"bwd {b:.3f} ms ({100 * sol_b / b:.0f}%)", flush=True)


def stage_ab(tt, op, bwd, bw):
    """The rows of bench_adaln.py's long preset (N = 65536): per-sample bf16 x with bf16 and with fp32
    (Wan) modulation at B = 1 / 2, per-token bf16 at B = 1; D = 1536 / 3072 / 5120."""
    import adaptiveload

    print(f"package: {os.path.dirname(adaptiveload.__file__)}", flush=True)
    rows = [(B, D, kind) for kind in ("fp32-mod", "bf16") for B in (1, 2) for D in (1536, 3072, 5120)]
    rows += [(1, D, "per-token") for D in (1536, 3072, 5120)]
    for B, D, kind in rows:
        if kind == "per-token":
            x, s, h = per_token(B, 65536, D)
        else:
            x, s, h = per_sample(B, 65536, D, torch.bfloat16)
            if kind == "bf16":
                s, h = s.to(torch.bfloat16), h.to(torch.bfloat16)
        dy = torch.randn_like(x)
        y, mean, rstd = op(x, None, None, s, h, EPS, torch.bfloat16)
        f = median_ms(tt, lambda: op(x, None, None, s, h, EPS, torch.bfloat16))
        b = median_ms(tt, lambda: bwd(dy, x, None, None, s, h, mean, rstd))
        k = 2 if kind == "per-token" else 1
        sol_f, sol_b = sol_ms(x, 2 * k, bw), sol_ms(x, 3 * k, bw)
        print(f"B={B} D={D} {kind}: fwd {f:.4f} ms ({100 * sol_f / f:.1f}% SoL), bwd {b:.4f} ms "
              f"({100 * sol_b / b:.1f}%)", flush=True)


def stage_store(tt, op, bwd, bw):
    settings = (("auto", "auto", "auto"), ("threads", "auto", "auto"), ("bulk", 4, "auto"), ("bulk", 5, "auto"),
                ("bulk", 6, "auto"), ("threads", 4, "auto"))
    for B, D, rounds in ((1, 1536, 3), (1, 3072, 3), (1, 5120, 3), (2, 1536, 3), (2, 3072, 3), (2, 5120, 3),
                         (1, 1024, 1), (1, 2048, 1), (1, 2560, 1), (1, 4096, 1)):
        x, s, h = per_sample(B, 65536, D, torch.bfloat16)
        fwd = lambda: op(x, None, None, s, h, EPS, torch.bfloat16)  # noqa: E731
        sol_f = sol_ms(x, 2, bw)
        for rnd in range(rounds):
            cells = []
            for store, stages, cap in settings:
                with override(store=store, fwd_stages=stages, max_threads=cap):
                    ms = median_ms(tt, fwd)
                cells.append(f"{store}/{stages}/{cap}: {ms:.4f} ms ({100 * sol_f / ms:.1f}%)")
            print(f"B={B} D={D} fwd round {rnd} (store/slots/thread cap): " + "; ".join(cells), flush=True)


def stage_tail(tt, op, bwd, bw):
    settings = (0, (5, 8), (10, 8), (10, 4), (15, 8), (20, 16))
    for B, D, rounds in ((1, 1536, 3), (1, 3072, 3), (1, 5120, 3), (2, 1536, 3), (2, 3072, 3), (2, 5120, 3),
                         (1, 1024, 1), (1, 2048, 1), (1, 4096, 1)):
        x, s, h = per_sample(B, 65536, D, torch.bfloat16)
        fwd = lambda: op(x, None, None, s, h, EPS, torch.bfloat16)  # noqa: E731
        for rnd in range(rounds):
            by_setting(tt, f"B={B} D={D} fwd round {rnd} by tail (percent/rows)", fwd, sol_ms(x, 2, bw), "tail",
                       settings)


# Small row counts, where the step of a model is short (LTX-Video at (B, S) = (8, 384) and (1, 6144), Wan's
# 12 images of 1,560 tokens): (B, N, D, norm, modulation dtype), per-sample modulation
SMALL_SHAPES = ((8, 384, 2048, "rms", torch.bfloat16), (1, 6144, 2048, "rms", torch.bfloat16),
                (12, 1560, 1536, "layer", torch.float32), (4, 1024, 3072, "layer", torch.float32))


def inductor_chain(norm: str):
    """Inductor's compiled norm -> modulate chain (forward and backward): the expression bench_rms_norm.py
    / bench_adaln.py (Wan's form) time against the op."""
    from bench_adaln import chain
    from bench_rms_norm import eager_chain

    if norm == "rms":
        return torch.compile(lambda x, s, h: eager_chain(x, None, s, h), dynamic=False)
    return torch.compile(lambda x, s, h: chain(x, s, h, x.dtype), dynamic=False)


def stage_small(tt, op, bwd, bw):
    """Small row counts (SMALL_SHAPES): the fused op's forward and backward with the kernels' own choices
    and with the register path (fwd_stages / bwd_stages 0), thread caps 128 / 256 / 512 and no short
    blocks after the wave (tail 0); then forward + backward of the op against Inductor's compiled chain
    (do_bench: the stream's time between events around each call, so where the host takes longer than the
    kernels, as Inductor's compiled autograd at these sizes does, the launch gaps are in it). On the H200 with
    torch 2.11, Inductor's chain failed at B = 1 (a [D] gradient for the [1, 1, D] scale): printed, not fatal."""
    ops = torch.ops.adaptiveload
    for B, N, D, norm, mdt in SMALL_SHAPES:
        x, s, h = per_sample(B, N, D, torch.bfloat16)
        s, h = s.to(mdt), h.to(mdt)
        dy = torch.randn_like(x)
        if norm == "rms":
            fwd = lambda: ops.rms_norm_modulate(x, None, s, h, EPS, torch.bfloat16)  # noqa: E731
            y, rstd = fwd()
            back = lambda: ops.rms_norm_modulate_backward(dy, x, None, s, h, rstd)  # noqa: E731
        else:
            fwd = lambda: op(x, None, None, s, h, EPS, torch.bfloat16)  # noqa: E731
            y, mean, rstd = fwd()
            back = lambda: bwd(dy, x, None, None, s, h, mean, rstd)  # noqa: E731
        sol_f, sol_b = sol_ms(x, 2, bw), sol_ms(x, 3, bw)
        name = f"B={B} N={N} D={D} {norm} {str(mdt).replace('torch.', '')} modulation"
        for label_, fn, sol, stage_key in (("fwd", fwd, sol_f, "fwd_stages"), ("bwd", back, sol_b, "bwd_stages")):
            by_setting(tt, f"{name} {label_} stages", fn, sol, stage_key, ("auto", 0))
            by_setting(tt, f"{name} {label_} max_threads", fn, sol, "max_threads", ("auto", 128, 256, 512))
        by_setting(tt, f"{name} fwd tail", fwd, sol_f, "tail", ("auto", 0))
        xg, sg, hg = (t.detach().clone().requires_grad_(True) for t in (x, s, h))
        chain = inductor_chain(norm)

        def inductor_fwd_bwd():
            torch.autograd.grad(chain(xg, sg, hg), (xg, sg, hg), dy)

        def fused_fwd_bwd():
            fwd()
            back()

        fus = median_ms(tt, fused_fwd_bwd)
        try:
            inductor_fwd_bwd()  # (compiles)
        except RuntimeError as e:
            print(f"{name} fwd+bwd: fused op {fus:.4f} ms; Inductor's chain failed: {e}", flush=True)
            continue
        ind = median_ms(tt, inductor_fwd_bwd)
        print(f"{name} fwd+bwd: fused op {fus:.4f} ms ({100 * (sol_f + sol_b) / fus:.0f}% SoL), Inductor "
              f"{ind:.4f} ms ({100 * (sol_f + sol_b) / ind:.0f}%), fused / Inductor {fus / ind:.2f}", flush=True)


def kernels_us(fn, calls=50) -> dict:
    """GPU µs a call of fn by kernel name (torch.profiler, mean of `calls` calls after 5 warm-up calls;
    template instances of one kernel added up)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    us = {}
    for e in events:
        if e.device_time_total > 0:
            name = e.key.split("<")[0].replace("void ", "").replace("adaln::", "")
            us[name] = us.get(name, 0.0) + e.device_time_total / calls
    return us


def stage_columns(tt, op, bwd, bw):
    """GPU µs of every kernel of the backwards at the models' row counts (per-sample modulation; torch.profiler,
    mean of 50 calls): rms_norm_modulate at LTX-Video's (8, 384) and (1, 6144), D = 2048, bf16 modulation;
    Wan's three sites at its 12 x 1,560 and 1 x 46,800, D = 1536, fp32 .chunk() modulation (shift, scale, gate of
    the attention, then of the FFN): adaln_modulate (norm1), residual_adaln_modulate with the attention's gate into
    the affine LayerNorm without modulation (norm2), and the plain residual into the modulated norm (norm3). Kernels
    of one name (template instances) are added up. Forces nothing:
    with gpu_session.sh ab (AB_STAGE=columns) it compares two builds' row, column-reduction and totals kernels."""
    ops, bf, randn = torch.ops.adaptiveload, torch.bfloat16, cuda_randn()
    cases = {}
    for B, N in ((8, 384), (1, 6144)):
        x, dy = randn(B, N, 2048), randn(B, N, 2048)
        shift, scale = ltx_shift_scale(randn, B, 2048)
        _, rstd = ops.rms_norm_modulate(x, None, scale, shift, EPS, bf)
        cases[f"rms_norm_modulate_backward B={B} N={N} D=2048"] = (
            lambda x=x, dy=dy, s=scale, h=shift, r=rstd: ops.rms_norm_modulate_backward(dy, x, None, s, h, r))
    for B, N in ((12, 1560), (1, 46800)):
        D = 1536
        x, y, dy = randn(B, N, D), randn(B, N, D), randn(B, N, D)
        c = wan_chunks(randn, B, D)
        w, b = randn(D, dtype=torch.float32), randn(D, dtype=torch.float32)
        _, mean1, rstd1 = ops.adaln_modulate(x, None, None, c[1], c[0], EPS, bf)
        r2, _, mean2, rstd2 = ops.residual_adaln_modulate(x, y, c[2], w, b, None, None, EPS, bf, bf)
        r3, _, mean3, rstd3 = ops.residual_adaln_modulate(x, y, None, None, None, c[4], c[3], EPS, bf, bf)
        shape = f"B={B} N={N} D={D}"
        cases[f"adaln_modulate_backward (norm1) {shape}"] = (
            lambda x=x, dy=dy, c=c, m=mean1, r=rstd1: ops.adaln_modulate_backward(dy, x, None, None, c[1], c[0], m, r))
        cases[f"residual_adaln_modulate_backward gated, affine (norm2) {shape}"] = (
            lambda dy=dy, y=y, c=c, w=w, b=b, r2=r2, m=mean2, r=rstd2: ops.residual_adaln_modulate_backward(
                dy, dy, r2, y, c[2], w, b, None, None, m, r, bf))
        cases[f"residual_adaln_modulate_backward plain, modulated (norm3) {shape}"] = (
            lambda dy=dy, c=c, r3=r3, m=mean3, r=rstd3: ops.residual_adaln_modulate_backward(
                dy, dy, r3, None, None, None, None, c[4], c[3], m, r, bf))
    for name, fn in cases.items():
        us = kernels_us(fn)
        print(f"{name}: total {sum(us.values()):.1f} us; " + "; ".join(f"{k} {v:.1f}" for k, v in us.items()),
              flush=True)


def stage_addend(tt, op, bwd, bw):
    """GPU µs a call (kernels_us: every kernel of the call added up) of the norm-site backward ops at the models'
    norm1 sites and at N = 65536, three ways: the op alone; the op, then an add of another gradient to its dx (the
    graph the backend's post-grad pass rewrites: Inductor ran that add as a kernel of its own, or inside another);
    the op with that gradient as dx_addend. adaln_modulate at Wan's 12 x 1,560 and 1 x 32,760 (D = 1536, fp32
    .chunk() modulation) and at N = 65536, D = 1536 / 3072; rms_norm_modulate at LTX-Video's (8, 384), D = 2048
    (bf16 modulation). Speed-of-light: 3 x-sized moves without the addend (dy, x, dx), 4 with it."""
    ops, bf, randn = torch.ops.adaptiveload, torch.bfloat16, cuda_randn()
    cases = []
    for B, N, D in ((12, 1560, 1536), (1, 32760, 1536), (1, 65536, 1536), (1, 65536, 3072)):
        x, dy, t = randn(B, N, D), randn(B, N, D), randn(B, N, D)
        c = wan_chunks(randn, B, D)
        _, mean, rstd = ops.adaln_modulate(x, None, None, c[1], c[0], EPS, bf)
        cases.append((f"adaln_modulate_backward B={B} N={N} D={D}", x, t,
                      lambda add=None, x=x, dy=dy, c=c, m=mean, r=rstd: ops.adaln_modulate_backward(
                          dy, x, None, None, c[1], c[0], m, r, dx_addend=add)))
    x, dy, t = randn(8, 384, 2048), randn(8, 384, 2048), randn(8, 384, 2048)
    shift, scale = ltx_shift_scale(randn, 8, 2048)
    _, rstd = ops.rms_norm_modulate(x, None, scale, shift, EPS, bf)
    cases.append(("rms_norm_modulate_backward B=8 N=384 D=2048", x, t,
                  lambda add=None, x=x, dy=dy, s=scale, h=shift, r=rstd: ops.rms_norm_modulate_backward(
                      dy, x, None, s, h, r, dx_addend=add)))
    for name, x, t, fn in cases:
        alone, after, folded = (sum(kernels_us(f).values()) for f in (
            fn, lambda fn=fn, t=t: fn()[0] + t, lambda fn=fn, t=t: fn(t)))
        sol3, sol4 = (1e3 * sol_ms(x, k, bw) for k in (3, 4))
        print(f"{name}: op {alone:.1f} us ({100 * sol3 / alone:.0f}% SoL); op then add {after:.1f} us; "
              f"op with dx_addend {folded:.1f} us ({100 * sol4 / folded:.0f}% SoL); saved {after - folded:.1f} us",
              flush=True)


def stage_rope(tt, op, bwd, bw):
    """GPU µs of the q/k RMSNorm -> RoPE op's kernels (rms_norm_rope, q and k one call each, forward and
    backward with dweight; torch.profiler) by thread cap a row (max_threads: auto and the caps that give
    2, 3 and 4+ groups a thread), settings alternated three times, against Inductor's compiled chain
    (bench_qk_norm.py's diffusers Wan code, all of its forward and backward kernels) at Wan's 12 x 1,560
    and 1 x 32,760 (12 heads) and 2 x 1,560 and 1 x 32,760 (40 heads), bf16. SoL: 4 x-sized moves
    forward, 10 forward + backward (bench_qk_norm.py's count)."""
    from bench_qk_norm import inputs, norm_rope

    ops, gen = torch.ops.adaptiveload, torch.Generator(device="cuda").manual_seed(0)
    mask = [True, True, False, False]
    for heads, shapes, caps in ((12, ((12, 1560), (1, 32760)), ("auto", 96, 64, 32)),
                                (40, ((2, 1560), (1, 32760)), ("auto", 320, 160, 96))):
        for B, S in shapes:
            fn, args = inputs(B, S, heads, 128, "norm+rope", gen)
            q, k, wq, wk, cos, sin = args
            sol_f = 4 * q.numel() * q.element_size() / bw * 1e6
            trained = [a for a in args if a.requires_grad]
            compiled = torch.compile(lambda *a: norm_rope(*a, heads))
            outs = compiled(*args)
            grads = [torch.randn_like(o) for o in outs]
            ind = sum(kernels_us(lambda: torch.autograd.grad(compiled(*args), trained, grads), calls=20).values())
            c, s_ = cos.float()[..., 0::2], sin.float()[..., 1::2]

            def both():
                for x, w, g in ((q, wq, grads[0]), (k, wk, grads[1])):
                    y, rstd = ops.rms_norm_rope(x, w, c, s_, heads, EPS, x.dtype)
                    ops.rms_norm_rope_backward(g, x, w, c, s_, rstd, mask)

            cells = {cap: [] for cap in caps}
            for _ in range(3):
                for cap in caps:
                    with override(max_threads=cap):
                        us = kernels_us(both, calls=20)
                    fwd = sum(v for n, v in us.items() if "rope_forward" in n)
                    bwd_us = sum(v for n, v in us.items() if "rope_backward" in n or "rope_dweight" in n)
                    cells[cap].append((fwd, bwd_us, sum(us.values())))
            line = [f"{B}x{S} D={heads * 128}: Inductor fwd+bwd {ind:.1f} us ({100 * 2.5 * sol_f / ind:.0f}%)"]
            for cap, runs in cells.items():
                fwd, bwd_us, tot = (sorted(r[i] for r in runs)[1] for i in range(3))
                line.append(f"{cap}: fwd {fwd:.1f} us ({100 * sol_f / fwd:.0f}%) bwd {bwd_us:.1f} "
                            f"({100 * 1.5 * sol_f / bwd_us:.0f}%) all {tot:.1f} ({100 * 2.5 * sol_f / tot:.0f}%)")
            print("; ".join(line), flush=True)


def op_calls_host_us(rounds: int = 9, calls: int = 1000) -> dict:
    """{call: (median, min) host µs} of the calls stage (see the module doc)."""
    import statistics
    import time

    B, N, D, bf, randn = 8, 384, 2048, torch.bfloat16, cuda_randn()
    x, y, dy = randn(B, N, D), randn(B, N, D), randn(B, N, D)
    shift, scale = ltx_shift_scale(randn, B, D)
    chunks = wan_chunks(randn, B, D)
    ops = torch.ops.adaptiveload
    with torch.no_grad():
        _, rstd = ops.rms_norm_modulate(x, None, scale, shift, EPS, bf)
        _, mean1, rstd1 = ops.adaln_modulate(x, None, None, chunks[0], chunks[1], EPS, bf)
        r, _, mean2, rstd2 = ops.residual_adaln_modulate(x, y, chunks[2], None, None, chunks[3], chunks[4], EPS, bf,
                                                         bf)
    cases = {
        "torch.empty_like (for scale)": lambda: torch.empty_like(x),
        "rms_norm_modulate": lambda: ops.rms_norm_modulate(x, None, scale, shift, EPS, bf),
        "rms_norm_modulate_backward": lambda: ops.rms_norm_modulate_backward(dy, x, None, scale, shift, rstd),
        "adaln_modulate": lambda: ops.adaln_modulate(x, None, None, chunks[0], chunks[1], EPS, bf),
        "adaln_modulate_backward": lambda: ops.adaln_modulate_backward(dy, x, None, None, chunks[0], chunks[1], mean1,
                                                                       rstd1),
        "residual_adaln_modulate": lambda: ops.residual_adaln_modulate(x, y, chunks[2], None, None, chunks[3],
                                                                       chunks[4], EPS, bf, bf),
        "residual_adaln_modulate_backward": lambda: ops.residual_adaln_modulate_backward(
            dy, dy, r, y, chunks[2], None, None, chunks[3], chunks[4], mean2, rstd2, bf),
    }

    def per_call_us(fn, n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()  # (before the sync: host time only)
        torch.cuda.synchronize()
        return (t1 - t0) / n * 1e6

    times = {name: [] for name in cases}
    with torch.no_grad():
        for fn in cases.values():
            per_call_us(fn, 50)  # warm-up
        for _ in range(rounds):
            for name, fn in cases.items():
                times[name].append(per_call_us(fn, calls))
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


STAGES = {"sweep": stage_sweep, "ring": stage_ring, "wide": stage_wide, "ab": stage_ab, "store": stage_store,
          "tail": stage_tail, "small": stage_small,
          "columns": stage_columns, "rope": stage_rope, "addend": stage_addend}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=(*STAGES, "host", "calls"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_stages: needs a CUDA GPU", file=sys.stderr)
        return 1
    import adaptiveload  # noqa: F401

    if args.stage == "host":
        us = host_time_us(torch.Generator(device="cuda").manual_seed(0))
        print("host us per fwd+bwd call (B=1 N=16 D=1536): " + ", ".join(f"{k} {v:.0f}" for k, v in us.items()))
        return 0
    if args.stage == "calls":
        print(f"package: {os.path.dirname(adaptiveload.__file__)}", flush=True)
        for name, (median, low) in op_calls_host_us().items():
            print(f"{name:34s} host µs/call median {median:7.2f}  min {low:7.2f}", flush=True)
        return 0
    import triton.testing as tt

    os.environ["ADAPTIVELOAD_REQUIRE_KERNEL"] = "1"
    op, bwd = torch.ops.adaptiveload.adaln_modulate, torch.ops.adaptiveload.adaln_modulate_backward
    bw = copy_bandwidth(tt)
    print(f"copy {bw / 1e12:.2f} TB/s")
    STAGES[args.stage](tt, op, bwd, bw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
