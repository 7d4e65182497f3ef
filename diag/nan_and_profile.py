"""One-off diagnosis (not committed): Inductor NaN shapes and a per-kernel profile, inductor vs adaptiveload."""
import math, sys, time, collections
import torch
from adaptiveload.train.distributed import init_distributed
from adaptiveload.train.setup import build_step
from adaptiveload.train.step import StepConfig
from adaptiveload.train.data import synthetic_batch

backend = sys.argv[1]
ctx = init_distributed()
step, spec, info = build_step(ctx, preset=sys.argv[2] if len(sys.argv) > 2 else "wan2.1-1.3b", factory=None, num_layers=10,
                              step_config=StepConfig(backend=backend, inner="inductor", learning_rate=1e-4),
                              activation_checkpointing="off", max_seq_len=46800, seed=0)
plan = [(1, (1, 4, 4))] if len(sys.argv) > 2 else [(1, (1, 60, 104)), (2, (1, 60, 104)), (1, (1, 90, 160)), (30, (1, 60, 104)), (1, (5, 60, 104)),
        (1, (13, 90, 160)), (2, (5, 60, 104)), (1, (21, 60, 104)), (2, (13, 60, 104))]
import os
if os.environ.get("ONLY_PROFILE"):
    plan = []
with step.frozen_weights():
    for B, shape in plan:
        batch = synthetic_batch(spec, B, shape, device=ctx.device)
        loss = float(step.forward_backward(batch, B)); step.synchronize()
        bad = [n for n, p in step.module.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        badw = [n for n, p in step.module.named_parameters() if not torch.isfinite(p).all()]
        print(f"{backend} B={B} latent={shape} loss={loss:.4f} nonfinite grads={len(bad)} {bad[:3]} nonfinite weights={len(badw)}", flush=True)
        step.optimizer_step()
        if bad:
            break
# profile a B=1 S=32760 step
batch = synthetic_batch(spec, 1, (2, 4, 4) if len(sys.argv) > 2 else (21, 60, 104), device=ctx.device)
for _ in range(2):
    step(batch, 1)
step.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
    t = time.perf_counter(); step(batch, 1); step.synchronize(); wall = time.perf_counter() - t
tot = collections.Counter(); cnt = collections.Counter()
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        tot[e.name] += e.time_range.elapsed_us(); cnt[e.name] += 1
def cat(n):
    n2 = n.lower()
    if "flash" in n2 or "fmha" in n2 or "attention" in n2: return "attention"
    if "gemm" in n2 or "sm90_xmma" in n2 or "cutlass" in n2 or "nvjet" in n2 or "matmul" in n2: return "gemm"
    if "adaln" in n2: return "adaln kernels"
    if "adam" in n2 or "foreach" in n2 or "multi_tensor" in n2: return "optimizer"
    if n2.startswith("triton"): return "triton"
    return "other"
cats = collections.Counter()
for n, v in tot.items(): cats[cat(n)] += v
print(f"{backend}: wall {wall*1e3:.1f} ms, kernels {sum(tot.values())/1e3:.1f} ms")
for c, v in cats.most_common(): print(f"  {c:14s} {v/1e3:8.2f} ms")
for n, v in tot.most_common(30): print(f"  {v/1e3:8.2f} ms x{cnt[n]:4d}  {n[:110]}")
