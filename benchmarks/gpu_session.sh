#!/usr/bin/env bash
# One GPU session for the fused ops (a machine with torch and nvcc; results under $OUT): install, build the kernels,
# then the GPU tests and the sanitizer (on the second GPU, alongside the benchmark on the first; one
# after the other on a one-GPU machine), writing logs and results under $OUT. Stages, run in this order:
#   build      adaptiveload build (always done first when any other stage is given)
#   tests      pytest -m cuda tests/ops (TESTS_K: a pytest -k expression for a subset; TESTS_WORKERS processes,
#              default 4, for the fixed-shape tests and the residual / segmented stages' tests) on GPU 1, in the
#              background while the benchmark runs (first, on GPU 0, where there is one GPU)
#   sanitize   benchmarks/sanitize.sh after the tests, on the same GPU (SANITIZE_OPS: which ops)
#   sweep, ring, tail, store, wide, small, addend, host: benchmarks/kernel_stages.py <stage> on GPU 0 -> $OUT/<stage>.log;
#              the kernels choose every launch setting themselves, and these stages force the ones they
#              compare with the private adaptiveload.ops._tuning.override (its keywords below)
#   sweep      op-only timings over thread caps (max_threads) and the two-kernel backward (two_kernel)
#   bench-quick / bench   benchmarks/bench_adaln.py on GPU 0 (a subset / BENCH_ARGS, default the session
#              preset); BENCH_AFTER_TESTS=1 starts it only once the tests and the sanitizer are done, so
#              that its host-bound wall times do not share the host with them
#   ring       forward and backward timings of the shared-memory row rings (fwd_stages / bwd_stages =
#              0, auto, 2, 3, 4, 8) at N = 65536, bf16, per-sample, B = 1 / 2, D = 1536 / 3072 / 5120 (and
#              thread caps max_threads = 512, 256, 128, 64 at D = 1536 / 3072), how the forward stores y
#              (store = threads / bulk, alternated three times), a clone of x of the same size, per-token
#              forward and backward rows
#   tail, store  the forward by its short blocks after the wave (tail) / by store, slots and thread cap
#   small      small row counts (LTX-Video (8, 384) / (1, 6144), Wan 12 x 1,560): slots, thread caps, short
#              blocks, and forward + backward against Inductor's compiled chain
#   wide       forward and backward at wide rows (fp32 x D = 3072 / 5120 / 8192, bf16 D = 8192 / 12288 /
#              16384; x of 512 MiB; the kernels' own choices)
#   rms        benchmarks/bench_rms_norm.py (rms_norm_modulate: op times against SoL, determinism,
#              accuracy against Inductor; RMS_ARGS) -> $OUT/rms_norm_${RMS_TAG:-h200}.json / .md
#   residual   the residual ops (csrc/residual_norm_modulate/): their CUDA tests (tests/ops/
#              test_residual_norm_modulate.py and tests/fxfuse/test_residual.py -m cuda, RESIDUAL_TESTS_TIMEOUT)
#              -> $OUT/residual_tests.log, then benchmarks/bench_residual.py (op times against SoL, determinism,
#              accuracy against Inductor; RESIDUAL_ARGS) -> $OUT/residual_${RESIDUAL_TAG:-h200}.json / .md
#   segmented  the segmented layout (packs): the CUDA tests of both families' segmented ops and the residual ops
#              (-k "not property"; SEGMENTED_TESTS_TIMEOUT) -> $OUT/segmented_tests.log, then
#              benchmarks/bench_segmented.py for adaln_modulate and the Wan residual site, speed only
#              -> $OUT/segmented_${SEGMENTED_TAG:-h200}.json / .md and segmented_${SEGMENTED_TAG:-h200}_residual.*
#   rope       the q/k RMSNorm -> RoPE op (csrc/rms_norm_rope/): its CUDA tests -> $OUT/rope_tests.log, then
#              benchmarks/bench_qk_norm.py (eager, Inductor, the backend and the op; ROPE_ARGS)
#              -> $OUT/qk_norm_${ROPE_TAG:-h200}.json / .md, then kernel_stages.py rope (the op's kernels'
#              GPU µs by thread cap against Inductor's) -> $OUT/rope_caps.log
#   ltx        benchmarks/bench_dit_step.py --model ltx (diffusers LTX-Video training step, backend vs Inductor;
#              needs diffusers as a wheel in .whl; LTX_ARGS) -> $OUT/ltx_step_${LTX_TAG:-h200}.json / .md
#   wan        benchmarks/bench_dit_step.py --model wan --profile (diffusers Wan 2.1 1.3B shape, 10 layers, training
#              step: eager, Inductor and the backend, with each one's norm-site GPU time; needs diffusers as a wheel
#              in .whl; WAN_ARGS, WAN_TIMEOUT) -> $OUT/wan_step_${WAN_TAG:-h200}.json / .md, wan_profile_*.txt
#   ab         kernel_stages.py ${AB_STAGE:-ab} (ab: kernel timings; columns: GPU µs of each backward kernel at the
#              models' row counts; host: host time a call; calls: host time of
#              a direct call of each op's forward and backward) for AB_BASE
#              (a folder with another version's adaptiveload/ and csrc/, built into its own cache beside
#              this one's) and for this checkout, in turn three times -> $OUT/ab.log (both stages force
#              no setting, so AB_BASE may be a build from before the override)
#   tests0     the fixed-shape tests on GPU 0 after its other stages, with TESTS0_ENV (VAR=value ...)
#              -> $OUT/tests0.log
#   host       host time of one forward+backward call per implementation (bench_adaln.host_time_us;
#              compiles Inductor and the backend first, ~1-2 min; 240 s limit)
#   ncu        Nsight Compute on GPU 0: speed-of-light, occupancy, launch, warp-state, memory,
#              scheduler, instruction and source-counter (stall sampling) sections of the forward,
#              one-pass backward and reduce kernels at N = 65536, bf16, D = 1536 / 3072 / 5120,
#              per-sample fp32 modulation (clocks left alone) -> $OUT/ncu.txt
#   ncu-rope   Nsight Compute (speed-of-light, occupancy, launch, warp-state, memory) of the rms_norm_rope kernels, one
#              forward and backward of q at Wan's 12 x 1,560 x 1,536 and 1 x 32,760 x 5,120, bf16, diffusers' stride-2
#              fp32 tables -> $OUT/ncu_rope.txt
#   ncu-seg    Nsight Compute (the same sections) of the segmented layout beside the per-sample one: every
#              kernel of adaln_modulate and residual_adaln_modulate (Wan gated site) forward and backward,
#              bf16, T = 65536, D = 1536 / 3072, per-sample, then 1 and 42 segments (equal lengths, ids in
#              order) -> $OUT/ncu_seg.txt
# Usage: benchmarks/gpu_session.sh build tests sweep bench-quick
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ADAPTIVELOAD_CACHE=/tmp/adaptiveload-cache HYPOTHESIS_PROFILE=ci
STAGES=" $* "
# the fixed-shape CUDA tests in TESTS_WORKERS processes on the one GPU (pytest-xdist; 0: one process):
# one process took ~8 min for tests/ops on the H200, more than a call's 10 minutes leave after the build
XDIST=$([[ ${TESTS_WORKERS:-4} -gt 0 ]] && echo "-n ${TESTS_WORKERS:-4}")
want() { [[ "$STAGES" == *" $1 "* ]]; }
# the Nsight Compute sections of the ncu stages
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
              --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats --section SourceCounters)

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
t0=$(date +%s)
if want ab; then  # the base version's build, alongside this one's
  base=$(cd "$AB_BASE" && pwd)
  in_base() { ADAPTIVELOAD_CACHE=/tmp/adaptiveload-cache-base PYTHONPATH="$base${PYTHONPATH:+:$PYTHONPATH}" "$@"; }
  # (from the base folder: `python -m` puts the working directory ahead of PYTHONPATH)
  (cd "$base" && in_base python3 -m adaptiveload build >"$OUT/build_base.log" 2>&1
   echo "base build: exit $?" >>"$OUT/build_base.log") &
  base_build=$!
