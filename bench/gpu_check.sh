#!/usr/bin/env bash
# Everything GPU-side in one command, for one GPU (written for one H200 with torch 2.11,
# triton 3.6, Python 3.12 and no network): under 8 minutes, each step with a hard time limit,
# each step's failure recorded and the next step run anyway, then one summary table.
#
#   1. build     fastpar with its CUDA sources for this GPU's arch (pip --no-deps, offline)
#   2. kernels   the kernel tests compiled on the GPU (TRITON_INTERPRET=0), bf16 included
#   3. tp-nccl   the extension's GEMM<->collective ops, the overlapped TP autograd Functions under
#                CUDA bf16 autocast, DataParallel's CUDA path and mixed precision (bf16
#                parameters, fp32 main gradients, fused AdamW on fp32 masters), on a one-rank
#                NCCL group (tests/test_tp_gpu.py)
#   4. accuracy  rms_norm / layer_norm at hidden 8192 and 16384, cross-entropy at 16K tokens x
#                128K vocabulary, compiled, against torch (tests/test_kernel_gpu_accuracy.py)
#   5. bench     the kernels against torch eager / torch.compile, with a time budget
#                (bench/bench_kernels.py)
#   6. train-1b  a few steps of the 1b preset on this GPU (--precision bf16, the GPU default),
#                no checkpoint: tokens/s, MFU; the last step evaluated and traced by the
#                profiler (CUDA kernels under fastpar's ranges), then a KV-cache sample
#
#   bash bench/gpu_check.sh 2>&1 | tee gpu_check.log
#   PYTHON=/path/to/python STEPS="build kernels" bash bench/gpu_check.sh    # some steps only
#
# Exit status: the number of failed steps. tests/conftest.py sets TRITON_INTERPRET=1 only when it
# is unset, so TRITON_INTERPRET=0 here runs the kernel tests compiled on the GPU. Steps 2-4 are
# pytest: the kernel tests without the tests marked gpu, then each gpu-marked file on its own.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=${STEPS:-"build kernels tp-nccl accuracy bench train-1b"}
DEADLINE=${DEADLINE:-460}          # seconds for the whole script; steps are cut to fit
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
summary=()

# step NAME LIMIT CMD...: run CMD with a hard limit of min(LIMIT, time left before the deadline,
# keeping RESERVE seconds for the steps after it), record ok / FAIL (rc) / TIMEOUT and seconds.
step() {
  local name=$1 limit=$2; shift 2
  if [[ " $STEPS " != *" $name "* ]]; then return; fi
  local left=$(( DEADLINE - $(elapsed) - ${RESERVE:-0} ))
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then summary+=("$name|skipped (no time left)|0"); return; fi
  echo; echo "== $name (limit ${limit} s, at $(elapsed) s) =="
  local t0 rc status
  t0=$(date +%s)
  # bash -c: the step may be one of the functions below (exported), which timeout cannot exec.
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@"
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status="TIMEOUT after ${limit} s" ;; *) status="FAIL (rc $rc)" ;; esac
  summary+=("$name|$status|$(( $(date +%s) - t0 ))")
}

echo "== gpu_check.sh, $(date '+%Y-%m-%d %H:%M') =="
"$PY" - <<'PY' || { echo "gpu_check.sh: torch sees no CUDA GPU here; run it on a GPU machine"; exit 1; }
import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit(1)
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; "
      f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
      f"Python {sys.version.split()[0]}")
PY
arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")

build() {
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch} \
    FASTPAR_REQUIRE_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e . &&
  "$PY" -c "import fastpar; i = fastpar._C.build_info(); print(i); assert i['cuda'], i"
}
kernel_tests() {
  local parallel=()
  "$PY" -c "import xdist" 2>/dev/null && parallel=(-n 8)
  TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} \
    -m "not gpu" tests/test_kernel_*.py
}
# gpu_tests FILE: the tests of FILE marked gpu, compiled kernels, each test's numbers printed.
gpu_tests() {
  TRITON_INTERPRET=0 "$PY" -m pytest -q -s -rs -p no:cacheprovider -m gpu "$@"
}
train_1b() {
  # PEAK_TFLOPS: the GPU's dense bf16 peak (H100/H200 SXM: 989). The stdlib corpus, byte tokens.
  local run rc=0
  run=$(mktemp -d)
  "$PY" -m fastpar train --model 1b --nproc 1 --steps "${TRAIN_STEPS:-12}" --seq-len 2048 \
    --global-batch-size 8 --micro-batch-size 4 --warmup-steps 3 --log-every 4 --no-save \
    --peak-tflops "${PEAK_TFLOPS:-989}" --out "$run" \
    --eval-every "${TRAIN_STEPS:-12}" --eval-batches 1 --sample-tokens 32 \
    --profile-steps "${TRAIN_STEPS:-12}:${TRAIN_STEPS:-12}" || rc=$?
  "$PY" - "$run" <<'PY' || rc=$?
import json, statistics, sys
run = sys.argv[1]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")][3:]   # after warm-up, tuning
tok = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
print(f"1b, seq 2048, batch 8, bf16: {tok:,.0f} tokens/s, MFU {mfu:.1%} "
      f"(median of steps {rows[0]['step']}-{rows[-1]['step']})")
# The evaluation, the KV-cache sample (printed above) and the profiler on CUDA.
assert "val_loss" in rows[-1], "no validation loss at the last step"
events = json.load(open(next(__import__("glob").iglob(f"{run}/profile/steps-*/rank0.json"))))[
    "traceEvents"]
ours = sum(e.get("name", "").startswith("fastpar: ") for e in events)
gpu = sum(e.get("cat") == "kernel" for e in events)
print(f"val loss {rows[-1]['val_loss']:.3f}; trace: {ours} fastpar ranges, {gpu} GPU kernels")
assert ours and gpu, "the trace lacks fastpar's ranges or the GPU's kernels"
PY
  rm -rf "$run"
  return $rc
}

export PY arch
export -f build kernel_tests gpu_tests train_1b

# Limits (s): sum of the later steps' minimum needs is kept in RESERVE so an early overrun
# cannot starve them.
RESERVE=300 step build 150 build
RESERVE=240 step kernels 90 kernel_tests
RESERVE=180 step tp-nccl 60 gpu_tests tests/test_tp_gpu.py
RESERVE=120 step accuracy 90 gpu_tests tests/test_kernel_gpu_accuracy.py
RESERVE=100 step bench 120 "$PY" bench/bench_kernels.py --budget 80 ${BENCH_ARGS:-}
RESERVE=0 step train-1b 110 train_1b

echo
echo "== summary ($(date '+%Y-%m-%d %H:%M'), $(elapsed) s in all) =="
printf '%-10s %-26s %s\n' step result seconds
failed=0
for row in "${summary[@]}"; do
  IFS='|' read -r name status secs <<<"$row"
  printf '%-10s %-26s %s\n' "$name" "$status" "$secs"
  [[ $status == ok ]] || failed=$((failed + 1))
done
exit "$failed"
