#!/usr/bin/env bash
# Everything GPU-side in one command, for one GPU (written for one H200 with torch 2.11, triton
# 3.6, Python 3.12 and no network): at most 8 minutes (DEADLINE=470 s), each step under a hard
# time limit, its failure recorded and the next step run anyway, then one summary table, printed
# last. Everything it keeps lands in $OUT (default bench/results/gpu_check-<date>-<time>), at most
# 8 files, all a GPU machine run returns: gpu_check.log (all the output), summary.txt (the
# table), kernels.json, nccl.json, train_metrics.jsonl, train_trace.json.gz. Scratch (the 1b run
# folder) is a temporary folder, removed at the end; the build goes where pip -e puts it.
#
# Steps, in order, limits in seconds (465 in all):
#   build      95  fastpar with its CUDA sources for this GPU's arch: machine code and PTX
#                  (pip --no-deps, offline); the PTX is looked for in the built library
#   bench      80  the model's kernels first (norms, rotary, swiglu, cross-entropy,
#                  bias-dropout-add, then bias-gelu), then the TP overlap ops at tp=1, against
#                  torch eager / cuBLAS + the same collective, at the 7b preset's widths
#                  (bench/bench_kernels.py --shapes 4k, no torch.compile peers; on a rerun
#                  BENCH_COMPILE=1 adds them, BENCH_ARGS="--shapes 16k" another shape)
#   nccl       25  all_reduce, all-gather, reduce-scatter on a one-rank NCCL group, each result
#                  checked (bench/nccl_check.py): a dp=1 run issues none
#   kernels    45  the kernel tests compiled on the GPU (TRITON_INTERPRET=0), bf16 included
#                  (not the sm_90 compile check, which CI runs without a GPU)
#   tp-nccl    40  the extension's ops, the overlapped TP Functions under CUDA bf16 autocast,
#                  DataParallel's CUDA path, mixed precision, ZeRO-3 built on the meta device
#                  (its gather stream, its memory freed), on a one-rank NCCL group
#                  (tests/test_tp_gpu.py -m gpu); DualPipeV's pair (two threads taking
#                  turns, the backward's on autograd's device thread) on a CUDA side stream
#                  under bf16 autocast, against its sides run one after the other
#                  (tests/test_pp_dualpipe.py -m gpu)
#   accuracy   60  norms at hidden 8192 / 16384, cross-entropy at 16K x 128K, the MoE grouped
#                  GEMM at 16K rows x 4096 -> 14336, compiled, against
#                  torch (tests/test_kernel_gpu_accuracy.py -m gpu); the CP ring's flash /
#                  memory-efficient block kernels against full SDPA (tests/test_cp_attention.py);
#                  packed documents through the varlen flash kernel and per-sequence rotary
#                  tables against each document alone (tests/test_documents.py)
#   compile    40  a GPT's blocks compiled fullgraph by inductor with the Triton kernels inside,
#                  under bf16 autocast, against eager (tests/test_compile.py -m gpu)
#   train-1b   80  steps of the 1b preset (bf16) with the byte vocabulary, so that the KV-cache
#                  sample after training runs (and is checked); tokens/s, MFU, validation loss,
#                  the last step traced by the profiler (CUDA kernels under fastpar's ranges)
#
#   bash bench/gpu_check.sh
#   STEPS=bench,train-1b bash bench/gpu_check.sh       # some steps (e.g. a rerun, fresh machine)
#   STEPS=train-1b LIMIT_train_1b=300 bash bench/gpu_check.sh   # a step's own limit
#   GPU_CHECK_CPU=1 bash bench/gpu_check.sh            # no GPU: the steps with a CPU stand-in run
#                                                      # it, the others say "skipped: ..."
#
# A step ran (exit 0), failed (its exit status, or the timeout), or was skipped with its reason:
# a step that cannot run says so and never "ran"; a pytest step whose tests all skipped is
# skipped. Exit status: the number of failed steps (1 with no GPU found, unless GPU_CHECK_CPU=1).
set -uo pipefail
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)/results/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE=$!
# finish CODE: the table last, then let tee write the log's last lines before exiting.
finish() {
  steps_summary
  local failed=$?
  exec >&- 2>&-
  wait "$TEE"
  exit "${1:-$failed}"
}
export PY=${PYTHON:-python3} CPU_RUN=${GPU_CHECK_CPU:-0} PYTHONUNBUFFERED=1
source bench/gpu_steps.sh
steps_init "build bench nccl kernels tp-nccl accuracy compile train-1b" || exit 2

