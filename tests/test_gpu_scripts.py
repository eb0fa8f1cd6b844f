"""The GPU check stays runnable: what a GPU run will execute is exercised here first.

tests/test_tp_gpu.py runs its checks on gloo with CPU autocast (FASTPAR_GPU_DRY_RUN=1); the tests
marked gpu are collected and skipped with their reason without a GPU; gpu_check.sh parses, and the
files it runs exist."""
import os
import re
import subprocess
import sys
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
    assert re.search(r"\b4 passed\b", out.stdout) and "skipped" not in out.stdout, out.stdout


def test_gpu_tests_skip_without_a_gpu():
    if torch.cuda.is_available():
        return
    out = _pytest("-rs", *GPU_TESTS, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\b13 skipped\b", out.stdout) and " passed" not in out.stdout, out.stdout
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
