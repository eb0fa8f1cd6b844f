"""The GPU check stays runnable: what a GPU run will execute is exercised here first.

tests/test_tp_gpu.py runs its checks on gloo with CPU autocast (FASTPAR_GPU_DRY_RUN=1); the tests
marked gpu are collected and skipped with their reason without a GPU; gpu_check.sh parses, and the
files it runs exist. Its step runner (bench/gpu_steps.sh) records ran / failed / timeout /
skipped-with-reason on toy steps, keeps files in $OUT within what a GPU machine run returns,
and prints the table last; gpu_check.sh without a GPU (GPU_CHECK_CPU=1) runs the steps that have a
CPU stand-in (the collectives on a one-rank gloo group, the tiny preset for the 1b steps),
reports the rest as skipped with their reason, and writes only to $OUT; STEPS= picks steps. bench_kernels.py's cases, the TP overlap ops
included, run on CPU at a tiny shape."""
import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = ("tests/test_tp_gpu.py", "tests/test_kernel_gpu_accuracy.py")


def _run(*cmd, timeout=240, **env):
    env_clean = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                              "FASTPAR_GPU_DRY_RUN")}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**env_clean, **env})


def _pytest(*args, timeout=240, **env):
    return _run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *args,
                timeout=timeout, **env)


def test_tp_gpu_checks_pass_as_a_cpu_dry_run():
    out = _pytest("tests/test_tp_gpu.py", FASTPAR_GPU_DRY_RUN="1")
    assert out.returncode == 0, out.stdout + out.stderr
    every = len(re.findall(r"^def test_", (ROOT / "tests" / "test_tp_gpu.py").read_text(), re.M))
    assert re.search(rf"\b{every} passed\b", out.stdout) and "skipped" not in out.stdout, \
        out.stdout


def test_gpu_tests_skip_without_a_gpu():
    if torch.cuda.is_available():
        return
    out = _pytest("-rs", *GPU_TESTS, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\b16 skipped\b", out.stdout) and " passed" not in out.stdout, out.stdout
    for path in GPU_TESTS:
        assert re.search(rf"SKIPPED \[\d+\] {path}:\d+: needs a CUDA GPU", out.stdout), path


def test_gpu_check_script_parses():
    assert _run("bash", "-n", "bench/gpu_check.sh", timeout=30).returncode == 0


def test_gpu_check_script_runs_files_that_exist():
    script = (ROOT / "bench/gpu_check.sh").read_text()
    named = set(re.findall(r"\b(?:tests|bench)/[\w*]+\.py\b", script))
    assert set(GPU_TESTS) <= named, named
    missing = [p for p in named if not list(ROOT.glob(p))]
    assert not missing, f"bench/gpu_check.sh names files that do not exist: {missing}"


STEPS = ["build", "bench", "nccl", "kernels", "tp-nccl", "accuracy", "compile", "train-1b"]
# What a GPU machine run returns from $OUT: 8 files, plain names.
OUT_NAMES = {"gpu_check.log", "summary.txt", "kernels.json", "nccl.json", "train_metrics.jsonl",
             "train_trace.json.gz"}


def _summary(stdout: str) -> dict[str, str]:
    """step -> its status, from the table that must end the output."""
    lines = stdout.rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("== summary"))
    assert lines[start + 1].split()[:3] == ["step", "status", "seconds"], lines[start:]
    return {line.split()[0]: re.split(r"\s{2,}", line)[1] for line in lines[start + 2:]}


