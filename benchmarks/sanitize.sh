#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the fused ops' kernels on a small set of shapes:
# aligned 16-byte path and scalar path (D not a multiple of 8, D = 1), per-sample / per-token /
# shared / strided modulation, affine or not, fp32 / bf16 / fp16, both backward designs, a
# partial last row tile; each case through adaln_modulate (LayerNorm) and rms_norm_modulate
# (RMSNorm; scale-only in every third case) and the residual ops (residual_adaln_modulate gated in
# every other case, residual_rms_norm_modulate on x + y, scale-only in every third case, else a plain
# norm; dr given), and the segmented variants of all four (the case's rows as one pack of 5 segments,
# ids unsorted int32 in every other case: the column kernel for unsorted ids),
# and the q/k RMSNorm -> RoPE op (rms_norm_rope, the cases of even D, heads of 128 where D allows),
# or only the ops named in SANITIZE_OPS ("adaln rms residual segmented rope", the default). PyTorch's caching allocator is off so that every tensor is its own allocation and an
# out-of-bounds access cannot land inside a neighbour.
# Usage: [SANITIZE_OPS=rms] benchmarks/sanitize.sh [LOGDIR]   (exit status non-zero when a tool reports an error)
set -uo pipefail
cd "$(dirname "$0")/.."
LOGDIR=${1:-${OUT:-/tmp}/sanitize}
mkdir -p "$LOGDIR"
PY=${PYTHON:-python3}
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 ADAPTIVELOAD_REQUIRE_KERNEL=1
CASES=$(mktemp --suffix .py)
trap 'rm -f "$CASES"' EXIT
cat >"$CASES" <<'PY'
import os
import torch
import adaptiveload  # noqa: F401
from adaptiveload.ops import _tuning

op, bwd = torch.ops.adaptiveload.adaln_modulate, torch.ops.adaptiveload.adaln_modulate_backward
rms, rms_bwd = torch.ops.adaptiveload.rms_norm_modulate, torch.ops.adaptiveload.rms_norm_modulate_backward
res, res_bwd = torch.ops.adaptiveload.residual_adaln_modulate, torch.ops.adaptiveload.residual_adaln_modulate_backward
res_rms = torch.ops.adaptiveload.residual_rms_norm_modulate
res_rms_bwd = torch.ops.adaptiveload.residual_rms_norm_modulate_backward
rope, rope_bwd = torch.ops.adaptiveload.rms_norm_rope, torch.ops.adaptiveload.rms_norm_rope_backward
ops = os.environ.get("SANITIZE_OPS", "adaln rms residual segmented rope").split()
seg_ops = [getattr(torch.ops.adaptiveload, f"{name}_segmented") for name in
           ("adaln_modulate", "rms_norm_modulate", "residual_adaln_modulate", "residual_rms_norm_modulate")]
seg_bwd = [getattr(torch.ops.adaptiveload, f"{name}_segmented_backward") for name in
           ("adaln_modulate", "rms_norm_modulate", "residual_adaln_modulate", "residual_rms_norm_modulate")]
