"""The GPU check's scripts stay runnable: what a GPU run will execute is exercised here first.

bench/gpu_tp_check.py runs its checks on gloo with CPU autocast (--cpu); the GPU-only scripts
refuse cleanly without a GPU; gpu_check.sh parses."""
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd, timeout=240):
    env_clean = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env_clean)


def test_tp_check_passes_as_a_cpu_dry_run():
    out = _run(sys.executable, "bench/gpu_tp_check.py", "--cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASS") == 4 and "0 failure(s)" in out.stdout, out.stdout


def test_gpu_only_scripts_refuse_without_a_gpu():
    if torch.cuda.is_available():
        return
    for script in ("bench/gpu_tp_check.py", "bench/gpu_kernel_check.py"):
        out = _run(sys.executable, script, timeout=60)
        assert out.returncode != 0 and "no CUDA GPU" in out.stdout + out.stderr, script


def test_gpu_check_script_parses():
    assert _run("bash", "-n", "bench/gpu_check.sh", timeout=30).returncode == 0
