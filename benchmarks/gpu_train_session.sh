#!/usr/bin/env bash
# GPU measurements of `adaptiveload train`, one phase per GPU machine call:
#   bash benchmarks/gpu_train_session.sh x2   # two H200 under torchrun with FSDP2: baseline, adaptiveload + equal-token,
#                                             # dual, cost_grouped
#   bash benchmarks/gpu_train_session.sh x1   # one H200 each: eager/inductor/adaptiveload + equal-token, adaptiveload + dual
#   bash benchmarks/gpu_train_session.sh x1pair  # Inductor and adaptiveload equal-token runs of x1 side by side, one per GPU
#   bash benchmarks/gpu_train_session.sh all  # x2, then x1pair (SAMPLES_X1)
#   bash benchmarks/gpu_train_session.sh packed 2  # W GPUs (torchrun when W > 1): the fused backend with
#                                                  # equal_token, dual, cost_grouped and packed, same samples and seed
#   bash benchmarks/gpu_train_session.sh calib  # `adaptiveload calibrate` of the compiled step, activation
#                                               # checkpointing off (GPU 0) and on (GPU 1); then e.g.
#   CALIBRATION=<calib_ckpt.json> EXTRA="--activation-checkpointing on" bash ... x2
# Same corpus (reference mix, --samples, --seed) and plan calibration for every configuration. Each run is capped
# with `timeout` so one hang cannot eat the session; results.json/png of every run and all logs are packed
# into $OUT/<phase>.tgz after every run (checkpoints are off); Dynamo recompiles and their reasons go to
# the run logs. Keep CAP times the number of runs, plus ~90 s of install and build, under the call's limit
# (x2 has four runs: pick them with ONLY, or set START_BY).
# ONLY="x2_baseline x2_dual" runs a subset of a phase; BUDGET_GB (default 120) sets --memory-budget-gb;
# EXTRA holds more arguments for every run (e.g. EXTRA=--drop-oversized). START_BY=S skips the runs that
# would start more than S seconds into the call (so a run the call's limit would cut off is not begun).
# A first run on a bare machine compiles cold (about 2.5 min of start-up and warm-up for the 10-layer model under torchrun); later runs hit the cache.
# MOCK=1 rehearses a phase on the CPU (gloo under torchrun): the tiny preset, SAMPLES (default 40) of the reference
# mix at the CPU downscale, --m-mem 2100 tokens instead of a memory budget, no install, GPU query or build;
# RUNS (default /tmp/runs) and OUT name the folders, e.g.
#   MOCK=1 OUT=/tmp/mock RUNS=/tmp/mock/runs bash benchmarks/gpu_train_session.sh packed 2
set -u
PHASE=${1:?x1, x2, x1pair, all, calib or packed W}
OUT=${OUT:-/tmp/out}
CAP=${CAP:-140}
RUNS=${RUNS:-/tmp/runs}
mkdir -p "$RUNS" "$OUT"
export TORCH_LOGS=recompiles PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ -n "${MOCK:-}" ]]; then
  COMMON=(--preset tiny --samples "${SAMPLES:-40}" --seed 0 --calibration "${CALIBRATION:-anchors-wan1.3b}"
          --m-mem 2100 --device cpu --quiet ${EXTRA:-})
  python -c "import torch; print(torch.__version__, 'cpu mock')" > "$RUNS/torch.txt"
else
  COMMON=(--preset wan2.1-1.3b --num-layers 10 --samples "${SAMPLES:-128}" --seed 0
          --calibration "${CALIBRATION:-anchors-wan1.3b}" --memory-budget-gb "${BUDGET_GB:-120}" --quiet ${EXTRA:-})
  python -m pip install -q -e . --no-deps --no-build-isolation
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RUNS/gpus.csv"
  python -c "import torch; print(torch.__version__, torch.version.cuda)" > "$RUNS/torch.txt"
  python -m adaptiveload build > "$RUNS/build.log" 2>&1
fi

