"""setup.py's CUDA arch flags: machine code for every arch of TORCH_CUDA_ARCH_LIST and PTX of the
newest, so the extension also loads on a GPU newer than any it was built for (the driver compiles
the PTX at load). Checked on the flags alone: no CUDA is compiled here."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch.utils.cpp_extension

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module (its setup() call runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("fastpar_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sass(flags):
    return {f.split(",code=")[1] for f in flags if ",code=sm_" in f}


def _ptx(flags):
    return {f.split(",code=")[1] for f in flags if ",code=compute_" in f}


@pytest.mark.parametrize("arch_list,sass,ptx", [
    ("8.0;9.0", {"sm_80", "sm_90"}, {"compute_90"}),             # the default
    ("9.0", {"sm_90"}, {"compute_90"}),                          # CI's and gpu_check.sh's
    ("8.0 9.0+PTX", {"sm_80", "sm_90"}, {"compute_90"}),
    ("10.0;9.0", {"sm_100", "sm_90"}, {"compute_100"}),          # newest by number, not text
    ("9.0a", {"sm_90a"}, {"compute_90"}),                        # 90a's PTX runs on 90 only
    ("8.0+PTX;9.0", {"sm_80", "sm_90"}, {"compute_90"}),
])
def test_every_arch_gets_machine_code_and_the_newest_ptx(setup_py, arch_list, sass, ptx):
    flags = setup_py.nvcc_arch_flags(arch_list)
    assert all(f.startswith("-gencode=arch=compute_") for f in flags), flags
    assert _sass(flags) == sass and _ptx(flags) == ptx, flags
    for f in flags:        # each target compiled from its own virtual arch
        virtual, code = f.removeprefix("-gencode=arch=").split(",code=")
        assert virtual.removeprefix("compute_") == code.split("_")[1], f


def test_the_reported_archs_are_the_listed_ones(setup_py):
    # fastpar._C.build_info()["cuda_archs"] reports these; CI expects ["9.0"] for "9.0".
    assert setup_py.cuda_archs("9.0") == ["9.0"]
    assert setup_py.cuda_archs("8.0; 9.0+PTX,9.0") == ["8.0", "9.0"]


@pytest.mark.parametrize("arch_list,message", [
    ("Hopper", "'Hopper' is not an arch such as 8.0, 9.0, 9.0a or 9.0+PTX"),
    ("9", "'9' is not an arch"),
    (" ; ", "names no arch"),
])
def test_a_bad_arch_list_is_one_clear_error(setup_py, arch_list, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        setup_py.nvcc_arch_flags(arch_list)


def test_the_cuda_extension_gets_them_and_torch_adds_none(setup_py, monkeypatch):
    monkeypatch.setattr(setup_py, "_cuda_build", lambda: True)
    # CUDAExtension joins its library paths to the toolkit's folder (none is needed to exist).
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    nvcc = setup_py._extension().extra_compile_args["nvcc"]
    assert _sass(nvcc) == {"sm_90"} and _ptx(nvcc) == {"compute_90"}, nvcc
    # torch's build adds its own arch flags (SASS only) unless the nvcc flags name an arch.
    assert torch.utils.cpp_extension._get_cuda_arch_flags(nvcc) == []
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    nvcc = setup_py._extension().extra_compile_args["nvcc"]
    assert _sass(nvcc) == {"sm_80", "sm_90"} and _ptx(nvcc) == {"compute_90"}, nvcc