fi
adaptiveload build --verbose >"$OUT/build.log" 2>&1
rc=$?
echo "build: exit $rc in $(( $(date +%s) - t0 )) s; cache $(tail -1 "$OUT/build.log")"
if [[ $rc -ne 0 ]]; then grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; fi

NGPU=$(nvidia-smi -L | wc -l)
if want tests || want sanitize; then
  (
    export CUDA_VISIBLE_DEVICES=$(( NGPU > 1 ? 1 : 0 ))
    if want tests; then
      # the fixed-shape tests first, then the hypothesis property test (its shrinking can be slow)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest tests/ops -m cuda -q -p no:cacheprovider --durations=10 $XDIST \
        -W ignore::DeprecationWarning -k "not kernels_match_float64_reference ${TESTS_K:+and ($TESTS_K)}" >"$OUT/tests.log" 2>&1
      echo "tests (fixed shapes): exit $?" >>"$OUT/tests.log"
      timeout ${PROPERTY_TIMEOUT:-90} python3 -m pytest tests/ops -m cuda -q -p no:cacheprovider \
        -W ignore::DeprecationWarning -k "kernels_match_float64_reference" >>"$OUT/tests.log" 2>&1
      echo "tests (property): exit $?" >>"$OUT/tests.log"
    fi
    if want sanitize; then
      timeout 150 benchmarks/sanitize.sh "$OUT/sanitize" >>"$OUT/tests.log" 2>&1
      echo "sanitize: exit $?" >>"$OUT/tests.log"
    fi
  ) &
  side=$!
  if (( NGPU < 2 )); then wait "$side"; fi