echo "== gpu_check.sh, $(date '+%Y-%m-%d %H:%M'), out: $OUT =="
ARCH=$(timeout 60 "$PY" - <<'PY'
import sys, torch, triton
p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
print(f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; " if p else
      "no CUDA GPU; ", f"torch {torch.__version__}, triton {triton.__version__}, CUDA "
      f"{torch.version.cuda}, Python {sys.version.split()[0]}", sep="", file=sys.stderr)
print("%d.%d" % torch.cuda.get_device_capability(0) if p else "")
PY
)
export ARCH
if [[ -z $ARCH && $CPU_RUN != 1 ]]; then
  echo "gpu_check.sh: torch sees no CUDA GPU here; run it on a GPU machine (GPU_CHECK_CPU=1: the"
  echo "run without one)"
  for name in $PICKED; do record "$name" "skipped: no CUDA GPU visible to torch" 0 ""; done
  finish 1
fi

needs_gpu() { [[ $CPU_RUN != 1 ]] || skip "needs a CUDA GPU (GPU_CHECK_CPU=1)"; }

# pytest_run ARGS...: ran if tests passed and none failed; skipped, with pytest's first reason,
# if every test skipped; failed otherwise. The key number is pytest's count line.
pytest_run() {
  run_logged "$PY" -m pytest -q -rs -p no:cacheprovider "$@"
  local rc=$? final passed skipped reason
  final=$(grep -E '^=* *[0-9]+ (passed|failed|skipped|errors?|deselected)' "$STEP_DIR/out" |
    tail -1)
  final=$(sed -E 's/^=+ *//; s/ *=+$//' <<<"$final")
  passed=$(grep -Eo '[0-9]+ passed' <<<"$final" | grep -Eo '[0-9]+' || echo 0)
  skipped=$(grep -Eo '[0-9]+ skipped' <<<"$final" | grep -Eo '[0-9]+' || echo 0)
  note "$final"
  if (( rc == 0 && passed == 0 && skipped > 0 )); then
    reason=$(grep -m1 '^SKIPPED' "$STEP_DIR/out" | sed -E 's/^SKIPPED \[[0-9]+\] [^ ]+ //')
    skip "all $skipped tests skipped: ${reason:0:60}"
  fi
  return "$rc"
}

build() {
  needs_gpu
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$ARCH} \
    FASTPAR_REQUIRE_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e . || return
  local lib info ptx dump=${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump
  info=$("$PY" -c "import torch, fastpar; i = fastpar._C.build_info(); assert i['cuda'], i
print('CUDA', i['cuda_runtime'], 'archs', ','.join(i['cuda_archs']))") || return
  lib=$("$PY" -c "import torch, fastpar._C as c; print(c.__file__)") || return
  [[ -x $dump ]] || dump=$(command -v cuobjdump) || { note "$info; PTX not checked"; return 0; }
  ptx=$("$dump" --list-ptx "$lib" 2>/dev/null | grep -Eo 'sm_[0-9a-z]+\.ptx' | sort -u |
    tr '\n' ' ')
  [[ -n $ptx ]] || { echo "build: no PTX embedded in $lib"; note "$info; no PTX"; return 1; }
  note "$info; PTX ${ptx% }"
}

bench() {
  needs_gpu
  local peers=--no-compile
  [[ ${BENCH_COMPILE:-0} == 1 ]] && peers=
  run_logged "$PY" bench/bench_kernels.py --shapes 4k $peers --budget "${BENCH_BUDGET:-65}" \
    --out "$OUT" ${BENCH_ARGS:-}
  local rc=$?
  [[ -f $OUT/kernels.json ]] && note "$("$PY" - "$OUT/kernels.json" <<'PY'
import json, math, sys
rows = json.load(open(sys.argv[1]))["rows"]
def span(rs):
    x = [r["x_eager"] for r in rs if r.get("x_eager")]
    g = math.exp(sum(map(math.log, x)) / len(x)) if x else float("nan")
    return f"{min(x, default=0):.2f}-{max(x, default=0):.2f}x (geomean {g:.2f}x)"
ops = [r for r in rows if not r["op"].startswith("tp_") and r["pass"] == "fwd+bwd"]
tp = [r for r in rows if r["op"].startswith("tp_")]
print(f"{len(rows)} rows; kernels fwd+bwd vs eager {span(ops)}; tp ops vs torch {span(tp)}")
PY
)"
  return "$rc"
}