TOY_STEPS = r"""
set -u
source bench/gpu_steps.sh
steps_init "good bad slow skipper full late unpicked" || exit 2
good() { head -c 100 /dev/zero > "$SCRATCH/a.bin"; keep "$SCRATCH/a.bin" && note "42 widgets";
         note "and more"; }
bad() { echo "bad step output"; return 3; }
slow() { sleep 20; }
skipper() { skip "no widget here"; echo "never printed"; }
full() {
  head -c $((16 * 2**20)) /dev/zero > "$SCRATCH/big.bin"
  keep "$SCRATCH/big.bin"
  head -c $((16 * 2**20)) /dev/urandom > "$SCRATCH/noise"
  keep "$SCRATCH/noise" || note "noise refused"
  keep "$SCRATCH/big.bin" "bad/name" || note "bad name refused"
  for i in 1 2 3 4 5 6 7; do
    echo "$i" > "$SCRATCH/f$i"
    keep "$SCRATCH/f$i" || note "f$i refused"
  done
}
export -f good bad slow skipper full
for s in good bad slow skipper full unpicked; do step "$s" 10 "$s"; done
STEPS_T0=$((STEPS_T0 - 1000))      # the deadline has passed
step late 10 good
steps_summary
"""


def test_step_runner_records_each_outcome_and_keeps_files_in_out(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir(), scratch.mkdir()
    t0 = time.time()
    res = _run("bash", "-c", TOY_STEPS, timeout=60, OUT=str(out), SCRATCH=str(scratch),
               STEPS="good,bad,slow skipper,full,late", LIMIT_slow="2", MIN_LIMIT="1",
               KILL_AFTER="1", DEADLINE="60")
    assert time.time() - t0 < 15, "the slow step outlived its 2 s limit"
    assert res.returncode == 2, res.stdout + res.stderr         # bad and slow failed
    status = _summary(res.stdout)
    assert list(status) == ["good", "bad", "slow", "skipper", "full", "late"], status
    assert status["good"] == "ran" and status["full"] == "ran"
    assert status["bad"] == "failed (rc 3)" and status["slow"] == "failed: timeout after 2 s"
    assert status["skipper"] == "skipped: no widget here"
    assert status["late"].startswith("skipped: no time left before the 60 s deadline")
    assert "never printed" not in res.stdout and "bad step output" in res.stdout
    table = (out / "summary.txt").read_text()
    assert table.strip() == res.stdout.strip().split("\n\n")[-1].strip()
    assert "42 widgets;and more" in table
    # 16 MiB kept gzipped, 16 MiB that gzip cannot shrink and a bad name refused, and $OUT
    # stopped at 8 files.
    assert "noise refused" in table and "bad name refused" in table
    assert "f6 refused" in table and "f5 refused" not in table
    kept = sorted(p.name for p in out.iterdir())
    assert kept == ["a.bin", "big.bin.gz", "f1", "f2", "f3", "f4", "f5", "summary.txt"], kept


def _gpu_check(tmp_path, **env):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    t0 = time.time()
    res = _run("bash", "bench/gpu_check.sh", timeout=120, OUT=str(out), TMPDIR=str(tmp),
               PYTHON=sys.executable, **env)
    # Only $OUT was written: plain files with the names it brings back, scratch removed.
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert set(files) <= OUT_NAMES and len(files) <= 8, files
    assert not list(tmp.glob("gpu_check.*")), list(tmp.iterdir())
    results = ROOT / "bench" / "results"
    newer = [p for p in results.rglob("*") if p.stat().st_mtime > t0] if results.exists() else []
    assert not newer, f"gpu_check.sh wrote outside $OUT: {newer}"
    log = (out / "gpu_check.log").read_text()
    assert res.stdout.strip().endswith((out / "summary.txt").read_text().strip())
    assert log.strip().endswith((out / "summary.txt").read_text().strip())
    return res, _summary(res.stdout), out


def test_gpu_check_without_a_gpu_runs_the_collectives_on_gloo(tmp_path):
    res, status, out = _gpu_check(tmp_path, GPU_CHECK_CPU="1", STEPS="nccl,bench")
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(status) == ["bench", "nccl"], status          # the script's order
    assert status["nccl"] == "ran" and status["bench"].startswith("skipped: needs a CUDA GPU")
    assert "gloo: 3/3 collectives right" in (out / "summary.txt").read_text()
    checks = json.loads((out / "nccl.json").read_text())["checks"]
    assert set(checks) == {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}
    assert all(c["ok"] for c in checks.values()), checks


def test_gpu_check_without_a_gpu_trains_the_tiny_stand_in_and_keeps_its_trace(tmp_path):
    res, status, out = _gpu_check(tmp_path, GPU_CHECK_CPU="1", STEPS="train-1b")
    assert res.returncode == 0, res.stdout + res.stderr
    assert status == {"train-1b": "ran"}, status
    table = (out / "summary.txt").read_text()
    assert "CPU stand-in: the tiny preset" in table and "sample ok" in table, table
    rows = [json.loads(line) for line in (out / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "val_loss" in rows[-1], rows
    with gzip.open(out / "train_trace.json.gz") as f:
        assert json.load(f)["traceEvents"]


def test_a_pytest_step_whose_tests_all_skip_is_skipped_not_ran(tmp_path):
    if torch.cuda.is_available():
        return
    res, status, _ = _gpu_check(tmp_path, GPU_CHECK_CPU="1", STEPS="build accuracy")
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(status) == ["build", "accuracy"], status
    assert status["build"].startswith("skipped: needs a CUDA GPU"), status
    assert re.match(r"skipped: all \d+ tests skipped: needs a CUDA GPU", status["accuracy"]), status


def test_gpu_check_without_a_gpu_skips_every_step_and_fails(tmp_path):
    if torch.cuda.is_available():
        return
    res, status, _ = _gpu_check(tmp_path)                   # no STEPS: every step
    assert res.returncode == 1, res.stdout + res.stderr
    assert list(status) == STEPS, status
    assert set(status.values()) == {"skipped: no CUDA GPU visible to torch"}, status


def test_an_unknown_step_is_an_error_before_anything_runs(tmp_path):
    res = _run("bash", "bench/gpu_check.sh", timeout=30, OUT=str(tmp_path), STEPS="bench,nope")
    assert res.returncode == 2
    assert f"unknown step 'nope'; the steps are: {' '.join(STEPS)}" in res.stdout + res.stderr
    assert "==" not in res.stdout


BENCH_ON_CPU = r"""
import sys, time
sys.path.insert(0, "bench")
import bench_kernels as B
import fastpar

B._bench = lambda fn: (lambda t0: (fn(), 1e3 * (time.perf_counter() - t0))[1])(time.perf_counter())
B._peak_mib = lambda fn: 0.0
s = dict(tokens=64, hidden=32, ffn=48, heads=4, kv=2, vocab=100)
cases = B._cases(s, "cpu") + B._tp_cases(s, "cpu", fastpar.init(backend="gloo").tp_group)
print("order", " ".join(c.op for c in cases))
for case in cases:
    for row in B.run_case(case, "tiny", False, 100.0):
        print("row", row["op"], row["pass"], row["max_rel_err"], row["x_eager"])
"""


def test_bench_kernels_cases_run_on_cpu_in_the_models_order():
    res = _run(sys.executable, "-c", BENCH_ON_CPU, timeout=120, FASTPAR_KERNEL_IMPL="torch")
    assert res.returncode == 0, res.stdout + res.stderr
    order = re.search(r"^order (.*)$", res.stdout, re.M).group(1).split()
    assert order == ["rms_norm", "layer_norm", "rotary", "swiglu", "cross_entropy",
                     "bias_dropout_add", "bias_gelu", "tp_matmul_allreduce",
                     "tp_allgather_matmul", "tp_matmul_reducescatter",
                     "tp_column_linear_backward"], order
    rows = [line.split()[1:] for line in res.stdout.splitlines() if line.startswith("row ")]
    assert len(rows) == 7 * 2 + 4, rows                 # kernels: fwd, fwd+bwd; TP ops: fwd
    for op, kind, err, ratio in rows:
        assert float(ratio) > 0, (op, kind)
        if op != "bias_dropout_add":                     # its peer draws another mask
            assert float(err) < 2e-2, (op, kind, err)    # bf16 against the peer