fi

export CUDA_VISIBLE_DEVICES=0
for stage in sweep ring tail store wide small addend; do  # kernel_stages.py's timing stages, in this order
  if want "$stage"; then
    python3 benchmarks/kernel_stages.py "$stage" >"$OUT/$stage.log" 2>&1
    echo "$stage: exit $?"; cat "$OUT/$stage.log"
  fi
done
if want ab; then
  wait "$base_build"; tail -2 "$OUT/build_base.log"
  for round in 1 2 3; do
    for v in base this; do
      runner=env  # this checkout, as installed
      [[ $v == base ]] && runner=in_base
      echo "== round $round: $v" >>"$OUT/ab.log"
      "$runner" python3 benchmarks/kernel_stages.py "${AB_STAGE:-ab}" >>"$OUT/ab.log" 2>&1
    done
  done
  echo "ab: done"; cat "$OUT/ab.log"
fi
if want rms; then
  timeout ${RMS_TIMEOUT:-240} python3 benchmarks/bench_rms_norm.py --out "$OUT" --tag "${RMS_TAG:-h200}" ${RMS_ARGS:-} \
    >"$OUT/rms.log" 2>&1
  echo "rms: exit $?"; cat "$OUT/rms.log"
fi
if want residual; then
  timeout ${RESIDUAL_TESTS_TIMEOUT:-240} python3 -m pytest $XDIST tests/ops/test_residual_norm_modulate.py \
    tests/fxfuse/test_residual.py -m cuda -q -p no:cacheprovider --durations=10 -W ignore::DeprecationWarning \
    >"$OUT/residual_tests.log" 2>&1
  echo "residual tests: exit $?"; tail -15 "$OUT/residual_tests.log"
  timeout ${RESIDUAL_TIMEOUT:-300} python3 benchmarks/bench_residual.py --out "$OUT" --tag "${RESIDUAL_TAG:-h200}" \
    ${RESIDUAL_ARGS:-} >"$OUT/residual.log" 2>&1
  echo "residual: exit $?"; cat "$OUT/residual.log"
fi
if want segmented; then
  timeout ${SEGMENTED_TESTS_TIMEOUT:-360} python3 -m pytest $XDIST tests/ops/test_segmented.py tests/ops/test_residual_segmented.py \
    tests/ops/test_residual_norm_modulate.py -m cuda -q -p no:cacheprovider -k "not property" \
    -W ignore::DeprecationWarning >"$OUT/segmented_tests.log" 2>&1
  echo "segmented tests: exit $?"; tail -5 "$OUT/segmented_tests.log"
  for op in adaln residual; do
    suffix=$([[ $op == residual ]] && echo _residual)
    timeout 120 python3 benchmarks/bench_segmented.py --op "$op" --no-accuracy --out "$OUT" \
      --tag "${SEGMENTED_TAG:-h200}$suffix" >"$OUT/segmented_$op.log" 2>&1
    echo "bench_segmented --op $op: exit $?"; cat "$OUT/segmented_$op.log"
  done
