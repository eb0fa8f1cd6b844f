#!/usr/bin/env bash
# The GPU check in one command, on a machine with a CUDA GPU (about 8 minutes on one H100/H200):
#   1. build fastpar with its CUDA sources (pip install --no-build-isolation -e .),
#   2. run the test suite with the real Triton path: the kernel tests on the GPU, bf16 included,
#   3. benchmark the kernels against torch eager and torch.compile (bench/bench_kernels.py),
#   4. train the 1b preset for a few steps on one GPU (bf16 autocast) and print tokens/s and MFU.
#
#   bash bench/gpu_check.sh                        # kernel tests on the GPU, then the benchmark
#   GPU_CHECK_TESTS=all bash bench/gpu_check.sh    # the whole suite in step 2 (over 8 minutes:
#                                                  # the multi-rank CPU tests take most of it)
#   PYTHON=/path/to/python BENCH_ARGS="--quick" bash bench/gpu_check.sh
#
# tests/conftest.py sets TRITON_INTERPRET=1 only when it is unset, so TRITON_INTERPRET=0 here makes
# the kernel tests run compiled on the GPU (fastpar.kernels.testing.DEVICE is then "cuda").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else
  'gpu_check.sh: torch sees no CUDA GPU here; run it on a GPU machine')"
"$PY" - <<'PY'
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"== {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; "
      f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")
PY

echo "== 1. build (CUDA sources for this GPU's arch) =="
arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
# The image has torch and numpy; --no-deps keeps pip off the network.
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch} \
  FASTPAR_REQUIRE_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" -c "import fastpar; print(fastpar._C.build_info())"
echo "build done at $(elapsed) s"

echo "== 2. tests, real Triton path =="
export TRITON_INTERPRET=0
parallel=()
if "$PY" -c "import xdist" 2>/dev/null; then parallel=(-n 8); fi
status=0
"$PY" -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} tests/test_kernel_*.py \
  || status=$?
if [ "${GPU_CHECK_TESTS:-kernels}" = all ]; then
  # The rest serially (multi-rank tests pick free ports). Two package tests assert the CPU
  # interpreter setup itself and do not apply with TRITON_INTERPRET=0.
  "$PY" -m pytest -q -p no:cacheprovider --ignore-glob='tests/test_kernel_*' \
    --deselect tests/test_package.py::test_triton_interpreter_is_on_for_tests \
    --deselect tests/test_package.py::test_kernel_dispatcher || status=$?
fi
echo "tests done at $(elapsed) s (status $status)"

echo "== 3. benchmark =="
budget=$(( 390 - $(elapsed) ))
[ "$budget" -lt 60 ] && budget=60
# shellcheck disable=SC2086
"$PY" bench/bench_kernels.py --budget "$budget" ${BENCH_ARGS:-}

echo "== 4. the 1b preset on one GPU: tokens/s and MFU =="
# PEAK_TFLOPS: the GPU's dense bf16 peak (H100/H200 SXM: 989). The stdlib corpus, byte tokens.
run=$(mktemp -d)
"$PY" -m fastpar train --model 1b --nproc 1 --steps "${TRAIN_STEPS:-30}" --seq-len 2048 \
  --global-batch-size 8 --micro-batch-size 4 --warmup-steps 5 --log-every 10 \
  --peak-tflops "${PEAK_TFLOPS:-989}" --out "$run" || status=$?
"$PY" - "$run/metrics.jsonl" <<'PY' || status=$?
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][5:]      # after compilation / warm-up
tok = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
print(f"1b, seq 2048, batch 8: {tok:,.0f} tokens/s, MFU {mfu:.1%} (median of {len(rows)} steps)")
PY
rm -rf "$run"
echo "gpu_check.sh done in $(elapsed) s on $(date '+%Y-%m-%d %H:%M')"
exit "$status"
