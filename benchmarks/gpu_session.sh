#!/usr/bin/env bash
# One lent-GPU session for the fused op (see /work/.library/device): install, build the kernels,
# then the GPU tests and the sanitizer (on the second GPU, alongside the benchmark on the first; one
# after the other on a one-GPU machine), writing logs and results under $OUT. Stages, run in this order:
#   build      adaptiveload build (always done first when any other stage is given)
#   tests      pytest -m cuda tests/ops (TESTS_K: a pytest -k expression for a subset) on GPU 1, in the
#              background while the benchmark runs (first, on GPU 0, where there is one GPU)
#   sanitize   benchmarks/sanitize.sh after the tests, on the same GPU
#   sweep      op-only timings over thread caps (ADAPTIVELOAD_MAX_THREADS) on GPU 0
#   bench-quick / bench   benchmarks/bench_adaln.py on GPU 0 (a subset / the full grid)
#   ring       forward and backward timings of the shared-memory row rings (ADAPTIVELOAD_FWD_STAGES /
#              ADAPTIVELOAD_BWD_STAGES = 0, auto, 2, 3, 4, 8) at N = 65536, bf16, per-sample, B = 1 / 2,
#              D = 1536 / 3072 / 5120 (and thread caps ADAPTIVELOAD_MAX_THREADS = 512, 256, 128, 64 at
#              D = 1536 / 3072), per-token forward rows, on GPU 0 -> $OUT/ring.log
#   wide       forward and backward at wide rows (fp32 x D = 3072 / 5120 / 8192, bf16 D = 8192 / 12288 /
#              16384; x of 512 MiB; default settings) on GPU 0 -> $OUT/wide.log
#   host       host time of one forward+backward call per implementation (bench_adaln.host_time_us;
#              compiles Inductor and the backend first, ~1-2 min) on GPU 0 -> $OUT/host.log
#   ncu        Nsight Compute on GPU 0: speed-of-light, occupancy, launch, warp-state and memory
#              sections of the forward, one-pass backward and reduce kernels at N = 65536, bf16,
#              D = 1536 / 3072 / 5120, per-sample fp32 modulation (clocks left alone) -> $OUT/ncu.txt
# Usage: benchmarks/gpu_session.sh build tests sweep bench-quick
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ADAPTIVELOAD_CACHE=/tmp/adaptiveload-cache HYPOTHESIS_PROFILE=ci
STAGES=" $* "
want() { [[ "$STAGES" == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
t0=$(date +%s)
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
      timeout ${TESTS_TIMEOUT:-150} python3 -m pytest tests/ops -m cuda -q -p no:cacheprovider --durations=10 \
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
if want sweep; then
  python3 - >"$OUT/sweep.log" 2>&1 <<'PY'
import os, sys, torch, triton.testing as tt
import adaptiveload  # noqa: F401
sys.path.insert(0, "benchmarks")
from bench_adaln import copy_bandwidth
os.environ["ADAPTIVELOAD_REQUIRE_KERNEL"] = "1"
op, bwd = torch.ops.adaptiveload.adaln_modulate, torch.ops.adaptiveload.adaln_modulate_backward
bw = copy_bandwidth(tt)
print(f"copy {bw / 1e12:.2f} TB/s")
for (B, N, D, pt) in [(1, 65536, 1536, False), (1, 65536, 3072, False), (1, 65536, 5120, False),
                      (1, 16384, 3072, True)]:
    x = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    if pt:
        s, h = (0.1 * torch.randn(B, N, 2 * D, device="cuda", dtype=torch.bfloat16)).chunk(2, -1)
    else:
        s, h = (0.1 * torch.randn(B, 2 * D, device="cuda")).chunk(2, -1); s, h = s.unsqueeze(1), h.unsqueeze(1)
    k = 2 if pt else 1
    solf, solb = 2 * k * x.numel() * 2 / bw * 1e3, 3 * k * x.numel() * 2 / bw * 1e3
    for mt in (256, 512):
        os.environ["ADAPTIVELOAD_MAX_THREADS"] = str(mt)
        y, mean, rstd = op(x, None, None, s, h, 1e-6, torch.bfloat16)
        f = tt.do_bench(lambda: op(x, None, None, s, h, 1e-6, torch.bfloat16), warmup=25, rep=100, return_mode="median")
        os.environ["ADAPTIVELOAD_BWD"] = ""
        g1 = tt.do_bench(lambda: bwd(dy, x, None, None, s, h, mean, rstd), warmup=25, rep=100, return_mode="median")
        os.environ["ADAPTIVELOAD_BWD"] = "two_kernel"
        g2 = tt.do_bench(lambda: bwd(dy, x, None, None, s, h, mean, rstd), warmup=25, rep=100, return_mode="median")
        os.environ["ADAPTIVELOAD_BWD"] = ""
        print(f"B={B} N={N} D={D} pt={pt} max_threads={mt}: fwd {f:.3f} ms ({100 * solf / f:.0f}% SoL) "
              f"bwd {g1:.3f} ({100 * solb / g1:.0f}%) two-kernel {g2:.3f} ({100 * solb / g2:.0f}%)", flush=True)
PY
  echo "sweep: exit $?"; cat "$OUT/sweep.log"
fi
if want ring; then
  python3 - >"$OUT/ring.log" 2>&1 <<'PY'
import os, sys, torch, triton.testing as tt
import adaptiveload  # noqa: F401
sys.path.insert(0, "benchmarks")
from bench_adaln import copy_bandwidth
os.environ["ADAPTIVELOAD_REQUIRE_KERNEL"] = "1"
op, bwd = torch.ops.adaptiveload.adaln_modulate, torch.ops.adaptiveload.adaln_modulate_backward
bw = copy_bandwidth(tt)
print(f"copy {bw / 1e12:.2f} TB/s")


def sweep(label, fn, sol, var, values):
    """Median of fn with env var `var` set to each value, as 'value: ms (% SoL)' cells; var is unset after."""
    cells = []
    for value in values:
        os.environ[var] = value
        ms = tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
        cells.append(f"{value}: {ms:.3f} ms ({100 * sol / ms:.0f}%)")
    os.environ.pop(var)
    print(f"{label}: " + "; ".join(cells), flush=True)


for B in (1, 2):
    for D in (1536, 3072, 5120):
        x = torch.randn(B, 65536, D, device="cuda", dtype=torch.bfloat16)
        s, h = (0.1 * torch.randn(B, 2 * D, device="cuda")).chunk(2, -1)
        s, h = s.unsqueeze(1), h.unsqueeze(1)
        dy = torch.randn_like(x)
        y, mean, rstd = op(x, None, None, s, h, 1e-6, torch.bfloat16)
        fwd = lambda: op(x, None, None, s, h, 1e-6, torch.bfloat16)  # noqa: E731
        back = lambda: bwd(dy, x, None, None, s, h, mean, rstd)  # noqa: E731
        sol_f, sol_b = 2 * x.numel() * 2 / bw * 1e3, 3 * x.numel() * 2 / bw * 1e3
        stages = ("0", "auto", "2", "3", "4", "8")
        sweep(f"B={B} D={D} fwd stages", fwd, sol_f, "ADAPTIVELOAD_FWD_STAGES", stages)
        sweep(f"B={B} D={D} bwd stages", back, sol_b, "ADAPTIVELOAD_BWD_STAGES", stages)
        if D < 5120:  # fewer threads a row, more chunks a thread (the ring at auto)
            caps = ("512", "256", "128", "64")
            sweep(f"B={B} D={D} fwd max_threads", fwd, sol_f, "ADAPTIVELOAD_MAX_THREADS", caps)
            sweep(f"B={B} D={D} bwd max_threads", back, sol_b, "ADAPTIVELOAD_MAX_THREADS", caps)
for D in (1536, 3072, 5120):  # per-token scale and shift (bf16 rows of a [B, N, 2D] chunk): 4 x-sized moves
    x = torch.randn(1, 65536, D, device="cuda", dtype=torch.bfloat16)
    s, h = (0.1 * torch.randn(1, 65536, 2 * D, device="cuda", dtype=torch.bfloat16)).chunk(2, -1)
    fwd = lambda: op(x, None, None, s, h, 1e-6, torch.bfloat16)  # noqa: E731
    sweep(f"B=1 D={D} per-token fwd stages", fwd, 4 * x.numel() * 2 / bw * 1e3, "ADAPTIVELOAD_FWD_STAGES",
          ("0", "auto", "2", "3", "4"))
PY
  echo "ring: exit $?"; cat "$OUT/ring.log"
fi
if want wide; then
  python3 - >"$OUT/wide.log" 2>&1 <<'PY'
import os, sys, torch, triton.testing as tt
import adaptiveload  # noqa: F401
sys.path.insert(0, "benchmarks")
from bench_adaln import copy_bandwidth
os.environ["ADAPTIVELOAD_REQUIRE_KERNEL"] = "1"
op, bwd = torch.ops.adaptiveload.adaln_modulate, torch.ops.adaptiveload.adaln_modulate_backward
bw = copy_bandwidth(tt)
print(f"copy {bw / 1e12:.2f} TB/s")
for dtype, D in ((torch.float32, 3072), (torch.float32, 5120), (torch.float32, 8192), (torch.bfloat16, 8192),
                 (torch.bfloat16, 12288), (torch.bfloat16, 16384)):
    N = (1 << 29) // (D * dtype.itemsize)  # x of 512 MiB
    x = torch.randn(1, N, D, device="cuda", dtype=dtype)
    s, h = (0.1 * torch.randn(1, 2 * D, device="cuda")).chunk(2, -1)
    s, h = s.unsqueeze(1), h.unsqueeze(1)
    dy = torch.randn_like(x)
    y, mean, rstd = op(x, None, None, s, h, 1e-6, dtype)
    f = tt.do_bench(lambda: op(x, None, None, s, h, 1e-6, dtype), warmup=25, rep=100, return_mode="median")
    b = tt.do_bench(lambda: bwd(dy, x, None, None, s, h, mean, rstd), warmup=25, rep=100, return_mode="median")
    sol_f, sol_b = 2 * x.numel() * dtype.itemsize / bw * 1e3, 3 * x.numel() * dtype.itemsize / bw * 1e3
    print(f"{dtype} N={N} D={D} per-sample fp32 modulation: fwd {f:.3f} ms ({100 * sol_f / f:.0f}% SoL), "
          f"bwd {b:.3f} ms ({100 * sol_b / b:.0f}%)", flush=True)
PY
  echo "wide: exit $?"; cat "$OUT/wide.log"
fi
if want host; then
  (cd benchmarks && timeout 240 python3 -c "
import torch, adaptiveload, bench_adaln as b
us = b.host_time_us(torch.Generator(device='cuda').manual_seed(0))
print('host us per fwd+bwd call (B=1 N=16 D=1536): ' + ', '.join(f'{k} {v:.0f}' for k, v in us.items()))") \
    >"$OUT/host.log" 2>&1
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
  ADAPTIVELOAD_REQUIRE_KERNEL=1 timeout 240 ncu --clock-control none -k regex:adaln \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 /tmp/ncu_cases.py >"$OUT/ncu.txt" 2>&1
  echo "ncu: exit $?"; grep -E "adaln::|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Block Size|Grid Size|Duration" "$OUT/ncu.txt" | head -90
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