fi
if want rope; then
  timeout ${ROPE_TESTS_TIMEOUT:-240} python3 -m pytest $XDIST tests/ops/test_rms_norm_rope.py tests/fxfuse/test_rope_pattern.py \
    -m cuda -q -p no:cacheprovider -W ignore::DeprecationWarning >"$OUT/rope_tests.log" 2>&1
  echo "rope tests: exit $?"; tail -3 "$OUT/rope_tests.log"
  timeout ${ROPE_TIMEOUT:-300} python3 benchmarks/bench_qk_norm.py --out "$OUT" --tag "${ROPE_TAG:-h200}" ${ROPE_ARGS:-} \
    >"$OUT/rope.log" 2>&1
  echo "rope: exit $?"; cat "$OUT/rope.log"
  timeout ${ROPE_CAPS_TIMEOUT:-240} python3 benchmarks/kernel_stages.py rope >"$OUT/rope_caps.log" 2>&1
  echo "rope caps: exit $?"; cat "$OUT/rope_caps.log"
fi
if want ltx; then
  timeout ${LTX_TIMEOUT:-400} python3 benchmarks/bench_dit_step.py --model ltx --out "$OUT" --tag "${LTX_TAG:-h200}" \
    ${LTX_ARGS:-} >"$OUT/ltx.log" 2>&1
  echo "ltx: exit $?"; tail -8 "$OUT/ltx.log"
fi
if want wan; then
  timeout ${WAN_TIMEOUT:-540} python3 benchmarks/bench_dit_step.py --model wan --profile --out "$OUT" \
    --tag "${WAN_TAG:-h200}" ${WAN_ARGS:-} >"$OUT/wan.log" 2>&1
  echo "wan: exit $?"; tail -28 "$OUT/wan.log"
fi
if want host; then
  timeout 240 python3 benchmarks/kernel_stages.py host >"$OUT/host.log" 2>&1
  echo "host: exit $?"; tail -3 "$OUT/host.log"
fi
if want ncu; then
  cat >/tmp/ncu_cases.py <<'PY'
