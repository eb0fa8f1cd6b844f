"""Build fastpar and its extension fastpar._C.

C++ sources in csrc/ are always built; CUDA sources (csrc/*.cu) only when torch has CUDA and a
toolkit is found. FASTPAR_SKIP_CUDA=1 turns CUDA off, FASTPAR_REQUIRE_CUDA=1 makes a missing CUDA
build an error, TORCH_CUDA_ARCH_LIST picks the archs (default "8.0;9.0").
Install with `pip install --no-build-isolation -e .` into an environment that has torch.
"""
import glob
import os

from setuptools import find_packages, setup
import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _cuda_build():
    if _flag("FASTPAR_SKIP_CUDA"):
        reason = "FASTPAR_SKIP_CUDA is set"
    elif torch.version.cuda is None:
        reason = f"torch {torch.__version__} has no CUDA"
    elif CUDA_HOME is None:
        reason = "no CUDA toolkit found (set CUDA_HOME)"
    else:
        return True
    if _flag("FASTPAR_REQUIRE_CUDA"):
        raise RuntimeError(f"FASTPAR_REQUIRE_CUDA=1 but the CUDA sources cannot be built: {reason}")
    print(f"fastpar: building without CUDA ({reason})")
    return False


def _extension():
    sources = sorted(glob.glob("csrc/*.cpp"))
    cxx = ["-O3"]  # the C++ standard is the one torch.utils.cpp_extension picks for this torch
    if not _cuda_build():
        return CppExtension("fastpar._C", sources, extra_compile_args={"cxx": cxx})
    archs = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # Passed as bare tokens (no quotes or ';' to survive the shell); the C++ side stringizes them.
    arch_tokens = ",".join(archs.replace(";", " ").split())
    # The arch list goes to the C++ compiler only (fastpar.cpp reports it): nvcc splits a -D
    # value at its commas.
    macros = ["-DFASTPAR_WITH_CUDA"]
    return CUDAExtension(
        "fastpar._C", sources + sorted(glob.glob("csrc/*.cu")),
        extra_compile_args={"cxx": cxx + macros + [f"-DFASTPAR_CUDA_ARCHS={arch_tokens}"],
                            "nvcc": ["-O3"] + macros})


setup(
    name="fastpar",
    version="0.1.0",
    description="3D-parallel Transformer training that hides communication behind computation",
    python_requires=">=3.10",
    # fastpar/kernels is a symlink (in git) to kernels/, followed by find_packages and checkouts.
    packages=find_packages(include=["fastpar", "fastpar.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    # The floor is what CI tests (.ci/run step 2: torch 2.11.0 with its triton 3.6.0). triton
    # publishes wheels for Linux only; fastpar.kernels imports it, so elsewhere it must be
    # installed by hand.
    install_requires=["torch>=2.11", 'triton>=3.6; platform_system == "Linux"', "numpy",
                      "safetensors", "tqdm", "matplotlib"],
    entry_points={"console_scripts": ["fastpar = fastpar.cli:run"]},
)