pack() {  # everything so far into $OUT/<phase>.tgz (replaced whole), so a cut-off call keeps finished runs
  tar czf "$OUT/$PHASE.tgz.part" -C "$RUNS" --exclude='checkpoint*' --exclude='*.pt' --exclude='*.distcp' . \
    && mv "$OUT/$PHASE.tgz.part" "$OUT/$PHASE.tgz"
}
logged() {  # name, then a whole command: run it under `timeout $CAP`, log it, pack; ONLY="name ..." runs just those
  local name=$1; shift
  [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]] && return
  if [[ -n "${START_BY:-}" ]] && (( SECONDS > START_BY )); then
    echo "== $name: skipped, ${SECONDS}s into the call is past START_BY=$START_BY" | tee -a "$RUNS/commands.txt"; return
  fi
  echo "== $name: $*" | tee -a "$RUNS/commands.txt"
  timeout "$CAP" "$@" > "$RUNS/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s" | tee -a "$RUNS/commands.txt"
  tail -n 25 "$RUNS/$name.log"
  pack
}
train() { local name=$1; shift; logged "$name" "$@" "${COMMON[@]}" --out "$RUNS/$name"; }

TORCHRUN=(python -m torch.distributed.run --standalone --nproc-per-node 2 -m adaptiveload train)
ONE=(python -m adaptiveload train)
CAL=(python -m adaptiveload calibrate --preset wan2.1-1.3b --num-layers 10 --backend adaptiveload)
x2_runs() {
  train x2_baseline "${TORCHRUN[@]}" --backend inductor --sampler equal
  train x2_adaptiveload_equal "${TORCHRUN[@]}" --backend adaptiveload --sampler equal
  train x2_dual "${TORCHRUN[@]}" --backend adaptiveload --sampler dual --policy random
  train x2_cost_grouped "${TORCHRUN[@]}" --backend adaptiveload --sampler dual --policy cost_grouped
}
packed_runs() {  # W: the fused backend with each batching policy on W ranks, one run after another
  local w=$1 policy
  local cmd=("${ONE[@]}")
  (( w > 1 )) && cmd=(python -m torch.distributed.run --standalone --nproc-per-node "$w" -m adaptiveload train)
  for policy in equal_token dual cost_grouped packed; do
    train "packed_x${w}_$policy" "${cmd[@]}" --backend adaptiveload --policy "$policy"
  done
}
x1pair_runs() {
  ( export CUDA_VISIBLE_DEVICES=0; train x1_inductor_equal "${ONE[@]}" --backend inductor --sampler equal ) &
  ( export CUDA_VISIBLE_DEVICES=1; train x1_adaptiveload_equal "${ONE[@]}" --backend adaptiveload --sampler equal ) &
  wait
}
case $PHASE in
  x2) x2_runs ;;
  x1)
    ( export CUDA_VISIBLE_DEVICES=0
      train x1_inductor_equal "${ONE[@]}" --backend inductor --sampler equal
      train x1_eager_equal "${ONE[@]}" --backend eager --sampler equal ) &
    ( export CUDA_VISIBLE_DEVICES=1
      train x1_adaptiveload_equal "${ONE[@]}" --backend adaptiveload --sampler equal
      train x1_adaptiveload_dual "${ONE[@]}" --backend adaptiveload --sampler dual ) &
    wait
    ;;
  x1pair) x1pair_runs ;;
  calib)
    ( export CUDA_VISIBLE_DEVICES=0
      logged calib_off "${CAL[@]}" --activation-checkpointing off --max-tokens 100000 --out "$RUNS/calib_off.json" ) &
    ( export CUDA_VISIBLE_DEVICES=1
      logged calib_ckpt "${CAL[@]}" --activation-checkpointing on --max-tokens 200000 --out "$RUNS/calib_ckpt.json" ) &
    wait
    ;;
  packed) packed_runs "${2:?packed W: the number of GPUs (ranks)}" ;;
  all)
    x2_runs
    COMMON[5]=${SAMPLES_X1:-64}; CAP=${CAP_X1:-$CAP}
    x1pair_runs
    ;;
esac
pack
ls -la "$OUT"