import torch
import adaptiveload  # noqa: F401
op, bwd = torch.ops.adaptiveload.adaln_modulate, torch.ops.adaptiveload.adaln_modulate_backward
for D in (1536, 3072, 5120):
    x = torch.randn(1, 65536, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    s, h = (0.1 * torch.randn(1, 2 * D, device="cuda")).chunk(2, -1)
    s, h = s.unsqueeze(1), h.unsqueeze(1)
    y, mean, rstd = op(x, None, None, s, h, 1e-6, torch.bfloat16)
    bwd(dy, x, None, None, s, h, mean, rstd)
torch.cuda.synchronize()
PY
  ADAPTIVELOAD_REQUIRE_KERNEL=1 timeout 240 ncu --clock-control none -k "regex:fwd_kernel|bwd_row_kernel|bwd_reduce_kernel" \
    "${NCU_SECTIONS[@]}" \
    python3 /tmp/ncu_cases.py >"$OUT/ncu.txt" 2>&1
  echo "ncu: exit $?"; grep -E "fwd_kernel|bwd_row_kernel|bwd_reduce_kernel|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Block Size|Grid Size|Duration" "$OUT/ncu.txt" | head -90
fi
if want ncu-seg; then
  cat >/tmp/ncu_seg_cases.py <<'PY'
import torch
import adaptiveload  # noqa: F401
ops = torch.ops.adaptiveload
T = 65536
for D in (1536, 3072):
    x, y, dy = (torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g, s, h = (0.1 * torch.randn(3, 1, D, device="cuda")).unbind(0)
    g, s, h = g[None], s[None], h[None]  # [1, 1, D]: per-sample
    out, mean, rstd = ops.adaln_modulate(x, None, None, s, h, 1e-6, torch.bfloat16)
    ops.adaln_modulate_backward(dy, x, None, None, s, h, mean, rstd)
    r, out, mean, rstd = ops.residual_adaln_modulate(x, y, g, None, None, s, h, 1e-6, torch.bfloat16, torch.bfloat16)
    ops.residual_adaln_modulate_backward(dy, None, r, y, g, None, None, s, h, mean, rstd, torch.bfloat16)
    for n in (1, 42):
        ids = torch.arange(n, device="cuda").repeat_interleave(T // n + 1)[:T].contiguous()
        gs, ss, hs = (0.1 * torch.randn(3, n, D, device="cuda")).unbind(0)
        xs, ys, dys = x[0], y[0], dy[0]
        out, mean, rstd = ops.adaln_modulate_segmented(xs, None, None, ss, hs, ids, 1e-6, torch.bfloat16)
        ops.adaln_modulate_segmented_backward(dys, xs, None, None, ss, hs, ids, mean, rstd)
        r, out, mean, rstd = ops.residual_adaln_modulate_segmented(xs, ys, gs, None, None, ss, hs, ids, 1e-6,
                                                                   torch.bfloat16, torch.bfloat16)
        ops.residual_adaln_modulate_segmented_backward(dys, None, r, ys, gs, None, None, ss, hs, ids, mean, rstd,
                                                       torch.bfloat16)
    torch.cuda.synchronize()
PY
  ADAPTIVELOAD_REQUIRE_KERNEL=1 timeout 420 ncu --clock-control none -k "regex:_kernel" \
    "${NCU_SECTIONS[@]}" \
    python3 /tmp/ncu_seg_cases.py >"$OUT/ncu_seg.txt" 2>&1
  echo "ncu-seg: exit $?"; grep -E "_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu_seg.txt" | head -150
fi
if want ncu-rope; then
  cat >/tmp/ncu_rope_cases.py <<'PY'
import torch
import adaptiveload  # noqa: F401
ops = torch.ops.adaptiveload
for B, S, H in ((12, 1560, 12), (1, 32760, 40)):
    D = H * 128
    x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(D, device="cuda")
    f = torch.rand(1, S, 1, 128, device="cuda") * 6.28
    cos, sin = f.cos()[..., 0::2], f.sin()[..., 1::2]
    y, rstd = ops.rms_norm_rope(x, w, cos, sin, H, 1e-6, torch.bfloat16)
    dy = torch.randn_like(y)
    ops.rms_norm_rope_backward(dy, x, w, cos, sin, rstd, [True, True, False, False])
torch.cuda.synchronize()
PY
  ADAPTIVELOAD_REQUIRE_KERNEL=1 timeout 150 ncu --clock-control none -k "regex:rope_" --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 /tmp/ncu_rope_cases.py >"$OUT/ncu_rope.txt" 2>&1
  echo "ncu-rope: exit $?"; grep -E "rope_|Duration|DRAM Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu_rope.txt" | head -60
fi
if want tests0; then  # the fixed-shape tests again, on GPU 0, with TESTS0_ENV (e.g. CUDA_LAUNCH_BLOCKING=1)
  env ${TESTS0_ENV:-} timeout ${TESTS_TIMEOUT:-150} python3 -m pytest tests/ops -m cuda -q -p no:cacheprovider \
    -W ignore::DeprecationWarning -k "not kernels_match_float64_reference" >"$OUT/tests0.log" 2>&1
  echo "tests0 (${TESTS0_ENV:-}): exit $?" | tee -a "$OUT/tests0.log"; tail -3 "$OUT/tests0.log"
fi
if [[ -n "${BENCH_AFTER_TESTS:-}" && -n "${side:-}" ]] && { want bench-quick || want bench; }; then
  wait "$side"; side=  # host-bound wall times: no test process competing for the host
fi
if want bench-quick; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_adaln.py --B 1 2 --N 65536 --D 1536 3072 5120 --layouts per-sample \
    --patterns bf16 --out "$OUT" --tag quick
  echo "bench-quick: exit $?"
fi
if want bench; then
  timeout ${BENCH_TIMEOUT:-290} python3 benchmarks/bench_adaln.py --out "$OUT" --tag h200 ${BENCH_ARGS:---preset session}
  echo "bench: exit $?"
fi
if [[ -n "${side:-}" ]]; then wait "$side"; fi
tail -40 "$OUT/tests.log" 2>/dev/null
exit 0
