#!/usr/bin/env bash
# CI step: compile every .cu file of the kernel sources (csrc/ and its subfolders) for sm_90 against
# the installed torch's headers, so a kernel that does not compile fails CI even on a machine without
# a GPU, in C++20 (the standard torch 2.13's cpp_extension builds them in, and that torch 2.14's headers
# require, pytorch/pytorch#178150). The CPU torch wheel lacks the generated CUDA macros header, hence
# -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE. Prints a line and skips (exit 0) where nvcc is absent; exits
# non-zero when a file does not compile (after all have been tried), printing its log.
# Usage: .ci/compile_cuda.sh [python [source-dir [file.cu ...]]]
#   python      whose torch headers to compile against (default: python3)
#   source-dir  the kernel sources, also the include path (default: csrc of this checkout; an
#               installed package's adaptiveload/_csrc works too)
#   file.cu     only these, relative to source-dir (default: every .cu under it, hidden folders left out)
# The device code is compiled without NVVM's optimizer (-Xcicc -O0): the check is whether it compiles,
# and that is 4x faster (81 s -> 19 s for the then single residual backward file of bf16 on 2 cores). Set NVCC_VERBOSE=1 for
# ptxas resource usage, which compiles the optimized code (the registers and spills the build gets).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
SRC=${2:-csrc}
shift $(($# < 2 ? $# : 2))
if ! command -v nvcc >/dev/null 2>&1; then
  echo "compile_cuda: nvcc not found, skipping the CUDA compile check"
  exit 0
fi
if (($# > 0)); then
  FILES=("$@")
else
  mapfile -t FILES < <(cd "$SRC" && find . -name '*.cu' -not -path '*/.*' | sed 's|^\./||' | sort)
fi
if ((${#FILES[@]} == 0)); then
  echo "compile_cuda: no .cu files in $SRC" >&2
  exit 1
fi
INC=$("$PY" -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))")
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
ABI=$("$PY" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
OUTDIR=$(mktemp -d)
trap 'rm -rf "$OUTDIR"' EXIT
EXTRA=(-Xcicc -O0)
if [[ "${NVCC_VERBOSE:-0}" == 1 ]]; then EXTRA=(-Xptxas -v); fi
status=0
pids=()
for f in "${FILES[@]}"; do
  obj="$OUTDIR/${f//\//__}"  # a/b.cu -> a__b.cu: files of one name in two subfolders do not collide
  (
    nvcc -std=c++20 -arch=sm_90 -O3 -c "$SRC/$f" -o "$obj.o" \
      $INC -I"$PYINC" -I"$SRC" -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
      -DTORCH_EXTENSION_NAME=adaln_check --expt-relaxed-constexpr "${EXTRA[@]}" \
      >"$obj.log" 2>&1 && echo "compile_cuda: ok   $SRC/$f" || { echo "compile_cuda: FAIL $SRC/$f"; cat "$obj.log"; exit 1; }
    if [[ "${NVCC_VERBOSE:-0}" == 1 ]]; then cat "$obj.log"; fi
  ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