g = torch.Generator(device="cuda").manual_seed(0)
cases = [  # (B, N, D, x dtype, modulation dtype, layout, affine)
    (2, 37, 1536, torch.bfloat16, torch.float32, "strided", False),
    (2, 37, 1536, torch.bfloat16, torch.bfloat16, "per-token", True),
    (1, 19, 1000, torch.float16, torch.float16, "per-sample", True),
    (3, 5, 17, torch.float32, torch.float32, "shared", True),
    (2, 9, 1, torch.bfloat16, torch.bfloat16, "per-token", False),
    (1, 7, 5120, torch.float32, torch.float32, "per-sample", False),
    (1, 3, 12288, torch.bfloat16, torch.float32, "per-sample", True),
    (1, 10001, 1536, torch.bfloat16, torch.float32, "strided", True),
    (1, 6000, 1000, torch.float16, torch.float16, "per-sample", True),
    (1, 20000, 1536, torch.bfloat16, torch.bfloat16, "per-sample", True),
]
for i, (B, N, D, xdt, mdt, layout, affine) in enumerate(cases):
    # forced through adaptiveload.ops._tuning.override, the kernels' own choice where "auto":
    # the two-kernel backward in every other case; the shared-memory rings where the case allows them
    # (aligned rows; backward: <= 16 elements a thread, per-token scale rows in the slot in case 1, fp32
    # 4 chunks in case 5; the ring in the two-kernel cases 1, 5 and 7); interleaved forward rows over
    # blocks of several rows in case 7 (a 2-slot ring that wraps) and case 8 (the register path,
    # forced with stages 0: its fp16 rows of D = 1000 are aligned, several a block); cases 0-6 have a
    # row or a few per block. y by bulk stores from the ring slots: case 0 (a row or so a block, 4
    # slots: the automatic count for the bulk store) and case 9 (3 slots, the fewest it takes, many
    # rows a block); case 7 asks with 2 slots (the threads store); the others take the launcher's choice
    settings = dict(two_kernel=i % 2 == 1,
                    fwd_stages=("auto", "auto", 2, 0, 0, 3, "auto", 2, 0, 3)[i],
                    bwd_stages=("auto", "auto", 3, 0, 0, "auto", 0, "auto", "auto", "auto")[i],
                    store="bulk" if i in (0, 7, 9) else "auto")
    x = torch.randn(B, N, D, device="cuda", generator=g).to(xdt)
    if layout == "strided":
        scale, shift = (t.unsqueeze(1) for t in torch.randn(B, 3 * D, device="cuda", generator=g).to(mdt).chunk(3, -1)[:2])
    elif layout == "per-token":
        scale, shift = torch.randn(B, N, 2 * D, device="cuda", generator=g).to(mdt).chunk(2, -1)
    elif layout == "shared":
        scale, shift = torch.randn(2, D, device="cuda", generator=g).to(mdt).unbind(0)
    else:
        scale, shift = torch.randn(2, B, 1, D, device="cuda", generator=g).to(mdt).unbind(0)
    w = torch.randn(D, device="cuda", generator=g).to(xdt) if affine else None
    b = torch.randn(D, device="cuda", generator=g).to(xdt) if affine else None
    with _tuning.override(**settings):
        if "adaln" in ops:
            y, mean, rstd = op(x, w, b, scale, shift, 1e-6, xdt)
            grads = bwd(torch.randn_like(y), x, w, b, scale, shift, mean, rstd)
        if "rms" in ops:
            h = None if i % 3 == 2 else shift
            y, rstd = rms(x, w, scale, h, 1e-6, xdt)
            grads = rms_bwd(torch.randn_like(y), x, w, scale, h, rstd)
        if "residual" in ops:  # the branch output y beside x; its gate: shift's tensor in every other case
            yb = torch.randn_like(x)
            gate = shift if i % 2 == 0 else None
            r, out, mean, rstd = res(x, yb, gate, w, b, scale, shift, 1e-6, xdt, xdt)
            grads = res_bwd(torch.randn_like(out), torch.randn_like(r), r, yb if gate is not None else None, gate, w, b,
                            scale, shift, mean, rstd, xdt)
            s = (scale, None, None)[i % 3]
            r, out, rstd = res_rms(x, yb, None, w, s, None, 1e-6, xdt, xdt)
            grads = res_rms_bwd(torch.randn_like(out), torch.randn_like(r), r, None, None, w, s, None, rstd, xdt)
        if "segmented" in ops:  # x [B*N, D] as one pack of 5 segments of random lengths (some may be empty)
            xs, ys = x.reshape(B * N, D), torch.randn(B * N, D, device="cuda", generator=g).to(xdt)
            ids = torch.randint(0, 5, (B * N,), device="cuda", generator=g)
            ids = ids.int() if i % 2 == 1 else ids.sort().values
            ms, mh, mg = torch.randn(3, 5, D, device="cuda", generator=g).to(mdt).unbind(0)
            y, mean, rstd = seg_ops[0](xs, w, b, ms, mh, ids, 1e-6, xdt)
            grads = seg_bwd[0](torch.randn_like(y), xs, w, b, ms, mh, ids, mean, rstd)
            h = None if i % 3 == 2 else mh
            y, rstd = seg_ops[1](xs, w, ms, h, ids, 1e-6, xdt)
            grads = seg_bwd[1](torch.randn_like(y), xs, w, ms, h, ids, rstd)
            r, out, mean, rstd = seg_ops[2](xs, ys, mg, w, b, ms, mh, ids, 1e-6, xdt, xdt)
            grads = seg_bwd[2](torch.randn_like(out), torch.randn_like(r), r, ys, mg, w, b, ms, mh, ids, mean, rstd, xdt)
            r, out, rstd = seg_ops[3](xs, ys, mg, w, ms, h, ids, 1e-6, xdt, xdt)
            grads = seg_bwd[3](torch.randn_like(out), None, r, ys, mg, w, ms, h, ids, rstd, xdt)
        if "rope" in ops and D % 2 == 0:  # q/k RMSNorm -> RoPE: heads of 128 where D allows, else of 2;
            # y in the modulation's dtype (fp32 x with a bf16 y: the element path); tables [N, 1, Dh / 2]
            heads = D // 128 if D % 128 == 0 else D // 2
            cos, sin = torch.randn(2, N, 1, D // heads // 2, device="cuda", generator=g).unbind(0)
            y, rstd = rope(x, w, cos, sin, heads, 1e-6, mdt)
            grads = rope_bwd(torch.randn_like(y), x, w, cos, sin, rstd, [True, True, False, False])
        torch.cuda.synchronize()
    print("ok", ops, B, N, D, xdt, mdt, layout, affine, settings, flush=True)
PY
status=0
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 3 "$PY" "$CASES" >"$LOGDIR/$tool.log" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGDIR/$tool.log" || tail -5 "$LOGDIR/$tool.log"
  if [[ $rc -ne 0 ]]; then echo "sanitize: $tool FAILED (exit $rc), see $LOGDIR/$tool.log"; status=1; fi
done
exit $status