nccl() {
  if [[ $CPU_RUN == 1 ]]; then
    run_logged "$PY" bench/nccl_check.py --cpu --mb 4 --out "$OUT"
  else
    run_logged "$PY" bench/nccl_check.py --out "$OUT"
  fi
  local rc=$?
  note "$(grep -E 'collectives right' "$STEP_DIR/out" | tail -1)"
  return "$rc"
}

kernel_tests() {
  needs_gpu
  local parallel=()
  "$PY" -c "import xdist" 2>/dev/null && parallel=(-n 8)
  TRITON_INTERPRET=0 pytest_run ${parallel[@]+"${parallel[@]}"} -m "not gpu" \
    --ignore tests/test_kernel_hopper_compile.py tests/test_kernel_*.py \
    tests/test_launch_occupancy.py
}

tp_nccl() {
  if [[ $CPU_RUN == 1 ]]; then   # the same checks on gloo and CPU autocast
    FASTPAR_GPU_DRY_RUN=1 pytest_run -s -m gpu tests/test_tp_gpu.py
  else
    TRITON_INTERPRET=0 pytest_run -s -m gpu tests/test_tp_gpu.py tests/test_pp_dualpipe.py
  fi
}

accuracy() {
  TRITON_INTERPRET=0 pytest_run -s -m gpu tests/test_kernel_gpu_accuracy.py tests/test_cp_attention.py \
    tests/test_documents.py
}

compile_blocks() { TRITON_INTERPRET=0 pytest_run -s -m gpu tests/test_compile.py; }

train_1b() {
  # PEAK_TFLOPS: the GPU's dense bf16 peak (H100/H200 SXM: 989). The stdlib corpus in bytes, so
  # --vocab-size 256: the byte tokenizer decodes every id and the sample runs. Without a GPU the
  # tiny preset stands in.
  local run=$SCRATCH/train-1b steps=${TRAIN_STEPS:-12} rc=0 trace
  local model=(--model 1b --seq-len 2048 --global-batch-size 8 --micro-batch-size 4)
  if [[ $CPU_RUN == 1 ]]; then
    model=(--model tiny --seq-len 64 --global-batch-size 4 --micro-batch-size 2) steps=4
    note "CPU stand-in: the tiny preset"
  fi
  run_logged "$PY" -m fastpar train "${model[@]}" --vocab-size 256 --nproc 1 --steps "$steps" \
    --warmup-steps 3 --log-every 4 --no-save --peak-tflops "${PEAK_TFLOPS:-989}" --out "$run" \
    --eval-every "$steps" --eval-batches 1 --sample-tokens 32 --profile-steps "$steps:$steps" ||
    rc=$?
  keep "$run/metrics.jsonl" train_metrics.jsonl
  trace=$(ls "$run"/profile/steps-*/rank0.json 2>/dev/null | head -1)
  [[ -n $trace ]] && gzip -c "$trace" > "$SCRATCH/train_trace.json.gz" &&
    keep "$SCRATCH/train_trace.json.gz"
  (( rc == 0 )) || return "$rc"
  "$PY" - "$run" "$STEP_DIR/out" "$trace" > "$STEP_DIR/key" <<'PY' || return
import json, os, statistics, sys
run, out, trace = sys.argv[1:]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")][3:]   # after warm-up, tuning
tok = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
log = open(out).read()
assert "val_loss" in rows[-1], "no validation loss at the last step"
assert "fastpar train: sample (" in log, "no KV-cache sample: " + "".join(
    line for line in log.splitlines(True) if "sample" in line)
events = json.load(open(trace))["traceEvents"] if trace else []
ours = sum(e.get("name", "").startswith("fastpar: ") for e in events)
gpu = sum(e.get("cat") == "kernel" for e in events)
cuda = os.environ["CPU_RUN"] != "1"
assert ours and (gpu or not cuda), f"the trace lacks fastpar's ranges ({ours}) or CUDA kernels"
print(f"{tok:,.0f} tokens/s, MFU {mfu:.1%}, val loss {rows[-1]['val_loss']:.3f}, sample ok, "
      f"trace {ours} ranges / {gpu} kernels")
PY
  cat "$STEP_DIR/key"
  note "$(cat "$STEP_DIR/key")"
}

export -f needs_gpu pytest_run build bench nccl kernel_tests tp_nccl accuracy compile_blocks train_1b

step build 95 build
step bench 80 bench
step nccl 25 nccl
step kernels 45 kernel_tests
step tp-nccl 40 tp_nccl
step accuracy 60 accuracy
step compile 40 compile_blocks
step train-1b 80 train_1b
finish
