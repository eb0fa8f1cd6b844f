import os

# Kernel tests run Triton's interpreter on CPU; this must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# Tiers. `python -m pytest` runs everything (README's command, CI's). `python -m pytest -m fast`
# is the development tier: every test outside these files, which start whole training runs
# (the launcher, several ranks, a model trained for steps), subprocesses of the command or of
# pytest, measure every layer's bytes on the wire, or compile every kernel.
SLOW_FILES = {
    "test_train.py", "test_train_cli.py", "test_train_tools.py", "test_user_work.py",
    "test_walkthrough.py", "test_reliability_failures.py", "test_reliability_checkpoint.py",
    "test_reliability_inputs.py", "test_mixed_precision.py", "test_kernel_hopper_compile.py",
    "test_reliability_hangs.py",
    "test_model_triton.py", "test_harness.py", "test_package.py", "test_init_from_checks.py",
    "test_cp_model.py", "test_generate.py", "test_hf.py", "test_nccl_rules.py",
    "test_pp_executor.py", "test_memory_check.py", "test_dp_pp_overlap.py", "test_own_model.py",
    "test_readme.py", "test_gpu_scripts.py", "test_tp_wire.py", "test_compile.py",
    "test_memory_measured.py", "test_documents_train.py",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the development tier (python -m pytest -m fast)")
    config.addinivalue_line("markers", "slow: whole training runs, the command in subprocesses, "
                                       "every kernel compiled (in the full run only)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU, skipped without one "
                                       "(bench/gpu_check.sh runs them: -m gpu)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        slow = item.path.name in SLOW_FILES
        item.add_marker(pytest.mark.slow if slow else pytest.mark.fast)
