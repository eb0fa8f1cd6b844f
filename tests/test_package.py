"""The installed package: the compiled extension, the command line, fastpar.kernels."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fastpar
import fastpar.kernels
from fastpar.kernels import impl_for


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_build_info_describes_this_build():
    info = fastpar._C.build_info()
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert isinstance(info["cuda"], bool)
    if info["cuda"]:
        assert info["cuda_archs"] and info["cuda_runtime"]
    else:
        assert info["cuda_archs"] == [] and info["cuda_runtime"] is None
    assert fastpar._C.cuda_device_count() == (torch.cuda.device_count() if info["cuda"] else 0)


def test_cli_version_and_info(tmp_path):
    out = _run("-m", "fastpar", "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"fastpar {fastpar.__version__}"
    out = _run("-m", "fastpar", "info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["fastpar"] == fastpar.__version__ and info["torch"] == torch.__version__
    assert info["extension"] == fastpar._C.build_info()
    assert info["backends"]["gloo"] is True
    assert len(info["cuda_devices"]) == torch.cuda.device_count()
    out = _run("-m", "fastpar", "info")
    assert out.returncode == 0 and "extension CUDA sources" in out.stdout


def test_kernels_is_a_subpackage_not_a_top_level_package(tmp_path):
    assert fastpar.kernels.__name__ == "fastpar.kernels"
    # From a directory outside the checkout, only fastpar.kernels can be imported.
    code = ("import importlib.util as u; import fastpar.kernels; "
            "print(u.find_spec('kernels') is None)")
    out = _run("-c", code, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_triton_interpreter_is_on_for_tests_without_a_gpu():
    # conftest turns the interpreter on unless the run chose (TRITON_INTERPRET=0 on a GPU).
    assert os.environ["TRITON_INTERPRET"] == ("1" if not torch.cuda.is_available() else
                                              os.environ["TRITON_INTERPRET"])


def test_kernel_dispatcher(monkeypatch):
    x = torch.ones(2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FASTPAR_KERNEL_IMPL", raising=False)
    assert impl_for(x) == "torch"                       # CPU tensors use the reference
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "triton")
    assert impl_for(x) == "triton"                      # forced, interpreter on
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        impl_for(x)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    assert impl_for(x) == "torch"
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "cuda")
    with pytest.raises(ValueError, match="FASTPAR_KERNEL_IMPL='cuda'"):
        impl_for(x)
